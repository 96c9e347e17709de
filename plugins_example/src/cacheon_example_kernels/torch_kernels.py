"""Pure torch variants: run anywhere torch runs. Outputs are written in place; nothing is returned.

``x.float()`` is ``x`` itself when x is already float32, so nothing here computes in place on it.
The collective variants receive ``group``, a ``torch.distributed`` process group, and sum over its ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def rmsnorm(*, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    xf = x.float()
    inv = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True).add_(eps))
    out.copy_((xf * inv).mul_(weight.float()))


def decode(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Paged GQA decode over CSR-listed KV slots, vectorized as a segment softmax (no host sync)."""
    b, hq, d = q.shape
    group = hq // k_cache.shape[1]
    lengths = (kv_indptr[1:] - kv_indptr[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(b, device=q.device), lengths)  # sequence of each slot
    slots = kv_indices[: owner.numel()].long()
    k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [nnz, hq, d]
    v = v_cache[slots].float().repeat_interleave(group, dim=1)
    scores = (q.float()[owner] * k).sum(-1) * scale  # [nnz, hq]
    peak = torch.full((b, hq), float("-inf"), device=q.device).scatter_reduce(
        0, owner[:, None].expand(-1, hq), scores, "amax"
    )
    weights = (scores - peak[owner]).exp()
    total = torch.zeros(b, hq, device=q.device).index_add_(0, owner, weights)
    mixed = torch.zeros(b, hq, d, device=q.device).index_add_(0, owner, weights[..., None] * v)
    out.copy_(mixed / total[..., None])


def fused_add_rmsnorm(
    *, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    total = x.float() + residual.float()
    residual.copy_(total)
    inv = torch.rsqrt(total.square().mean(dim=-1, keepdim=True).add_(eps))
    out.copy_(total.mul_(inv).mul_(weight.float()))


def fused_experts(
    *,
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """SwiGLU experts in float32, one GEMM pair per expert over the tokens routed to it."""
    inter = w2.shape[2]
    x = hidden_states.float()
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_tokens = torch.arange(topk_ids.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1).float()
    routed = flat_ids >= 0  # negative ids are padded entries: they add nothing
    flat_ids, flat_tokens, flat_weights = flat_ids[routed], flat_tokens[routed], flat_weights[routed]
    order = flat_ids.argsort()
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync per call
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pick = order[start : start + count]
        start += count
        tokens = flat_tokens[pick]
        gate_up = x[tokens] @ w13[expert].float().T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        acc.index_add_(0, tokens, (act @ w2[expert].float().T) * flat_weights[pick, None])
    out.copy_(acc)


def finalize(
    *, routed_output: torch.Tensor, expert_weights: torch.Tensor, permuted_indices: torch.Tensor, out: torch.Tensor
) -> None:
    """Weighted gather-sum of each token's rows of the expert GEMM's output, in float32."""
    valid = permuted_indices >= 0  # a negative index is a padded entry: it adds nothing
    rows = routed_output[permuted_indices.long().clamp(min=0)].float()  # [t, k, h]
    weights = torch.where(valid, expert_weights.float(), 0.0)
    out.copy_(torch.einsum("tkh,tk->th", rows, weights))


def _sum_over(total: torch.Tensor, group: Any) -> None:
    """Sums ``total`` over the ranks of ``group`` in place; a group of one rank leaves it as it is."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)


def all_reduce(*, x: torch.Tensor, out: torch.Tensor, group: Any) -> None:
    out.copy_(x)  # reduced in the output, never in x
    _sum_over(out, group)


def allreduce_add_rmsnorm(
    *,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    group: Any,
) -> None:
    # A dense copy even when x is float32: x is not written, and the reduction needs dense memory.
    total = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    _sum_over(total, group)
    total.add_(residual.float())
    residual_out.copy_(total)
    inv = torch.rsqrt(total.square().mean(dim=-1, keepdim=True).add_(eps))
    out.copy_(total.mul_(inv).mul_(weight.float()))
