"""Where the host's time goes in one OrbitKV restore call (needs a CUDA device): cProfile of
repeated restores of 256 scattered 16 KiB pages x 32 layers (benchmarks/transfer.py's layout),
each call on an idle stream, so that every microsecond the host spends before the moving kernel
starts is a microsecond the GPU is idle; by turns, the call on the SMs replayed from a CUDA graph (as shipped
for extents below 512 KiB), the same call launched eagerly, and where the extents are staged through device memory
(512 KiB and more: 16 KiB pages and up) the shipped staged call; a profile of the shipped call. Then the SMs'
eager call step by step with the host's time in each,
the moving kernel launched through Triton's JIT and, by turns, through its compiled handle (every
call's verdicts checked).

    python benchmarks/transfer_host.py [--size-kib 16] [--calls 200] [--copies]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from transfer import layout_for, make_arena, plans

from cacheon_orbitkv.transfer import Pages, restore, save


def copy_calls(arena, calls: int) -> None:
    """The host's time in one call that queues copies out of the registered arena into device memory (32 MiB
    in all, or 2 MiB), by the number of copies it carries: ``cuMemcpyBatchAsync`` with each source access
    order, and one ``cuMemcpyHtoDAsync`` per copy. Median and min of ``calls``, each from an idle stream."""
    import ctypes

    from cacheon_orbitkv import transfer as t

    shipped = t.BatchCopy.get()
    assert shipped is not None
    into = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    driver = t._Graphs.driver()
    print("\nqueueing copies out of the arena (host time per call, us: median, min):")
    for count, size in ((1, 2 << 20), (1, 32 << 20), (16, 2 << 20), (4, 8 << 20), (128, 256 << 10)):
        offsets = np.arange(count, dtype=np.uint64) * np.uint64(size)
        src = np.uint64(arena.cpu.data_ptr()) + offsets * np.uint64(3)  # scattered extents
        dst = np.uint64(into.data_ptr()) + offsets
        sizes = np.full(count, size, dtype=np.uint64)
        ways = {}
        for order, name in ((1, "stream"), (2, "during the call"), (3, "any")):
            batch = t.BatchCopy(shipped._fn)
            batch._attributes = t._CopyAttributes(order, (0, 0), (0, 0), 0)
            ways[f"cuMemcpyBatchAsync, source order {name}"] = lambda b=batch, d=dst, s=src, n=sizes: b.copy(d, s, n)

        def one_by_one(dst=dst, src=src, sizes=sizes) -> None:
            handle = ctypes.c_void_p(stream.cuda_stream)
            for d, s_, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
                driver.cuMemcpyHtoDAsync_v2(d, ctypes.c_void_p(s_), n, handle)

        ways["cuMemcpyHtoDAsync per copy"] = one_by_one
        for name, fn in ways.items():
            spent = []
            for _ in range(calls):
                torch.cuda.synchronize()
                with torch.cuda.stream(stream):
                    began = time.perf_counter()
                    fn()
                    spent.append(time.perf_counter() - began)
            torch.cuda.synchronize()
            print(f"  {count} x {size >> 10} KiB, {name}: {np.median(spent) * 1e6:.0f}, {min(spent) * 1e6:.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-kib", type=int, default=16)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--copies", action="store_true", help="only time the host's calls that queue copies")
    args = parser.parse_args()
    arena = make_arena(1 << 30)
    if args.copies:
        copy_calls(arena, args.calls)
        return 0
    layout = layout_for(args.size_kib << 10, layers=32)
    pages = plans(layout, 256, 1)
    sums = save(arena, layout, pages).checksums()
    plan = Pages.of([p.block for p in pages], [p.offset for p in pages], sums)  # as the engine adapters pass them
    calls = {
        "on the SMs, replayed from its CUDA graph": lambda: restore(arena, layout, plan, path="triton"),
        "on the SMs, launched eagerly": lambda: restore(arena, layout, plan, path="triton", graphs=False),
    }
    if restore(arena, layout, plan).path == "staged":  # extents the copy engines stage through device memory
        calls["staged (as shipped at this size)"] = lambda: restore(arena, layout, plan)
    for call in calls.values():
        assert all(call().wait())
    host: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(args.calls):  # by turns
        for label, call in calls.items():
            torch.cuda.synchronize()
            began = time.perf_counter()
            call()
            host[label].append(time.perf_counter() - began)
    torch.cuda.synchronize()
    for label, times in host.items():
        print(
            f"host time per restore call, {label}: median {np.median(times) * 1e6:.0f} us, "
            f"p90 {np.percentile(times, 90) * 1e6:.0f} us, min {min(times) * 1e6:.0f} us"
        )
    profile = cProfile.Profile()
    for _ in range(args.calls):  # the shipped call
        torch.cuda.synchronize()
        profile.enable()
        restore(arena, layout, plan)
        profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue())
    # The same restore call step by step, the host's time in each (median of the calls), and two
    # launches tried: the moving kernel launched through its compiled handle (what the JIT returned on
    # its first launch), skipping Triton's argument binding and cache lookup.
    import triton

    from cacheon_orbitkv import transfer as t
    from cacheon_orbitkv.gpu_kernels import build_table, move_table

    steps: dict[str, list[float]] = {}
    handles: dict[str, object] = {}

    def lap(name: str, began: float) -> float:
        now = time.perf_counter()
        steps.setdefault(name, []).append(now - began)
        return now

    def stepwise(direct: bool) -> torch.Tensor:
        began = first = time.perf_counter()
        t._check_alignment(layout)
        batch = t._pages(arena, layout, plan, committed=True)
        began = lap("check the pages", began)
        host_table = t._small_table(layout, batch, arena.device, True)
        began = lap("pinned table (empty + fill)", began)
        small = host_table.to(arena.device, non_blocking=True)
        began = lap("copy to the device", began)
        n_segments, n = len(layout.segments), len(batch)
        items = n * n_segments * layout.tiles
        sums = torch.empty(n, dtype=torch.int64, device=arena.device)
        table = torch.empty((5, items), dtype=torch.int64, device=arena.device)
        began = lap("two device allocations", began)
        build_table[(triton.cdiv(items, 1024),)](
            small,
            n_segments,
            n,
            layout.tiles,
            arena.kernel_view.data_ptr(),
            table,
            items,
            sums,
            0,
            TILE=layout.tile_words,
            ITEMS=1024,
            num_warps=4,
        )
        began = lap("build_table launch", began)
        warps = 8 if layout.tile_words >= 2048 else 4
        if direct and "move" in handles:
            stream = torch.cuda.current_stream().cuda_stream
            handles["move"][(items, 1, 1)](
                table, items, sums, 0, True, False, layout.tile_words, False, False, stream=stream
            )
            began = lap("move_table launch, compiled handle", began)
        else:
            kernel = move_table[(items,)](
                table,
                items,
                sums,
                0,
                TO_ARENA=False,
                CHECKSUM=True,
                BLOCK=layout.tile_words,
                SUM_ONLY=False,
                PERSISTENT=False,
                num_warps=warps,
            )
            handles.setdefault("move", kernel)
            began = lap("move_table launch", began)
        expected = small[layout.segment_table.size + 2 * n :]
        verdicts = sums == expected
        began = lap("verdicts (compare)", began)
        t.Fence(event=t._fence_event(arena), verdicts=verdicts, sums=sums, path="triton", length=layout.page_bytes)
        lap("fence event", began)
        steps.setdefault("the whole call", []).append(time.perf_counter() - first)
        return verdicts

    for direct in (False, True) * 3:
        for _ in range(args.calls // 6):
            torch.cuda.synchronize()
            assert all(bool(v) for v in stepwise(direct).cpu().tolist())
    torch.cuda.synchronize()
    print("\nthe restore call step by step (host time in us: median, p90, max):")
    for name, values in steps.items():
        median, p90, most = (float(np.percentile(values, q)) * 1e6 for q in (50, 90, 100))
        print(f"  {name:40s} {median:8.1f} {p90:8.1f} {most:8.1f}")
    arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
