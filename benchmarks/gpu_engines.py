"""OrbitKV inside vLLM's GPU engine (vLLM 0.33, Model Runner V2): the end-to-end cases, and time
to first token against vLLM's own OffloadingConnector.

Cases (each engine run is a new process, ``benchmarks/gpu_vllm_engine.py``; chains of runs that
need their own cache manager run side by side on the one GPU):

- ``eager``: a tiny Llama (bf16), cold run saves, a new engine restores with the same ids and
  logprobs within 0.05, another model identity misses; fp8 KV pages are never restored into a
  bf16 cache nor bf16 pages into an fp8 cache, and an fp8 engine restores its own pages;
- ``ssd``: every page from the SSD tier of a restarted manager;
- ``graphs``: the same restore with torch.compile and CUDA graphs (no enforce_eager);
- ``decode``: pages of generated tokens (the connector's ``save_decode``): an engine generates 96 tokens
  after the prompt and saves 12 full pages, the last 3 holding generated tokens; a new engine given the
  prompt and the first 88 generated tokens restores all 12 and goes on as the first engine went on;
- ``sliding``: a Gemma3-style model with sliding-window and full-attention layers (two KV cache groups);
- ``layouts``: the LHBNC and BLNHC KV cache layouts (VLLM_KV_CACHE_LAYOUT), and pages of one layout
  offered to an engine of another (never copied);
- ``ttft``: Llama-3-8B-shaped random weights, 8k and 32k-token prompts: cold, restored by a new
  engine, restored within one engine after ``reset_prefix_cache()``, and the same through vLLM's
  OffloadingConnector; for the new engine, how much of each prompt's time the connector's loader
  spent leasing the pages and restoring them (its ``lease_seconds`` and ``restore_seconds``); and a
  new engine whose connector leaves Python's thread switch interval alone while loads run
  (``load_switch_interval_us`` 0), against the default that lowers it. The OrbitKV engines run with
  ``--timeline``: each prompt's time split at the connector's hooks and the engine's steps.

Every restore must also be consumed: the connector's pages written into the KV cache equal the
pages planned (the scheduler's ``planned_pages``, else the pages the manager leased) and no load
failed. Exits 1 when any check fails.

    python benchmarks/gpu_engines.py --out DIR [--cases eager,ssd,graphs,sliding,decode] [--ttft]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "gpu_vllm_engine.py"
PROMPT = 300  # 9 full 32-token pages and a 12-token tail
HIT = 288
DECODE, FED = 96, 88  # the decode case: tokens generated, and how many of them the second prompt repeats


class Manager:
    """``orbitkv-cache-manager`` as a child process on a unix socket."""

    def __init__(self, root: Path, name: str, pool: str, ssd: bool = False) -> None:
        self.root, self.name, self.pool, self.ssd = root, name, pool, ssd
        self.sock = root / f"{name}.sock"
        self.endpoint = f"unix://{self.sock}"
        self.ssd_path = root / f"{name}-ssd.bin"
        self.proc: subprocess.Popen[str] | None = None

    def start(self, pool: str | None = None) -> Manager:
        args = [
            sys.executable,
            "-m",
            "cacheon_orbitkv.manager",
            "--addr",
            self.endpoint,
            "--pool-size",
            pool or self.pool,
        ]
        if self.ssd:
            args += ["--ssd-cache-path", str(self.ssd_path), "--ssd-cache-capacity", "64mb"]
        log = (self.root / f"{self.name}-manager.log").open("a")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"manager {self.name} did not start: {line!r}")
        return self

    def stats(self) -> dict[str, Any]:
        from cacheon_orbitkv.client import CacheClient

        with CacheClient(self.endpoint) as client:
            return dict(client.stats())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Report:
    """Checks and runs, shared by the chains (threads)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def check(self, case: str, what: str, ok: bool, detail: Any = "") -> bool:
        with self.lock:
            self.checks.append({"case": case, "check": what, "ok": bool(ok), "detail": detail})
            print(f"[{case}] {'PASS' if ok else 'FAIL'}: {what} {detail if not ok else ''}", flush=True)
        return bool(ok)

    def save(self) -> None:
        with self.lock:
            (self.out / "gpu_engines.json").write_text(
                json.dumps({"checks": self.checks, "runs": self.runs}, indent=1, default=str)
            )


