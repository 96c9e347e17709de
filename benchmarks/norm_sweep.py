"""A tuning sweep for the example plugin's Triton RMSNorm and fused add + RMSNorm kernels on a CUDA GPU.

The plugin's kernels (plugins_example/src/cacheon_example_kernels/triton_kernels.py) run one program per
row and use rsqrt. Below the first step of triton_kernels.TWO_READ_LAUNCH (at h 2049-4096 793 rows for
RMSNorm and 896 for fused; at h 4097-8192 576 for RMSNorm, and none for fused), and outside h 2049-8192,
they hold the row in registers, with BLOCK = next_pow2(h) and num_warps = min(max(BLOCK // 512, 4), 16),
at most 8 from 256 rows of h 2049-8192, but 4 for fused at 793-895 rows of h 2049-4096 and 16 for fused at
256-415 rows and from 560 of h 4097-8192 (triton_kernels.ONE_READ_WARPS; as the stream family's S0, S1 at
triton_kernels.HINTED_ROWS: 2-191 rows), and with 16 at triton_kernels.ONE_READ_AGAIN's rows (fused h 2049-4096
at 2048-10751, RMSNorm h 4097-8192 at 3072-8191); from there they otherwise
read it twice in pieces and load the weight first, as the wpre family with one row per program, but at
793-1056 rows of RMSNorm at h 4097-8192, which loads the weight in the second pass, as the loop family below
(``triton_kernels._norm_launch``). RMSNorm at 1057-2272 rows of h 2049-4096
runs on a persistent grid instead (triton_kernels.PERSISTENT_LAUNCH; as the grid family's S0 at 4 programs
per SM with 8 warps or 5 with 4).
The candidates (defined here, but for the stream and wpre families and the loop family's RMSNorm, which run
the plugin's kernels) keep its semantics
(float32 accumulation, row strides as arguments so rows may be padded, columns masked past h; fused:
residual <- x + residual, out = norm of the float32 sum) in ten families:

- rows: ROWS rows per program as one 2-D [ROWS, BLOCK] block and num_warps, the weight loaded after the
  sum, 32-bit offsets (R1 with the plugin's warps does the loads and math of the plugin's kernels as they
  were until 2026-12-02);
- hint: one row per program with streaming eviction hints (evict_first) on the row's loads and stores;
- persist: a persistent grid of WAVES programs per SM, each loading the weight once and walking its rows,
  optionally prefetching its next row before it reduces and writes the current one, with or without hints;
- loop: the two-read kernels with the weight in the second pass (the plugin's for RMSNorm; for fused, the
  plugin's until all its two-read launches loaded the weight first): one row per program in pieces of
  RBLOCK columns, read twice as torch.compile's looped reductions do (the first pass sums the squares and
  keeps the row in L2, the second reads it again and writes, so fewer values live per thread), at every
  piece size and warp count;
- stream: the plugin's own one-read kernels at every warp count, with each level of eviction hints
  (triton_kernels.STREAM_POLICIES; S0: none, as the plugin launches but at triton_kernels.HINTED_ROWS; S1:
  evict_first on the row's loads and the residual's store, as it launches there; S2: on the output's store too);
- wpre: the plugin's weight-first kernels (one or two pieces, the weight loaded once per program, before
  its rows, and held in registers, instead of from L2 in every row's second pass); ROWS rows per program
  (1, 2 or 4) share it. With one row per program this is what the plugin launches where it loads the
  weight first (WEIGHT_FIRST);
- keep: the two-read shape in two pieces with the first piece kept in registers between the passes, so
  only the second is read again (from L2), the weight loaded before the row or after the sum;
- grid: the plugin's persistent kernel (rmsnorm_persistent, as triton_kernels.PERSISTENT_LAUNCH launches it:
  the weight loaded once per program, its next row loaded before it writes the current one, one read of
  each row), and for fused the same walk with the plugin's one-read fused sums (fused_grid_kernel, defined
  here: the plugin has no fused persistent launch) at WAVES programs per SM, GRID_WARPS warps (``--grid-warps``,
  default 4 and 8) and each level of eviction hints (STREAM_POLICIES; ``--grid-streams``, default all three);
  as the persist family with prefetch, but summing as the plugin sums (rsqrt) and with the hints of the
  plugin's levels;
- wgrid: the wpre family's one-row kernels (the weight first, read twice in one or two pieces) on a
  persistent grid of WAVES programs per SM, each loading the weight once and walking its rows;
- split (RMSNorm only): SPLIT programs per row, each summing the whole row (the first program to reach a
  row reads it from memory, the others mostly from L2) and scaling and writing only its own 1/SPLIT of
  the columns: SPLIT times as many, smaller, programs, so the last wave of a few hundred rows is
  spread finer over the SMs. Not for fused: a program would read residual columns that another one
  already overwrote in place.

The grid is pruned to 8..MAX_PER_THREAD float32 values of the block per thread (fewer than 8 cannot fill
one 16-byte load of bf16; more spill registers; half of it with prefetch), ROWS > 1 only where T >= ROWS,
and the grid family's grids to at most 64 warps per SM (every program resident at once).

For every bf16 (kernel, h, T) and every candidate, correctness comes first: the candidate runs on
row-padded inputs and is compared in float32 with norm_gpu's torch reference evaluated in float32
(rtol = atol = 2e-2; fused also compares the residual written), and the padding must be left untouched.
A wrong candidate is recorded as failed and not timed. The baselines are checked the same way (torch.compile
on contiguous rows, to spare it a recompilation) and timed either way. Then, on the same rotated inputs:
the candidates, the plugin's kernels as they are (also writing into an output allocated per call, as
Liger's functions do: under CUDA graphs that block is the one the last call freed, warm in L2 at small T,
while the rotated outputs are not), Liger-Kernel (called as benchmarks/norm_gpu.py calls it;
its fused add + RMSNorm is 'n/a' where the installed version lacks it), torch.compile of norm_gpu's
reference, and the ceiling: a device-to-device copy moving the same bytes, rotated among the same number
of sets. Where outputs are allocated per call, three more: the copy into a block allocated per call (the
ceiling for outputs placed so), the plugin's fused kernel writing its new residual into such a block too
(as Liger's fused function does; the slot updates the residual in place, so the plugin never runs so:
this times the kernel with Liger's placement of outputs; with ``--alloc-outputs`` every candidate is timed
writing into such a block too, so that a launch can be picked against Liger as they are compared), and the floor
of the plugin's shape at that
size (one read or two, or RMSNorm's persistent grid where it runs it): each row read, summed and only then
written back unchanged (no weight, no scaling), at the plugin's launch, to tell the cost of the norm's data
dependency from that of its arithmetic; and that floor with the row times the weight (loaded where the
plugin loads it), to tell the weight's reads from the rest. (Until 2026-12-05, where RMSNorm ran its
persistent grid both floors were of the two-read shape ``_norm_launch`` gives there; and in every run up to
``benchmarks/results/2026-12-05-h100-f`` the floors of the weight-first launches were the loop kernel's shape
loading the weight first, which at RMSNorm h 8192 T 1088-1151 ran well below the plugin's weight-first kernel,
so no floor there: they are now that kernel's own shape, ``rmsnorm_weight_first_floor_kernel`` and
``fused_weight_first_floor_kernel``.)

Timing: the median of ``triton.testing.do_bench`` (here warmup 5 ms, rep 20 ms), inputs rotated among
sets of about 512 MiB in all (norm_gpu.Rotation; before 2026-12-02's cold sweep, at most 16 sets, which
at T 256-384 left part of them in L2) so that nothing is served from L2. do_bench times calls issued from
Python, so where a call's GPU time is shorter than its launch (T up to about 1024 here, and for Liger's
autograd wrapper at some sizes up to T 4096) it measures the host. ``--graphs`` replays the calls from one CUDA
graph instead (norm_gpu.CallGraph, as many calls for every implementation; each captured call still takes the
next input set; before 2026-12-06's last runs triton's do_bench_cudagraph, see ``timer``), which
measures the GPU alone, as an engine running under CUDA graphs sees it. Under graphs torch's copy of 256 MiB
and more runs about 1.5x slower than outside them, so the copy is no ceiling there at those sizes. Bytes
are the fewest each op must move (RMSNorm reads x and writes out; fused reads x and residual and writes
residual and out; the weight is one row and not counted).

The goal it serves: for T >= 256 each kernel reaches >= 0.97 of the copy of the same bytes, and at every
size it is not slower than Liger. ``/copy`` below is copy time over kernel time, ``/liger`` Liger's time
over the kernel's (at least 1: not slower).

    python3 benchmarks/norm_sweep.py [--out DIR] [--quick] [--graphs]
                                     [--families rows,hint,persist,loop,stream,wpre,keep,split,grid,wgrid]
                                     [--persist-waves 2,4] [--grid-warps 4,8] [--grid-streams 0,1,2]
                                     [--hidden 4096,8192] [--tokens 256,4096]

writes DIR/norm_sweep.json (default /tmp/out), rewritten after every size so a cut-short run keeps what
it measured; no new size is started after --budget-s (default 330 s). ``--quick`` runs h = 4096 and
T in {256, 4096} only.
"""

# ruff: noqa: N803  (Triton's constexpr parameters are upper case, as in the plugin)

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from norm_gpu import EPS, CallGraph, Rotation, ceiling_gbps, torch_fused, torch_rmsnorm

from cacheon_example_kernels import triton_kernels

