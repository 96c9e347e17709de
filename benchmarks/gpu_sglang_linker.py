"""OrbitKVLinker on CUDA with SGLang 0.5.23's real pools, tree and scheduler pieces: restore timings
and byte-exact checks for a Llama-3-8B-shaped KV pool.

SGLang cannot serve on the lent GPU (its ``sgl_kernel`` does not load on the device's torch), so
this drives the linker the way SGLang's scheduler does (tests/sglang/sglang_cache.py) with SGLang's
own ``MHATokenToKVPool`` on the GPU, its allocator, ``UnifiedRadixCache`` built by its registry
(which builds the linker), ``Req``/``PrefillAdder``/``ScheduleBatch`` and a real cache manager
process. Only the model forward is ours (tests/sglang/sglang_cuda.py ``TensorScheduler``): per layer
it waits on SGLang's layer counter, reads the prefix on the default stream and writes seeded random
K and V for its own tokens. ``sgl_kernel`` is absent (tests/sglang/absent_sgl_kernel.py).

Per case: a cold prefill saves the prompt's pages through the linker; then, ``--repeats`` times,
SGLang's ``flush_cache`` empties HBM, every K/V byte is poisoned, and the same prompt is restored
through the linker's CUDA path. Checked each time: SGLang reuses N-1 tokens rounded down to a
page; the planned destination pages (and nothing else) were written before the forward ran; every
layer's restored K and V are byte-equal to what the cold forward wrote; the linker's and the
manager's byte counts equal planned pages x page bytes; no lease or reservation is left.

    python3 benchmarks/gpu_sglang_linker.py --out DIR [--cases llama8b-p64-8k,...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (layers, kv heads, head dim, page tokens, prompt tokens)
CASES = {
    "llama8b-p64-8k": (32, 8, 128, 64, 8193),
    "llama8b-p64-32k": (32, 8, 128, 64, 32769),
    "llama8b-p512-8k": (32, 8, 128, 512, 8193),  # 1 MiB page chunks: the copy-engine path
    "tiny": (2, 2, 64, 16, 129),  # a dry run of the script itself (``--device cpu``)
}
DEVICE = "cuda"


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def ceiling(nbytes: int, repeats: int = 5) -> float:
    """Seconds for one pinned host -> device copy of ``nbytes`` (median): the transfer ceiling."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del host, dev
    return statistics.median(times)