def engine(report: Report, case: str, label: str, model: Path, *options: str, timeout: float = 420) -> dict[str, Any]:
    """One engine lifetime; its log goes to the case's folder. A failed run raises."""
    logs = report.out / "logs"
    logs.mkdir(exist_ok=True)
    start = time.perf_counter()
    with (logs / f"{case}-{label}.log").open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(DRIVER), str(model), *options],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=timeout,
            check=False,
        )
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (logs / f"{case}-{label}.log").read_text()[-3000:]
        raise RuntimeError(f"{case}/{label}: engine exited {proc.returncode} without a RESULT\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["wall"] = wall
    with report.lock:
        report.runs.append({"case": case, "label": label, "options": options, **result})
    print(
        f"[{case}] {label}: {wall:.0f} s wall (startup {result['startup_s']:.0f} s), "
        f"external hits {result['metrics'].get('vllm:external_prefix_cache_hits')}, "
        f"tags {result['connector'].get('layout_tags')}, page bytes {result['connector'].get('page_bytes')}",
        flush=True,
    )
    return result


def same_output(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, str]:
    """Same ids, logprobs within 0.05: of two prompt outputs, or of two runs' first prompts."""
    a, b = (r["outputs"][0] if "outputs" in r else r for r in (a, b))
    worst = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=False)), default=0.0)
    ok = a["ids"] == b["ids"] and len(a["logprobs"]) == len(b["logprobs"]) and worst <= 0.05
    return ok, f"ids {a['ids']} vs {b['ids']}, largest logprob difference {worst:.4f}"


def hits(result: dict[str, Any]) -> Any:
    return result["metrics"].get("vllm:external_prefix_cache_hits")


def consumed(report: Report, case: str, result: dict[str, Any], leased_pages: int) -> None:
    """Pages written into the KV cache == pages planned, and no load failed."""
    sched = result["connector"].get("scheduler", {})
    worker = result["connector"].get("worker", {})
    planned = sched.get("planned_pages", leased_pages)
    written = worker.get("pages_written")
    pages = set(result["connector"].get("page_bytes") or [])
    if written is None and len(pages) == 1:  # a connector without the counter: its restored bytes
        written = worker.get("loaded_bytes", 0) // pages.pop()
    failed = worker.get("load_failures", 0) + sched.get("load_failures", 0)
    report.check(
        case,
        "consumption: pages written == pages planned > 0, no failed load",
        written == planned and planned > 0 and failed == 0 and worker.get("corrupt_pages", 0) == 0,
        f"written {written}, planned {planned} ({'scheduler' if 'planned_pages' in sched else 'manager leases'}), "
        f"failed loads {failed}",
    )


def common(endpoint: str) -> list[str]:
    return ["--endpoint", endpoint, "--prompt-tokens", str(PROMPT)]


