"""Import-light startup bootstrap, run by ``cacheon_sglang.pth`` in every interpreter of the environment.

It imports neither torch nor sglang. It installs one meta-path finder that watches the modules
named by the adapter table; when one of them finishes loading, activation runs (installing the
pass-through adapters whose targets now exist). Spawned SGLang children run it too, which is why
the seam reaches processes a parent-side patch never would. ``CACHEON_SGLANG_BOOTSTRAP=0``
turns it off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from .seams import WATCHED_MODULES

_local = threading.local()


class _ActivatingLoader(importlib.abc.Loader):
    """Runs the real loader, then activation. Everything else is delegated to the real loader."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        from . import seam

        seam.activate(loaded=self._name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)


class SeamFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each watched module; declines everything else at the cost of a set lookup."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in WATCHED_MODULES or getattr(_local, "busy", False):
            return None
        _local.busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _local.busy = False
        if spec is None or spec.loader is None or isinstance(spec.loader, _ActivatingLoader):
            return spec
        spec.loader = _ActivatingLoader(spec.loader, fullname)
        return spec


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` once per interpreter; True if it is in place."""
    if os.environ.get("CACHEON_SGLANG_BOOTSTRAP", "1") == "0":
        return False
    if not any(isinstance(f, SeamFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SeamFinder())
    return True


def install_from_pth() -> None:
    """The ``.pth`` entry: never let a bootstrap problem stop the interpreter from starting."""
    try:
        install()
    except Exception as exc:  # reported, not raised: a .pth error would break every Python process here
        print(f"cacheon-sglang: bootstrap not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