HIDDEN = [4096, 8192]
TOKENS = [1, 16, 64, 256, 1024, 4096, 16384, 32768]
QUICK_HIDDEN = [4096]
QUICK_TOKENS = [256, 4096]
KERNELS = ("rmsnorm", "fused_add_rmsnorm")

ROWS_CHOICES = (1, 2, 4, 8)
WARP_CHOICES = (1, 2, 4, 8, 16)
PERSIST_WARPS = (4, 8, 16)
PERSIST_WAVES = (2, 4)  # programs per SM of the persistent grid
FAMILIES = ("rows", "hint", "persist", "loop", "stream", "wpre", "keep", "split", "grid", "wgrid")
WGRID_WARPS = (8, 16)  # the wgrid family's warps (its programs per SM: PERSIST_WAVES)
GRID_WARPS = (4, 8)  # the grid family's warps (its programs per SM: PERSIST_WAVES)
GRID_STREAMS = (0, 1, 2)  # the grid family's eviction hint levels (triton_kernels.STREAM_POLICIES)
STREAM_CHOICES = (0, 1, 2)  # the plugin's one-read kernels' eviction hints (triton_kernels.STREAM_POLICIES)
LOOP_BLOCKS = (512, 1024, 2048, 4096, 8192)  # columns per piece of the looped kernels (at most the row)
LOOP_WARPS = (1, 2, 4, 8, 16)
WPRE_ROWS = (1, 2, 4)  # rows per program sharing the weight held in registers (wpre family)
MIN_PER_THREAD = 8  # float32 values of the [ROWS, BLOCK] block per thread: below 8, no full 16-byte bf16 load
MAX_PER_THREAD = 128  # above this the block no longer fits in registers

DTYPE = torch.bfloat16
RTOL = ATOL = 2e-2
PAD = 64  # extra columns per row in the correctness inputs: row strides are h + PAD
SENTINEL = 7.0  # exact in bf16: what the output's padding holds before the kernel runs, and must hold after