def case_eager(report: Report, root: Path, models: dict[str, Path]) -> None:
    case, model = "eager", models["llama"]
    m = Manager(root, case, "256mb").start()
    try:
        cold = engine(report, case, "cold", model, *common(m.endpoint))
        s0 = m.stats()
        page = cold["connector"]["page_bytes"][0]
        report.check(case, "cold run: no external hit", hits(cold) == 0, hits(cold))
        report.check(
            case,
            "cold run saves every full page of the prompt",
            s0["bytes_written"]["dram"] == 9 * page,
            f"{s0['bytes_written']['dram']} bytes written, page {page} bytes",
        )
        warm = engine(report, case, "warm", model, *common(m.endpoint))
        s1 = m.stats()
        report.check(case, "new engine: 288 tokens restored", hits(warm) == HIT, hits(warm))
        report.check(
            case,
            "new engine: manager read exactly the 9 pages",
            s1["bytes_read"]["dram"] == 9 * page and s1["leases"] == 0,
            s1,
        )
        report.check(case, "new engine: same ids, logprobs within 0.05", *same_output(cold, warm))
        consumed(report, case, warm, s1["hits"]["dram"] - s0["hits"]["dram"])
        other = engine(report, case, "other-identity", model, *common(m.endpoint), "--fingerprint", "another-model")
        s2 = m.stats()
        report.check(
            case,
            "another model identity misses",
            hits(other) == 0 and s2["hits"]["dram"] == s1["hits"]["dram"],
            (hits(other), s2["hits"]),
        )
        report.check(case, "another identity: answers as the cold run", *same_output(cold, other))
        # fp8 KV pages: the bf16 pages of variant 0 are in the store; an fp8 engine must not take them.
        fp8 = engine(
            report, case, "fp8-cold", model, *common(m.endpoint), "--kv-cache-dtype", "fp8", "--variants", "0,1"
        )
        s3 = m.stats()
        report.check(
            case,
            "fp8 engine never restores bf16 pages (bf16 pages of the prompt stored)",
            hits(fp8) == 0 and s3["hits"]["dram"] == s2["hits"]["dram"],
            (hits(fp8), s3["hits"]),
        )
        fp8_warm = engine(report, case, "fp8-warm", model, *common(m.endpoint), "--kv-cache-dtype", "fp8")
        s4 = m.stats()
        report.check(case, "fp8 engine restores its own fp8 pages", hits(fp8_warm) == HIT, hits(fp8_warm))
        report.check(
            case,
            "fp8 restore: same output as the fp8 cold run",
            *same_output(fp8["outputs"][0], fp8_warm["outputs"][0]),
        )
        consumed(report, case, fp8_warm, s4["hits"]["dram"] - s3["hits"]["dram"])
        # fp8 pages of variant 1 are in the store, bf16 ones are not: a bf16 engine must not take them.
        bf16 = engine(report, case, "bf16-after-fp8", model, *common(m.endpoint), "--variants", "1")
        s5 = m.stats()
        report.check(
            case,
            "bf16 engine never restores fp8 pages (fp8 pages of the prompt stored)",
            hits(bf16) == 0 and s5["hits"]["dram"] == s4["hits"]["dram"],
            (hits(bf16), s5["hits"]),
        )
    finally:
        m.stop()


def case_ssd(report: Report, root: Path, models: dict[str, Path]) -> None:
    case, model = "ssd", models["llama"]
    m = Manager(root, case, "128kb", ssd=True).start()  # 4 pages of DRAM for a 9-page prompt
    try:
        cold = engine(report, case, "cold", model, *common(m.endpoint))
        s0 = m.stats()
        report.check(
            case, "cold run demotes pages to the SSD tier", s0["bytes_written"]["ssd"] > 0, s0["bytes_written"]
        )
    finally:
        m.stop()
    m = Manager(root, case, "1mb", ssd=True).start()  # restarted: every page comes from SSD
    try:
        warm = engine(report, case, "warm", model, *common(m.endpoint))
        s1 = m.stats()
        page = warm["connector"]["page_bytes"][0]
        report.check(
            case,
            "restarted manager: hits from SSD, nothing beyond the selected pages read",
            s1["hits"]["ssd"] > 0 and s1["bytes_read"]["ssd"] == s1["hits"]["ssd"] * page,
            {"hits": s1["hits"], "bytes_read": s1["bytes_read"]},
        )
        # (a manager that demotes its DRAM pages at shutdown restores all 9 pages; one that does not,
        # the pages evicted to SSD before it stopped)
        served = s1["hits"]["ssd"] + s1["hits"]["dram"]
        report.check(
            case,
            "SSD restore: vLLM's external hits are the pages the restarted manager served",
            0 < hits(warm) == served * warm["block_size"],
            (hits(warm), s1["hits"]),
        )
        report.check(case, "SSD restore: same ids, logprobs within 0.05", *same_output(cold, warm))
        consumed(report, case, warm, s1["hits"]["ssd"] + s1["hits"]["dram"])
    finally:
        m.stop()