def run_case(name: str, endpoint: str, repeats: int) -> dict:
    from tests.sglang import sglang_cache as sc
    from tests.sglang import sglang_cuda as scu

    from cacheon_orbitkv.client import CacheClient
    from cacheon_orbitkv.transfer import choose_path

    layers, heads, head_dim, page, tokens = CASES[name]
    size = (tokens // page + 4) * page
    fx = sc.build_mha(
        endpoint, page_size=page, layers=layers, size=size, max_context=size, heads=heads, head_dim=head_dim
    )
    linker = fx["linker"]
    kv = fx["kvcache"]
    assert linker.device == DEVICE and (linker._load_stream is not None) == DEVICE.startswith("cuda"), linker.device
    layout = linker.pool_layout.layouts[0]
    result: dict = {
        "case": name,
        "layers": layers,
        "kv_heads": heads,
        "head_dim": head_dim,
        "page": page,
        "prompt_tokens": tokens,
        "page_bytes": layout.page_bytes,
        "chunk_bytes": layout.chunks[0],
        "path": choose_path(layout, linker.device),
        "namespace": linker.namespace,
    }
    sched = scu.TensorScheduler(fx, seed=1)
    # A prompt of its own per case: the cases share one manager, and a shared prefix would be a hit.
    seed = sum(name.encode())
    ids = [int(x) for x in torch.randint(10, 30000, (tokens,), generator=torch.Generator().manual_seed(seed))]
    with CacheClient(endpoint) as client:
        written_before = client.stats()["bytes_written"]["dram"]

    start = time.perf_counter()
    cold = sched.run("cold", ids)  # prefill, insert, offload; run() settles every save
    sync()
    result["cold_prefill_and_save_s"] = time.perf_counter() - start
    assert cold["host_loaded"] == 0 and not cold["failed"], cold
    reuse = (tokens - 1) // page * page  # SGLang's match limit: N-1 tokens, whole pages
    loc = cold["out_cache_loc"][:reuse].to(torch.int64)
    want_k = [kv.k_buffer[layer][loc].clone() for layer in range(layers)]
    want_v = [kv.v_buffer[layer][loc].clone() for layer in range(layers)]
    with CacheClient(endpoint) as client:
        stats = client.stats()
    result["saved_bytes"] = linker.stats["saved_bytes"]
    written = stats["bytes_written"]["dram"] - written_before
    assert linker.stats["saved_bytes"] == written >= reuse // page * layout.page_bytes, (linker.stats, written)

    # What a restore calls: the linker's lookup (scheduler thread) and load (lease, copy, fence, release).
    timings: dict[str, list[float]] = {"lookup": [], "load": []}
    for what in ("lookup", "load"):
        own = getattr(linker, what)

        def timed(*args, _own=own, _what=what):
            t0 = time.perf_counter()
            try:
                return _own(*args)
            finally:
                timings[_what].append(time.perf_counter() - t0)

        setattr(linker, what, timed)

    rounds = []
    for i in range(repeats):
        sched.flush()
        scu.poison([*kv.k_buffer, *kv.v_buffer])
        sync()
        with CacheClient(endpoint) as client:
            read_before = client.stats()["bytes_read"]["dram"]
        loaded_before = linker.stats["loaded_bytes"]
        rid = f"warm-{i}"
        t0 = time.perf_counter()
        req = sched.new_req(rid, ids)
        batch = sched.schedule(req)  # match (lookup), admission (load: the restore), loading start
        t1 = time.perf_counter()
        private = fx["cache"].linker.private_load_indices[rid].to(torch.int64).clone()
        planned = sorted({int(s) // page for s in private[::page].tolist()})
        # Before the forward: exactly the planned pages hold anything but the poison.
        rows = torch.zeros(kv.k_buffer[0].shape[0], dtype=torch.bool, device=kv.k_buffer[0].device)
        for t in [*kv.k_buffer, *kv.v_buffer]:
            rows |= scu.touched_rows(t)
        touched = set((rows.nonzero().flatten() // page).unique().tolist())
        t2 = time.perf_counter()
        sched.forward(batch)
        sync()
        t3 = time.perf_counter()
        failed = sched.finish(batch)
        sched.settle()
        equal = [
            torch.equal(kv.k_buffer[layer][private].view(torch.uint8), want_k[layer].view(torch.uint8))
            and torch.equal(kv.v_buffer[layer][private].view(torch.uint8), want_v[layer].view(torch.uint8))
            for layer in range(layers)
        ]
        with CacheClient(endpoint) as client:
            stats = client.stats()
        planned_bytes = len(planned) * layout.page_bytes
        round_ = {
            "host_loaded": req.host_loaded_length,
            "planned_pages": len(planned),
            "touched_is_planned": touched == set(planned),
            "layers_byte_equal": sum(equal),
            "failed": [r.rid for r in failed],
            "manager_bytes_read": stats["bytes_read"]["dram"] - read_before,
            "linker_loaded_bytes": linker.stats["loaded_bytes"] - loaded_before,
            "planned_bytes": planned_bytes,
            "leases_left": stats["leases"],
            "reservations_left": stats["reservations"],
            "lookup_s": timings["lookup"][-1] if timings["lookup"] else None,
            "load_s": timings["load"][-1] if timings["load"] else None,
            "schedule_s": t1 - t0,
            "forward_s": t3 - t2,
            "layer_wait_max_s": max(sched.layer_waits),
            "layer_wait_sum_s": sum(sched.layer_waits),
        }
        rounds.append(round_)
        ok = (
            round_["host_loaded"] == reuse
            and round_["planned_pages"] == reuse // page
            and round_["touched_is_planned"]
            and round_["layers_byte_equal"] == layers
            and not round_["failed"]
            and round_["manager_bytes_read"] == round_["linker_loaded_bytes"] == planned_bytes
            and round_["leases_left"] == 0
            and round_["reservations_left"] == 0
        )
        round_["ok"] = ok
        print(json.dumps({"case": name, "round": i, **round_}), flush=True)
    result["rounds"] = rounds
    result["ok"] = all(r["ok"] for r in rounds)
    result["linker_stats"] = dict(linker.stats)
    loads = [r["load_s"] for r in rounds[1:] or rounds]  # the first round compiles the restore kernel
    result["load_s_median"] = statistics.median(loads)
    result["restored_bytes"] = rounds[-1]["planned_bytes"]
    result["restore_gbs"] = result["restored_bytes"] / result["load_s_median"] / 1e9
    if DEVICE.startswith("cuda"):
        result["ceiling_s"] = ceiling(result["restored_bytes"])
        result["ceiling_gbs"] = result["restored_bytes"] / result["ceiling_s"] / 1e9
    linker.close()
    del want_k, want_v, fx, sched, kv
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_sglang_linker.json")
    parser.add_argument("--cases", default="llama8b-p64-8k,llama8b-p64-32k,llama8b-p512-8k")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (the linker's torch path)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool", default="12gb", help="the manager's DRAM pool")
    parser.add_argument(
        "--probe", action="store_true", help="only import the linker path and report what sgl_kernel gave"
    )
    parser.add_argument(
        "--any-importer",
        action="store_true",
        help="hand the absent sgl_kernel to any SGLang module, not only the known ones",
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    from tests.sglang import absent_sgl_kernel

    if DEVICE.startswith("cuda"):
        absent_sgl_kernel.install(strict=not args.any_importer)
    if args.probe:
        try:
            from sglang.srt.mem_cache.registry import create_unified_radix_cache  # noqa: F401
            from tests.sglang import sglang_cuda

            from cacheon_sglang import linker  # noqa: F401
        finally:
            print(json.dumps(absent_sgl_kernel.report(), indent=1))
        return 0
    from tests.manager_process import ManagerProcess
    from tests.sglang import sglang_cuda

    sglang_cuda.use_device(DEVICE)
    tmp = Path(tempfile.mkdtemp(prefix="sgl-linker-"))
    sock = Path(tempfile.mkdtemp(prefix="okv-", dir="/tmp"))
    manager = ManagerProcess(tmp, sock, pool=args.pool).start()
    results = []
    try:
        for name in args.cases.split(","):
            try:
                results.append(run_case(name, manager.endpoint, args.repeats))
            except Exception as exc:  # one case's failure is reported; the others still run
                import traceback

                traceback.print_exc()
                results.append({"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        manager.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
    report = {
        "device": torch.cuda.get_device_name() if DEVICE.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "absent_sgl_kernel": absent_sgl_kernel.report(),
        "results": results,
    }
    print()
    print("| case | path | restored | load (median) | GB/s | ceiling GB/s | of ceiling | max layer wait | checks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        print(
            f"| {r['case']} | {r['path']} | {r['restored_bytes'] / 2**20:.0f} MiB"
            f" ({r['rounds'][-1]['planned_pages']} pages)"
            f" | {r['load_s_median'] * 1e3:.1f} ms | {r['restore_gbs']:.1f} | {r.get('ceiling_gbs', 0):.1f}"
            f" | {r['restore_gbs'] / r.get('ceiling_gbs', float('inf')):.2f}"
            f" | {max(x['layer_wait_max_s'] for x in r['rounds']) * 1e3:.2f} ms"
            f" | {'pass' if r['ok'] else 'FAIL'} |"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_sglang_linker.json").write_text(json.dumps(report, indent=1))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
    raise SystemExit(main())
