"""Triton variants: one program per row (per row and column block for the MoE finalize), float32
accumulation, rows may be padded (row stride).

The norms have two shapes, picked from the row count T and width h (``_norm_launch``; once per shape, then
kept: ``_rmsnorm_plan``, ``_fused_plan``): the whole row held in registers (one read), and, for many rows of
2049-8192 columns, the row in pieces read twice (the second read comes from L2), which keeps fewer values per
thread and so more rows in flight; that shape loads the weight before the row at most sizes
(TWO_READ_LAUNCH). The two shapes sum the squares in a different order, so their float32 results can
differ in the last bits. RMSNorm has a third launch at some sizes (PERSISTENT_LAUNCH, ``_persistent_launch``):
one read of each row on a persistent grid of a few programs per SM, each walking rows; it gives the one-read
kernel's bytes.

Triton is imported lazily, so the plugin loads (and its torch variants serve) where Triton is not
installed; ``supports`` then says no.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import types
from typing import Any

import torch

from cacheon_core import CallDescriptor

MAX_BLOCK = 65536
FINALIZE_BLOCK = 1024  # columns per program of the MoE finalize: rows of any width are tiled
# The norms read a row twice, in pieces, when h is 2049-8192 (block: h rounded up to a power of two) and the row count
# reaches the first step of TWO_READ_LAUNCH[fused, block], but in the rows of ONE_READ_AGAIN[fused, block]; below it, at
# other widths, or for the fused norm of h 4097-8192 (no such step), one read (benchmarks/norm_sweep.py --graphs on an
# H200; h 4096 and 8192; families loop, stream and wpre; T 256-16384, T 576-2048 in steps of 16-256). From
# FEWER_WARPS_MIN_ROWS rows the one-read kernels run at most 8 warps: at h 8192, T 256-512, 1-13% faster than with 16
# (RMSNorm); ONE_READ_WARPS: other warps from its step's T (fused h 2049-4096: 4 warps at 793-895 rows; fused h
# 4097-8192: 16 at 256-415 rows, 0.4-2.2% faster than 8 in each of 9 same-run pairs at T 256-384, 8 at 416-559, where 8
# ran 1.8-4.8% faster at T 448-548, and 16 again from 560, 0.4-2.3% faster than 8 in each of 13 same-run pairs at T
# 576-992 and 0.7-2.3% at T 560-576, and 0.4% slower at T 1023 in the one run that measured it, BENCHMARKS.md
# 2026-12-04).
# TWO_READ_LAUNCH: steps of (from T rows, columns per piece, warps, the weight first), each from its own
# T. The weight first (the *_weight_first kernels): loaded before the row and kept in registers; else
# loaded again in the second pass (RMSNorm only). Measured on an H200 under CUDA graphs (norm_sweep.py:
# the plugin against every launch of the loop, stream and wpre families). T 2048-16384: the weight first
# as fast or faster at every size but fused h 4096 T 8192-16384 with pieces of 2048 and 8 warps, hence
# its second step (the sweeps chose it from 8192 rows; it runs from 10752, where ONE_READ_AGAIN's fused rows
# end). Below 2048 rows, against the launches they replaced:
# - the H200's 132 SMs run 792 programs of one read with 8 warps at once (six each): at h 4096 that
#   launch ran at 1.009 of the copy at 792 rows and 0.900-0.912 at 808-831 (RMSNorm; fused 0.968 and
#   0.893-0.908);
# - RMSNorm h 4096: two reads with the weight first from 793 rows, 1-11% faster (T 808-831: 9-11%
#   faster than one read; T 896, from an earlier step: 9%); at 1057-2272 rows, PERSISTENT_LAUNCH;
# - RMSNorm h 8192: the weight first with 8 warps at T 576-792, 9-11% faster than one read (T 576-704)
#   and 2-5% than the weight in the second pass (T 768-784); at T 808-1024 it ran 4-8% slower than that,
#   which runs from 793 rows; past that launch's first wave (8 programs of 8 warps on each of 132 SMs:
#   1056 rows) it ran at 0.90-0.92 of the copy (T 1072-1151, on an H100; 0.99-1.02 at T 800-1057) and
#   the weight first with 8 warps, as at 576-792 rows, at 0.987-0.995 (T 1057-1151), hence that launch
#   again from 1057 rows (BENCHMARKS.md, 2026-12-05); from 1152 rows the weight first with 16 warps, 4-10%
#   faster;
# - fused h 4096: one read with 4 warps at 793-895 rows, 8-9% faster than with 8 at T 808-831 and as fast
#   as the weight first at T 896; the weight first from 896 rows, 2-8% faster at T 896-1280 than one read
#   and the weight in the second pass.
# Fused h 4097-8192 reads once at every T (16 warps from 560 rows). Its weight-first launch in one piece of
# 8192 from 1024 rows, 0.3-1% faster than one read in the sweeps that chose it (outputs rotated; timed by
# do_bench_cudagraph), ran behind by turns under CUDA graphs of as many calls for every launch (norm_turns.py;
# BENCHMARKS.md, 2026-12-06, "from 1 to 4096 rows"):
# on an H100, outputs allocated per call as an engine's are, the one read with no hints and 16 warps took
# 1.7-5.8% less time at T 1024-4096 and ran as fast as Liger's function or faster (the median of ten rounds'
# ratios 1.001-1.017), where the two reads ran 1.1-4.5% behind it at T 1536-4096. As the plugin launches it, on
# another H100 (BENCHMARKS.md, 2026-12-06, "past 2048 rows"): 1.000-1.008 of Liger's function at T 1024-4096, and
# 0.972-0.991 of the copy writing into the rotated outputs.
FEWER_WARPS_MIN_ROWS = 256
# RMSNorm's persistent grid (the rmsnorm_persistent kernel), by block: (from T, below T, ((programs per SM,
# warps), ...)), for T in [from, below); it takes precedence over TWO_READ_LAUNCH there. Of the grids, the
# one whose programs' last rows are the fullest, T / (cdiv(T, grid) * grid) (the first on a tie): a grid
# that T leaves a few rows over a whole number of rows per program ends on a short last wave. On an H200
# (132 SMs) at h 4096, T 1152-2048 (norm_sweep.py's grid family), the grid so picked ran at 0.958-0.995
# of the copy, against 0.952-0.970 for the two reads with the weight first (BENCHMARKS.md, 2026-12-04).
# From 1057 rows: 1056 are the two-read launch's first wave (8 programs of 8 warps on each SM), past which
# it ran at 0.90-0.91 of the copy (T 1088-1120). To 2272 rows: on an H100 at 2144-2272 rows, with outputs
# allocated per call as Liger allocates its own, the grid of 4 programs of 8 warps per SM ran 10.8-11.5 us
# against 11.5-12.1 for the two reads with the weight first and 11.2-12.5 for Liger (faster than those at
# 2144 rows there, and at 2176 in three runs before); with the outputs rotated, 0.977 and 0.985 of the copy
# at 2176 and 2240 rows against 0.995-0.997 (BENCHMARKS.md, 2026-12-06). The H200 has not run it past 2112.
PERSISTENT_LAUNCH = {4096: (1057, 2273, ((4, 8), (5, 4)))}
# ONE_READ_AGAIN: (fused, block): (from T, below T, num_warps): one read with no hints at those rows, past the first
# step of TWO_READ_LAUNCH (it takes precedence over that table there). By turns on an H100 under CUDA graphs of as
# many calls (benchmarks/norm_turns.py --copy, with the one-read candidates writing into blocks allocated per call and,
# in a second run, into the rotated outputs; BENCHMARKS.md, 2026-12-06, "past 2048 rows"), the one read with 16 warps
# took less time than the two reads with the weight first in both placements: fused h 4096 at T 2048 (1.8% and 3.9%),
# 3072 (4.7%, 4.4%; 8 warps 0.3-0.4% faster still) and 4096 (3.6%, 3.2%), where the two reads ran 2.3-2.5% behind
# Liger's function at T 3072-4096 and the one read ahead of it; RMSNorm h 8192 at T 3072 (2.7%, 2.3%) and 4096 (2.3%,
# 1.8%), where the two reads ran 0.8-2.4% behind Liger. Below, the placements disagree: at T 1536 (fused h 4096) and
# 2048 (RMSNorm h 8192) the two reads took 2.1% and 1.6% less time with outputs allocated per call, the one read 4.5%
# and 0.7% less into the rotated outputs. Timed there as candidate launches of the same kernel (each checked against
# the float32 reference on that card first). As the plugin launched it with these rows ending at 8191 (an H100,
# BENCHMARKS.md 2026-12-07; tests/example's GPU tests passed at its rows), Liger's function's time over the plugin's:
# fused h 4096 T 2048-6144 0.997-1.008, RMSNorm h 8192 T 3072-6144 1.004-1.009; the copy's placed alike over the
# plugin's 0.982-0.997. From 8192 rows of the fused norm of h 4096 (three calls by turns, both placements each) the
# one read with 16 warps took less time than the two reads in every run that timed it at T 8192 (six runs,
# 0.31-1.63%), 9216 (four, 0.86-1.05%) and 10240 (four, 0.54-0.71%), and more at 11264 (four, 0.08-0.35%) and 12288
# (six, 0.14-0.75%): so its fused rows end at 10751 (the crossover lies between 10240 and 11264; 10752 is their
# midpoint). RMSNorm h 8192 at 8192 and 12288 rows: the one read no faster (one call), so its rows end at 8191. As
# the plugin launches these rows (an H100, BENCHMARKS.md 2026-12-07, "as the plugin launches them up to 10751 rows";
# tests/example's GPU tests passed at 10751 and 10752), Liger's function's time over the plugin's at fused h 4096 T
# 8192, 10240 and 10751: 1.000-1.012 in both placements of outputs.
ONE_READ_AGAIN = {(False, 8192): (3072, 8192, 16), (True, 4096): (2048, 10752, 16)}
ONE_READ_WARPS = {  # (fused, block): ((from T, num_warps), ...): one read, below TWO_READ_LAUNCH's first step
    (True, 4096): ((793, 4),),
    (True, 8192): ((256, 16), (416, 8), (560, 16)),
}
TWO_READ_LAUNCH = {  # (fused, block): ((from T, RBLOCK, num_warps, weight first), ...)
    (False, 4096): ((793, 2048, 8, True),),
    (False, 8192): ((576, 4096, 8, True), (793, 4096, 8, False), (1057, 4096, 8, True), (1152, 4096, 16, True)),
    (True, 4096): ((896, 2048, 8, True), (10752, 4096, 16, True)),
}
# Sizes at which the norms take shapes the slot's own verification sizes (at most 33 rows, h up to 4096) never reach:
# one read of 8192-wide blocks with 8 warps (RMSNorm 256-575 rows, fused 416-559), and with 16 (fused, 256-415 rows and
# from 560; RMSNorm 3072-8191 rows), and of 4096-wide ones with 4 (fused, 793-895 rows) and 16 (fused, 2048-10751 rows);
# two reads of RMSNorm with the weight in the second pass, in two pieces (h 4097-8192, 793-1056 rows); and the weight
# first, in two pieces (h 2049-4096, with 8 warps; RMSNorm of h 4097-8192 at 576-792 and 1057-1151 rows with 8 warps and
# from 1152 with 16); RMSNorm's persistent grid (h 2049-4096, 1057-2272 rows: on an H200 5 programs per SM with 4 warps
# at 1152 rows, 4 with 8 at 2048). `cacheon verify` runs them (Variant.verify_dims). Not among them: one read of blocks
# of 8192 with 16 warps below 256 rows, or of wider blocks, and the fused kernel's weight-first step from 10752 rows
# of 2049-4096 columns (past verification's element cap; tests/example runs it on CUDA).
NORM_VERIFY_DIMS = (
    {"t": 256, "h": 4200},
    {"t": 448, "h": 4200},
    {"t": 640, "h": 4200},
    {"t": 800, "h": 2100},
    {"t": 1024, "h": 2100},
    {"t": 1024, "h": 4200},
    {"t": 1088, "h": 4200},
    {"t": 1152, "h": 2100},
    {"t": 2048, "h": 2100},
    {"t": 2048, "h": 4200},
    {"t": 3072, "h": 4200},
)
# L2 eviction policies for the one-read kernels (ROW_EVICT, OUT_EVICT in _kernels), by level: 0 none,
# as the plugin launches; 1 evict_first on the row's loads and the residual's store; 2 on the output's
# store as well. benchmarks/norm_sweep.py times each (its stream family); 2 is not launched, 1 only at
# HINTED_ROWS (BENCHMARKS.md, 2026-12-02: from 256 rows 1 was within noise of none with the inputs out of
# L2, and the next kernel reads the output, which 2 would send out of L2 first).
STREAM_POLICIES = (
    {"ROW_EVICT": "", "OUT_EVICT": ""},
    {"ROW_EVICT": "evict_first", "OUT_EVICT": ""},
    {"ROW_EVICT": "evict_first", "OUT_EVICT": "evict_first"},
)
# Level 1 at HINTED_ROWS[fused, block] (from its first T to below its second) for the widths the sweeps measured
# (blocks 4096 and 8192, those of TWO_READ_LAUNCH), where the one-read kernels run a few rows. By turns on an H100
# under CUDA graphs of as many calls for every launch (benchmarks/norm_turns.py; BENCHMARKS.md, 2026-12-06, "with
# every graph of as many calls"), at the plugin's warps, outputs allocated per call as an engine's are, at T 2-64
# of both norms and both widths: with the inputs out of L2 level 1 took 3.6-8.4% less time than none at every size;
# with one input set warm in L2, from 1.2% less to 2.3% more (fused h 8192 T 2). From 192 rows, with the outputs
# rotated, it was slower at some sizes (fused h 8192 T 192-256 by 0.4-1.7%; the entry "where the hints stop").
# Sweeps before that run timed under triton's do_bench_cudagraph, whose count of calls a graph left part of the
# inputs in L2 between replays: there level 1 had taken up to 20% more time than none at T 12-20 of RMSNorm h 4096,
# and the bounds were 16 and 24 rows. T 1 was not measured, and keeps none.
HINTED_ROWS = {
    (False, 4096): (2, 192),
    (False, 8192): (2, 192),
    (True, 4096): (2, 192),
    (True, 8192): (2, 192),
}


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for n >= 0 in plain integers: Triton 3.6's (a ConstexprFunction) takes
    about 2.6 us a host call, and every launch below asks for it."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for b > 0 in plain integers (as dear a host call as ``triton.next_power_of_2``)."""
    return -(-a // b)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def supports(descriptor: CallDescriptor) -> bool:
    """CUDA devices with Triton installed; the CPU only under Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    ok_device = descriptor.device.startswith("cuda") or (descriptor.device == "cpu" and _interpreting())
    return ok_device and descriptor.dims["h"] <= MAX_BLOCK


@functools.cache
def _kernels() -> types.SimpleNamespace:
    import triton
    import triton.language as tl

    # Both norms issue every load of a row (the weight included) before the reduction and use rsqrt: the
    # weight's load then overlaps the row's instead of following the sum, which the small T (a few
    # microseconds a call) pays for (benchmarks/norm_sweep.py --graphs). Row offsets are 64-bit, so a
    # tensor past 2**31 elements is addressed right.
    #
    # The fused kernels read the residual at r_ptr and write the sum at ro_ptr; the plugin passes the same
    # tensor for both (the slot updates the residual in place), benchmarks/norm_sweep.py also a new one.
    #
    # ROW_EVICT and OUT_EVICT are L2 eviction policies ("" or "evict_first"; STREAM_POLICIES): ROW_EVICT
    # for the row's loads and the residual's store, OUT_EVICT for the output's store.
    @triton.jit
    def rmsnorm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        x_row,
        out_row,
        h,
        eps,
        BLOCK: tl.constexpr,
        ROW_EVICT: tl.constexpr,
        OUT_EVICT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0, eviction_policy=ROW_EVICT).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / h + eps)
        y = (x * rstd * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * out_row + cols, y, mask=mask, eviction_policy=OUT_EVICT)

    @triton.jit
    def fused_add_rmsnorm_kernel(
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
        BLOCK: tl.constexpr,
        ROW_EVICT: tl.constexpr,
        OUT_EVICT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0, eviction_policy=ROW_EVICT).to(tl.float32)
        r = tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0, eviction_policy=ROW_EVICT).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        s = x + r
        tl.store(ro_ptr + row * ro_row + cols, s.to(ro_ptr.dtype.element_ty), mask=mask, eviction_policy=ROW_EVICT)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / h + eps)
        y = (s * rstd * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * out_row + cols, y, mask=mask, eviction_policy=OUT_EVICT)

    # The two-read shape (torch.compile's looped reductions have it too): the first pass sums the
    # squares and asks L2 to keep the row (evict_last), the second reads it again, scales and writes
    # (evict_first). Pieces are unrolled (CHUNKS is a compile-time constant).
    @triton.jit
    def rmsnorm_loop_kernel(x_ptr, w_ptr, out_ptr, x_row, out_row, h, eps, RBLOCK: tl.constexpr, CHUNKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((RBLOCK,), dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            cols = c * RBLOCK + tl.arange(0, RBLOCK)
            x = tl.load(x_ptr + row * x_row + cols, mask=cols < h, other=0.0, eviction_policy="evict_last")
            xf = x.to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / h + eps)
        for c in tl.static_range(CHUNKS):
            cols = c * RBLOCK + tl.arange(0, RBLOCK)
            mask = cols < h
            x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            tl.store(
                out_ptr + row * out_row + cols, (x.to(tl.float32) * rstd * w).to(out_ptr.dtype.element_ty), mask=mask
            )

    # The two-read shape with the weight first (TWO_READ_LAUNCH): in one or two pieces (CHUNKS), each
    # named, the weight loaded before the rows and kept in registers; ROWS rows per program, one after
    # another, share it (the plugin launches one; benchmarks/norm_sweep.py's wpre family times more).
    # Written with the pieces in a loop, as the kernels above, the same loads compiled for sm_90 with the
    # weight's issued after the sum's first shuffles rather than before, and the fused kernel ran 3-4%
    # slower on an H200 (BENCHMARKS.md). Same sums, in the same order, as the loop kernel above. The fused
    # kernel (the plugin's only fused two-read kernel: every fused step of TWO_READ_LAUNCH loads the
    # weight first) reads x and the residual in both passes and writes the residual only in the second,
    # so each piece of the residual is read before it is overwritten, and out is the norm of the float32
    # sum, as in the one-read kernel. t only masks rows past it (the SASS for sm_90 is the same whether t
    # is a multiple of 16 or not), so it is not specialized: a new batch size compiles nothing.
    @triton.jit(do_not_specialize=["t"])
    def rmsnorm_weight_first_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        x_row,
        out_row,
        t,
        h,
        eps,
        RBLOCK: tl.constexpr,
        CHUNKS: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        tl.static_assert(CHUNKS <= 2)
        first = tl.program_id(0).to(tl.int64) * ROWS
        c0 = tl.arange(0, RBLOCK)
        c1 = RBLOCK + c0
        m0 = c0 < h
        m1 = c1 < h
        w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if CHUNKS == 2:
            w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
        for i in tl.static_range(ROWS):
            row = first + i
            k0 = m0 & (row < t)
            k1 = m1 & (row < t)
            x0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc = x0 * x0
            if CHUNKS == 2:
                x1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_last")
                x1 = x1.to(tl.float32)
                acc += x1 * x1
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / h + eps)
            x0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_first")
            tl.store(
                out_ptr + row * out_row + c0, (x0.to(tl.float32) * rstd * w0).to(out_ptr.dtype.element_ty), mask=k0
            )
            if CHUNKS == 2:
                x1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_first")
                y1 = (x1.to(tl.float32) * rstd * w1).to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + row * out_row + c1, y1, mask=k1)

    @triton.jit(do_not_specialize=["t"])
    def fused_add_rmsnorm_weight_first_kernel(
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
        h,
        eps,
        RBLOCK: tl.constexpr,
        CHUNKS: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        tl.static_assert(CHUNKS <= 2)
        first = tl.program_id(0).to(tl.int64) * ROWS
        c0 = tl.arange(0, RBLOCK)
        c1 = RBLOCK + c0
        m0 = c0 < h
        m1 = c1 < h
        w0 = tl.load(w_ptr + c0, mask=m0, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if CHUNKS == 2:
            w1 = tl.load(w_ptr + c1, mask=m1, other=0.0, eviction_policy="evict_last").to(tl.float32)
        for i in tl.static_range(ROWS):
            row = first + i
            k0 = m0 & (row < t)
            k1 = m1 & (row < t)
            x0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
            r0 = tl.load(r_ptr + row * r_row + c0, mask=k0, other=0.0, eviction_policy="evict_last").to(tl.float32)
            s0 = x0 + r0
            acc = s0 * s0
            if CHUNKS == 2:
                x1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_last")
                r1 = tl.load(r_ptr + row * r_row + c1, mask=k1, other=0.0, eviction_policy="evict_last")
                s1 = x1.to(tl.float32) + r1.to(tl.float32)
                acc += s1 * s1
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / h + eps)
            x0 = tl.load(x_ptr + row * x_row + c0, mask=k0, other=0.0, eviction_policy="evict_first").to(tl.float32)
            r0 = tl.load(r_ptr + row * r_row + c0, mask=k0, other=0.0, eviction_policy="evict_first").to(tl.float32)
            s0 = x0 + r0
            tl.store(ro_ptr + row * ro_row + c0, s0.to(ro_ptr.dtype.element_ty), mask=k0)
            tl.store(out_ptr + row * out_row + c0, (s0 * rstd * w0).to(out_ptr.dtype.element_ty), mask=k0)
            if CHUNKS == 2:
                x1 = tl.load(x_ptr + row * x_row + c1, mask=k1, other=0.0, eviction_policy="evict_first")
                r1 = tl.load(r_ptr + row * r_row + c1, mask=k1, other=0.0, eviction_policy="evict_first")
                s1 = x1.to(tl.float32) + r1.to(tl.float32)
                tl.store(ro_ptr + row * ro_row + c1, s1.to(ro_ptr.dtype.element_ty), mask=k1)
                tl.store(out_ptr + row * out_row + c1, (s1 * rstd * w1).to(out_ptr.dtype.element_ty), mask=k1)

    # The persistent grid (RMSNorm; PERSISTENT_LAUNCH): a few programs per SM, each loading the weight once
    # and walking rows pid, pid + grid, ... (``walk`` steps: cdiv(t, grid), so a program's last may be
    # past t, masked); it loads its next row before it reduces and writes the current one, so two rows are
    # in flight per program. One read of each row, summed as the one-read kernel sums it: the same bytes.
    # t and walk only bound the rows, so they are not specialized.
    @triton.jit(do_not_specialize=["t", "walk"])
    def rmsnorm_persistent_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        x_row,
        out_row,
        t,
        walk,
        h,
        eps,
        BLOCK: tl.constexpr,
        ROW_EVICT: tl.constexpr,
        OUT_EVICT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < h
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(
            x_ptr + pid.to(tl.int64) * x_row + cols, mask=mask & (pid < t), other=0.0, eviction_policy=ROW_EVICT
        )
        i = 0
        while i < walk:  # a while loop: Triton's interpreter cannot run range() over a runtime bound
            row = pid + i * step
            following = row + step
            ahead = tl.load(
                x_ptr + following.to(tl.int64) * x_row + cols,
                mask=mask & (following < t),
                other=0.0,
                eviction_policy=ROW_EVICT,
            )
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / h + eps)
            y = (xf * rstd * w).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row.to(tl.int64) * out_row + cols, y, mask=mask & (row < t), eviction_policy=OUT_EVICT)
            x = ahead
            i += 1

    @triton.jit
    def finalize_kernel(
        ro_ptr, w_ptr, idx_ptr, out_ptr, ro_row, w_row, idx_row, out_row, h, K: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < h
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(K):  # top-k is fixed per model: one compilation each, the loop unrolled
            index = tl.load(idx_ptr + row * idx_row + j)
            routed = index >= 0  # a negative index is a padded entry: nothing is read, nothing added
            weight = tl.where(routed, tl.load(w_ptr + row * w_row + j).to(tl.float32), 0.0)
            src = ro_ptr + tl.maximum(index, 0).to(tl.int64) * ro_row + cols
            acc += weight * tl.load(src, mask=mask & routed, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_row + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return types.SimpleNamespace(
        rmsnorm=rmsnorm_kernel,
        fused_add_rmsnorm=fused_add_rmsnorm_kernel,
        rmsnorm_loop=rmsnorm_loop_kernel,
        rmsnorm_weight_first=rmsnorm_weight_first_kernel,
        fused_add_rmsnorm_weight_first=fused_add_rmsnorm_weight_first_kernel,
        rmsnorm_persistent=rmsnorm_persistent_kernel,
        finalize=finalize_kernel,
    )


def _norm_launch(t: int, h: int, fused: bool) -> tuple[bool, dict[str, int | str]]:
    """``(two reads, launch options)`` for a norm of ``t`` rows of ``h`` columns.

    One read: BLOCK = next_pow2(h), 8 warps per 4096-wide row, 16 from 8192 below FEWER_WARPS_MIN_ROWS
    rows of h 2049-8192, else 8, or ONE_READ_WARPS's from its step's T; no eviction hints
    (STREAM_POLICIES[0]) but at HINTED_ROWS[fused, block] (h 2049-8192), level 1; at ONE_READ_AGAIN[fused, block]'s
    rows, its warps. Two reads (h 2049-8192, from the first step of TWO_READ_LAUNCH, outside ONE_READ_AGAIN's rows):
    the pieces, warps and place of the weight's load of the step for ``t`` (the weight first: ``WEIGHT_FIRST``, the
    *_weight_first kernels, one row per program). Measured on an H200
    (benchmarks/norm_gpu.py, benchmarks/norm_sweep.py). RMSNorm asks ``_persistent_launch`` first: where it
    gives a grid, that runs instead."""
    block = _next_pow2(h)
    steps = TWO_READ_LAUNCH.get((fused, block), ())  # the widths the sweeps measured (blocks 4096, 8192)
    tuned = bool(steps)
    again_from, again_below, again_warps = ONE_READ_AGAIN.get((fused, block), (0, 0, 0))
    if again_from <= t < again_below:
        return False, {"BLOCK": block, "num_warps": again_warps, **STREAM_POLICIES[0]}
    if not tuned or t < steps[0][0]:
        warps = min(max(block // 512, 4), 16)
        if tuned and t >= FEWER_WARPS_MIN_ROWS:
            warps = min(warps, 8)
        fewer = ONE_READ_WARPS.get((fused, block), ())
        warps = next((w for least, w in reversed(fewer) if t >= least), warps)
        least, below = HINTED_ROWS.get((fused, block), (0, 0))
        level = 1 if least <= t < below else 0
        return False, {"BLOCK": block, "num_warps": warps, **STREAM_POLICIES[level]}
    rblock, warps, first = next((r, w, f) for least, r, w, f in reversed(steps) if t >= least)
    options: dict[str, int | str] = {"RBLOCK": rblock, "CHUNKS": _cdiv(h, rblock), "num_warps": warps}
    if first:
        options["WEIGHT_FIRST"] = True
    return True, options


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SMs; 1 on the CPU (Triton's interpreter), where a persistent grid is its programs."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _persistent_launch(t: int, h: int, sms: int) -> tuple[int, dict[str, int | str]] | None:
    """``(programs, launch options)`` of RMSNorm's persistent grid for ``t`` rows of ``h`` columns on a
    device of ``sms`` SMs (PERSISTENT_LAUNCH), or None where it does not run."""
    block = _next_pow2(h)
    least, below, grids = PERSISTENT_LAUNCH.get(block, (0, 0, ()))
    if not least <= t < below:
        return None

    def fullness(grid: tuple[int, int]) -> float:
        programs = grid[0] * sms
        return t / (_cdiv(t, programs) * programs)

    per_sm, warps = max(grids, key=fullness)
    return min(t, per_sm * sms), {"BLOCK": block, "num_warps": warps, **STREAM_POLICIES[0]}


# A launch is picked once per (rows, width, SMs) and kept (``_rmsnorm_plan``, ``_fused_plan``): an engine's
# batches come in few shapes, and at a few rows a call is host-bound, its launch arithmetic part of its time.
PLANS_KEPT = 4096  # per norm; the least recently used go first


@functools.lru_cache(maxsize=PLANS_KEPT)
def _rmsnorm_plan(t: int, h: int, sms: int) -> tuple[Any, int, tuple[int, ...], dict[str, int | str]]:
    """RMSNorm's launch for ``t`` (> 0) rows of ``h`` columns on ``sms`` SMs: ``(kernel, grid, the scalars
    between the strides and h, launch options)``, the persistent grid where ``_persistent_launch`` gives one,
    else ``_norm_launch``'s."""
    kernels = _kernels()
    persistent = _persistent_launch(t, h, sms)
    if persistent is not None:
        grid, options = persistent
        return kernels.rmsnorm_persistent, grid, (t, _cdiv(t, grid)), options
    loop, options = _norm_launch(t, h, fused=False)
    if options.pop("WEIGHT_FIRST", False):
        return kernels.rmsnorm_weight_first, t, (t,), {"ROWS": 1, **options}
    return kernels.rmsnorm_loop if loop else kernels.rmsnorm, t, (), options