def case_graphs(report: Report, root: Path, models: dict[str, Path]) -> None:
    case, model = "graphs", models["llama"]
    m = Manager(root, case, "256mb").start()
    try:
        cold = engine(report, case, "cold", model, *common(m.endpoint), "--graphs", timeout=600)
        s0 = m.stats()
        warm = engine(report, case, "warm", model, *common(m.endpoint), "--graphs", timeout=600)
        s1 = m.stats()
        report.check(case, "CUDA graphs: new engine restores 288 tokens", hits(warm) == HIT, hits(warm))
        report.check(case, "CUDA graphs: same ids, logprobs within 0.05", *same_output(cold, warm))
        consumed(report, case, warm, s1["hits"]["dram"] - s0["hits"]["dram"])
    finally:
        m.stop()


def case_decode(report: Report, root: Path, models: dict[str, Path]) -> None:
    case, model = "decode", models["llama"]
    m = Manager(root, case, "256mb").start()
    try:
        first = engine(report, case, "generate", model, *common(m.endpoint), "--max-tokens", str(DECODE))
        s0 = m.stats()
        page = first["connector"]["page_bytes"][0]
        full = (PROMPT + DECODE) // 32  # 12: pages 10 to 12 hold generated tokens (page 10 from its 13th)
        report.check(
            case,
            f"{DECODE} tokens generated, {full} full pages saved ({full - PROMPT // 32} of them of generated tokens)",
            len(first["outputs"][0]["ids"]) == DECODE and s0["bytes_written"]["dram"] == full * page,
            f"{len(first['outputs'][0]['ids'])} tokens, {s0['bytes_written']['dram']} bytes written, page {page} bytes",
        )
        ids, logprobs = first["outputs"][0]["ids"], first["outputs"][0]["logprobs"]
        fed = json.dumps(ids[:FED])
        after = engine(report, case, "continue", model, *common(m.endpoint), "--append-ids", fed)
        s1 = m.stats()
        restored = (PROMPT + FED) // 32 * 32  # 384: every page of the prompt and the generated tokens it repeats
        report.check(case, f"new engine: {restored} tokens restored", hits(after) == restored, hits(after))
        report.check(
            case,
            f"new engine: the manager read the {restored // 32} pages, {restored // 32 - PROMPT // 32} of them saved "
            "during decode",
            s1["hits"]["dram"] - s0["hits"]["dram"] == restored // 32 and s1["leases"] == 0,
            (s0["hits"], s1["hits"]),
        )
        # What the first engine generated after those 88 tokens: the new engine's 8.
        report.check(
            case,
            "new engine: goes on as the first engine did (ids, logprobs within 0.05)",
            *same_output(after, {"ids": ids[FED : FED + 8], "logprobs": logprobs[FED : FED + 8]}),
        )
        consumed(report, case, after, s1["hits"]["dram"] - s0["hits"]["dram"])
    finally:
        m.stop()


def case_sliding(report: Report, root: Path, models: dict[str, Path]) -> None:
    case, model = "sliding", models["gemma"]
    m = Manager(root, case, "256mb").start()
    try:
        cold = engine(report, case, "cold", model, *common(m.endpoint))
        s0 = m.stats()
        pages = cold["connector"]["page_bytes"]
        report.check(case, "two KV cache groups (hybrid allocator on)", len(pages) == 2, cold["connector"])
        # 9 full-attention pages, and only the 2 pages the 64-token window needs (63 past tokens).
        expected = 9 * pages[0] + 2 * pages[-1] if len(pages) == 2 else None
        report.check(
            case, "cold run saves 9 full + 2 window pages", s0["bytes_written"]["dram"] == expected, s0["bytes_written"]
        )
        warm = engine(report, case, "warm", model, *common(m.endpoint))
        s1 = m.stats()
        report.check(case, "window model: 288 tokens restored", hits(warm) == HIT, hits(warm))
        report.check(
            case, "window model: manager read 11 pages", s1["hits"]["dram"] - s0["hits"]["dram"] == 11, s1["hits"]
        )
        report.check(case, "window model: same ids, logprobs within 0.05", *same_output(cold, warm))
        consumed(report, case, warm, s1["hits"]["dram"] - s0["hits"]["dram"])
    finally:
        m.stop()


