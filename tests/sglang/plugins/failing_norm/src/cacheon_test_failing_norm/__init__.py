"""Variants that fail after selection: for the strict and lenient policy tests, and collective
variants whose fault ``CACHEON_TEST_COLLECTIVE_FAULT`` chooses (unset: never eligible):
``raise_on_rank_1`` fails on rank 1 only, after the ranks agreed; ``supports_rank_0`` is eligible
on rank 0 only, so the ranks disagree."""

import os

from cacheon_core import Variant, hookimpl


def rmsnorm(*, x, weight, eps, out):
    raise RuntimeError("failing_rmsnorm: kernel launch failed")


def fused_add_rmsnorm(*, x, residual, weight, eps, out):
    residual.mul_(3.0)  # a half-done in-place update, then the failure
    raise RuntimeError("failing_fused: kernel launch failed")


def _fault():
    return os.environ.get("CACHEON_TEST_COLLECTIVE_FAULT", "")


def all_reduce(*, x, out, group):
    import torch.distributed as dist

    if _fault() == "raise_on_rank_1" and dist.get_rank(group) == 1:
        raise RuntimeError("failing_all_reduce: rank-local fault")
    out.copy_(x)
    dist.all_reduce(out, group=group)  # the other rank waits here when its peer has failed


def all_reduce_supports(descriptor):
    if _fault() == "supports_rank_0":
        return descriptor.topology.tp_rank == 0
    return _fault() == "raise_on_rank_1"


@hookimpl
def cacheon_variants():
    return [
        Variant(slot="norm.rmsnorm", name="failing_rmsnorm", impl=rmsnorm, priority=100),
        Variant(slot="norm.fused_add_rmsnorm", name="failing_fused", impl=fused_add_rmsnorm, priority=100),
        Variant(
            slot="collective.all_reduce",
            name="failing_all_reduce",
            impl=all_reduce,
            supports=all_reduce_supports,
            priority=100,
        ),
    ]