GOAL_MIN_T = 256
GOAL_COPY = 0.97


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def rmsnorm_rows_kernel(x_ptr, w_ptr, out_ptr, x_row, out_row, t, h, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < h
    mask = (rows < t)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / h + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * out_row + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fused_add_rmsnorm_rows_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, x_row, r_row, out_row, t, h, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < h
    mask = (rows < t)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r_ptrs = r_ptr + rows[:, None] * r_row + cols[None, :]
    r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    s = x + r
    tl.store(r_ptrs, s.to(r_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / h + eps)  # the norm of the float32 sum, as the plugin
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = s * rstd[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * out_row + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_load(ptrs, mask, HINT: tl.constexpr):
    if HINT:  # read once: let it leave L2 first
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _row_store(ptrs, value, mask, HINT: tl.constexpr):
    if HINT:
        tl.store(ptrs, value, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def rmsnorm_persist_kernel(
    x_ptr, w_ptr, out_ptr, x_row, out_row, t, h, eps, BLOCK: tl.constexpr, PREFETCH: tl.constexpr, HINT: tl.constexpr
):
    """A persistent grid: each program loads the weight once and walks rows pid, pid + grid, ...; with
    PREFETCH it loads its next row before it reduces and writes the current one (two rows in flight)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < h
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PREFETCH:
        x = _row_load(x_ptr + tl.cast(pid, tl.int64) * x_row + cols, col_ok & (pid < t), HINT)
        for row in range(pid, t, step):
            nxt = row + step
            x_next = _row_load(x_ptr + tl.cast(nxt, tl.int64) * x_row + cols, col_ok & (nxt < t), HINT)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / h + eps)
            y = (xf * rstd * w).to(out_ptr.dtype.element_ty)
            _row_store(out_ptr + tl.cast(row, tl.int64) * out_row + cols, y, col_ok, HINT)
            x = x_next
    else:
        for row in range(pid, t, step):
            xf = _row_load(x_ptr + tl.cast(row, tl.int64) * x_row + cols, col_ok, HINT).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / h + eps)
            y = (xf * rstd * w).to(out_ptr.dtype.element_ty)
            _row_store(out_ptr + tl.cast(row, tl.int64) * out_row + cols, y, col_ok, HINT)


@triton.jit
def fused_add_rmsnorm_persist_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    x_row,
    r_row,
    out_row,
    t,
    h,
    eps,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    HINT: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < h
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PREFETCH:
        ok = col_ok & (pid < t)
        x = _row_load(x_ptr + tl.cast(pid, tl.int64) * x_row + cols, ok, HINT)
        r = _row_load(r_ptr + tl.cast(pid, tl.int64) * r_row + cols, ok, HINT)
        for row in range(pid, t, step):
            nxt = row + step
            ok_next = col_ok & (nxt < t)
            x_next = _row_load(x_ptr + tl.cast(nxt, tl.int64) * x_row + cols, ok_next, HINT)
            r_next = _row_load(r_ptr + tl.cast(nxt, tl.int64) * r_row + cols, ok_next, HINT)
            s = x.to(tl.float32) + r.to(tl.float32)
            _row_store(r_ptr + tl.cast(row, tl.int64) * r_row + cols, s.to(r_ptr.dtype.element_ty), col_ok, HINT)
            rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / h + eps)
            y = (s * rstd * w).to(out_ptr.dtype.element_ty)
            _row_store(out_ptr + tl.cast(row, tl.int64) * out_row + cols, y, col_ok, HINT)
            x = x_next
            r = r_next
    else:
        for row in range(pid, t, step):
            x = _row_load(x_ptr + tl.cast(row, tl.int64) * x_row + cols, col_ok, HINT).to(tl.float32)
            r_ptrs = r_ptr + tl.cast(row, tl.int64) * r_row + cols
            s = x + _row_load(r_ptrs, col_ok, HINT).to(tl.float32)
            _row_store(r_ptrs, s.to(r_ptr.dtype.element_ty), col_ok, HINT)
            rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / h + eps)
            y = (s * rstd * w).to(out_ptr.dtype.element_ty)
            _row_store(out_ptr + tl.cast(row, tl.int64) * out_row + cols, y, col_ok, HINT)


@triton.jit
def rmsnorm_hint_kernel(x_ptr, w_ptr, out_ptr, x_row, out_row, h, eps, BLOCK: tl.constexpr):
    """The plugin's one row per program, with streaming eviction hints on the row's loads and stores."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    x = _row_load(x_ptr + row * x_row + cols, mask, True).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / h + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    _row_store(out_ptr + row * out_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask, True)


@triton.jit
def fused_add_rmsnorm_hint_kernel(x_ptr, r_ptr, w_ptr, out_ptr, x_row, r_row, out_row, h, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    x = _row_load(x_ptr + row * x_row + cols, mask, True).to(tl.float32)
    r_ptrs = r_ptr + row * r_row + cols
    s = x + _row_load(r_ptrs, mask, True).to(tl.float32)
    _row_store(r_ptrs, s.to(r_ptr.dtype.element_ty), mask, True)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / h + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    _row_store(out_ptr + row * out_row + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), mask, True)


def sweep_rmsnorm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows: int, warps: int) -> None:
    t, h = x.shape
    rmsnorm_rows_kernel[(triton.cdiv(t, rows),)](
        x, w, out, x.stride(0), out.stride(0), t, h, EPS, ROWS=rows, BLOCK=triton.next_power_of_2(h), num_warps=warps
    )


def sweep_fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows: int, warps: int) -> None:
    t, h = x.shape
    fused_add_rmsnorm_rows_kernel[(triton.cdiv(t, rows),)](
        x,
        r,
        w,
        out,
        x.stride(0),
        r.stride(0),
        out.stride(0),
        t,
        h,
        EPS,
        ROWS=rows,
        BLOCK=triton.next_power_of_2(h),
        num_warps=warps,
    )


def config_grid(
    h: int, t: int, max_per_thread: int = MAX_PER_THREAD, families: tuple[str, ...] = FAMILIES
) -> list[dict[str, Any]]:
    """The launch configurations worth timing at this size, each a dict naming its family."""
    block = triton.next_power_of_2(h)

    def fits(rows: int, warps: int, limit: int = max_per_thread) -> bool:
        return MIN_PER_THREAD <= rows * block // (32 * warps) <= limit

    grid: list[dict[str, Any]] = []
    if "rows" in families:
        grid += [
            {"family": "rows", "rows": rows, "num_warps": warps}
            for rows in ROWS_CHOICES
            for warps in WARP_CHOICES
            if rows <= t and fits(rows, warps)
        ]
    if "hint" in families:
        grid += [{"family": "hint", "rows": 1, "num_warps": warps} for warps in WARP_CHOICES if fits(1, warps)]
    if "persist" in families:  # two rows in registers with prefetch: half the per-thread room
        grid += [
            {"family": "persist", "rows": 1, "num_warps": warps, "waves": waves, "prefetch": prefetch, "hint": hint}
            for warps in PERSIST_WARPS
            for waves in PERSIST_WAVES
            for prefetch in (False, True)
            for hint in (False, True)
            if fits(1, warps, max_per_thread // 2)
        ]
    if "grid" in families:
        grid += [
            {"family": "grid", "rows": 1, "num_warps": warps, "waves": waves, "stream": stream}
            for waves in PERSIST_WAVES
            for warps in GRID_WARPS
            for stream in GRID_STREAMS
            if fits(1, warps, max_per_thread // 2) and waves * warps <= 64  # all resident: 64 warps per SM
        ]
    if "wgrid" in families:
        grid += [
            {"family": "wgrid", "rows": 1, "num_warps": warps, "waves": waves, "rblock": rblock}
            for waves in PERSIST_WAVES
            for warps in WGRID_WARPS
            for rblock in LOOP_BLOCKS
            if rblock <= block and triton.cdiv(h, rblock) <= 2 and MIN_PER_THREAD <= rblock // (32 * warps) <= 64
        ]
    if "stream" in families:
        grid += [
            {"family": "stream", "rows": 1, "num_warps": warps, "stream": stream}
            for stream in STREAM_CHOICES
            for warps in WARP_CHOICES
            if fits(1, warps)
        ]
    if "wpre" in families:  # one or two pieces only, so the weight's pieces are named in the kernel
        grid += [
            {"family": "wpre", "rows": rows, "num_warps": warps, "rblock": rblock}
            for rblock in LOOP_BLOCKS
            for warps in LOOP_WARPS
            for rows in WPRE_ROWS
            if rblock <= block <= 2 * rblock and MIN_PER_THREAD <= rblock // (32 * warps) <= max_per_thread // 4
        ]
    if "keep" in families:  # two pieces, the first kept in registers between the passes
        grid += [
            {"family": "keep", "rows": 1, "num_warps": warps, "rblock": block // 2, "weight_first": first}
            for warps in LOOP_WARPS
            for first in (False, True)
            if block >= 2048 and MIN_PER_THREAD <= block // 2 // (32 * warps) <= max_per_thread // 2
        ]
    if "split" in families:  # RMSNorm only (measure_size); the row's pieces divide among the programs
        grid += [
            {"family": "split", "rows": 1, "num_warps": warps, "rblock": rblock, "split": split}
            for rblock in LOOP_BLOCKS
            for split in (2, 4)
            for warps in LOOP_WARPS
            if rblock <= block
            and triton.cdiv(h, rblock) % split == 0
            and MIN_PER_THREAD <= rblock // (32 * warps) <= max_per_thread // 2
        ]
    if "loop" in families:
        grid += [
            {"family": "loop", "rows": 1, "num_warps": warps, "rblock": rblock}
            for rblock in LOOP_BLOCKS
            for warps in LOOP_WARPS
            if rblock <= block and MIN_PER_THREAD <= rblock // (32 * warps) <= max_per_thread // 2
        ]
    return grid


def label(cfg: dict[str, Any]) -> str:
    if cfg["family"] == "rows":
        return f"R{cfg['rows']}xW{cfg['num_warps']}"
    if cfg["family"] == "hint":
        return f"H1xW{cfg['num_warps']}"
    if cfg["family"] == "loop":
        return f"L{cfg['rblock']}xW{cfg['num_warps']}"
    if cfg["family"] == "wpre":
        return f"WP{cfg['rblock']}xR{cfg['rows']}xW{cfg['num_warps']}"
    if cfg["family"] == "keep":
        return f"K{cfg['rblock']}xW{cfg['num_warps']}" + ("+wf" if cfg["weight_first"] else "")
    if cfg["family"] == "stream":
        return f"S{cfg['stream']}xW{cfg['num_warps']}"
    if cfg["family"] == "grid":
        return f"G{cfg['waves']}xW{cfg['num_warps']}xS{cfg['stream']}"
    if cfg["family"] == "wgrid":
        return f"WG{cfg['waves']}x{cfg['rblock']}xW{cfg['num_warps']}"
    if cfg["family"] == "split":
        return f"SP{cfg['split']}x{cfg['rblock']}xW{cfg['num_warps']}"
    return f"P{cfg['waves']}xW{cfg['num_warps']}" + ("+pf" if cfg["prefetch"] else "") + ("+h" if cfg["hint"] else "")


# ------------------------------------------------------------------------ implementations, one signature
# rmsnorm: f(x, w, out) -> the output tensor; fused: f(x, r, w, out) -> (output, residual). The plugin's
# and the candidates' write into out and r; Liger allocates its outputs (and its fused op returns the
# new residual rather than writing r), torch.compile writes r in place and returns a new output.


def plugin_impls() -> dict[str, Any]:
    def rms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        triton_kernels.rmsnorm(x=x, weight=w, eps=EPS, out=out)
        return out

    def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        triton_kernels.fused_add_rmsnorm(x=x, residual=r, weight=w, eps=EPS, out=out)
        return out, r

    return {"rmsnorm": rms, "fused_add_rmsnorm": fused}


def plugin_alloc_impls() -> dict[str, Any]:
    """The plugin writing into an output allocated per call, as Liger's functions do. Under CUDA graphs the
    caching allocator hands back the block the last call freed, so those writes land in the same memory
    (warm in L2 at small T) while the rotated outputs do not. The fused residual stays in place (Liger
    allocates a new one as well)."""

    def rms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        own = torch.empty_like(x)
        triton_kernels.rmsnorm(x=x, weight=w, eps=EPS, out=own)
        return own

    def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        own = torch.empty_like(x)
        triton_kernels.fused_add_rmsnorm(x=x, residual=r, weight=w, eps=EPS, out=own)
        return own, r

    return {"rmsnorm": rms, "fused_add_rmsnorm": fused}


def allocating(impl: Any, fused: bool) -> Any:
    """A candidate writing its output into a block allocated per call (``--alloc-outputs``), as
    plugin_alloc_impls places the plugin's: timed so, a candidate compares with plug.a and with Liger as
    they compare with each other. The fused residual stays in place, as the slot updates it."""
    if fused:
        return lambda x, r, w, out: impl(x, r, w, torch.empty_like(x))
    return lambda x, w, out: impl(x, w, torch.empty_like(x))


def plugin_fresh_impls() -> dict[str, Any]:
    """The plugin's fused kernel, launched as the plugin launches it, writing both of its outputs (the norm
    and the new residual) into blocks allocated per call, as Liger's fused function does; the input
    residual is left as it was. The slot updates the residual in place, so the plugin never runs this
    way: it times the kernel with Liger's placement of outputs. RMSNorm has one output: plugin_alloc."""

    def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, h = x.shape
        own, new_r = torch.empty_like(x), torch.empty_like(r)
        _, options = triton_kernels._norm_launch(t, h, fused=True)
        plugin = triton_kernels._kernels()
        args = (x, r, w, own, new_r, x.stride(0), r.stride(0), own.stride(0), new_r.stride(0))
        if options.pop("WEIGHT_FIRST", False):  # the plugin's two reads load the weight first
            plugin.fused_add_rmsnorm_weight_first[(t,)](*args, t, h, EPS, ROWS=1, **options)
        else:
            plugin.fused_add_rmsnorm[(t,)](*args, h, EPS, **options)
        return own, new_r

    return {"rmsnorm": None, "fused_add_rmsnorm": fused}


@triton.jit
def rmsnorm_floor_kernel(x_ptr, w_ptr, out_ptr, x_row, out_row, h, BLOCK: tl.constexpr, WEIGHT: tl.constexpr = False):
    # Not a norm: the row written back unchanged (WEIGHT: times the weight, loaded before the row), but only
    # once its sum of squares is known.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    if WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    total = tl.sum(xf * xf, axis=0)
    if WEIGHT:
        x = (xf * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row + cols, tl.where(total >= 0.0, x, 0.0), mask=mask)


@triton.jit
def fused_floor_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, x_row, r_row, out_row, h, BLOCK: tl.constexpr, WEIGHT: tl.constexpr = False
):
    # Not a norm: residual <- x + residual, and that sum (WEIGHT: times the weight) written to out once its
    # sum of squares is known.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    if WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0).to(tl.float32)
    s = x + r
    sb = s.to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * r_row + cols, sb, mask=mask)
    total = tl.sum(s * s, axis=0)
    if WEIGHT:
        sb = (s * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row + cols, tl.where(total >= 0.0, sb, 0.0), mask=mask)


@triton.jit(do_not_specialize=["t", "walk"])
def rmsnorm_persistent_floor_kernel(
    x_ptr, w_ptr, out_ptr, x_row, out_row, t, walk, h, BLOCK: tl.constexpr, WEIGHT: tl.constexpr = False
):
    # Not a norm: the plugin's persistent grid (triton_kernels' rmsnorm_persistent: each program walks rows
    # pid, pid + grid, ..., loading its next row before it sums and writes the current one), the row written
    # back unchanged (WEIGHT: times the weight, loaded once per program) once its sum of squares is known.
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    if WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid.to(tl.int64) * x_row + cols, mask=mask & (pid < t), other=0.0)
    i = 0
    while i < walk:  # as the plugin's kernel: Triton's interpreter cannot run range() over a runtime bound
        row = pid + i * step
        following = row + step
        ahead = tl.load(x_ptr + following.to(tl.int64) * x_row + cols, mask=mask & (following < t), other=0.0)
        xf = x.to(tl.float32)
        total = tl.sum(xf * xf, axis=0)
        y = x
        if WEIGHT:
            y = (xf * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row.to(tl.int64) * out_row + cols, tl.where(total >= 0.0, y, 0.0), mask=mask & (row < t))
        x = ahead
        i += 1


@triton.jit
def rmsnorm_loop_floor_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    x_row,
    out_row,
    h,
    RBLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    WEIGHT: tl.constexpr = False,
):
    # The plugin's two-read shape with the weight in the second pass (its loop kernel) with no scaling: sum
    # the squares in pieces, then read the row again and write it back unchanged, or (WEIGHT) times the
    # weight, loaded where the loop kernel loads it.
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((RBLOCK,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        cols = c * RBLOCK + tl.arange(0, RBLOCK)
        x = tl.load(x_ptr + row * x_row + cols, mask=cols < h, other=0.0, eviction_policy="evict_last")
        xf = x.to(tl.float32)
        acc += xf * xf
    total = tl.sum(acc, axis=0)
    for c in tl.static_range(CHUNKS):
        cols = c * RBLOCK + tl.arange(0, RBLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        if WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            x = (x.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * out_row + cols, tl.where(total >= 0.0, x, 0.0), mask=mask)


@triton.jit(do_not_specialize=["t"])
def rmsnorm_weight_first_floor_kernel(
    x_ptr, w_ptr, out_ptr, x_row, out_row, t, h, RBLOCK: tl.constexpr, CHUNKS: tl.constexpr, WEIGHT: tl.constexpr
):
    # Not a norm: the plugin's weight-first kernel (triton_kernels' rmsnorm_weight_first, one row per
    # program: its arguments, masks, loads and their order), the row written back unchanged (WEIGHT: times
    # the weight, loaded before the row and held) once its sum of squares is known, with no scaling.
    tl.static_assert(CHUNKS <= 2)
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, RBLOCK)
    c1 = RBLOCK + c0
    k0 = (c0 < h) & (row < t)
    k1 = (c1 < h) & (row < t)
    if WEIGHT:
        w0 = tl.load(w_ptr + c0, mask=c0 < h, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if CHUNKS == 2:
            w1 = tl.load(w_ptr + c1, mask=c1 < h, other=0.0, eviction_policy="evict_last").to(tl.float32)
    x0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
    acc = x0 * x0
    if CHUNKS == 2:
        x1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += x1 * x1
    total = tl.sum(acc, axis=0)
    y0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_first")
    if WEIGHT:
        y0 = (y0.to(tl.float32) * w0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row + c0, tl.where(total >= 0.0, y0, 0.0), mask=k0)
    if CHUNKS == 2:
        y1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_first")
        if WEIGHT:
            y1 = (y1.to(tl.float32) * w1).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * out_row + c1, tl.where(total >= 0.0, y1, 0.0), mask=k1)


@triton.jit(do_not_specialize=["t"])
def fused_weight_first_floor_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    x_row,
    r_row,
    out_row,
    t,
    h,
    RBLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    WEIGHT: tl.constexpr,
):
    # As above for the plugin's fused weight-first kernel: the second pass writes the residual's new value in
    # place and to out (WEIGHT: times the weight).
    tl.static_assert(CHUNKS <= 2)
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, RBLOCK)
    c1 = RBLOCK + c0
    k0 = (c0 < h) & (row < t)
    k1 = (c1 < h) & (row < t)
    if WEIGHT:
        w0 = tl.load(w_ptr + c0, mask=c0 < h, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if CHUNKS == 2:
            w1 = tl.load(w_ptr + c1, mask=c1 < h, other=0.0, eviction_policy="evict_last").to(tl.float32)
    x0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
    r0 = tl.load(r_ptr + row * r_row + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
    s0 = x0 + r0
    acc = s0 * s0
    if CHUNKS == 2:
        x1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_last").to(tl.float32)
        r1 = tl.load(r_ptr + row * r_row + c1, mask=k1, other=0.0, eviction_policy="evict_last").to(tl.float32)
        s1 = x1 + r1
        acc += s1 * s1
    total = tl.sum(acc, axis=0)
    x0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_first").to(tl.float32)
    r0 = tl.load(r_ptr + row * r_row + c0, mask=k0, other=0.0, eviction_policy="evict_first").to(tl.float32)
    s0 = x0 + r0
    y0 = s0.to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * r_row + c0, y0, mask=k0)
    if WEIGHT:
        y0 = (s0 * w0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row + c0, tl.where(total >= 0.0, y0, 0.0), mask=k0)
    if CHUNKS == 2:
        x1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_first").to(tl.float32)
        r1 = tl.load(r_ptr + row * r_row + c1, mask=k1, other=0.0, eviction_policy="evict_first").to(tl.float32)
        s1 = x1 + r1
        y1 = s1.to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + row * r_row + c1, y1, mask=k1)
        if WEIGHT:
            y1 = (s1 * w1).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * out_row + c1, tl.where(total >= 0.0, y1, 0.0), mask=k1)


