"""Where the host's time goes in one OrbitKV restore call (needs a CUDA device): cProfile of
repeated restores of 256 scattered 16 KiB pages x 32 layers (benchmarks/transfer.py's layout),
each call on an idle stream, so that every microsecond the host spends before the moving kernel
starts is a microsecond the GPU is idle.

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
    host = []
    for _ in range(args.calls):
        torch.cuda.synchronize()
        began = time.perf_counter()
        restore(arena, layout, plan)
        host.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    print(f"host time per restore call: median {np.median(host) * 1e6:.0f} us, min {min(host) * 1e6:.0f} us")
    profile = cProfile.Profile()
    for _ in range(args.calls):
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
    arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
