"""The one adapter table for SGLang 0.5.23.

Every other part of the seam derives from ``SEAM_ADAPTERS``: the modules the startup bootstrap
watches, the integrations activation installs, the compatibility canary's rows, the binding
vocabulary and its environment gates, and the chokepoints ``cacheon slots`` reports. Adding an
adapter is one row here plus its integration and tests. Review every row when the pin moves.

This module is data only: it imports neither torch nor sglang (the bootstrap reads it in every
Python process of the environment).
"""

from __future__ import annotations

import attrs

SGLANG_PIN = "0.5.23"


@attrs.frozen
class SeamRow:
    """One pinned chokepoint.

    ``module`` and ``target`` (a qualified name inside it) locate what the row relies on, and
    ``signature`` records its parameter names as reviewed at the pin; the canary checks both.
    ``integration`` is the module whose ``install(row, module)`` patches it. ``binding`` is the
    public identifier whose gate arms the row; ``default_on`` rows are armed when the launch
    environment sets no gate at all. ``consumers`` are modules holding by-value copies of the
    target that the integration rebinds. ``requires`` names packages an optional row needs:
    without them the row is unassessable, never "pass". Rows naming the same ``joint`` set are one
    semantic path: activation installs all of them or none (a set with a row that cannot be
    installed is refused as a whole, every row reported failed).
    """

    name: str
    binding: str
    slots: tuple[str, ...]
    module: str
    target: str
    signature: tuple[str, ...]
    integration: str
    default_on: bool = False
    requires: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()
    joint: str = ""


