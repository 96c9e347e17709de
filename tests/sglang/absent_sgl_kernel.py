"""``sgl_kernel`` made visible, as an absent package, to the few SGLang modules whose CUDA branch
imports it at module level, so SGLang's own memory pools, tree and scheduler code import on a GPU
host where ``sgl_kernel`` cannot load (torch 2.11 lacks symbols its libraries need).

On a CUDA host, SGLang 0.5.23 modules the linker path imports bind names from ``sgl_kernel`` at
import time in ``if _is_cuda:`` branches (MoE, int8 and GGUF quantization, the host-pool and
hisparse transfer kernels), never calling them there. This hook answers those imports, and only
those (``IMPORTERS``), with ``AbsentKernel`` placeholders: a placeholder computes nothing and
raises ``AbsentKernelError`` on any call or attribute use, so a kernel that the code under test
really needed fails loudly instead of being stood in for. Every other importer sees
``sgl_kernel`` as not installed (``ModuleNotFoundError``), as on a host without it, so
``try: import sgl_kernel`` fallbacks keep their behaviour. ``bound`` lists every name handed out,
``calls`` every use attempted (both are reported by the GPU driver).

``install(strict=False)`` hands ``sgl_kernel`` to any SGLang import statement that is not inside a
``try`` (each importer recorded in ``importers``), for import paths that reach more such modules than
``IMPORTERS`` (joining SGLang's TP group imports its sampler and layer modules); an import inside a
``try`` still finds it not installed and takes its fallback.
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# SGLang 0.5.23 modules, imported by the linker path, with a module-level ``if _is_cuda:`` import
# from sgl_kernel (found by scanning the modules that path imports).
IMPORTERS = (
    "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py",
    "sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py",
    "sglang/srt/layers/quantization/gguf.py",
    "sglang/srt/layers/quantization/w8a8_int8.py",
    "sglang/srt/mem_cache/hisparse_memory_pool.py",
    "sglang/srt/mem_cache/pool_host/mha.py",
    "sglang/srt/mem_cache/pool_host/unified.py",
)
PACKAGE = "sgl_kernel"

bound: list[str] = []  # "sgl_kernel.X <- importer"
calls: list[str] = []  # every use of a placeholder (none expected)
importers: set[str] = set()  # every SGLang file that was handed the absent package
_state = {"strict": True, "installed": False}


class AbsentKernelError(RuntimeError):
    """A placeholder for an sgl_kernel name was used: the code under test needed a kernel that is absent."""


class AbsentKernel:
    """A name bound from the absent ``sgl_kernel``: no behaviour at all."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _refuse(self, what: str) -> AbsentKernelError:
        calls.append(f"{self._name}: {what}")
        return AbsentKernelError(
            f"{self._name} was {what}, but sgl_kernel is absent here (it cannot load on this torch); "
            "the linker path must never use it"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("called")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise self._refuse(f"asked for attribute {name!r}")

    def __repr__(self) -> str:
        return f"<absent {self._name}>"


def _importer() -> tuple[str | None, str, int]:
    """The SGLang file whose import statement is running (relative to site-packages), its path and line."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "importlib" not in name and not name.endswith(__file__.replace("\\", "/")):
            at = name.rfind("/sglang/")
            return (name[at + 1 :] if at >= 0 else None), name, frame.f_lineno or 0
        frame = frame.f_back  # type: ignore[assignment]
    return None, "", 0


@functools.cache
def _guarded_imports(path: str) -> tuple[tuple[int, int], ...]:
    """Line ranges of the import statements inside a ``try`` body in the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return ()
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        ranges.append((sub.lineno, sub.end_lineno or sub.lineno))
    return tuple(ranges)


def _allowed(importer: tuple[str | None, str, int]) -> bool:
    relative, path, line = importer
    if relative is None:
        return False
    if _state["strict"]:
        return relative in IMPORTERS
    return relative.startswith("sglang/") and not any(a <= line <= b for a, b in _guarded_imports(path))


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        importer = _importer()
        if not _allowed(importer):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (sgl_kernel is absent)")
        importers.add(str(importer[0]))
        qualified = f"{self.__name__}.{name}"
        bound.append(f"{qualified} <- {importer[0]}")
        return AbsentKernel(qualified)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _AbsentModule(spec.name)
        module.__path__ = []  # a package: submodules (sgl_kernel.kvcacheio) come through the finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", maxsplit=1)[0] != PACKAGE:
            return None
        importer = _importer()
        if not _allowed(importer):
            raise ModuleNotFoundError(f"No module named {fullname!r} (sgl_kernel is absent)", name=fullname)
        importers.add(str(importer[0]))
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def install(strict: bool = True) -> None:
    """Put the hook first on ``sys.meta_path`` (before any SGLang import)."""
    if any(name.split(".")[0] == "sglang" for name in sys.modules):
        raise RuntimeError("absent_sgl_kernel.install() must run before SGLang is imported")
    _state["strict"] = strict
    if not _state["installed"]:
        sys.meta_path.insert(0, _Finder())
        _state["installed"] = True


def report() -> dict[str, Any]:
    return {
        "strict": _state["strict"],
        "importers": sorted(importers),
        "bound": sorted(set(bound)),
        "calls": list(calls),
    }
