"""Recovery-contract micro-benchmark: required_ranges and restorable_boundaries over 4096-page evidence.

The floor is one Python pass over the same evidence (touching each page end once, as validation
must); the ratio says how close the contract is to reading its input. Full attention + a 1024-token
window + a recurrent checkpoint every 16 pages, 64-token pages.

    python benchmarks/contract.py [--pages 4096] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import report  # benchmarks/report.py: the script's own directory is on sys.path

from cacheon_orbitkv.contract import RecoveryContract

NS = "bench"


def per_call_us(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=4096, help="evidence pages per group (default 4096)")
    parser.add_argument("--reps", type=int, default=200, help="timed calls per figure (default 200)")
    parser.add_argument("--append", metavar="FILE", help="append the result table to this markdown file")
    args = parser.parse_args()

    page = 64
    contract = RecoveryContract.compile(NS, page, [(0, "attention", 0), (1, "window", 1024), (2, "recurrent", 0)])
    end = args.pages * page
    ends = list(range(page, end + 1, page))
    evidence = {0: ends, 1: ends, 2: ends[15::16]}

    def floor() -> None:
        for values in evidence.values():
            for value in values:
                if value % page:
                    raise AssertionError

    rows = [
        ("required_ranges, 3 groups", per_call_us(lambda: contract.required_ranges(NS, 0, end), args.reps)),
        (
            f"restorable_boundaries, 3 x {args.pages} pages",
            per_call_us(lambda: contract.restorable_boundaries(NS, 0, end, evidence), args.reps),
        ),
        (
            f"common_boundaries, 2 shards x 3 x {args.pages} pages",
            per_call_us(lambda: contract.common_boundaries(NS, 0, end, [evidence, evidence]), args.reps),
        ),
        (f"floor: one pass over 3 x {args.pages} page ends", per_call_us(floor, args.reps)),
    ]
    floor_us = rows[-1][1]
    lines = ["| operation | median (us) | x floor |", "|---|---|---|"]
    lines += [f"| {name} | {us:.1f} | {us / floor_us:.2f} |" for name, us in rows]
    table = "\n".join(lines)
    print(table)
    if args.append:
        report.append(args.append, "Recovery contract", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
