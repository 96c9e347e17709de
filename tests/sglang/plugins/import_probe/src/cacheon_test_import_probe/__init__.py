"""Records, per process, that this candidate module was imported (CACHEON_TEST_PROBE_DIR)."""

import os

from cacheon_core import Variant, hookimpl

_probe = os.environ.get("CACHEON_TEST_PROBE_DIR")
if _probe:
    with open(os.path.join(_probe, f"imported-{os.getpid()}"), "w") as fh:
        fh.write("imported\n")


def rmsnorm(*, x, weight, eps, out):
    xf = x.float()
    out.copy_(xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight.float())


@hookimpl
def cacheon_variants():
    return [Variant(slot="norm.rmsnorm", name="probe_rmsnorm", impl=rmsnorm, priority=0)]