def case_layouts(report: Report, root: Path, models: dict[str, Path]) -> None:
    """Other KV cache layouts vLLM 0.33 allocates on request (VLLM_KV_CACHE_LAYOUT): one run per
    head (LHBNC), all layers of a block in one range (BLNHC); and pages saved in one layout are
    never copied into an engine of another (their layout tag differs: a failed load, recomputed)."""
    case, model = "layouts", models["llama"]
    m = Manager(root, case, "256mb").start()
    try:
        for layout, tag in (("LHBNC", "block-runs-H_NC"), ("BLNHC", "block-dense-NHC")):
            variant = "1" if layout == "LHBNC" else "2"  # its own prompt: nothing of the other layout stored
            opts = [*common(m.endpoint), "--kv-layout", layout, "--variants", variant]
            cold = engine(report, case, f"{layout}-cold", model, *opts)
            before = m.stats()
            warm = engine(report, case, f"{layout}-warm", model, *opts)
            after = m.stats()
            report.check(
                case,
                f"{layout}: engine runs in that layout",
                warm.get("kv_cache_layout") == layout,
                warm.get("kv_cache_layout"),
            )
            report.check(
                case, f"{layout}: page tag {tag}", warm["connector"].get("layout_tags") == [tag], warm["connector"]
            )
            report.check(case, f"{layout}: 288 tokens restored", hits(warm) == HIT, hits(warm))
            report.check(case, f"{layout}: same ids, logprobs within 0.05", *same_output(cold, warm))
            consumed(report, case, warm, after["hits"]["dram"] - before["hits"]["dram"])
        # variant 1's pages are in the store as LHBNC (one run per head); an LBHNC engine must not copy them
        mixed = engine(
            report, case, "LBHNC-after-LHBNC", model, *common(m.endpoint), "--kv-layout", "LBHNC", "--variants", "1"
        )
        worker = mixed["connector"].get("worker", {})
        reference = next(r for r in report.runs if r["case"] == case and r["label"] == "LHBNC-cold")
        report.check(
            case,
            "pages of another layout are never copied (no page written; the request recomputed)",
            worker.get("pages_written", 0) == 0 and mixed["outputs"][0]["finish_reason"] == "length",
            {"hits": hits(mixed), "worker": worker},
        )
        report.check(case, "another layout: answers as that prompt's cold run", *same_output(reference, mixed))
    finally:
        m.stop()


LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def shm_bytes() -> int:
    return shutil.disk_usage("/dev/shm").free