@functools.lru_cache(maxsize=PLANS_KEPT)
def _fused_plan(t: int, h: int) -> tuple[Any, tuple[int, ...], dict[str, int | str]]:
    """Fused add + RMSNorm's launch for ``t`` (> 0) rows of ``h`` columns: ``(kernel, the scalars between the
    strides and h, launch options)``; its grid is ``t``."""
    kernels = _kernels()
    two_reads, options = _norm_launch(t, h, fused=True)
    if options.pop("WEIGHT_FIRST", False):
        return kernels.fused_add_rmsnorm_weight_first, (t,), {"ROWS": 1, **options}
    if two_reads:  # a fused step of TWO_READ_LAUNCH without the weight first: there is no such kernel
        raise ValueError(f"TWO_READ_LAUNCH: the fused two-read launch for {t} x {h} must load the weight first")
    return kernels.fused_add_rmsnorm, (), options


def rmsnorm(*, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    t, h = x.shape
    if t == 0:
        return
    kernel, grid, lead, options = _rmsnorm_plan(t, h, _sm_count(x.device))
    kernel[(grid,)](x, weight, out, x.stride(0), out.stride(0), *lead, h, eps, **options)


def fused_add_rmsnorm(
    *, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    t, h = x.shape
    if t == 0:
        return
    kernel, lead, options = _fused_plan(t, h)
    stride = residual.stride(0)  # the residual is written in place: its own output
    kernel[(t,)](
        x, residual, weight, out, residual, x.stride(0), stride, out.stride(0), stride, *lead, h, eps, **options
    )


def finalize(
    *, routed_output: torch.Tensor, expert_weights: torch.Tensor, permuted_indices: torch.Tensor, out: torch.Tensor
) -> None:
    """One program per token and block of columns, looping over the token's k entries (no host sync)."""
    (t, h), k = out.shape, permuted_indices.shape[1]
    if t == 0 or h == 0:
        return
    block = min(_next_pow2(h), FINALIZE_BLOCK)
    _kernels().finalize[(t, _cdiv(h, block))](
        routed_output,
        expert_weights,
        permuted_indices,
        out,
        routed_output.stride(0),
        expert_weights.stride(0),
        permuted_indices.stride(0),
        out.stride(0),
        h,
        K=k,
        BLOCK=block,
        num_warps=4,
    )
