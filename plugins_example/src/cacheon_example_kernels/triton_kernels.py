"""Triton variants: one program per row (per row and column block for the MoE finalize), float32
accumulation, rows may be padded (row stride).

Triton is imported lazily, so the plugin loads (and its torch variants serve) where Triton is not
installed; ``supports`` then says no.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

from cacheon_core import CallDescriptor

MAX_BLOCK = 65536
FINALIZE_BLOCK = 1024  # columns per program of the MoE finalize: rows of any width are tiled


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def supports(descriptor: CallDescriptor) -> bool:
    """CUDA devices with Triton installed; the CPU only under Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    ok_device = descriptor.device.startswith("cuda") or (descriptor.device == "cpu" and _interpreting())
    return ok_device and descriptor.dims["h"] <= MAX_BLOCK


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl

    # Both norms issue every load of a row (the weight included) before the reduction and use rsqrt: the
    # weight's load then overlaps the row's instead of following the sum, which the small T (a few
    # microseconds a call) pays for (benchmarks/norm_sweep.py --graphs). Row offsets are 64-bit, so a
    # tensor past 2**31 elements is addressed right.
    @triton.jit
    def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, x_row, out_row, h, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / h + eps)
        tl.store(out_ptr + row * out_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def fused_add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, x_row, r_row, out_row, h, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < h
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        s = x + r
        tl.store(r_ptr + row * r_row + cols, s.to(r_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / h + eps)
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

    return rmsnorm_kernel, fused_add_rmsnorm_kernel, finalize_kernel


def _launch_args(h: int) -> dict[str, int]:
    import triton

    block = triton.next_power_of_2(h)
    # 8 warps per 4096-wide row, 16 from 8192 (measured on an H200: benchmarks/norm_gpu.py)
    return {"BLOCK": block, "num_warps": min(max(block // 512, 4), 16)}


def rmsnorm(*, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    t, h = x.shape
    if t == 0:
        return
    kernel, _, _ = _kernels()
    kernel[(t,)](x, weight, out, x.stride(0), out.stride(0), h, eps, **_launch_args(h))


def fused_add_rmsnorm(
    *, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    t, h = x.shape
    if t == 0:
        return
    _, kernel, _ = _kernels()
    kernel[(t,)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), h, eps, **_launch_args(h))


def finalize(
    *, routed_output: torch.Tensor, expert_weights: torch.Tensor, permuted_indices: torch.Tensor, out: torch.Tensor
) -> None:
    """One program per token and block of columns, looping over the token's k entries (no host sync)."""
    (t, h), k = out.shape, permuted_indices.shape[1]
    if t == 0 or h == 0:
        return
    import triton

    _, _, kernel = _kernels()
    block = min(triton.next_power_of_2(h), FINALIZE_BLOCK)
    kernel[(t, triton.cdiv(h, block))](
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
