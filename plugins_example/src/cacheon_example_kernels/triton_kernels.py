"""Triton variants: one program per row (per row and column block for the MoE finalize), float32
accumulation, rows may be padded (row stride).

The norms have two shapes, picked per call from the row count T and width h (``_norm_launch``): the
whole row held in registers (one read), and, for many rows of 2049-8192 columns, the row in pieces
read twice (the second read comes from L2), which keeps fewer values per thread and so more rows in
flight; that shape loads the weight before the row at most sizes (WEIGHT_FIRST_LAUNCH). The two shapes
sum the squares in a different order, so their float32 results can differ in the last bits.

Triton is imported lazily, so the plugin loads (and its torch variants serve) where Triton is not
installed; ``supports`` then says no.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import types

import torch

from cacheon_core import CallDescriptor

MAX_BLOCK = 65536
FINALIZE_BLOCK = 1024  # columns per program of the MoE finalize: rows of any width are tiled
# The norms read a row twice, in pieces of LOOP_BLOCK columns, from LOOP_FROM[fused, block] rows when h
# is 2049-8192 (block: h rounded up to a power of two). Below that row count the one-read kernel was as
# fast or faster, from it the two-read one (benchmarks/norm_sweep.py --graphs on an H200; h 4096 and 8192;
# families loop, stream and wpre; T 256-16384, and T 768-1792 in steps of 128 or 256). From
# FEWER_WARPS_MIN_ROWS rows the one-read kernels run at most 8 warps: at h 8192, T 256-512, 1-13% faster
# than with 16.
LOOP_BLOCK = 4096
LOOP_FROM = {(False, 4096): 896, (True, 4096): 1024, (False, 8192): 768, (True, 8192): 1024}
FEWER_WARPS_MIN_ROWS = 256
# WEIGHT_FIRST_LAUNCH: from which row count the two-read kernels load the weight before the row and keep
# it in registers (WEIGHT_FIRST), instead of loading each piece again in the second pass, and their
# launch, by kernel and block: steps of (from T rows, columns per piece, warps), each from its own T.
# Measured on an H200 under CUDA graphs (norm_sweep.py: the plugin against every launch of the loop
# family, and against the wpre family). T 2048-16384: as fast or faster at every size but fused h 4096
# T 8192-16384 with pieces of 2048 and 8 warps, hence its second step. T 896-1792, the plugin's launch
# against the launch it replaced: RMSNorm h 4096 from 896 rows 2-10% faster (T 896 one read: 9%); RMSNorm
# h 8192 4-10% faster from 1152 rows (T 1152-1792), 1-3% slower at T 768-1024; fused h 4096 2-4% faster
# at T 1280-1792 (and the sweep's own weight-first kernel 8% at T 1152), 1-4% slower at T 896-1024;
# fused h 8192 from 1024 rows 0.3-1% faster. Between 1056 and 1152 rows nothing was measured.
WEIGHT_FIRST_LAUNCH = {  # (fused, block): ((from T, RBLOCK, num_warps), ...)
    (False, 4096): ((896, 2048, 8),),
    (False, 8192): ((1152, 4096, 16),),
    (True, 4096): ((1152, 2048, 8), (8192, 4096, 16)),
    (True, 8192): ((1024, 8192, 16),),
}
# Sizes at which the norms take shapes the slot's own verification sizes (at most 33 rows, h up to 4096)
# never reach: one read of 8192-wide blocks with 8 warps; two reads with the weight in the second pass,
# in one piece (fused, h 2049-4096, 1024-1151 rows) and in two (RMSNorm, h 4097-8192, 768-1151 rows);
# and the weight first, in two pieces (h 2049-4096; RMSNorm from 1152 rows of h 4097-8192) and in one
# (fused, h 4097-8192). `cacheon verify` runs them (Variant.verify_dims). Not among them: one read of
# blocks of 8192 with 16 warps (below 256 rows) or wider, and the fused kernel's weight-first step from
# 8192 rows of 2049-4096 columns (past verification's element cap; tests/example runs it on CUDA).
NORM_VERIFY_DIMS = (
    {"t": 256, "h": 4200},
    {"t": 1024, "h": 2100},
    {"t": 1024, "h": 4200},
    {"t": 2048, "h": 2100},
    {"t": 2048, "h": 4200},
)
# L2 eviction policies for the one-read kernels (ROW_EVICT, OUT_EVICT in _kernels), by level: 0 none,
# as the plugin launches; 1 evict_first on the row's loads and the residual's store; 2 on the output's
# store as well. benchmarks/norm_sweep.py times each (its stream family); 1 and 2 are not launched
# (BENCHMARKS.md, 2026-12-02: 1 was within noise of none with the inputs out of L2, and the next kernel
# reads the output, which 2 would send out of L2 first).
STREAM_POLICIES = (
    {"ROW_EVICT": "", "OUT_EVICT": ""},
    {"ROW_EVICT": "evict_first", "OUT_EVICT": ""},
    {"ROW_EVICT": "evict_first", "OUT_EVICT": "evict_first"},
)


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
    # (evict_first). Pieces are unrolled (CHUNKS is a compile-time constant). The fused kernel reads x
    # and the residual in both passes and writes the residual only in the second, so each piece of the
    # residual is read before it is overwritten, and out is the norm of the float32 sum, as above.
    @triton.jit
    def rmsnorm_loop_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        x_row,
        out_row,
        h,
        eps,
        RBLOCK: tl.constexpr,
        CHUNKS: tl.constexpr,
        WEIGHT_FIRST: tl.constexpr = False,
    ):
        row = tl.program_id(0).to(tl.int64)
        if WEIGHT_FIRST:  # its one or two pieces (CHUNKS), before the row's loads, kept in registers
            c0 = tl.arange(0, RBLOCK)
            w0 = tl.load(w_ptr + c0, mask=c0 < h, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if CHUNKS == 2:
                w1 = tl.load(w_ptr + RBLOCK + c0, mask=RBLOCK + c0 < h, other=0.0, eviction_policy="evict_last")
                w1 = w1.to(tl.float32)
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
            if WEIGHT_FIRST:
                w = w0 if c == 0 else w1
            else:
                w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            tl.store(
                out_ptr + row * out_row + cols, (x.to(tl.float32) * rstd * w).to(out_ptr.dtype.element_ty), mask=mask
            )

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
        WEIGHT_FIRST: tl.constexpr = False,
    ):
        row = tl.program_id(0).to(tl.int64)
        if WEIGHT_FIRST:  # as in rmsnorm_loop_kernel
            c0 = tl.arange(0, RBLOCK)
            w0 = tl.load(w_ptr + c0, mask=c0 < h, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if CHUNKS == 2:
                w1 = tl.load(w_ptr + RBLOCK + c0, mask=RBLOCK + c0 < h, other=0.0, eviction_policy="evict_last")
                w1 = w1.to(tl.float32)
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
            if WEIGHT_FIRST:
                w = w0 if c == 0 else w1
            else:
                w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            tl.store(out_ptr + row * out_row + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

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
        fused_add_rmsnorm_loop=fused_add_rmsnorm_loop_kernel,
        finalize=finalize_kernel,
    )


def _norm_launch(t: int, h: int, fused: bool) -> tuple[bool, dict[str, int]]:
    """``(two reads, launch options)`` for a norm of ``t`` rows of ``h`` columns.

    One read: BLOCK = next_pow2(h), 8 warps per 4096-wide row, 16 from 8192 below FEWER_WARPS_MIN_ROWS
    rows of h 2049-8192, else 8; no eviction hints (STREAM_POLICIES[0]). Two reads (h 2049-8192, from
    LOOP_FROM rows): the weight first, with the pieces and warps of WEIGHT_FIRST_LAUNCH, from its first
    step's row count; below it (RMSNorm at h 4097-8192, fused at h 2049-4096) pieces of LOOP_BLOCK columns
    and 8 warps. Measured on an H200 (benchmarks/norm_gpu.py, benchmarks/norm_sweep.py)."""
    import triton

    block = triton.next_power_of_2(h)
    tuned = 4096 <= block <= 2 * LOOP_BLOCK  # the widths the sweeps measured
    if not tuned or t < LOOP_FROM[fused, block]:
        warps = min(max(block // 512, 4), 16)
        if tuned and t >= FEWER_WARPS_MIN_ROWS:
            warps = min(warps, 8)
        return False, {"BLOCK": block, "num_warps": warps, **STREAM_POLICIES[0]}
    steps = WEIGHT_FIRST_LAUNCH[fused, block]
    if t >= steps[0][0]:
        rblock, warps = next((r, w) for least, r, w in reversed(steps) if t >= least)
        return True, {"RBLOCK": rblock, "CHUNKS": triton.cdiv(h, rblock), "num_warps": warps, "WEIGHT_FIRST": True}
    rblock = min(block, LOOP_BLOCK)
    return True, {"RBLOCK": rblock, "CHUNKS": triton.cdiv(h, rblock), "num_warps": 8}


def rmsnorm(*, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    t, h = x.shape
    if t == 0:
        return
    kernels = _kernels()
    loop, options = _norm_launch(t, h, fused=False)
    kernel = kernels.rmsnorm_loop if loop else kernels.rmsnorm
    kernel[(t,)](x, weight, out, x.stride(0), out.stride(0), h, eps, **options)


def fused_add_rmsnorm(
    *, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    t, h = x.shape
    if t == 0:
        return
    kernels = _kernels()
    loop, options = _norm_launch(t, h, fused=True)
    kernel = kernels.fused_add_rmsnorm_loop if loop else kernels.fused_add_rmsnorm
    stride = residual.stride(0)  # the residual is written in place: its own output
    kernel[(t,)](x, residual, weight, out, residual, x.stride(0), stride, out.stride(0), stride, h, eps, **options)


def finalize(
    *, routed_output: torch.Tensor, expert_weights: torch.Tensor, permuted_indices: torch.Tensor, out: torch.Tensor
) -> None:
    """One program per token and block of columns, looping over the token's k entries (no host sync)."""
    (t, h), k = out.shape, permuted_indices.shape[1]
    if t == 0 or h == 0:
        return
    import triton

    block = min(triton.next_power_of_2(h), FINALIZE_BLOCK)
    _kernels().finalize[(t, triton.cdiv(h, block))](
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
