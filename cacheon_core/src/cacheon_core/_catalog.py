"""The built-in slot catalog and its trusted torch reference implementations.

A slot may exist here before any engine exposes a live chokepoint for it: ``cacheon slots`` tells
which slots have a seam adapter in an installed engine package and which have no live adapter.
References compute in float32 and write their outputs in place, like any variant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._hookspecs import hookimpl
from ._slots import ScalarSpec, SlotSpec, TensorSpec, Tolerance

FLOATS = ("float32", "float16", "bfloat16")
NORM_TOLERANCES = {
    "float32": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(1e-3, 1e-3),
    "bfloat16": Tolerance(1.6e-2, 1.6e-2),
}
ATTENTION_TOLERANCES = {
    "float32": Tolerance(1e-4, 1e-4),
    "float16": Tolerance(2e-3, 2e-3),
    "bfloat16": Tolerance(2e-2, 2e-2),
}

# SGLang's moe_forward_native rounds each GEMM and the activation to the input dtype; against this
# reference it needed atol = rtol = 1.4e-6 (fp32), 1.6e-3 (fp16), 1.13e-2 (bf16) over the sampler's
# inputs (t <= 64, h <= 1024, k <= 8, 20 seeds each). These leave about twice that room.
FUSED_EXPERTS_TOLERANCES = {
    "float32": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(4e-3, 4e-3),
    "bfloat16": Tolerance(2.5e-2, 2.5e-2),
}


def _rms(x: Any, weight: Any, eps: float) -> Any:
    import torch

    variance = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight.float()


def rmsnorm_reference(*, x: Any, weight: Any, eps: float, out: Any) -> None:
    out.copy_(_rms(x.float(), weight, eps))


def fused_add_rmsnorm_reference(*, x: Any, residual: Any, weight: Any, eps: float, out: Any) -> None:
    total = x.float() + residual.float()
    residual.copy_(total)
    out.copy_(_rms(total, weight, eps))


def _group_sum(x: Any, group: Any) -> Any:
    """x summed over the ranks of ``group`` in float32, by torch.distributed itself (the trusted sum)."""
    import torch.distributed as dist

    total = x.float().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def all_reduce_reference(*, x: Any, out: Any, group: Any) -> None:
    out.copy_(_group_sum(x, group))


def allreduce_add_rmsnorm_reference(
    *, x: Any, residual: Any, weight: Any, eps: float, out: Any, residual_out: Any, group: Any
) -> None:
    # SGLang 0.5.23 (the FlashInfer fusion and its fallback alike) returns the new residual as a
    # fresh tensor; the residual it was given is left as it was.
    total = _group_sum(x, group) + residual.float()
    residual_out.copy_(total)
    out.copy_(_rms(total, weight, eps))


def _gqa_attend(q: Any, k: Any, v: Any, scale: float) -> Any:
    """q [HQ, D], k/v [L, HKV, D] -> [HQ, D], softmax in float32."""
    import torch

    group = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.float(), k) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)


def decode_reference(
    *, q: Any, k_cache: Any, v_cache: Any, kv_indptr: Any, kv_indices: Any, scale: float, out: Any
) -> None:
    for b in range(q.shape[0]):
        slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        out[b].copy_(_gqa_attend(q[b], k_cache[slots], v_cache[slots], scale))


def decode_sampler(dims: Mapping[str, int], dtype: str, device: str, generator: Any) -> dict[str, Any]:
    import torch

    dt = getattr(torch, dtype)
    b, hq, d, ns, hkv, nnz = dims["b"], dims["hq"], dims["d"], dims["ns"], dims["hkv"], dims["nnz"]
    rand = {"generator": generator, "device": device}
    # Split nnz tokens into b non-empty sequences; every token sits in its own slot of the pool.
    cuts = torch.randperm(nnz - 1, generator=generator, device=device)[: b - 1].add(1).sort().values
    bounds = torch.cat(
        [
            torch.zeros(1, dtype=torch.int64, device=device),
            cuts,
            torch.full((1,), nnz, dtype=torch.int64, device=device),
        ]
    )
    return {
        "q": torch.randn(b, hq, d, dtype=dt, **rand),
        "k_cache": torch.randn(ns, hkv, d, dtype=dt, **rand),
        "v_cache": torch.randn(ns, hkv, d, dtype=dt, **rand),
        "kv_indptr": bounds.to(torch.int32),
        "kv_indices": torch.randperm(ns, generator=generator, device=device)[:nnz].to(torch.int32),
    }


def decode_rule(dims: Mapping[str, int]) -> str | None:
    if dims["hkv"] == 0 or dims["hq"] % dims["hkv"]:
        return f"query heads hq={dims['hq']} must be a multiple of kv heads hkv={dims['hkv']}"
    if "b1" in dims and dims["b1"] != dims["b"] + 1:
        return f"kv_indptr has {dims['b1']} entries, a batch of b={dims['b']} needs b+1={dims['b'] + 1}"
    return None


def msa_block_score_reference(*, q: Any, block_keys: Any, scale: float, out: Any) -> None:
    import torch

    group = q.shape[1] // block_keys.shape[2]
    keys = block_keys.float().repeat_interleave(group, dim=2)  # [B, NBLK, HQ, D]
    out.copy_(torch.einsum("bhd,bnhd->bhn", q.float(), keys) * scale)


def fused_experts_reference(
    *, hidden_states: Any, w13: Any, w2: Any, topk_weights: Any, topk_ids: Any, out: Any
) -> None:
    import torch

    # A negative id is a padded token's entry (SGLang's top-k masks padded rows with -1): it adds nothing.
    valid = topk_ids >= 0
    ids = topk_ids.long().clamp(min=0)
    inter = w2.shape[2]
    gate_up = torch.einsum("th,tknh->tkn", hidden_states.float(), w13.float()[ids])  # [t, k, 2i]
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    expert_out = torch.einsum("tki,tkhi->tkh", act, w2.float()[ids])
    weights = torch.where(valid, topk_weights.float(), 0.0)
    out.copy_((expert_out * weights.unsqueeze(-1)).sum(dim=1))


def fused_experts_sampler(dims: Mapping[str, int], dtype: str, device: str, generator: Any) -> dict[str, Any]:
    import torch

    dt = getattr(torch, dtype)
    t, h, e, n2, i, k = dims["t"], dims["h"], dims["e"], dims["n2"], dims["i"], dims["k"]
    rand = {"generator": generator, "device": device}
    # A router's output: k distinct experts per token, weights normalised over them; with t > 2 the
    # last token is padding, its ids -1 as SGLang's top-k masks padded rows.
    ids = torch.rand(t, e, **rand).argsort(dim=-1)[:, :k].to(torch.int32)
    if t > 2:
        ids[-1] = -1
    # Weights scaled like a trained layer's (unit-variance activations), so every dtype stays in range.
    return {
        "hidden_states": torch.randn(t, h, **rand).to(dt),
        "w13": (torch.randn(e, n2, h, **rand) / h**0.5).to(dt),
        "w2": (torch.randn(e, h, i, **rand) / i**0.5).to(dt),
        "topk_weights": torch.softmax(torch.randn(t, k, **rand), dim=-1),
        "topk_ids": ids,
    }


def fused_experts_rule(dims: Mapping[str, int]) -> str | None:
    if dims["n2"] != 2 * dims["i"]:
        return f"w13 has n2={dims['n2']} rows per expert, gate and up of i={dims['i']} need 2*i={2 * dims['i']}"
    if dims["k"] > dims["e"]:
        return f"top-k={dims['k']} exceeds the e={dims['e']} experts"
    return None


def moe_finalize_reference(*, routed_output: Any, expert_weights: Any, permuted_indices: Any, out: Any) -> None:
    import torch

    rows = routed_output.float()[permuted_indices.long().clamp(min=0)]  # [t, k, h]
    weights = torch.where(permuted_indices >= 0, expert_weights.float(), 0.0)
    out.copy_((rows * weights.unsqueeze(-1)).sum(dim=1))


def moe_finalize_sampler(dims: Mapping[str, int], dtype: str, device: str, generator: Any) -> dict[str, Any]:
    import torch

    t, k, p, h = dims["t"], dims["k"], dims["p"], dims["h"]
    rand = {"generator": generator, "device": device}
    # Every (token, k) entry names its own row of the expert GEMM's output (a permutation of the
    # p >= t*k rows); with t > 2 the last token is padding (-1: adds nothing).
    indices = torch.randperm(p, **rand)[: t * k].view(t, k).to(torch.int32)
    if t > 2:
        indices[-1] = -1
    return {
        "routed_output": torch.randn(p, h, **rand).to(getattr(torch, dtype)),
        # bf16 weights with bf16 rows, as SGLang's FlashInfer handoff carries them; float32 otherwise
        "expert_weights": torch.softmax(torch.randn(t, k, **rand), dim=-1).to(
            torch.bfloat16 if dtype == "bfloat16" else torch.float32
        ),
        "permuted_indices": indices,
    }


def moe_finalize_rule(dims: Mapping[str, int]) -> str | None:
    if dims["p"] < dims["t"] * dims["k"]:
        return f"routed_output has p={dims['p']} rows, fewer than the t*k={dims['t'] * dims['k']} routed entries"
    return None


_NORM_INPUTS = (
    TensorSpec("x", ("t", "h"), FLOATS, layout="rows", dynamic=True),
    TensorSpec("weight", ("h",), FLOATS),
)
_NORM_DIMS = ({"t": 1, "h": 128}, {"t": 7, "h": 1000}, {"t": 33, "h": 4096})
_FUSED_INPUTS = (
    TensorSpec("x", ("t", "h"), FLOATS, layout="rows", dynamic=True),
    TensorSpec("residual", ("t", "h"), FLOATS, layout="rows", dynamic=True, written=True),
    TensorSpec("weight", ("h",), FLOATS),
)
_EPS = ScalarSpec("eps", "float", 1e-6)

RMSNORM = SlotSpec(
    id="norm.rmsnorm",
    version=1,
    summary="out = x * rsqrt(mean(x^2, -1) + eps) * weight, computed in float32",
    inputs=_NORM_INPUTS,
    outputs=(TensorSpec("out", ("t", "h"), same_dtype_as="x"),),
    scalars=(_EPS,),
    reference=rmsnorm_reference,
    tolerances=NORM_TOLERANCES,
    verify_dims=_NORM_DIMS,
)

FUSED_ADD_RMSNORM = SlotSpec(
    id="norm.fused_add_rmsnorm",
    version=1,
    summary="residual <- x + residual (in place); out = rmsnorm(x + residual) * weight",
    inputs=_FUSED_INPUTS,
    outputs=(TensorSpec("out", ("t", "h"), same_dtype_as="x"),),
    scalars=(_EPS,),
    reference=fused_add_rmsnorm_reference,
    tolerances=NORM_TOLERANCES,
    verify_dims=_NORM_DIMS,
)

ATTENTION_DECODE = SlotSpec(
    id="attention.decode",
    version=1,
    summary="paged decode attention (GQA): one query token per sequence over its KV slots, listed in CSR form",
    inputs=(
        TensorSpec("q", ("b", "hq", "d"), FLOATS, layout="rows", dynamic=True),
        TensorSpec("k_cache", ("ns", "hkv", "d"), FLOATS, layout="rows"),
        TensorSpec("v_cache", ("ns", "hkv", "d"), FLOATS, layout="rows"),
        TensorSpec("kv_indptr", ("b1",), ("int32", "int64"), dynamic=True),
        TensorSpec("kv_indices", ("nnz",), ("int32", "int64"), dynamic=True),
    ),
    outputs=(TensorSpec("out", ("b", "hq", "d"), same_dtype_as="q"),),
    scalars=(ScalarSpec("scale", "float", example=0.125),),
    reference=decode_reference,
    tolerances=ATTENTION_TOLERANCES,
    verify_dims=(
        {"b": 2, "hq": 4, "d": 64, "ns": 96, "hkv": 4, "b1": 3, "nnz": 40},
        {"b": 3, "hq": 8, "d": 128, "ns": 256, "hkv": 2, "b1": 4, "nnz": 200},
    ),
    sampler=decode_sampler,
    dims_rule=decode_rule,
)

MSA_BLOCK_SCORE = SlotSpec(
    id="attention.msa_block_score",
    version=1,
    summary="block-sparse attention selection: score of every KV block summary for each query head",
    inputs=(
        TensorSpec("q", ("b", "hq", "d"), FLOATS, layout="rows", dynamic=True),
        TensorSpec("block_keys", ("b", "nblk", "hkv", "d"), FLOATS, dynamic=True),
    ),
    outputs=(TensorSpec("out", ("b", "hq", "nblk"), ("float32",)),),
    scalars=(ScalarSpec("scale", "float", example=0.125),),
    reference=msa_block_score_reference,
    tolerances=ATTENTION_TOLERANCES,
    verify_dims=({"b": 2, "hq": 8, "d": 64, "nblk": 16, "hkv": 2},),
    dims_rule=decode_rule,
)

MOE_FINALIZE = SlotSpec(
    id="moe.finalize",
    version=2,
    summary=(
        "MoE finalize from the expert GEMM's permuted rows (SGLang 0.5.23's deferred-finalize handoff): "
        "out[t] = sum_k expert_weights[t, k] * routed_output[permuted_indices[t, k]]; a negative index adds nothing"
    ),
    inputs=(
        TensorSpec("routed_output", ("p", "h"), FLOATS, layout="rows", dynamic=True),
        TensorSpec("expert_weights", ("t", "k"), ("float32", "bfloat16"), dynamic=True),
        TensorSpec("permuted_indices", ("t", "k"), ("int32",), dynamic=True),
    ),
    outputs=(TensorSpec("out", ("t", "h"), same_dtype_as="routed_output"),),
    reference=moe_finalize_reference,
    tolerances=ATTENTION_TOLERANCES,
    verify_dims=({"t": 5, "k": 2, "p": 12, "h": 256}, {"t": 64, "k": 8, "p": 512, "h": 512}),
    sampler=moe_finalize_sampler,
    dims_rule=moe_finalize_rule,
)

ALL_REDUCE = SlotSpec(
    id="collective.all_reduce",
    version=1,
    summary="tensor-parallel all-reduce: out = the sum of x over the ranks of group",
    inputs=(TensorSpec("x", ("t", "h"), FLOATS, layout="rows", dynamic=True),),
    outputs=(TensorSpec("out", ("t", "h"), same_dtype_as="x"),),
    reference=all_reduce_reference,
    tolerances=NORM_TOLERANCES,
    verify_dims=({"t": 1, "h": 128}, {"t": 33, "h": 1000}),
    collective=True,
)

FUSED_EXPERTS = SlotSpec(
    id="moe.fused_experts",
    version=1,
    summary=(
        "unquantized SwiGLU experts, routed and combined: "
        "out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(gate) * up), [gate; up] = w13[e] @ x[t], "
        "e = topk_ids[t, k]; a negative id (a padded entry) adds nothing"
    ),
    inputs=(
        TensorSpec("hidden_states", ("t", "h"), FLOATS, layout="rows", dynamic=True),
        TensorSpec("w13", ("e", "n2", "h"), FLOATS),
        TensorSpec("w2", ("e", "h", "i"), FLOATS),
        TensorSpec("topk_weights", ("t", "k"), ("float32",), dynamic=True),
        TensorSpec("topk_ids", ("t", "k"), ("int32", "int64"), dynamic=True),
    ),
    outputs=(TensorSpec("out", ("t", "h"), same_dtype_as="hidden_states"),),
    reference=fused_experts_reference,
    tolerances=FUSED_EXPERTS_TOLERANCES,
    verify_dims=(
        {"t": 5, "h": 64, "e": 8, "n2": 64, "i": 32, "k": 2},
        {"t": 33, "h": 256, "e": 16, "n2": 256, "i": 128, "k": 4},
    ),
    sampler=fused_experts_sampler,
    dims_rule=fused_experts_rule,
)

ARFUSION = SlotSpec(
    id="arfusion.allreduce_add_rmsnorm",
    version=2,
    summary=(
        "all-reduce fused with residual add and RMSNorm (SGLang 0.5.23's forward_with_allreduce_fusion): "
        "residual_out = sum of x over group + residual; out = rmsnorm(residual_out) * weight; residual is not written"
    ),
    inputs=(
        TensorSpec("x", ("t", "h"), FLOATS, layout="rows", dynamic=True),
        TensorSpec("residual", ("t", "h"), FLOATS, layout="rows", dynamic=True),
        TensorSpec("weight", ("h",), FLOATS),
    ),
    outputs=(
        TensorSpec("out", ("t", "h"), same_dtype_as="x"),
        TensorSpec("residual_out", ("t", "h"), same_dtype_as="residual"),
    ),
    scalars=(_EPS,),
    reference=allreduce_add_rmsnorm_reference,
    tolerances=NORM_TOLERANCES,
    verify_dims=({"t": 1, "h": 128}, {"t": 33, "h": 1000}),
    collective=True,
)

BUILTIN_SLOTS = (
    RMSNORM,
    FUSED_ADD_RMSNORM,
    ATTENTION_DECODE,
    MSA_BLOCK_SCORE,
    FUSED_EXPERTS,
    MOE_FINALIZE,
    ALL_REDUCE,
    ARFUSION,
)


@hookimpl
def cacheon_slots() -> tuple[SlotSpec, ...]:
    return BUILTIN_SLOTS
