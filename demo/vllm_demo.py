"""The demo's main act: a real vLLM engine (CPU build) restoring its KV cache through OrbitKV.

Starts an OrbitKV cache manager process, writes a tiny random-weight Llama-style model, then runs
one engine process per case, each a whole engine lifetime (as a restarted server would be):

1. cold: a 300-token prompt computed and its 9 full pages saved;
2. warm: a new engine process restores them and must answer identically;
3. another model identity (namespace) misses and answers as the cold run did;
4. a 320-token prompt (a whole number of pages) reuses at most one page less;
5. forced SSD: a manager whose DRAM pool (4 pages) is smaller than the prompt (9 pages) writes the
   pages to its SSD file; restarted on that file, its DRAM empty, it serves the restore from SSD,
   reading exactly the selected pages;
6. a chat: one engine answers two turns (each turn's prompt is the previous prompt, its answer and a
   new message), saving the pages of prompts and answers; a new engine process serves turn 3,
   restoring every full page of turns 1-2, and answers as an engine without the cache;
7. two hosts: two managers (own arenas and sockets) sharing a Redis Cluster of 3 primaries and 3
   replicas (Debian's redis-server): an engine on host A computes the prompt, an engine on host B,
   whose manager never saw it, restores it from the cluster and answers identically.

Each case prints its generate time, what the manager served (the receipt of the restore: pages and
bytes per tier, leases left) and the output token ids. Exits non-zero when any case misbehaves.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cacheon_orbitkv.client import CacheClient

HERE = Path(__file__).parent
PROMPT = 300
PAGE = 32


class Manager:
    def __init__(self, folder: Path, name: str, pool: str, ssd: Path | None = None, remote: str | None = None) -> None:
        self.endpoint = f"unix://{folder}/{name}.sock"
        args = [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", self.endpoint, "--pool-size", pool]
        if ssd is not None:
            args += ["--ssd-cache-path", str(ssd), "--ssd-cache-capacity", "64mb"]
        if remote is not None:
            args += ["--remote", remote]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        if not self.proc.stdout.readline().startswith("ready"):
            sys.exit(f"orbitkv-cache-manager did not start: {args}")

    def stats(self) -> dict[str, Any]:
        with CacheClient(self.endpoint) as client:
            return client.stats()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def engine(model: Path, endpoint: str, tokens: int = PROMPT, *options: str) -> dict[str, Any]:
    from vllm_engine import EngineFailed, spawn

    try:
        return spawn(model, endpoint, tokens, *options)
    except EngineFailed as exc:
        sys.exit(str(exc))


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {
        f"{kind}_{tier}": after[kind][tier] - before[kind][tier]
        for kind in ("hits", "bytes_read", "bytes_written")
        for tier in ("dram", "ssd")
    }


def report(case: str, result: dict[str, Any], served: dict[str, int], leases: int) -> None:
    hits = result["metrics"].get("vllm:external_prefix_cache_hits")
    print(
        f"{case:<22} generate {result['seconds'] * 1e3:7.0f} ms (engine process {result['wall']:5.1f} s); "
        f"vLLM external hit tokens {hits}; pages found in DRAM {served['hits_dram']}, on SSD {served['hits_ssd']} "
        f"({served['bytes_read_ssd']} B read from SSD); {served['bytes_read_dram']} B restored out of the pool; "
        f"{served['bytes_written_dram']} B saved; pages written into vLLM's KV cache "
        f"{(result.get('connector') or {}).get('pages_written')}; leases left {leases}; ids {result['ids']}"
    )


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["ids"] == b["ids"] and all(
        math.isclose(x, y, abs_tol=0.05) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)
    )


def two_hosts(folder: Path, model: Path, page_bytes: int, cold: dict[str, Any], check: Any) -> None:
    """Case 7: hosts A and B, each with its own manager, sharing one Redis Cluster."""
    sys.path.insert(0, str(HERE.parent))
    from tests.redis_cluster import RedisNodes

    cluster = RedisNodes(folder / "redis").start()
    hosts = []
    try:
        a = Manager(folder, "host-a", "256mb", remote=cluster.url)
        hosts.append(a)
        b = Manager(folder, "host-b", "256mb", remote=cluster.url)
        hosts.append(b)
        print(f"7 two hosts: managers A and B, a Redis Cluster of 3 primaries + 3 replicas at {cluster.url}")
        computed = engine(model, a.endpoint)
        deadline = time.monotonic() + 30
        while a.stats()["remote"]["pages_written"] < 9 and time.monotonic() < deadline:
            time.sleep(0.1)  # written behind the save
        wrote = a.stats()["remote"]
        print(f"{'':<22} host A computed the prompt and wrote {wrote['pages_written']} pages to the cluster")
        restored = engine(model, b.endpoint)
        remote = b.stats()["remote"]
        hits = restored["metrics"].get("vllm:external_prefix_cache_hits")
        print(
            f"{'7 host B (new)':<22} generate {restored['seconds'] * 1e3:7.0f} ms; vLLM external hit tokens {hits}; "
            f"pages read from the cluster {remote['hits']} ({remote['bytes_read']} B, header and checksum verified); "
            f"pages written into vLLM's KV cache {(restored.get('connector') or {}).get('pages_written')}; "
            f"ids {restored['ids']}"
        )
        check(
            wrote["pages_written"] == 9
            and remote["hits"] == 9
            and remote["bytes_read"] == 9 * page_bytes
            and restored["connector"]["pages_written"] == 9
            and same(cold, computed)
            and same(cold, restored),
            "host B restored host A's 9 pages from the cluster and answered as the cold run",
        )
    finally:
        for m in hosts:
            m.stop()
        cluster.stop()


def main() -> None:
    sys.path.insert(0, str(HERE))
    import tiny_model

    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="okv-demo-") as tmp:
        folder = Path(tmp)
        model = tiny_model.build(folder / "model")
        page_bytes = 2 * 2 * PAGE * 2 * 64 * 4  # layers x (K, V) x block x kv heads x head dim x fp32
        dram = Manager(folder, "dram", "256mb")
        try:
            print(f"orbitkv-cache-manager on {dram.endpoint}; tiny Llama at {model}; {PROMPT}-token prompt")
            before = dram.stats()
            cold = engine(model, dram.endpoint)
            after = dram.stats()
            report("1 cold", cold, delta(before, after), after["leases"])
            check(delta(before, after)["bytes_written_dram"] == 9 * page_bytes, "cold run saved 9 pages")

            before = after
            warm = engine(model, dram.endpoint)
            after = dram.stats()
            served = delta(before, after)
            report("2 warm (new process)", warm, served, after["leases"])
            check(served["bytes_read_dram"] == 9 * page_bytes and same(cold, warm), "warm run restored 9 pages, same")

            before = after
            other = engine(model, dram.endpoint, PROMPT, "--fingerprint", "another-model-identity")
            after = dram.stats()
            served = delta(before, after)
            report("3 other identity", other, served, after["leases"])
            check(served["hits_dram"] == 0 and same(cold, other), "another identity missed and matched cold")
            print(
                f"{'':<22} generate time, restored (2) / computed in a warmed-up environment (3): "
                f"{warm['seconds'] / other['seconds']:.2f}; the first engine (1) also paid one-time compilation. "
                "The tiny model's prefill costs little: the restore is checked for exactness, not speed."
            )

            engine(model, dram.endpoint, 320)  # saves the 10th page too
            before = dram.stats()
            whole = engine(model, dram.endpoint, 320)
            after = dram.stats()
            served = delta(before, after)
            report("4 320-token prompt", whole, served, after["leases"])
            check(served["hits_dram"] == 9, "a 10-page prompt restored 9 pages")
        finally:
            dram.stop()

        ssd_file = folder / "ssd.bin"
        small = Manager(folder, "small", "256kb", ssd_file)  # 4 pages of DRAM for a 9-page prompt
        try:
            engine(model, small.endpoint)
        finally:
            small.stop()
        restarted = Manager(folder, "restarted", "1mb", ssd_file)  # everything it serves comes from SSD
        try:
            warm_ssd = engine(model, restarted.endpoint)
            after = restarted.stats()
            served = {f"{k}_{t}": after[k][t] for k in ("hits", "bytes_read", "bytes_written") for t in ("dram", "ssd")}
            report("5 forced SSD", warm_ssd, served, after["leases"])
            check(
                served["hits_ssd"] > 0 and served["bytes_read_ssd"] == served["hits_ssd"] * page_bytes,
                "forced SSD read exactly the selected pages",
            )
            check(same(cold, warm_ssd), "forced SSD matched cold")
        finally:
            restarted.stop()

        chat_manager = Manager(folder, "chat", "256mb")
        try:
            chat = ["--max-tokens", "60", "--message-tokens", "30"]
            before = chat_manager.stats()
            first = engine(model, chat_manager.endpoint, 100, *chat, "--turns", "2")
            after = chat_manager.stats()
            for number, turn in enumerate(first["turns"], 1):
                print(
                    f"6 chat turn {number}: prompt {len(turn['prompt'])} tokens, answer {len(turn['answer'])} tokens "
                    "(one engine; each turn's prompt is the previous prompt, its answer and a new message)"
                )
            saved = delta(before, after)["bytes_written_dram"]
            last = first["turns"][-1]
            computed = len(last["prompt"]) + len(last["answer"]) - 1  # the last answer token has no KV
            print(f"{'':<22} saved {saved // page_bytes} pages ({saved} B): every full page of prompts and answers")
            check(saved == computed // PAGE * page_bytes, "the chat saved every full page of prompts and answers")
            message = [(i * 37 + 3 * 101) % 997 for i in range(30)]
            turn3 = folder / "turn3.json"
            turn3.write_text(json.dumps(last["prompt"] + last["answer"] + message))
            before = after
            third = engine(model, chat_manager.endpoint, 100, *chat, "--prompt-file", str(turn3))
            after = chat_manager.stats()
            served = delta(before, after)
            report("6 chat turn 3 (new)", third, served, after["leases"])
            cold_third = engine(model, chat_manager.endpoint, 100, *chat, "--prompt-file", str(turn3), "--no-connector")
            check(
                served["bytes_read_dram"] == computed // PAGE * page_bytes
                and third["connector"]["pages_written"] == computed // PAGE
                and same(cold_third, third),
                "turn 3 restored every page of turns 1-2 and answered as an engine without the cache",
            )
        finally:
            chat_manager.stop()

        two_hosts(folder, model, page_bytes, cold, check)
    if failures:
        sys.exit("vLLM demo failed: " + "; ".join(failures))
    print("vLLM demo: every case restored exactly what the contract selected and answered as the cold run")


if __name__ == "__main__":
    main()
