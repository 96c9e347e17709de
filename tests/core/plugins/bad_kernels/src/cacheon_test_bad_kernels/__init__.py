"""A plugin whose variants have valid signatures but break the contract when they run."""

import torch

from cacheon_core import Variant, hookimpl


def _rms(x, weight, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def returns_new(*, x, weight, eps, out):
    return _rms(x, weight, eps).to(x.dtype)


def writes_nan(*, x, weight, eps, out):
    out.copy_(_rms(x, weight, eps))
    out[-1, -1] = float("nan")


def writes_x(*, x, weight, eps, out):
    out.copy_(_rms(x, weight, eps))
    x.mul_(0.5)


@hookimpl
def cacheon_variants():
    return [
        Variant(slot="norm.rmsnorm", name="bad_returns_new", impl=returns_new),
        Variant(slot="norm.rmsnorm", name="bad_writes_nan", impl=writes_nan),
        Variant(slot="norm.rmsnorm", name="bad_writes_x", impl=writes_x),
    ]
