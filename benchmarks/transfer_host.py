"""Where the host's time goes in one OrbitKV restore call (needs a CUDA device): cProfile of
repeated restores of 256 scattered 16 KiB pages x 32 layers (benchmarks/transfer.py's layout),
each call on an idle stream, so that every microsecond the host spends before the moving kernel
starts is a microsecond the GPU is idle; the shipped call (replayed from a CUDA graph) and the same call
launched eagerly, by turns. Then the eager call step by step with the host's time in each,
the moving kernel launched through Triton's JIT and, by turns, through its compiled handle (every
call's verdicts checked).

    python benchmarks/transfer_host.py [--size-kib 16] [--calls 200]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-kib", type=int, default=16)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    arena = make_arena(1 << 30)
    layout = layout_for(args.size_kib << 10, layers=32)
    pages = plans(layout, 256, 1)
    sums = save(arena, layout, pages).checksums()
    plan = Pages.of([p.block for p in pages], [p.offset for p in pages], sums)  # as the engine adapters pass them
    assert all(restore(arena, layout, plan).wait())
    assert all(restore(arena, layout, plan, graphs=False).wait())
    host: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.calls):  # by turns: replayed from the CUDA graph (as shipped), and eagerly
        for graphs in (True, False):
            torch.cuda.synchronize()
            began = time.perf_counter()
            restore(arena, layout, plan, graphs=graphs)
            host[graphs].append(time.perf_counter() - began)
    torch.cuda.synchronize()
    for graphs, label in ((True, "replayed from its CUDA graph, as shipped"), (False, "launched eagerly")):
        times = host[graphs]
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
                table, items, sums, True, False, layout.tile_words, False, False, stream=stream
            )
            began = lap("move_table launch, compiled handle", began)
        else:
            kernel = move_table[(items,)](
                table,
                items,
                sums,
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