# The plugin's two-read fused kernel with the weight loaded in the second pass, as it was launched until its
# two reads all loaded the weight first (triton_kernels.TWO_READ_LAUNCH): the loop family times it.
@triton.jit
def fused_add_rmsnorm_loop_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    ro_ptr,
    x_row,
    r_row,
    out_row,
    ro_row,
    h,
    eps,
    RBLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((RBLOCK,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        cols = c * RBLOCK + tl.arange(0, RBLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        r = tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        s = x.to(tl.float32) + r.to(tl.float32)
        acc += s * s
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / h + eps)
    for c in tl.static_range(CHUNKS):
        cols = c * RBLOCK + tl.arange(0, RBLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        r = tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        s = x.to(tl.float32) + r.to(tl.float32)
        tl.store(ro_ptr + row * ro_row + cols, s.to(ro_ptr.dtype.element_ty), mask=mask)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_ptr + row * out_row + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rmsnorm_wgrid_kernel(
    x_ptr, w_ptr, out_ptr, x_row, out_row, t, walk, h, eps, RBLOCK: tl.constexpr, CHUNKS: tl.constexpr
):
    """The plugin's weight-first two-read RMSNorm on a persistent grid: each program loads the weight once
    (one or two pieces, in registers) and walks rows pid, pid + grid, ... (``walk`` steps, the last masked
    past t), reading each row twice as the weight-first kernel does."""
    tl.static_assert(CHUNKS <= 2)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    c0 = tl.arange(0, RBLOCK)
    c1 = RBLOCK + c0
    m0 = c0 < h
    m1 = c1 < h
    w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if CHUNKS == 2:
        w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    i = 0
    while i < walk:
        row = pid + i * step
        base = row.to(tl.int64) * x_row
        k0 = m0 & (row < t)
        k1 = m1 & (row < t)
        x0 = tl.load(x_ptr + base + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc = x0 * x0
        if CHUNKS == 2:
            x1 = tl.load(x_ptr + base + c1, mask=k1, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc += x1 * x1
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / h + eps)
        o = row.to(tl.int64) * out_row
        x0 = tl.load(x_ptr + base + c0, mask=k0, other=0.0, eviction_policy="evict_first")
        tl.store(out_ptr + o + c0, (x0.to(tl.float32) * rstd * w0).to(out_ptr.dtype.element_ty), mask=k0)
        if CHUNKS == 2:
            x1 = tl.load(x_ptr + base + c1, mask=k1, other=0.0, eviction_policy="evict_first")
            tl.store(out_ptr + o + c1, (x1.to(tl.float32) * rstd * w1).to(out_ptr.dtype.element_ty), mask=k1)
        i += 1


@triton.jit(do_not_specialize=["t", "walk"])
def fused_grid_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    ro_ptr,
    x_row,
    r_row,
    out_row,
    ro_row,
    t,
    walk,
    h,
    eps,
    BLOCK: tl.constexpr,
    ROW_EVICT: tl.constexpr,
    OUT_EVICT: tl.constexpr,
):
    """The grid family's fused kernel: the plugin's rmsnorm_persistent walk (weight once per program, the
    next row's x and residual loaded before the current row's are written; rows differ, so the residual
    updated in place is never read after it is written) with the plugin's one-read fused kernel's sums,
    in its order: that kernel's bytes."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    first = mask & (pid < t)
    x = tl.load(x_ptr + pid.to(tl.int64) * x_row + cols, mask=first, other=0.0, eviction_policy=ROW_EVICT)
    r = tl.load(r_ptr + pid.to(tl.int64) * r_row + cols, mask=first, other=0.0, eviction_policy=ROW_EVICT)
    i = 0
    while i < walk:
        row = pid + i * step
        following = (row + step).to(tl.int64)
        ahead = mask & (row + step < t)
        x_ahead = tl.load(x_ptr + following * x_row + cols, mask=ahead, other=0.0, eviction_policy=ROW_EVICT)
        r_ahead = tl.load(r_ptr + following * r_row + cols, mask=ahead, other=0.0, eviction_policy=ROW_EVICT)
        s = x.to(tl.float32) + r.to(tl.float32)
        here = mask & (row < t)
        at = row.to(tl.int64)
        tl.store(ro_ptr + at * ro_row + cols, s.to(ro_ptr.dtype.element_ty), mask=here, eviction_policy=ROW_EVICT)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / h + eps)
        y = (s * rstd * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + at * out_row + cols, y, mask=here, eviction_policy=OUT_EVICT)
        x = x_ahead
        r = r_ahead
        i += 1


@triton.jit
def fused_wgrid_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    x_row,
    r_row,
    out_row,
    t,
    walk,
    h,
    eps,
    RBLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """The plugin's weight-first two-read fused kernel on a persistent grid (rmsnorm_wgrid_kernel's walk);
    the residual written in place in the second pass."""
    tl.static_assert(CHUNKS <= 2)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    c0 = tl.arange(0, RBLOCK)
    c1 = RBLOCK + c0
    m0 = c0 < h
    m1 = c1 < h
    w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if CHUNKS == 2:
        w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    i = 0
    while i < walk:
        row = pid + i * step
        xb = row.to(tl.int64) * x_row
        rb = row.to(tl.int64) * r_row
        ob = row.to(tl.int64) * out_row
        k0 = m0 & (row < t)
        k1 = m1 & (row < t)
        x0 = tl.load(x_ptr + xb + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
        r0 = tl.load(r_ptr + rb + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
        s0 = x0 + r0
        acc = s0 * s0
        if CHUNKS == 2:
            x1 = tl.load(x_ptr + xb + c1, mask=k1, other=0.0, eviction_policy="evict_last").to(tl.float32)
            r1 = tl.load(r_ptr + rb + c1, mask=k1, other=0.0, eviction_policy="evict_last").to(tl.float32)
            s1 = x1 + r1
            acc += s1 * s1
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / h + eps)
        x0 = tl.load(x_ptr + xb + c0, mask=k0, other=0.0, eviction_policy="evict_first").to(tl.float32)
        r0 = tl.load(r_ptr + rb + c0, mask=k0, other=0.0, eviction_policy="evict_first").to(tl.float32)
        s0 = x0 + r0
        tl.store(r_ptr + rb + c0, s0.to(r_ptr.dtype.element_ty), mask=k0)
        tl.store(out_ptr + ob + c0, (s0 * rstd * w0).to(out_ptr.dtype.element_ty), mask=k0)
        if CHUNKS == 2:
            x1 = tl.load(x_ptr + xb + c1, mask=k1, other=0.0, eviction_policy="evict_first").to(tl.float32)
            r1 = tl.load(r_ptr + rb + c1, mask=k1, other=0.0, eviction_policy="evict_first").to(tl.float32)
            s1 = x1 + r1
            tl.store(r_ptr + rb + c1, s1.to(r_ptr.dtype.element_ty), mask=k1)
            tl.store(out_ptr + ob + c1, (s1 * rstd * w1).to(out_ptr.dtype.element_ty), mask=k1)
        i += 1


@triton.jit
def rmsnorm_split_kernel(
    x_ptr, w_ptr, out_ptr, x_row, out_row, t, h, eps, RBLOCK: tl.constexpr, CHUNKS: tl.constexpr, SPLIT: tl.constexpr
):
    # SPLIT programs per row (adjacent program ids, so they run together): each sums the whole row in
    # CHUNKS pieces, then reads again, scales and writes its own CHUNKS // SPLIT pieces.
    pid = tl.program_id(0)
    row = (pid // SPLIT).to(tl.int64)
    part = pid % SPLIT
    acc = tl.zeros((RBLOCK,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        cols = c * RBLOCK + tl.arange(0, RBLOCK)
        x = tl.load(x_ptr + row * x_row + cols, mask=cols < h, other=0.0, eviction_policy="evict_last")
        xf = x.to(tl.float32)
        acc += xf * xf
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / h + eps)
    for c in tl.static_range(CHUNKS // SPLIT):
        cols = (part * (CHUNKS // SPLIT) + c) * RBLOCK + tl.arange(0, RBLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_ptr + row * out_row + cols, (x.to(tl.float32) * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rmsnorm_keep_kernel(
    x_ptr, w_ptr, out_ptr, x_row, out_row, t, h, eps, RBLOCK: tl.constexpr, WEIGHT_FIRST: tl.constexpr
):
    # The two-read shape in two pieces with the first piece kept in registers between the passes: only
    # the second piece is read again (from L2), so a row holds half the values the one-read kernel holds
    # and reads half as much again as the plugin's two-read kernel.
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, RBLOCK)
    c1 = RBLOCK + c0
    m0 = c0 < h
    m1 = c1 < h
    if WEIGHT_FIRST:
        w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
        w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    x0 = tl.load(x_ptr + row * x_row + c0, mask=m0, other=0.0, eviction_policy="evict_first").to(tl.float32)
    x1 = tl.load(x_ptr + row * x_row + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x0 * x0, axis=0) + tl.sum(x1 * x1, axis=0)) / h + eps)
    if not WEIGHT_FIRST:
        w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + row * out_row + c0, (x0 * rstd * w0).to(out_ptr.dtype.element_ty), mask=m0)
    x1 = tl.load(x_ptr + row * x_row + c1, mask=m1, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if not WEIGHT_FIRST:
        w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + row * out_row + c1, (x1 * rstd * w1).to(out_ptr.dtype.element_ty), mask=m1)


@triton.jit
def fused_keep_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    x_row,
    r_row,
    out_row,
    t,
    h,
    eps,
    RBLOCK: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
):
    # As rmsnorm_keep_kernel for the fused op: the first piece's sum is kept (and its residual written
    # in the first pass, its last read done), the second piece's x and residual are read again.
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, RBLOCK)
    c1 = RBLOCK + c0
    m0 = c0 < h
    m1 = c1 < h
    if WEIGHT_FIRST:
        w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
        w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    x0 = tl.load(x_ptr + row * x_row + c0, mask=m0, other=0.0, eviction_policy="evict_first").to(tl.float32)
    r0 = tl.load(r_ptr + row * r_row + c0, mask=m0, other=0.0, eviction_policy="evict_first").to(tl.float32)
    x1 = tl.load(x_ptr + row * x_row + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    r1 = tl.load(r_ptr + row * r_row + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    s0 = x0 + r0
    s1 = x1 + r1
    tl.store(r_ptr + row * r_row + c0, s0.to(r_ptr.dtype.element_ty), mask=m0)
    rstd = tl.rsqrt((tl.sum(s0 * s0, axis=0) + tl.sum(s1 * s1, axis=0)) / h + eps)
    if not WEIGHT_FIRST:
        w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + row * out_row + c0, (s0 * rstd * w0).to(out_ptr.dtype.element_ty), mask=m0)
    x1 = tl.load(x_ptr + row * x_row + c1, mask=m1, other=0.0, eviction_policy="evict_first").to(tl.float32)
    r1 = tl.load(r_ptr + row * r_row + c1, mask=m1, other=0.0, eviction_policy="evict_first").to(tl.float32)
    s1 = x1 + r1
    tl.store(r_ptr + row * r_row + c1, s1.to(r_ptr.dtype.element_ty), mask=m1)
    if not WEIGHT_FIRST:
        w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + row * out_row + c1, (s1 * rstd * w1).to(out_ptr.dtype.element_ty), mask=m1)


def floor_impl(kernel: str, t: int, h: int, weight: bool = False) -> Any:
    """The norm's dependency alone, in the shape and launch the plugin picks at this size (block or pieces,
    warps): each row read, summed, and only then written back (RMSNorm: x itself; fused: the residual's
    new value, also written in place), with no scaling, and with no weight or (``weight``) times the
    weight, loaded where the plugin loads it. Where RMSNorm runs its persistent grid
    (``triton_kernels._persistent_launch``, asked with the SMs of the device it is called on), the floor
    runs that grid too (``rmsnorm_persistent_floor_kernel``)."""
    two_reads, options = triton_kernels._norm_launch(t, h, fused=kernel != "rmsnorm")
    first = two_reads and options.get("WEIGHT_FIRST", False)
    if first:  # the weight-first kernels' own shape (they take t: rows past it are masked)
        rms_kernel, fused_kernel = rmsnorm_weight_first_floor_kernel, fused_weight_first_floor_kernel
        opts = {k: options[k] for k in ("RBLOCK", "CHUNKS", "num_warps")}
    elif two_reads:  # RMSNorm's loop kernel: every fused two-read step loads the weight first
        if kernel != "rmsnorm":
            raise ValueError(f"a fused two-read launch at {t} x {h} without the weight first: the plugin has none")
        rms_kernel, fused_kernel = rmsnorm_loop_floor_kernel, None
        opts = {k: options[k] for k in ("RBLOCK", "CHUNKS", "num_warps")}
    else:
        rms_kernel, fused_kernel = rmsnorm_floor_kernel, fused_floor_kernel
        opts = {"BLOCK": options["BLOCK"], "num_warps": options["num_warps"]}
    opts["WEIGHT"] = weight
    if kernel == "rmsnorm":

        def rms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            rows, cols = x.shape
            persistent = triton_kernels._persistent_launch(rows, cols, triton_kernels._sm_count(x.device))
            if persistent is not None:
                grid, launch = persistent
                walk = triton_kernels._cdiv(rows, grid)
                rmsnorm_persistent_floor_kernel[(grid,)](
                    x,
                    w,
                    out,
                    x.stride(0),
                    out.stride(0),
                    rows,
                    walk,
                    cols,
                    BLOCK=launch["BLOCK"],
                    num_warps=launch["num_warps"],
                    WEIGHT=weight,
                )
                return out
            rows_arg = (rows, cols) if first else (cols,)
            rms_kernel[(rows,)](x, w, out, x.stride(0), out.stride(0), *rows_arg, **opts)
            return out

        return rms

    def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows_arg = (x.shape[0], x.shape[1]) if first else (x.shape[1],)
        fused_kernel[(x.shape[0],)](x, r, w, out, x.stride(0), r.stride(0), out.stride(0), *rows_arg, **opts)
        return out, r

    return fused


ULP = 2**-7  # one unit in the last place of bf16


def check_floor(kernel: str, impl: Any, t: int, h: int, w: torch.Tensor, weight: bool) -> bool:
    """The floor's bytes: RMSNorm's out equals x (``weight``: x times w, within one unit in the last place);
    fused's residual is x + r rounded to bf16 (within one unit in the last place: Triton's interpreter
    truncates), and out equals the residual (times w)."""
    x = torch.randn(t, h, device=w.device, dtype=DTYPE)
    out = torch.empty_like(x)
    if kernel == "rmsnorm":
        got = impl(x, w, out)
        return bool(
            torch.allclose(got.float(), x.float() * w.float(), rtol=ULP, atol=0.0) if weight else torch.equal(got, x)
        )
    r = torch.randn(t, h, device=w.device, dtype=DTYPE)
    want = x.float() + r.float()
    got, got_r = impl(x, r, w, out)
    if not torch.allclose(got_r.float(), want, rtol=ULP, atol=0.0):
        return False
    return bool(
        torch.allclose(got.float(), got_r.float() * w.float(), rtol=ULP, atol=0.0)
        if weight
        else torch.equal(got, got_r)
    )


def candidate_impl(kernel: str, cfg: dict[str, Any]) -> Any:
    rows, warps, family = cfg["rows"], cfg["num_warps"], cfg["family"]
    plugin = triton_kernels._kernels()  # the stream and wpre families and RMSNorm's loop time the plugin's
    rms_kernel = {
        "hint": rmsnorm_hint_kernel,
        "persist": rmsnorm_persist_kernel,
        "loop": plugin.rmsnorm_loop,
        "stream": plugin.rmsnorm,
        "wpre": plugin.rmsnorm_weight_first,
        "keep": rmsnorm_keep_kernel,
        "split": rmsnorm_split_kernel,
        "grid": plugin.rmsnorm_persistent,
        "wgrid": rmsnorm_wgrid_kernel,
    }.get(family)
    fused_kernel = {
        "hint": fused_add_rmsnorm_hint_kernel,
        "persist": fused_add_rmsnorm_persist_kernel,
        "loop": fused_add_rmsnorm_loop_kernel,
        "stream": plugin.fused_add_rmsnorm,
        "wpre": plugin.fused_add_rmsnorm_weight_first,
        "keep": fused_keep_kernel,
        "grid": fused_grid_kernel,
        "wgrid": fused_wgrid_kernel,
    }.get(family)

    def launch(t: int, h: int) -> tuple[tuple[int], dict[str, Any]]:
        opts: dict[str, Any] = {"BLOCK": triton.next_power_of_2(h), "num_warps": warps}
        if family == "persist":
            opts.update(PREFETCH=cfg["prefetch"], HINT=cfg["hint"])
            return (min(t, sm_count() * cfg["waves"]),), opts
        if family == "grid":
            opts.update(triton_kernels.STREAM_POLICIES[cfg["stream"]])
            return (min(t, sm_count() * cfg["waves"]),), opts
        if family == "wgrid":
            opts = {"RBLOCK": cfg["rblock"], "CHUNKS": triton.cdiv(h, cfg["rblock"]), "num_warps": warps}
            return (min(t, sm_count() * cfg["waves"]),), opts
        if family == "loop":
            return (t,), {"RBLOCK": cfg["rblock"], "CHUNKS": triton.cdiv(h, cfg["rblock"]), "num_warps": warps}
        if family == "wpre":
            opts = {"RBLOCK": cfg["rblock"], "CHUNKS": triton.cdiv(h, cfg["rblock"]), "num_warps": warps}
            return (triton.cdiv(t, rows),), {**opts, "ROWS": rows}
        if family == "keep":
            return (t,), {"RBLOCK": cfg["rblock"], "WEIGHT_FIRST": cfg["weight_first"], "num_warps": warps}
        if family == "split":
            opts = {"RBLOCK": cfg["rblock"], "CHUNKS": triton.cdiv(h, cfg["rblock"]), "SPLIT": cfg["split"]}
            return (t * cfg["split"],), {**opts, "num_warps": warps}
        if family == "stream":
            opts.update(triton_kernels.STREAM_POLICIES[cfg["stream"]])
        return (t,), opts

    if kernel == "rmsnorm":

        def rms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            t, h = x.shape
            if family == "rows":
                sweep_rmsnorm(x, w, out, rows, warps)
                return out
            grid, opts = launch(t, h)
            args: tuple[Any, ...] = (x, w, out, x.stride(0), out.stride(0))
            if family in ("grid", "wgrid"):  # persistent: each program's steps, cdiv(t, grid)
                args += (t, triton.cdiv(t, grid[0]), h, EPS)
            else:
                args += (t, h, EPS) if family in ("persist", "wpre", "keep", "split") else (h, EPS)
            rms_kernel[grid](*args, **opts)
            return out

        return rms

    def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, h = x.shape
        if family == "rows":
            sweep_fused(x, r, w, out, rows, warps)
            return out, r
        grid, opts = launch(t, h)
        # the plugin's kernels and the grid family's take the plugin's arguments: the residual's output too
        if family in ("loop", "stream", "wpre", "grid"):
            args: tuple[Any, ...] = (x, r, w, out, r, x.stride(0), r.stride(0), out.stride(0), r.stride(0))
        else:
            args = (x, r, w, out, x.stride(0), r.stride(0), out.stride(0))
        if family in ("grid", "wgrid"):
            args += (t, triton.cdiv(t, grid[0]), h, EPS)
        else:
            args += (t, h, EPS) if family in ("persist", "wpre", "keep") else (h, EPS)
        fused_kernel[grid](*args, **opts)
        return out, r

    return fused


@functools.cache
def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def liger_impls() -> tuple[dict[str, Any], dict[str, str]]:
    """Liger's functions called as benchmarks/norm_gpu.py calls them; a missing one is None, with a note."""
    impls: dict[str, Any] = {}
    notes: dict[str, str] = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as exc:
        impls["rmsnorm"], notes["rmsnorm"] = None, f"n/a: {exc}"
    else:

        def rms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)

        impls["rmsnorm"] = rms
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError as exc:
        impls["fused_add_rmsnorm"], notes["fused_add_rmsnorm"] = None, f"n/a: {exc}"
    else:

        def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)  # (out, new residual)

        impls["fused_add_rmsnorm"] = fused
    return impls, notes


