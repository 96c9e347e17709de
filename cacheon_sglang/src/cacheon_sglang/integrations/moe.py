"""``moe.fused_experts`` at SGLang's ``UnquantizedFusedMoEMethod.apply``.

``apply`` is where both unquantized paths start: ``forward_cpu`` (``moe_forward_native``, or the
AMX kernel) and ``forward_cuda`` (``MoeRunner`` and the Triton ``fused_experts``, or FlashInfer,
DeepGEMM, triton_kernels). The adapter serves only what the slot means, SwiGLU experts over
unquantized weights in SGLang's ``[e, 2i, h]`` / ``[e, h, i]`` layout with standard top-k routing,
every expert local, combined with the router weights and nothing else; anything else runs SGLang's
own ``apply``: no call site (not a scheduler), torch.compile mode, another dispatch or top-k format,
pre-quantized input, biases, a fused or interleaved swiglu, another activation, router weights on
the input, no combine, a routed scaling factor other than 1, a runner backend other than Triton,
repacked (AMX, aiter) or transposed (triton_kernels) weights, expert parallelism, or no eligible
candidate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import seam
from ..seams import SeamRow
from . import bind, patch_method

SLOT = "moe.fused_experts"


@functools.cache
def _formats() -> tuple[Any, Any, Any]:
    # Imported on first call: the row installs while SGLang is still importing its MoE modules.
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput, StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardDispatchOutput, StandardTopKOutput, StandardCombineInput


def _method_serves(method: Any) -> bool:
    if method.is_torch_compile or method.with_bias or method.w13_swiglu_interleaved:
        return False
    if method.use_triton_kernels or method.use_flashinfer_trtllm_moe or method.use_deep_gemm:
        return False
    if method.use_flashinfer_cutlass or getattr(method, "_aiter_runner", None) is not None:
        return False  # these load or shuffle the expert weights into their own layouts
    runner = method.runner
    return runner is None or bool(runner.runner_backend.is_triton())


def _config_serves(config: Any) -> bool:
    return (
        config.activation == "silu"
        and config.is_gated
        and not config.apply_router_weight_on_input
        and not config.no_combine
        and config.routed_scaling_factor in (None, 1.0)
        and config.gemm1_alpha is None
        and config.gemm1_clamp_limit is None
        and config.swiglu_limit is None
    )


def _layer_serves(layer: Any, hidden_states: Any) -> bool:
    if getattr(layer, "use_intel_amx_backend", False) or getattr(layer, "moe_ep_size", 1) != 1:
        return False
    if getattr(layer, "w13_weight_bias", None) is not None or getattr(layer, "w2_weight_bias", None) is not None:
        return False
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if w13 is None or w2 is None or w13.dim() != 3 or w2.dim() != 3 or hidden_states.dim() != 2:
        return False
    experts = w13.shape[0]
    return bool(layer.num_experts == layer.num_local_experts == experts == w2.shape[0])


def make_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        if seam.STATE.sites is None:
            return original(self, *args, **kwargs)
        try:
            layer, dispatch_output = _arguments(args, kwargs)
        except TypeError:
            return original(self, *args, **kwargs)
        dispatch_type, topk_type, combine_type = _formats()
        if type(dispatch_output) is not dispatch_type or type(dispatch_output.topk_output) is not topk_type:
            return original(self, *args, **kwargs)
        if dispatch_output.hidden_states_scale is not None or dispatch_output.hidden_states_pre_quant is not None:
            return original(self, *args, **kwargs)
        x = dispatch_output.hidden_states
        config = getattr(self, "moe_runner_config", None)
        if config is None or not (_method_serves(self) and _config_serves(config) and _layer_serves(layer, x)):
            return original(self, *args, **kwargs)
        site = seam.site(SLOT)
        topk = dispatch_output.topk_output
        out = (
            None
            if site is None
            else site.call(
                hidden_states=x,
                w13=layer.w13_weight,
                w2=layer.w2_weight,
                topk_weights=topk.topk_weights,
                topk_ids=topk.topk_ids,
            )
        )
        if out is None:
            return original(self, *args, **kwargs)
        return combine_type(hidden_states=out)

    return apply


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(layer, dispatch_output) as ``apply(self, layer, dispatch_output)`` binds them."""
    bound = bind(("layer", "dispatch_output"), args, kwargs)
    if bound is None or len(bound) != 2:
        raise TypeError("not apply's signature")
    return bound["layer"], bound["dispatch_output"]


def install(row: SeamRow, module: ModuleType) -> bool:
    return patch_method(module, row.target, lambda original, cls: make_adapter(original), "apply")
