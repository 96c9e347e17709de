"""The compatibility canary: every adapter row checked against an SGLang source tree.

Statically, from source: the row's module file exists, the target (``func`` or
``Class.method``) is defined in it, and its parameter names are the recorded ones. By import,
where the row's requirements are installed: the module imports, the target resolves, and
``inspect.signature`` (through the adapter's ``__wrapped__``) gives the recorded names. A row
whose requirements are missing is ``unassessable``, never ``pass``. A green canary is necessary
evidence for a pin, not proof that candidates still run at the chokepoint.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Literal

import attrs

from cacheon_core import CanaryRow, method_signatures, override_rows

from .seams import SEAM_ADAPTERS, SGLANG_PIN, SeamRow

LINKER_BASE = "sglang.srt.mem_cache.unified_cache.unified_cache_linker"
LINKER_BASE_CLASS = "UnifiedCacheLinker"
LINKER_FACTORY = "sglang.srt.mem_cache.unified_cache.linker_factory"


def installed_source_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("sglang is not installed; pass --source DIR to check a source tree")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _params(args: ast.arguments) -> tuple[str, ...]:
    return tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))


def static_check(root: Path, row: SeamRow) -> str | None:
    """Why the source under ``root`` breaks the row, or None when it matches."""
    path = _module_file(root, row.module)
    if path is None:
        return f"module {row.module} not found under {root}"
    scope: list[ast.stmt] = ast.parse(path.read_text(), str(path)).body
    parts = row.target.split(".")
    for depth, name in enumerate(parts):
        last = depth == len(parts) - 1
        kinds: tuple[type, ...] = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = [n for n in scope if isinstance(n, kinds) and getattr(n, "name", None) == name]
        if not found:
            what = "function" if last else "class"
            return f"{what} {'.'.join(parts[: depth + 1])} not found in {path.name}"
        node = found[-1]
        if last:
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            params = _params(node.args)
            if params != row.signature:
                return f"{row.target} takes {list(params)}, recorded {list(row.signature)}"
        else:
            assert isinstance(node, ast.ClassDef)
            scope = node.body
    return None


def import_check(row: SeamRow) -> str | None:
    module = importlib.import_module(row.module)
    target: object = module
    for name in row.target.split("."):
        if not hasattr(target, name):
            return f"{row.module} has no {row.target}"
        # A class's attribute as defined (a classmethod keeps its cls parameter, as in the source).
        target = inspect.getattr_static(target, name) if isinstance(target, type) else getattr(target, name)
        if isinstance(target, (classmethod, staticmethod)):
            target = target.__func__
    params = tuple(inspect.signature(target).parameters)  # type: ignore[arg-type]
    if params != row.signature:
        return f"{row.target} takes {list(params)} at import, recorded {list(row.signature)}"
    return None


def linker_rows(root: Path) -> list[CanaryRow]:
    """OrbitKVLinker's methods against ``UnifiedCacheLinker`` in the tree: each override present with
    the same parameter names, every abstract method implemented. Both sides are read from source."""
    path = _module_file(root, LINKER_BASE)
    if path is None:
        why = f"module {LINKER_BASE} not found under {root}"
        return [CanaryRow("linker", LINKER_BASE, LINKER_BASE_CLASS, "break", "break", "not run (static)", why)]
    base = method_signatures(path.read_text(), [LINKER_BASE_CLASS])
    ours = method_signatures((Path(__file__).parent / "linker.py").read_text(), ["OrbitKVLinker"])
    init = ours.pop("__init__").params
    rows = override_rows(base, {name: sig.params for name, sig in ours.items()}, LINKER_BASE, "OrbitKVLinker")
    rows.append(_constructor_row(root, init))
    return [attrs.evolve(r, row=f"linker.{r.row}") for r in rows]


def _constructor_row(root: Path, init: tuple[str, ...]) -> CanaryRow:
    """SGLang builds a dynamic linker as ``linker_cls(a, b, k=..., ...)``: our ``__init__`` must take
    as many positional arguments and every keyword the factory passes."""
    target = "create_unified_cache_linker"
    path = _module_file(root, LINKER_FACTORY)
    calls = []
    if path is not None:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "linker_cls":
                calls.append((len(node.args), {k.arg for k in node.keywords if k.arg}))
    why = None
    if not calls:
        why = f"no linker_cls(...) call found in {LINKER_FACTORY}"
    plain = [p for p in init[1:] if not p.startswith("*")]
    for positional, keywords in calls:
        missing = sorted(keywords - set(plain))
        if positional > len(plain) or missing:
            why = (
                f"the factory calls linker_cls with {positional} positional and {sorted(keywords)}; "
                f"__init__ takes {list(init)}"
            )
    status: Literal["pass", "break"] = "break" if why else "pass"
    return CanaryRow("__init__", LINKER_FACTORY, target, status, "break" if why else "ok", "not run (static)", why)


def run_canary(source: str | Path | None = None) -> list[CanaryRow]:
    """Check every row; ``source`` is a source tree to check statically instead of the installed sglang."""
    root = Path(source) if source is not None else installed_source_root()
    results = linker_rows(root)
    for row in SEAM_ADAPTERS:
        why = static_check(root, row)
        static = "ok" if why is None else "break"
        missing = [name for name in row.requires if importlib.util.find_spec(name) is None]
        if why is not None:
            results.append(CanaryRow(row.name, row.module, row.target, "break", static, "skipped", why))
        elif missing:
            results.append(
                CanaryRow(
                    row.name,
                    row.module,
                    row.target,
                    "unassessable",
                    static,
                    "skipped",
                    f"requires {missing}, not installed",
                )
            )
        elif source is not None:
            results.append(CanaryRow(row.name, row.module, row.target, "pass", static, "not run (source tree)"))
        else:
            try:
                broken = import_check(row)
            except Exception as exc:  # an import that fails is a break, reported with its reason
                broken = f"import of {row.module} failed: {type(exc).__name__}: {exc}"
            if broken is None:
                results.append(CanaryRow(row.name, row.module, row.target, "pass", static, "ok"))
            else:
                results.append(CanaryRow(row.name, row.module, row.target, "break", static, "break", broken))
    return results


def installed_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


PIN = SGLANG_PIN