def compiled_impls() -> dict[str, Any]:
    """torch.compile of norm_gpu's references; call torch.compiler.reset() and this again for each h."""
    rms_c = torch.compile(torch_rmsnorm)
    fused_c = torch.compile(torch_fused)

    def rms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return rms_c(x, w)

    def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fused_c(x, r, w), r

    return {"rmsnorm": rms, "fused_add_rmsnorm": fused}


# ------------------------------------------------------------------------------------------ correctness


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    g, w = got.float(), want.float()
    err = (g - w).abs().max().item() if g.numel() else 0.0
    return bool(torch.allclose(g, w, rtol=RTOL, atol=ATOL)), err


def check(kernel: str, impl: Any, t: int, h: int, w: torch.Tensor, pad: int = PAD) -> dict[str, Any]:
    """Run impl once on row-padded random inputs (row stride h + pad) against the float32 reference."""
    dev = w.device
    x = torch.randn(t, h + pad, device=dev, dtype=DTYPE)[:, :h]
    out_base = torch.full((t, h + pad), SENTINEL, device=dev, dtype=DTYPE)
    out = out_base[:, :h]
    try:
        if kernel == "rmsnorm":
            want = torch_rmsnorm(x.float(), w.float())
            got = impl(x, w, out)
            ok, err = close(got, want)
            problems = [] if ok else [f"out max abs err {err:.3g}"]
        else:
            r_base = torch.randn(t, h + pad, device=dev, dtype=DTYPE)
            r_pad = r_base[:, h:].clone()
            r = r_base[:, :h]
            r_want = r.float()  # a float32 copy: torch_fused writes x + r into it
            want = torch_fused(x.float(), r_want, w.float())
            got, got_r = impl(x, r, w, out)
            ok, err = close(got, want)
            ok_r, err_r = close(got_r, r_want)
            problems = [] if ok else [f"out max abs err {err:.3g}"]
            problems += [] if ok_r else [f"residual max abs err {err_r:.3g}"]
            if not torch.equal(r_base[:, h:], r_pad):
                problems.append("wrote the residual's row padding")
            err = max(err, err_r)
        if not bool((out_base[:, h:] == SENTINEL).all()):
            problems.append("wrote the output's row padding")
    except Exception as exc:  # a config that does not compile or launch is recorded, not fatal
        return {"ok": False, "max_err": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"ok": not problems, "max_err": err, "error": "; ".join(problems) or None}


