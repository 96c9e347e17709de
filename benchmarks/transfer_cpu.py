"""OrbitKV's CPU transfer path (what a CPU engine's save and restore run), against plain copies of the same
bytes in the same run.

vLLM-shaped layouts on the CPU: 32 layers, a K and a V segment each, pages of 16 tokens of 8, 64 or 256 KiB
per layer and half (chunks of 4, 32 and 128 KiB: pages of 256 KiB, 2 MiB and 8 MiB), 128 MiB of pages per
size, scattered over the engine's blocks and the arena. Both routes of the CPU path:

- compiled: one numba call per batch (``wire._copy_pages_in`` / ``_copy_pages_out``): a save or a restore
  copies and sums each chunk in one pass (a restore's page that fails its checksum is written and reported bad,
  as on the GPU);
- torch copies: a ``copy_`` per chunk and a checksum per page, the route where numba is not installed or
  has not finished compiling.

The ceiling is one memcpy of the same bytes between two contiguous buffers (one thread, as both routes
run); the checksum alone over the same bytes is shown too. Every figure is checked before it is timed:
the two routes' checksums are the same and equal ``checksum`` of each extent, every restored block equals
its source block, and a page whose arena bytes were changed is reported (and, by the torch copies, not
written). Timed by turns, each figure the median of ``--rounds`` rounds.

    python benchmarks/transfer_cpu.py [--rounds 9] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time

import numpy as np
import report  # benchmarks/report.py: the script's own directory is on sys.path
import torch

from cacheon_orbitkv import wire
from cacheon_orbitkv.transfer import Arena, GroupLayout, Pages, restore, save
from cacheon_orbitkv.wire import checksum, compiled_checksum, prefault

LAYERS = 32
TOTAL = 128 << 20  # bytes of pages per size


def routed(compiled: bool, fn):
    """``fn`` with the compiled kernels, or with them hidden (the torch copies)."""
    kernels = wire._compiled
    wire._compiled = kernels if compiled else None
    try:
        return fn()
    finally:
        wire._compiled = kernels


def one_size(chunk: int, rounds: int) -> list[str]:
    page = 2 * LAYERS * chunk
    n = TOTAL // page
    blocks = n + n // 4
    gen = torch.Generator().manual_seed(chunk)
    source = [torch.randint(0, 256, (blocks, chunk), dtype=torch.uint8, generator=gen) for _ in range(2 * LAYERS)]
    dest = [torch.zeros(blocks, chunk, dtype=torch.uint8) for _ in range(2 * LAYERS)]
    layout, into = GroupLayout(source), GroupLayout(dest)
    region = mmap.mmap(-1, page * (n + 4))  # shared anonymous memory, as the arena's memfd
    prefault(region)
    arena = Arena(region)
    rng = np.random.default_rng(chunk)
    engine_blocks = rng.permutation(blocks)[:n]
    extents = rng.permutation(n + 4)[:n] * page
    pages = Pages.of(engine_blocks, extents)

    # Correctness first: both routes' checksums, the restored blocks, a changed page refused.
    fast = routed(True, lambda: save(arena, layout, pages))
    slow = routed(False, lambda: save(arena, layout, pages))
    assert fast.path == "compiled" and slow.path == "torch"
    sums = fast.checksums()
    assert sums == slow.checksums() == [checksum(region[o : o + page]) for o in extents.tolist()]
    committed = Pages.of(engine_blocks, extents, sums)
    for compiled in (True, False):
        for seg in dest:
            seg.zero_()
        fence = routed(compiled, lambda: restore(arena, into, committed))
        assert fence.path == ("compiled" if compiled else "torch") and all(fence.wait())
        assert all(torch.equal(d[engine_blocks], s[engine_blocks]) for d, s in zip(dest, source, strict=True))
        wrong = int(extents[1]) + page // 2
        region[wrong] ^= 0xFF
        for seg in dest:
            seg.zero_()
        fence = routed(compiled, lambda: restore(arena, into, committed))
        region[wrong] ^= 0xFF
        assert fence.wait() == [True, False] + [True] * (n - 2)
        good = np.delete(engine_blocks, 1)
        assert all(torch.equal(d[good], s[good]) for d, s in zip(dest, source, strict=True))
        if not compiled:  # the compiled route copies a page out as it sums it: its verdict says not to use it
            assert not any(d[int(engine_blocks[1])].any() for d in dest)

    flat_src = np.frombuffer(region, np.uint8, n * page)
    flat_dst = np.empty(n * page, np.uint8)
    flat_dst[:] = 1  # faulted in
    times: dict[str, list[float]] = {}
    variants = {
        "save, compiled": lambda: routed(True, lambda: save(arena, layout, pages)),
        "save, torch copies": lambda: routed(False, lambda: save(arena, layout, pages)),
        "restore, compiled": lambda: routed(True, lambda: restore(arena, into, committed)),
        "restore, torch copies": lambda: routed(False, lambda: restore(arena, into, committed)),
        "memcpy": lambda: np.copyto(flat_dst, flat_src),
        "checksum": lambda: [checksum(region[o : o + page]) for o in extents.tolist()],
    }
    for _ in range(rounds):
        for name, fn in variants.items():
            began = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - began)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    gbs = lambda s: n * page / s / 1e9  # noqa: E731
    size = f"{chunk >> 10} KiB chunks ({page >> 20 or page >> 10} {'MiB' if page >= 1 << 20 else 'KiB'} pages)"
    rows = []
    for way in ("save", "restore"):
        compiled, torch_s = med[f"{way}, compiled"], med[f"{way}, torch copies"]
        rows.append(
            f"| {way}, {size} x {n} | {gbs(compiled):.2f} GB/s | torch copies {gbs(torch_s):.2f} GB/s; "
            f"memcpy {gbs(med['memcpy']):.2f} GB/s; checksum alone {gbs(med['checksum']):.2f} GB/s | "
            f"{torch_s / compiled:.2f}x / {med['memcpy'] / compiled:.2f} |"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds, the variants by turns in each")
    parser.add_argument("--append", metavar="FILE", help="append the table to FILE (BENCHMARKS.md)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # both routes and the memcpy run on one thread
    if not compiled_checksum():
        print("numba is not installed or failed to compile: install cacheon-orbitkv[fast]", file=sys.stderr)
        return 1
    rows = [
        "| figure | compiled | same run | compiled over torch copies / of memcpy |",
        "|---|---|---|---|",
    ]
    for chunk in (4 << 10, 32 << 10, 128 << 10):
        rows += one_size(chunk, args.rounds)
    table = "\n".join(rows)
    print(table)
    if args.append:
        report.append(
            args.append,
            "OrbitKV's CPU transfer path: compiled page kernels against per-chunk torch copies",
            table,
            note=f"Medians of {args.rounds} rounds, the variants by turns; torch on one thread.",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
