"""The ``cacheon`` entry point of this distribution: its hook implementations."""

from __future__ import annotations

from cacheon_core import Variant, hookimpl

from . import torch_kernels, triton_kernels


@hookimpl
def cacheon_variants() -> list[Variant]:
    return [
        Variant(slot="norm.rmsnorm", name="example_torch", impl=torch_kernels.rmsnorm, priority=1),
        Variant(
            slot="norm.fused_add_rmsnorm", name="example_torch_fused", impl=torch_kernels.fused_add_rmsnorm, priority=1
        ),
        Variant(slot="attention.decode", name="example_torch_decode", impl=torch_kernels.decode, priority=1),
        Variant(slot="moe.fused_experts", name="example_torch_experts", impl=torch_kernels.fused_experts, priority=1),
        Variant(
            slot="moe.finalize", name="example_torch_finalize", impl=torch_kernels.finalize, priority=1, slot_version=2
        ),
        Variant(
            slot="collective.all_reduce",
            name="example_torch_all_reduce",
            impl=torch_kernels.all_reduce,
            priority=1,
            slot_version=1,
        ),
        Variant(
            slot="arfusion.allreduce_add_rmsnorm",
            name="example_torch_arfusion",
            impl=torch_kernels.allreduce_add_rmsnorm,
            priority=1,
            slot_version=2,
        ),
        Variant(
            slot="norm.rmsnorm",
            name="example_triton",
            impl=triton_kernels.rmsnorm,
            supports=triton_kernels.supports,
            priority=10,
            graph_safe=True,
            verify_dims=triton_kernels.NORM_VERIFY_DIMS,
        ),
        Variant(
            slot="norm.fused_add_rmsnorm",
            name="example_triton_fused",
            impl=triton_kernels.fused_add_rmsnorm,
            supports=triton_kernels.supports,
            priority=10,
            graph_safe=True,
            verify_dims=triton_kernels.NORM_VERIFY_DIMS,
        ),
        Variant(
            slot="moe.finalize",
            name="example_triton_finalize",
            impl=triton_kernels.finalize,
            supports=triton_kernels.supports,
            priority=10,
            graph_safe=True,
            slot_version=2,
        ),
    ]
