"""Variants that fail after selection: for the strict and lenient policy tests."""

from cacheon_core import Variant, hookimpl


def rmsnorm(*, x, weight, eps, out):
    raise RuntimeError("failing_rmsnorm: kernel launch failed")


def fused_add_rmsnorm(*, x, residual, weight, eps, out):
    residual.mul_(3.0)  # a half-done in-place update, then the failure
    raise RuntimeError("failing_fused: kernel launch failed")


@hookimpl
def cacheon_variants():
    return [
        Variant(slot="norm.rmsnorm", name="failing_rmsnorm", impl=rmsnorm, priority=100),
        Variant(slot="norm.fused_add_rmsnorm", name="failing_fused", impl=fused_add_rmsnorm, priority=100),
    ]