# ---------------------------------------------------------------------------------------------- timing


def timer(warmup: int, rep: int, graphs: bool = False) -> Any:
    """Median microseconds of one call. With graphs, ``calls`` calls are replayed from one CUDA graph
    (norm_gpu.CallGraph; inputs still rotated: each captured call picks the next set; ``calls``: the rotation's
    count, the same for everything timed at a size), so the host's launch time, which exceeds these kernels' GPU
    time at small T, is not what gets measured. (Before 2026-12-06's last runs the graphs were triton's
    do_bench_cudagraph's, whose count of calls followed an eager estimate, host time included: implementations
    with a slower host path got fewer calls, fewer sets, and more of them from L2.)"""

    def median_us(fn: Any, calls: int) -> float:
        if graphs:
            return CallGraph(fn, calls).per_call_us(5)
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median")) * 1e3

    return median_us


def rotated_call(impl: Any, pick: Any, w: torch.Tensor, fused: bool) -> Any:
    """One call of ``impl`` on the next set of inputs from ``pick`` (norm_gpu.Rotation): ``(x, r, out)`` fused,
    ``(x, out)`` else, with the weight ``w``."""
    if fused:

        def call() -> None:
            x, r, out = pick()
            impl(x, r, w, out)
    else:

        def call() -> None:
            x, out = pick()
            impl(x, w, out)

    return call