def case_ttft(report: Report, root: Path, models: dict[str, Path]) -> None:
    case = "ttft"
    model = root / "llama3-8b-shape"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    lengths = (8192, 32768)
    shape = ["--dummy", "--vocab", "120000", "--prompt-tokens", ",".join(map(str, lengths)), "--max-tokens", "1"]
    shape += ["--block-size", "64", "--warmup-tokens", "2048", "--max-model-len", "33024"]
    shape += ["--kv-bytes", str(16 << 30), "--gpu-util", "0.5"]
    # tokens (prompts and warm-up) x layers x KV heads x head dim x (K, V) x bf16
    need = (sum(lengths) + 2048) * 32 * 8 * 128 * 2 * 2
    pool = min(need + (1 << 30), int(shm_bytes() * 0.9))
    report.check(case, f"/dev/shm holds the pool ({need >> 20} MiB)", pool >= need, f"free {shm_bytes() >> 20} MiB")
    runs: dict[str, dict[str, Any]] = {}

    def attempt(label: str, *options: str) -> None:
        try:
            runs[label] = engine(report, case, label, model, *options, *shape, timeout=600)
        except Exception as exc:  # the other figures still count
            report.check(case, f"{label} ran", False, f"{type(exc).__name__}: {str(exc)[-1500:]}")

    m = Manager(root, case, f"{pool >> 20}mb").start()
    try:
        attempt("orbitkv-cold", "--endpoint", m.endpoint, "--repeat-after-reset", "--timeline")
        before = m.stats()
        attempt("orbitkv-new-engine", "--endpoint", m.endpoint, "--timeline")
        after = m.stats()
        if "orbitkv-new-engine" in runs:
            consumed(report, case, runs["orbitkv-new-engine"], after["hits"]["dram"] - before["hits"]["dram"])
        # The same restore with Python's thread switch interval left alone while the load runs (5 ms):
        # what lowering it (the connector's default, load_switch_interval_us 200) does inside the engine.
        plain = json.dumps({"load_switch_interval_us": 0})
        attempt("orbitkv-new-engine-interval-left-alone", "--endpoint", m.endpoint, "--extra", plain, "--timeline")
        if "orbitkv-new-engine-interval-left-alone" in runs:
            later = m.stats()
            consumed(
                report,
                case,
                runs["orbitkv-new-engine-interval-left-alone"],
                later["hits"]["dram"] - after["hits"]["dram"],
            )
    finally:
        m.stop()
    offload_bytes = json.dumps({"cpu_bytes_to_use": need + (1 << 30)})
    attempt("offloading-connector", "--connector", "offloading", "--extra", offload_bytes, "--repeat-after-reset")

    def seconds(label: str, key: str, i: int) -> float | None:
        outs = runs.get(label, {}).get(key)
        return outs[i]["seconds"] if outs else None

    def load_ms(label: str, key: str, i: int) -> tuple[float, float] | None:
        """The worker's lease and restore milliseconds for prompt ``i`` (its counters' change over it)."""
        outs = runs.get(label, {}).get(key)
        if not outs or "lease_seconds" not in outs[i].get("worker", {}):
            return None
        now, before = outs[i]["worker"], outs[i]["worker_before"]
        return (now["lease_seconds"] - before["lease_seconds"]) * 1e3, (
            now["restore_seconds"] - before["restore_seconds"]
        ) * 1e3

    rows = []
    for i, n in enumerate(lengths):
        row = {
            "tokens": n,
            "cold": seconds("orbitkv-cold", "outputs", i),
            "orbitkv_new_engine": seconds("orbitkv-new-engine", "outputs", i),
            "orbitkv_new_engine_interval_left_alone": seconds("orbitkv-new-engine-interval-left-alone", "outputs", i),
            "orbitkv_same_engine": seconds("orbitkv-cold", "again", i),
            "offloading_cold": seconds("offloading-connector", "outputs", i),
            "offloading_same_engine": seconds("offloading-connector", "again", i),
            "orbitkv_new_engine_lease_restore_ms": load_ms("orbitkv-new-engine", "outputs", i),
            "orbitkv_same_engine_lease_restore_ms": load_ms("orbitkv-cold", "again", i),
            "orbitkv_new_engine_interval_left_alone_lease_restore_ms": load_ms(
                "orbitkv-new-engine-interval-left-alone", "outputs", i
            ),
        }
        rows.append(row)
        if n == max(lengths):
            cold, new = row["cold"], row["orbitkv_new_engine"]
            report.check(
                case,
                f"{n} tokens: a new engine restores 5x faster than cold",
                bool(cold and new and cold >= 5 * new),
                row,
            )
    with report.lock:
        report.runs.append({"case": case, "label": "table", "rows": rows, "manager": after})
    ms = lambda v: f"{v * 1e3:.0f} ms" if v is not None else "-"  # noqa: E731
    print(
        "| prompt | cold | OrbitKV, new engine | OrbitKV, same engine after reset | Offloading cold "
        "| Offloading, after reset |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {ms(r['cold'])} | {ms(r['orbitkv_new_engine'])} | {ms(r['orbitkv_same_engine'])} | "
            f"{ms(r['offloading_cold'])} | {ms(r['offloading_same_engine'])} |"
        )
    print("\n| prompt | OrbitKV restore | time to first token | of it, the loader leasing | the loader restoring |")
    print("|---|---|---|---|---|")
    for r in rows:
        for where, key in (
            ("new engine", "orbitkv_new_engine"),
            ("same engine after reset", "orbitkv_same_engine"),
            ("new engine, Python's switch interval left alone (5 ms)", "orbitkv_new_engine_interval_left_alone"),
        ):
            split = r[f"{key}_lease_restore_ms"]
            lease, restore = (f"{split[0]:.1f} ms", f"{split[1]:.1f} ms") if split else ("-", "-")
            print(f"| {r['tokens']} | {where} | {ms(r[key])} | {lease} | {restore} |")
    print(
        "\n| prompt | OrbitKV restore | lookup | lookup end to load submitted | submitted to loader done "
        "| loader done to seen finished | seen finished to forward | forward | forward end to result "
        "| engine steps while loading | TTFT |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, n in enumerate(lengths):
        for where, label, key in (
            ("new engine", "orbitkv-new-engine", "outputs"),
            ("same engine after reset", "orbitkv-cold", "again"),
            ("new engine, interval left alone", "orbitkv-new-engine-interval-left-alone", "outputs"),
        ):
            outs = runs.get(label, {}).get(key)
            line = outs[i].get("timeline") if outs else None
            if not line or not line["forward_steps"]:
                continue
            t = line["marks"]
            forward = line["forward_steps"][-1]  # the step that computes the prompt's last tokens
            spans = [
                t.get("lookup ends", 0) - t.get("lookup begins", 0),
                t.get("load submitted", 0) - t.get("lookup ends", 0),
                t.get("loader ends", 0) - t.get("load submitted", 0),
                t.get("load seen finished", 0) - t.get("loader ends", 0),
                forward[0] - t.get("load seen finished", 0),
                forward[1] - forward[0],
                line["generate_ms"] - forward[1],
            ]
            cells = " | ".join(f"{v:.1f} ms" for v in spans)
            print(f"| {n} | {where} | {cells} | {line['steps_while_loading']} | {line['generate_ms']:.0f} ms |")


CASES = {
    "eager": case_eager,
    "ssd": case_ssd,
    "graphs": case_graphs,
    "sliding": case_sliding,
    "decode": case_decode,
    "layouts": case_layouts,
    "ttft": case_ttft,
}


def build_models(root: Path, names: set[str]) -> dict[str, Path]:
    sys.path.insert(0, str(HERE.parent / "demo"))
    import tiny_model

    models: dict[str, Path] = {}
    if names & {"eager", "ssd", "graphs", "layouts", "decode"}:
        models["llama"] = tiny_model.build(root / "tiny-llama")
    if "sliding" in names:
        models["gemma"] = tiny_model.build_sliding(root / "tiny-gemma")
    return models


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="directory for gpu_engines.json and logs/")
    parser.add_argument("--cases", default="eager,ssd,graphs,sliding,decode", help="comma-separated, run side by side")
    parser.add_argument("--ttft", action="store_true", help="then the time-to-first-token case, alone on the GPU")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    names = [c for c in args.cases.split(",") if c]
    root = Path(tempfile.mkdtemp(prefix="orbitkv-gpu-"))
    print(f"/dev/shm free: {shm_bytes() >> 20} MiB", flush=True)
    models = build_models(root, set(names))

    def guarded(name: str) -> None:
        try:
            CASES[name](report, root, models)
        except Exception as exc:  # a case that cannot run is a failed check, never a silent pass
            report.check(name, "case ran to the end", False, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        finally:
            report.save()

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        list(pool.map(guarded, names))
    if args.ttft:
        guarded("ttft")
    (out / "logs").mkdir(exist_ok=True)
    for log in root.glob("*-manager.log"):
        shutil.copy(log, out / "logs" / log.name)
    failed = [c for c in report.checks if not c["ok"]]
    print(f"\n{len(report.checks) - len(failed)} of {len(report.checks)} checks passed")
    for c in report.checks:
        print(f"| {c['case']} | {c['check']} | {'pass' if c['ok'] else 'FAIL: ' + str(c['detail'])[:300]} |")
    report.save()
    return 1 if failed or not report.checks else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
