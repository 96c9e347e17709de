"""``norm.rmsnorm`` and ``norm.fused_add_rmsnorm`` at SGLang's RMSNorm and GemmaRMSNorm.

Both classes inherit ``BaseFusedOp.forward``, which caches a per-instance forward target on first
call (``forward_cuda``, ``forward_cpu``...); an adapter on one platform method would miss the other
platforms, and one on ``RMSNorm`` alone would never reach a Gemma model. The adapter is therefore
each class's own ``forward``: it serves the plain and the residual path through the dispatcher and
falls through to SGLang's ``forward`` (and its cached target) for everything else: no call site
(not a scheduler), torch.compile mode, an explicit backend, post-residual additions, fused input
quantization, variance or dtype overrides, an fp32 residual, or no eligible candidate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import seam
from ..seams import SeamRow
from . import patch_method


def _weight(layer: Any, gemma: bool) -> Any:
    if gemma:
        # SGLang keeps weight + 1 in this buffer, refreshed whenever the weight is loaded.
        return layer.gemma_weight
    if (
        layer._quant_linear is not None
        or layer.variance_size_override is not None
        or layer.override_orig_dtype is not None
        or layer.fp32_residual
        or layer.cast_x_before_out_mul
    ):
        return None
    return layer.weight


def make_adapter(original: Callable[..., Any], gemma: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if seam.STATE.sites is None or kwargs or not args or self.is_torch_compile:
            return original(self, *args, **kwargs)
        if len(args) > 2 and any(a is not None for a in args[2:]):
            return original(self, *args, **kwargs)
        weight = _weight(self, gemma)
        if weight is None:
            return original(self, *args, **kwargs)
        x = args[0]
        residual = args[1] if len(args) > 1 else None
        hidden = x.shape[-1]
        try:
            rows = x.view(-1, hidden)
            residual_rows = residual.view(-1, hidden) if residual is not None else None
        except RuntimeError:  # not viewable as rows without a copy: leave it to SGLang
            return original(self, *args, **kwargs)
        eps = self.variance_epsilon
        if residual_rows is None:
            site = seam.site("norm.rmsnorm")
            out = None if site is None else site.call(x=rows, weight=weight, eps=eps)
            if out is None:
                return original(self, *args, **kwargs)
            return out.view(x.shape)
        site = seam.site("norm.fused_add_rmsnorm")
        out = None if site is None else site.call(x=rows, residual=residual_rows, weight=weight, eps=eps)
        if out is None:
            return original(self, *args, **kwargs)
        # SGLang's fused kernels update the residual in place and return both, as this does.
        return out.view(x.shape), residual

    return forward


def install(row: SeamRow, module: ModuleType) -> bool:
    return patch_method(
        module,
        row.target,
        lambda original, cls: make_adapter(original, gemma=cls.__name__ == "GemmaRMSNorm"),
        "forward",
    )
