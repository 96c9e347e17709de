"""``arfusion.allreduce_add_rmsnorm`` at ``RMSNorm`` / ``GemmaRMSNorm.forward_with_allreduce_fusion``.

SGLang 0.5.23 calls these from its layer-boundary fusions (``fused_attn_input`` /
``fused_ffn_input``) only where FlashInfer's all-reduce fusion applies (SM90/SM100 with FlashInfer)
or on ROCm with aiter: never in its own flow on a CPU host. The CPU tests call the method
directly, over SGLang's own parallel state. The adapter serves a call with a residual, no
post-residual addition, more than one rank in the group the method reduces over (attention-TP
when ``use_attn_tp_group``, which GemmaRMSNorm always passes; otherwise the post-experts
reduction group) and no CUDA graph capture in progress. It returns ``(out, new residual)``, the
residual it was given left as it was, as SGLang's fusion and its fallback both do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import seam
from ..seams import SeamRow
from . import bind, capturing, patch_method
from .norm import _weight

SLOT = "arfusion.allreduce_add_rmsnorm"
PARAMS = ("x", "residual", "post_residual_addition", "use_attn_tp_group")


def _group(use_attn_tp_group: bool) -> Any:
    if use_attn_tp_group:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        return get_attn_tp_group()
    from sglang.srt.layers.moe.utils import post_experts_reduction_group

    return post_experts_reduction_group()


def make_adapter(original: Callable[..., Any], gemma: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_with_allreduce_fusion(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = bind(PARAMS, args, kwargs) if seam.STATE.sites is not None else None
        if bound is None:
            return original(self, *args, **kwargs)
        x, residual = bound.get("x"), bound.get("residual")
        if x is None or residual is None or bound.get("post_residual_addition") is not None:
            return original(self, *args, **kwargs)
        group = _group(True if gemma else bool(bound.get("use_attn_tp_group", True)))
        site = seam.site(SLOT)
        if site is None or group.world_size == 1 or x.dim() != 2 or residual.shape != x.shape:
            return original(self, *args, **kwargs)
        if capturing(x):
            return original(self, *args, **kwargs)
        weight = _weight(self, gemma)  # the same declines as the norm adapter (quantized linear, overrides)
        if weight is None or self.is_torch_compile:
            return original(self, *args, **kwargs)
        result = site(
            group=group.device_group,
            control_group=group.cpu_group,
            x=x,
            residual=residual,
            weight=weight,
            eps=self.variance_epsilon,
        )
        if result is None:
            return original(self, *args, **kwargs)
        return result

    return forward_with_allreduce_fusion


def install(row: SeamRow, module: ModuleType) -> bool:
    return patch_method(
        module,
        row.target,
        lambda original, cls: make_adapter(original, gemma=cls.__name__ == "GemmaRMSNorm"),
        "forward_with_allreduce_fusion",
    )
