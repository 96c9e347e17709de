"""Host time of the example Triton norms' launch arithmetic, against the same code with Triton's helpers.

The plugin's Triton norms pick their launch on the host (``triton_kernels._norm_launch``, and for RMSNorm
``_persistent_launch`` first; once per shape since the picks are kept, the second table), sizing blocks and
grids with plain-integer twins of ``triton.next_power_of_2`` and ``triton.cdiv`` (``_next_pow2``, ``_cdiv``):
Triton's own are ConstexprFunctions, costly as host calls. The baseline is the same launch functions with
Triton's helpers put back in their place, timed by turns in the same process; each figure is the best of five
repeats of 200000 calls. No GPU is needed (nothing is launched), only Triton installed.

A second table: each norm's whole pick of a launch (kernel, grid, arguments) as a call makes it, kept per
shape (``_rmsnorm_plan`` and ``_fused_plan``, an LRU cache) against picked anew (the same function unwrapped),
by turns; the two give the same launch (checked before timing).

    python benchmarks/launch_host.py [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import report  # benchmarks/report.py: the script's own directory is on sys.path
import triton

from cacheon_example_kernels import triton_kernels

CALLS = 200_000

CASES: list[tuple[str, Callable[[], Any]]] = [
    ("`_norm_launch(100, 4096, fused=False)`: one read", lambda: triton_kernels._norm_launch(100, 4096, False)),
    ("`_norm_launch(3000, 4096, fused=False)`: two reads", lambda: triton_kernels._norm_launch(3000, 4096, False)),
    ("`_norm_launch(3000, 4096, fused=True)`: two reads", lambda: triton_kernels._norm_launch(3000, 4096, True)),
    ("`_persistent_launch(1536, 4096, 132)`: the grid", lambda: triton_kernels._persistent_launch(1536, 4096, 132)),
    ("`_persistent_launch(100, 4096, 132)`: not its rows", lambda: triton_kernels._persistent_launch(100, 4096, 132)),
]


PLANS: list[tuple[str, Any, tuple[int, ...]]] = [
    ("RMSNorm, 16 x 4096 on 132 SMs: one read", triton_kernels._rmsnorm_plan, (16, 4096, 132)),
    ("RMSNorm, 1536 x 4096 on 132 SMs: the persistent grid", triton_kernels._rmsnorm_plan, (1536, 4096, 132)),
    ("RMSNorm, 3000 x 8192 on 132 SMs: two reads", triton_kernels._rmsnorm_plan, (3000, 8192, 132)),
    ("fused add + RMSNorm, 16 x 4096: one read", triton_kernels._fused_plan, (16, 4096)),
    ("fused add + RMSNorm, 3000 x 4096: two reads", triton_kernels._fused_plan, (3000, 4096)),
]


def best_us(fn: Callable[[], Any]) -> float:
    return min(timeit.repeat(fn, number=CALLS, repeat=5)) / CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()
    shipped = triton_kernels._next_pow2, triton_kernels._cdiv
    rows = ["| host call | as shipped (us) | with Triton's helpers (us) | shipped / Triton's |", "|---|---|---|---|"]
    for name, fn in CASES:
        expected = fn()
        triton_kernels._next_pow2, triton_kernels._cdiv = triton.next_power_of_2, triton.cdiv
        try:
            assert fn() == expected, name  # the same launch either way, checked before it is timed
            baseline = best_us(fn)
        finally:
            triton_kernels._next_pow2, triton_kernels._cdiv = shipped
        ours = best_us(fn)
        rows.append(f"| {name} | {ours:.2f} | {baseline:.2f} | {ours / baseline:.2f} |")
    rows += ["", "| the pick of a launch | kept (us) | picked anew (us) | kept / anew |", "|---|---|---|---|"]
    for name, plan, shape in PLANS:
        assert plan(*shape) == plan.__wrapped__(*shape), name
        anew = best_us(lambda plan=plan, shape=shape: plan.__wrapped__(*shape))
        kept = best_us(lambda plan=plan, shape=shape: plan(*shape))
        rows.append(f"| {name} | {kept:.2f} | {anew:.2f} | {kept / anew:.2f} |")
    table = "\n".join(rows)
    print(table)
    if args.append:
        note = f"Triton {triton.__version__}; the same launch functions, by turns, best of 5 x {CALLS} calls."
        report.append(args.append, "Host time of the example Triton norms' launch arithmetic", table, note)


if __name__ == "__main__":
    main()