SEAM_ADAPTERS: tuple[SeamRow, ...] = (
    SeamRow(
        name="scheduler_gate",
        binding="scheduler_gate",
        slots=(),
        module="sglang.srt.managers.scheduler",
        target="run_scheduler_process",
        signature=(
            "server_args",
            "port_args",
            "gpu_id",
            "tp_rank",
            "pp_rank",
            "dp_rank",
            "pipe_writer",
            "display_tp_rank",
            "display_dp_rank",
            "display_moe_ep_rank",
        ),
        integration="cacheon_sglang.integrations.scheduler_gate",
        default_on=True,
        consumers=(
            "sglang.srt.entrypoints.engine",
            "sglang.srt.entrypoints.http_server",
            "sglang.srt.managers.data_parallel_controller",
            "sglang.srt.ray.http_server",
        ),
    ),
    SeamRow(
        name="rmsnorm",
        binding="norm",
        slots=("norm.rmsnorm", "norm.fused_add_rmsnorm"),
        module="sglang.srt.layers.layernorm",
        target="RMSNorm.forward_native",
        signature=("self", "x", "residual", "post_residual_addition", "quant_linear"),
        integration="cacheon_sglang.integrations.norm",
        default_on=True,
    ),
    SeamRow(
        name="gemma_rmsnorm",
        binding="norm",
        slots=("norm.rmsnorm", "norm.fused_add_rmsnorm"),
        module="sglang.srt.layers.layernorm",
        target="GemmaRMSNorm.forward_native",
        signature=("self", "x", "residual", "post_residual_addition"),
        integration="cacheon_sglang.integrations.norm",
        default_on=True,
    ),
    SeamRow(
        name="fused_moe",
        binding="moe",
        slots=("moe.fused_experts",),
        module="sglang.srt.layers.quantization.unquant",
        # The one method both of SGLang's unquantized paths pass: forward_cpu (moe_forward_native)
        # and forward_cuda (MoeRunner, fused_experts). FusedMoE.run_moe_core looks it up per call.
        target="UnquantizedFusedMoEMethod.apply",
        signature=("self", "layer", "dispatch_output"),
        integration="cacheon_sglang.integrations.moe",
    ),
    SeamRow(
        name="tp_all_reduce",
        binding="collective",
        slots=("collective.all_reduce",),
        module="sglang.srt.distributed.parallel_state",
        # tensor_model_parallel_all_reduce, imported by value across SGLang, is get_tp_group().all_reduce:
        # the class attribute is looked up per call, so the one patch covers every importer.
        target="GroupCoordinator.all_reduce",
        signature=("self", "input_"),
        integration="cacheon_sglang.integrations.collective",
    ),
    SeamRow(
        name="rmsnorm_arfusion",
        binding="arfusion",
        slots=("arfusion.allreduce_add_rmsnorm",),
        module="sglang.srt.layers.layernorm",
        # Reached by SGLang's layer-boundary fusions only with FlashInfer on SM90/SM100, or aiter on
        # ROCm: never in SGLang's own flow on a CPU host.
        target="RMSNorm.forward_with_allreduce_fusion",
        signature=("self", "x", "residual", "post_residual_addition", "use_attn_tp_group"),
        integration="cacheon_sglang.integrations.arfusion",
    ),
    SeamRow(
        name="gemma_rmsnorm_arfusion",
        binding="arfusion",
        slots=("arfusion.allreduce_add_rmsnorm",),
        module="sglang.srt.layers.layernorm",
        target="GemmaRMSNorm.forward_with_allreduce_fusion",
        signature=("self", "x", "residual", "post_residual_addition", "use_attn_tp_group"),
        integration="cacheon_sglang.integrations.arfusion",
    ),
    # The deep MoE epilogue: three points of one path, installed together or not at all. SGLang 0.5.23
    # defers a MoE finalize only with FlashInfer's TRT-LLM MoE runner and the CustomAllReduceV2 push
    # plane (CUDA): never in its own flow on a CPU host.
    SeamRow(
        name="epilogue_defer_gate",
        binding="arfusion",
        slots=(),
        module="sglang.srt.layers.layer_boundary.fusions.custom_all_reduce_fusion",
        # Asked once per FFN exit of a layer that has fusions, before the FFN runs (ExitPolicy._decide).
        target="CustomAllReduceFusion.can_defer_finalize",
        signature=("self", "plan", "forward_batch"),
        integration="cacheon_sglang.integrations.epilogue",
        joint="deep_epilogue",
    ),
    SeamRow(
        name="epilogue_moe_export",
        binding="arfusion",
        slots=(),
        module="sglang.srt.layers.layer_boundary.fusions.moe_finalize",
        # Every model's deferred MoE (deepseek_v2, qwen2_moe, minimax_m3, mimo_v2) builds its handoff here.
        target="MoeDeferredFinalize.from_flashinfer",
        signature=("cls", "deferred_output", "gated_shared_output", "m", "reduce"),
        integration="cacheon_sglang.integrations.epilogue",
        joint="deep_epilogue",
    ),
    SeamRow(
        name="epilogue_consume",
        binding="arfusion",
        slots=("moe.finalize", "arfusion.allreduce_add_rmsnorm"),
        module="sglang.srt.layers.layer_boundary.fusions.custom_all_reduce_fusion",
        # The next attention input's fused finalize + all-reduce + residual add + norm.
        target="CustomAllReduceFusion._finalize_add_norm",
        signature=("self", "plan", "owed", "residual", "forward_batch", "post_residual_addition"),
        integration="cacheon_sglang.integrations.epilogue",
        joint="deep_epilogue",
    ),
    SeamRow(
        name="triton_decode",
        binding="attention_decode",
        slots=("attention.decode",),
        module="sglang.kernels.ops.attention.decode_attention",
        target="decode_attention_fwd",
        signature=(
            "q",
            "k_buffer",
            "v_buffer",
            "o",
            "kv_indptr",
            "kv_indices",
            "attn_logits",
            "attn_lse",
            "num_kv_splits",
            "max_kv_splits",
            "sm_scale",
            "k_scale",
            "v_scale",
            "logit_cap",
            "sinks",
            "xai_temperature_len",
            "has_mla",
            "use_pdl",
            "page_size",
            "score_mod",
            "aux_tensors",
            "enable_lean",
            "lean_Mp",
            "lean_Lp",
            "lean_Op",
            "lean_locks",
            "uneven_batch",
        ),
        integration="cacheon_sglang.integrations.attention",
        requires=("triton",),
        # TritonAttnBackend imports the kernel inside __init__ and binds it per instance, so the
        # defining symbol must be patched before the backend (and so the model runner) is built.
        consumers=("sglang.srt.layers.attention.triton_backend",),
    ),
)

ROWS_BY_NAME = {row.name: row for row in SEAM_ADAPTERS}
WATCHED_MODULES: frozenset[str] = frozenset(row.module for row in SEAM_ADAPTERS)
SEAM_BINDINGS: tuple[str, ...] = tuple(sorted({row.binding for row in SEAM_ADAPTERS}))
DEFAULT_BINDINGS: tuple[str, ...] = tuple(sorted({row.binding for row in SEAM_ADAPTERS if row.default_on}))
INTEGRATIONS: tuple[str, ...] = tuple(dict.fromkeys(row.integration for row in SEAM_ADAPTERS))


def rows_for(binding: str) -> tuple[SeamRow, ...]:
    return tuple(row for row in SEAM_ADAPTERS if row.binding == binding)


def joint_rows(joint: str) -> tuple[SeamRow, ...]:
    return tuple(row for row in SEAM_ADAPTERS if joint and row.joint == joint)