def op_bytes(kernel: str, t: int, h: int) -> int:
    """Fewest bytes the op must move: rmsnorm reads x, writes out; fused reads x, r and writes r, out."""
    return (2 if kernel == "rmsnorm" else 4) * t * h * DTYPE.itemsize


def measure_size(
    kernel: str,
    t: int,
    h: int,
    w: torch.Tensor,
    baselines: dict[str, Any],
    median_us: Any,
    max_per_thread: int,
    families: tuple[str, ...] = FAMILIES,
    alloc_outputs: bool = False,
) -> dict[str, Any]:
    nbytes = op_bytes(kernel, t, h)
    fused = kernel == "fused_add_rmsnorm"

    def make_inputs() -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(t, h, device=w.device, dtype=DTYPE) for _ in range(3 if fused else 2))

    def make_copy() -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.randn(nbytes // 2 // DTYPE.itemsize, device=w.device, dtype=DTYPE)
        return src, torch.empty_like(src)

    # the same bytes_per_set for both, so the op and the copy rotate among the same number of sets
    pick = Rotation(make_inputs, nbytes)
    pick_copy = Rotation(make_copy, nbytes)

    def timed(impl: Any) -> float:
        return median_us(rotated_call(impl, pick, w, fused), pick.count)

    def copy_once() -> None:
        src, dst = pick_copy()
        dst.copy_(src)

    def copy_fresh() -> None:  # into a block allocated per call: under graphs, the one the last call freed
        src, _ = pick_copy()
        torch.empty_like(src).copy_(src)

    row: dict[str, Any] = {"kernel": kernel, "h": h, "t": t, "bytes": nbytes}
    row["copy_us"] = median_us(copy_once, pick_copy.count)
    row["copy_alloc_us"] = median_us(copy_fresh, pick_copy.count)
    for key, weight in (("floor", False), ("floor_w", True)):
        floor = floor_impl(kernel, t, h, weight)
        row[key] = {"ok": check_floor(kernel, floor, t, h, w, weight), "us": None}
        if not row[key]["ok"]:
            continue
        row[key]["us"] = median_us(rotated_call(floor, pick, w, fused), pick.count)
    for name, (impl, note) in baselines.items():
        entry: dict[str, Any] = {"us": None}
        if impl is None:
            entry["note"] = note
        else:
            # torch.compile is checked on contiguous rows: a padded stride would cost it another compilation
            entry.update(check(kernel, impl, t, h, w, pad=0 if name == "torch_compile" else PAD))
            try:  # baselines are timed even where the check fails (Liger's casting differs): recorded, not gated
                entry["us"] = timed(impl)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row[name] = entry
    configs = []
    for cfg in config_grid(h, t, max_per_thread, families):
        if cfg["family"] == "split" and fused:
            continue  # RMSNorm only: see the families' descriptions
        impl = candidate_impl(kernel, cfg)
        entry = {**cfg, "label": label(cfg), "us": None, **check(kernel, impl, t, h, w)}
        if entry["ok"]:
            entry["us"] = timed(allocating(impl, fused) if alloc_outputs else impl)
        configs.append(entry)
    row["configs"] = configs
    timed_configs = [c for c in configs if c["us"] is not None]
    best = min(timed_configs, key=lambda c: c["us"], default=None)
    row["best"] = None if best is None else {k: best[k] for k in ("label", "rows", "num_warps", "us")}
    for family in families:  # the fastest of each family, to see what each change buys
        own = [c for c in timed_configs if c["family"] == family]
        if own:
            fam_best = min(own, key=lambda c: c["us"])
            row.setdefault("best_of", {})[family] = {"label": fam_best["label"], "us": fam_best["us"]}
    return row


# --------------------------------------------------------------------------------------------- reports


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den


def meets_goal(us: float | None, row: dict[str, Any]) -> bool | None:
    if us is None:
        return None
    fast = row["t"] < GOAL_MIN_T or (ratio(row["copy_us"], us) or 0.0) >= GOAL_COPY
    liger_us = row["liger"]["us"]
    return fast and (liger_us is None or liger_us >= us)


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def flag(v: bool | None) -> str:
    return "-" if v is None else ("ok" if v else "MISS")


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'kernel':<18}{'h':>6}{'T':>7}  {'best':<14}{'us':>8}{'copy':>8}{'/copy':>7}{'liger':>8}{'/liger':>8}"
        f"{'plugin':>8}{'p/copy':>8}{'p/liger':>8}{'compile':>9}{'ok':>7}  {'goal':<6}{'p.goal'}"
    )
    lines = [head, "-" * len(head)]
    for row in sorted(results, key=lambda r: (KERNELS.index(r["kernel"]), r["h"], r["t"])):
        best = row["best"]
        b_us = None if best is None else best["us"]
        p_us = row["plugin"]["us"]
        l_us = row["liger"]["us"]
        ok_txt = f"{sum(c['ok'] for c in row['configs'])}/{len(row['configs'])}"
        name = "-" if best is None else best["label"]
        lines.append(
            f"{row['kernel']:<18}{row['h']:>6}{row['t']:>7}  {name:<14}{fmt(b_us):>8}{fmt(row['copy_us']):>8}"
            f"{fmt(ratio(row['copy_us'], b_us), '.3f'):>7}{fmt(l_us):>8}{fmt(ratio(l_us, b_us), '.2f'):>8}"
            f"{fmt(p_us):>8}{fmt(ratio(row['copy_us'], p_us), '.3f'):>8}{fmt(ratio(l_us, p_us), '.2f'):>8}"
            f"{fmt(row['torch_compile']['us']):>9}{ok_txt:>7}  "
            f"{flag(meets_goal(b_us, row)):<6}{flag(meets_goal(p_us, row))}"
        )
    return "\n".join(lines)


def fresh_table(results: list[dict[str, Any]]) -> str:
    """Outputs allocated per call (warm under graphs), against a copy into a block allocated per call; and
    the plugin's shape's dependency floor against the rotated copy."""
    head = (
        f"{'kernel':<18}{'h':>6}{'T':>7}{'copy.a':>8}{'plug.a':>8}{'/copy.a':>8}{'fresh':>8}{'/copy.a':>8}"
        f"{'liger':>8}{'/copy.a':>8}{'liger/fresh':>12}{'floor':>8}{'fl/copy':>8}{'p/floor':>8}"
        f"{'floor+w':>8}{'flw/copy':>9}{'p/flw':>8}"
    )
    lines = [head, "-" * len(head)]
    for row in sorted(results, key=lambda r: (KERNELS.index(r["kernel"]), r["h"], r["t"])):
        ca, pa, fr = row.get("copy_alloc_us"), row["plugin_alloc"]["us"], row.get("plugin_fresh", {}).get("us")
        li, fl, pl = row["liger"]["us"], row.get("floor", {}).get("us"), row["plugin"]["us"]
        fw = row.get("floor_w", {}).get("us")
        fr_or_pa = pa if fr is None else fr
        lines.append(
            f"{row['kernel']:<18}{row['h']:>6}{row['t']:>7}{fmt(ca):>8}{fmt(pa):>8}{fmt(ratio(ca, pa), '.3f'):>8}"
            f"{fmt(fr):>8}{fmt(ratio(ca, fr), '.3f'):>8}{fmt(li):>8}{fmt(ratio(ca, li), '.3f'):>8}"
            f"{fmt(ratio(li, fr_or_pa), '.3f'):>12}{fmt(fl):>8}{fmt(ratio(row['copy_us'], fl), '.3f'):>8}"
            f"{fmt(ratio(fl, pl), '.3f'):>8}{fmt(fw):>8}{fmt(ratio(row['copy_us'], fw), '.3f'):>9}"
            f"{fmt(ratio(fw, pl), '.3f'):>8}"
        )
    return "\n".join(lines)


