"""Rebinding by-value consumers: ``from x import f`` copies, default arguments and class attributes.

Patching the defining module alone leaves every module that copied the original holding the old
object (SGLang's entry points keep ``run_scheduler_process`` as an import, a default argument and
a ``staticmethod`` class attribute). This walks the loaded ``sglang`` modules once and replaces
each such reference to ``original`` with ``replacement``.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def _swap_defaults(fn: types.FunctionType, original: object, replacement: object) -> int:
    count = 0
    if fn.__defaults__ and any(d is original for d in fn.__defaults__):
        fn.__defaults__ = tuple(replacement if d is original else d for d in fn.__defaults__)
        count += 1
    if fn.__kwdefaults__ and any(d is original for d in fn.__kwdefaults__.values()):
        fn.__kwdefaults__ = {k: replacement if d is original else d for k, d in fn.__kwdefaults__.items()}
        count += 1
    return count


def _swap_class(cls: type, original: object, replacement: Any) -> int:
    count = 0
    for attr, raw in list(vars(cls).items()):
        if raw is original:
            setattr(cls, attr, replacement)
            count += 1
        elif isinstance(raw, staticmethod) and raw.__func__ is original:
            setattr(cls, attr, staticmethod(replacement))
            count += 1
        elif isinstance(raw, types.FunctionType):
            count += _swap_defaults(raw, original, replacement)
    return count


def rebind(original: object, replacement: Any, prefix: str = "sglang.") -> int:
    """Replace references to ``original`` held by loaded modules under ``prefix``; returns how many."""
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith(prefix) or name == prefix.rstrip(".")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                count += 1
            elif isinstance(value, types.FunctionType) and value.__module__ == name:
                count += _swap_defaults(value, original, replacement)
            elif isinstance(value, type) and value.__module__ == name:
                count += _swap_class(value, original, replacement)
    return count
