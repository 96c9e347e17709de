"""Version-pinned SGLang 0.5.23 adapters, one module per integration named in the adapter table.

Each module exposes ``install(row, module) -> bool``: it patches the row's target in the loaded
module, refuses to patch twice (a marker on the patched object), and returns True once in place.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

MARK = "__cacheon_adapter__"


def patch_method(
    module: ModuleType, target: str, make: Callable[[Callable[..., Any], type], Callable[..., Any]], attribute: str
) -> bool:
    """Replace ``attribute`` of the class ``target`` names (``Class.method``) with ``make(original, cls)``,
    marked; a class already holding a marked adapter is left as it is."""
    cls = getattr(module, target.split(".", maxsplit=1)[0])
    current = cls.__dict__.get(attribute)
    if current is None or not getattr(current, MARK, False):
        adapter = make(getattr(cls, attribute), cls)
        setattr(adapter, MARK, True)
        setattr(cls, attribute, adapter)
    return True


def capturing(tensor: Any) -> bool:
    """Whether ``tensor`` is on CUDA and its stream is capturing a CUDA graph: adapters then keep
    SGLang's own path (a dispatched call checks and counts on the host, which a replay skips)."""
    if not tensor.is_cuda:
        return False
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


def bind(params: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by name, as a method with ``params`` after ``self`` binds them, or None
    when the call does not fit that signature (too many positionals, unknown or repeated names)."""
    if len(args) > len(params) or set(kwargs) - set(params):
        return None
    bound = dict(zip(params, args, strict=False))
    if set(bound) & set(kwargs):
        return None
    bound.update(kwargs)
    return bound
