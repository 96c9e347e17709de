"""The cattrs converter for every Cacheon record that crosses a file, a pipe or the CLI's --json."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from cattrs.preconf.json import make_converter

_CODE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def callable_name(fn: Callable[..., Any] | None) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _is_code(cls: Any) -> bool:
    if cls is Callable or getattr(cls, "__origin__", None) is Callable:
        return True
    return isinstance(cls, type) and issubclass(cls, _CODE_TYPES)


converter = make_converter()
# Callables (references, impls, samplers) are code, not data: they serialize as their import name.
converter.register_unstructure_hook_func(_is_code, callable_name)
