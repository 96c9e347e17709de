"""``collective.all_reduce`` at SGLang's ``GroupCoordinator.all_reduce``.

Every tensor-parallel all-reduce in SGLang 0.5.23 reaches this method by attribute lookup:
``tensor_model_parallel_all_reduce`` (imported by value in about thirty modules) is
``get_tp_group().all_reduce``, so patching the class covers every importer. The adapter serves only
the tensor-parallel group (attention-TP and MoE-TP are the same object under plain tensor
parallelism) with more than one rank, floating tensors and no CUDA graph capture in progress (the
ranks' route agreement cannot run inside a capture); anything else, and a route the ranks did not
agree on, runs SGLang's own ``all_reduce``. A CPU tensor is reduced in place, as SGLang's CPU path
does; elsewhere the result is a new tensor, as SGLang's out-of-place paths return.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import seam
from ..seams import SeamRow
from . import capturing, patch_method

SLOT = "collective.all_reduce"


def _rows(tensor: Any) -> Any:
    """``tensor`` as [t, h] rows over the same memory, or None."""
    if tensor.dim() == 0 or tensor.numel() == 0 or not tensor.is_floating_point():
        return None
    try:
        return tensor.view(-1, tensor.shape[-1])
    except RuntimeError:
        return None


def _is(group: Any, tp_group: Callable[[], Any]) -> bool:
    try:
        return group is tp_group()
    except Exception:  # parallel state not built (yet): not the tensor-parallel group
        return False


def make_adapter(original: Callable[..., Any], tp_group: Callable[[], Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def all_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
        if seam.STATE.sites is None or len(args) + len(kwargs) != 1 or self.world_size == 1:
            return original(self, *args, **kwargs)
        tensor = args[0] if args else kwargs.get("input_")
        if tensor is None or not _is(self, tp_group):
            return original(self, *args, **kwargs)
        rows = _rows(tensor)
        site = seam.site(SLOT)
        if rows is None or site is None or capturing(tensor):
            return original(self, *args, **kwargs)
        out = site(group=self.device_group, control_group=self.cpu_group, x=rows)
        if out is None:
            return original(self, *args, **kwargs)
        if tensor.is_cpu:
            rows.copy_(out)
            return tensor
        return out.view(tensor.shape)

    return all_reduce


def install(row: SeamRow, module: ModuleType) -> bool:
    return patch_method(
        module, row.target, lambda original, cls: make_adapter(original, module.get_tp_group), "all_reduce"
    )
