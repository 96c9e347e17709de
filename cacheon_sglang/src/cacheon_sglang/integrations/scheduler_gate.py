"""The scheduler gate: a process that enters ``run_scheduler_process`` becomes a scheduler.

The wrapper keeps the original's name and module, so a parent pickling the target for a spawned
child sends a reference the child resolves to its own (wrapped) copy. Every by-value copy SGLang
holds (imports, default arguments, ``Engine.run_scheduler_process_func``) is rebound.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from .. import seam
from ..rebind import rebind
from ..seams import SeamRow

MARK = "__cacheon_gate__"


def install(row: SeamRow, module: ModuleType) -> bool:
    original = getattr(module, row.target)
    if getattr(original, MARK, False):
        return True
    signature = inspect.signature(original)

    @functools.wraps(original)
    def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        server_args = bound.get("server_args")
        seam.enter_scheduler(
            tp_rank=int(bound.get("tp_rank") or 0),
            tp_size=int(getattr(server_args, "tp_size", 1) or 1),
            dp_rank=bound.get("dp_rank"),
        )
        return original(*args, **kwargs)

    setattr(run_scheduler_process, MARK, True)
    setattr(module, row.target, run_scheduler_process)
    rebind(original, run_scheduler_process)
    return True


def original_code() -> Any:
    """The code object of SGLang's own ``run_scheduler_process`` (wrapped or not), for stack checks."""
    import sys

    module = sys.modules.get("sglang.srt.managers.scheduler")
    if module is None:
        return None
    fn = getattr(module, "run_scheduler_process", None)
    fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__code__", None)