def fixed_configs(results: list[dict[str, Any]], top: int = 3) -> tuple[str, list[dict[str, Any]]]:
    """Per (kernel, h): the configs that stay closest to each size's best, had one config served every size."""
    lines, summary = [], []
    for kernel in KERNELS:
        for h in sorted({r["h"] for r in results if r["kernel"] == kernel}):
            rows = [r for r in results if r["kernel"] == kernel and r["h"] == h and r["best"]]
            stats: dict[str, dict[str, Any]] = {}
            for r in rows:
                for c in r["configs"]:
                    if c["us"] is None:
                        continue
                    s = stats.setdefault(c["label"], {"sizes": 0, "worst_vs_best": 1.0, "goal_misses": []})
                    s["sizes"] += 1
                    s["worst_vs_best"] = min(s["worst_vs_best"], r["best"]["us"] / c["us"])
                    if not meets_goal(c["us"], r):
                        s["goal_misses"].append(r["t"])
            ranked = sorted(stats.items(), key=lambda kv: (-kv[1]["sizes"], -kv[1]["worst_vs_best"]))[:top]
            for name, s in ranked:
                summary.append({"kernel": kernel, "h": h, "label": name, **s})
                lines.append(
                    f"{kernel:<18}{h:>6}  {name:<14} sizes {s['sizes']}/{len(rows)}  "
                    f"worst {s['worst_vs_best']:.3f} of the best  goal missed at T={s['goal_misses'] or 'none'}"
                )
    return "\n".join(lines), summary


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    global PERSIST_WAVES, GRID_WARPS, GRID_STREAMS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/out", help="folder for norm_sweep.json (default /tmp/out)")
    parser.add_argument("--quick", action="store_true", help="h=4096, T in {256, 4096} only: a smoke run")
    parser.add_argument("--warmup", type=int, default=5, help="do_bench warmup in ms (default 5)")
    parser.add_argument("--rep", type=int, default=20, help="do_bench repetition time in ms (default 20)")
    parser.add_argument(
        "--max-per-thread", type=int, default=MAX_PER_THREAD, help="prune configs holding more values per thread"
    )
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="stop starting new sizes after this many seconds (default 330)"
    )
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help="candidate families, a comma list of rows (ROWS rows per program), hint (one row per program, "
        "streaming eviction hints), persist (a persistent grid, optionally prefetching its next row "
        "and with the hints), loop (one row per program in pieces, read twice, as torch.compile's looped "
        "reductions), stream (the plugin's one-read kernels with each level of eviction hints), wpre (the "
        "two-read shape in one or two pieces, the weight loaded in the first pass), keep (two pieces, the first "
        "kept in registers between the passes), split (RMSNorm: several programs per row, each writing its share "
        "of the columns), grid (the plugin's persistent RMSNorm, and that walk for fused), wgrid (the "
        "weight-first two reads on a persistent grid); default all",
    )
    parser.add_argument(
        "--graphs", action="store_true", help="time calls replayed from a CUDA graph (no host launch time)"
    )
    parser.add_argument(
        "--alloc-outputs",
        action="store_true",
        help="time the candidates writing into an output allocated per call (as plug.a and Liger are placed), "
        "not into the rotated outputs: best, /copy and /liger then compare with plug.a and Liger's time",
    )
    parser.add_argument("--tokens", default=None, help="a comma list of T replacing the default (or --quick) list")
    parser.add_argument("--hidden", default=None, help="a comma list of h replacing the default (or --quick) list")
    parser.add_argument(
        "--persist-waves",
        default=",".join(map(str, PERSIST_WAVES)),
        help="programs per SM of the persistent families' grids (persist, grid, wgrid), a comma list "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--grid-warps",
        default=",".join(map(str, GRID_WARPS)),
        help="the grid family's warps, a comma list (default %(default)s)",
    )
    parser.add_argument(
        "--grid-streams",
        default=",".join(map(str, GRID_STREAMS)),
        help="the grid family's eviction hint levels (triton_kernels.STREAM_POLICIES), a comma list "
        "(default %(default)s)",
    )
    args = parser.parse_args()
    PERSIST_WAVES = tuple(int(w) for w in args.persist_waves.split(","))
    GRID_WARPS = tuple(int(w) for w in args.grid_warps.split(","))
    GRID_STREAMS = tuple(int(s) for s in args.grid_streams.split(","))
    if not torch.cuda.is_available():
        raise SystemExit("norm_sweep needs a CUDA GPU")
    families = tuple(f for f in args.families.split(",") if f)
    if unknown := set(families) - set(FAMILIES):
        raise SystemExit(f"unknown families: {sorted(unknown)}")
    hidden, tokens = (QUICK_HIDDEN, QUICK_TOKENS) if args.quick else (HIDDEN, TOKENS)
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    if args.hidden:
        hidden = [int(h) for h in args.hidden.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "norm_sweep.json"
    start = time.perf_counter()
    torch.manual_seed(0)
    median_us = timer(args.warmup, args.rep, args.graphs)
    plugin = plugin_impls()
    plugin_alloc = plugin_alloc_impls()
    plugin_fresh = plugin_fresh_impls()
    liger, liger_notes = liger_impls()
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(),
        "sm_count": props.multi_processor_count,
        "machine": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "liger_kernel": version("liger-kernel") or version("liger_kernel"),
        "cacheon_example_kernels": version("cacheon-example-kernels"),
        "liger_notes": liger_notes,
        "settings": {
            "dtype": "bfloat16",
            "eps": EPS,
            "do_bench": {"warmup_ms": args.warmup, "rep_ms": args.rep, "return_mode": "median"},
            "cuda_graphs": args.graphs,
            "alloc_outputs": args.alloc_outputs,
            "rtol": RTOL,
            "atol": ATOL,
            "row_pad_in_checks": PAD,
            "hidden": hidden,
            "tokens": tokens,
            "rows_choices": ROWS_CHOICES,
            "warp_choices": WARP_CHOICES,
            "families": families,
            "persist_warps": PERSIST_WARPS,
            "persist_waves": PERSIST_WAVES,
            "grid_warps": GRID_WARPS,
            "grid_streams": GRID_STREAMS,
            "wgrid_warps": WGRID_WARPS,
            "per_thread": [MIN_PER_THREAD, args.max_per_thread],
            "goal": {"min_t": GOAL_MIN_T, "copy_ratio": GOAL_COPY, "not_slower_than": "liger"},
        },
        "plugin_launch": {},
        "partial": True,
        "results": [],
    }
    with torch.inference_mode():
        result["ceiling_gbps_2gib_copy"] = ceiling_gbps()
        print(f"2 GiB copy ceiling {result['ceiling_gbps_2gib_copy']:.0f} GB/s", flush=True)
        for h in hidden:
            torch.compiler.reset()  # h stays static for torch.compile; only T goes dynamic
            compiled = compiled_impls()
            try:  # per kernel and T: (reads the row twice, launch options)
                result["plugin_launch"][str(h)] = {
                    kernel: {str(t): triton_kernels._norm_launch(t, h, kernel != "rmsnorm") for t in tokens}
                    for kernel in KERNELS
                }
            except Exception as exc:
                result["plugin_launch"][str(h)] = f"unknown: {exc}"
            w = torch.randn(h, device="cuda", dtype=DTYPE)
            for t in tokens:
                for kernel in KERNELS:
                    elapsed = time.perf_counter() - start
                    if elapsed > args.budget_s:
                        print(f"[{elapsed:6.1f}s] budget spent: skipping {kernel} h={h} T={t}", flush=True)
                        result.setdefault("skipped", []).append({"kernel": kernel, "h": h, "t": t})
                        continue
                    baselines = {
                        "plugin": (plugin[kernel], None),
                        "plugin_alloc": (plugin_alloc[kernel], None),
                        "plugin_fresh": (plugin_fresh[kernel], "RMSNorm has one output: as plugin_alloc"),
                        "liger": (liger[kernel], liger_notes.get(kernel)),
                        "torch_compile": (compiled[kernel], None),
                    }
                    row = measure_size(
                        kernel, t, h, w, baselines, median_us, args.max_per_thread, families, args.alloc_outputs
                    )
                    result["results"].append(row)
                    out_file.write_text(json.dumps(result, indent=1))
                    best, n_ok = row["best"], sum(c["ok"] for c in row["configs"])
                    best_txt = "none" if best is None else f"{best['label']} {best['us']:.1f}us"
                    print(
                        f"[{time.perf_counter() - start:6.1f}s] {kernel} h={h} T={t}: best {best_txt}, "
                        f"copy {row['copy_us']:.1f}us, plugin {fmt(row['plugin']['us'])}us "
                        f"(output allocated per call {fmt(row['plugin_alloc']['us'])}us), "
                        f"liger {fmt(row['liger']['us'])}us, compile {fmt(row['torch_compile']['us'])}us, "
                        f"{n_ok}/{len(row['configs'])} configs correct; "
                        + ", ".join(f"{k} {v['label']} {v['us']:.1f}us" for k, v in row.get("best_of", {}).items()),
                        flush=True,
                    )
    fixed_text, result["fixed_configs"] = fixed_configs(result["results"])
    result["partial"] = "skipped" in result
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    out_file.write_text(json.dumps(result, indent=1))
    print()
    print(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, liger {result['liger_kernel']}")
    print(
        "us: medians in microseconds; best: the fastest correct candidate (R rows per program x W warps); "
        "copy: a copy of the same bytes;\n/copy and p/copy: copy time over the best's and the plugin's; "
        "/liger and p/liger: Liger's time over theirs;\n"
        f"goal / p.goal: /copy >= {GOAL_COPY} where T >= {GOAL_MIN_T}, and not slower than Liger at any T"
    )
    print(table(result["results"]))
    print()
    print(
        "outputs allocated per call (under graphs each call gets the block the last one freed): copy.a, a copy "
        "into such a block; plug.a, the plugin so (fused: the residual in place); fresh, the plugin's fused "
        "kernel writing its new residual into such a block too, as Liger does; liger/fresh: Liger's time over "
        "fresh's (RMSNorm: over plug.a); floor: the plugin's shape's dependency alone (read, sum, then write "
        "the row unchanged) at the plugin's launch, against the rotated copy and as p/floor, floor time over "
        "the plugin's; floor+w: the same with the row times the weight (loaded where the plugin loads it), "
        "as flw/copy and p/flw"
    )
    print(fresh_table(result["results"]))
    print()
    print("one config for every T, closest to each size's best:")
    print(fixed_text)
    print(f"\n{out_file} written, {result['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
