"""A plugin whose variant cannot be called with the ABI's keywords."""

from cacheon_core import Variant, hookimpl


def rmsnorm(x, weight, eps, out, /):
    out.copy_(x)


@hookimpl
def cacheon_variants():
    return [Variant(slot="norm.rmsnorm", name="positional", impl=rmsnorm)]
