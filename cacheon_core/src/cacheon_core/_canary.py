"""What every engine package's compatibility canary reports, and the static override check they share."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from typing import Literal

import attrs

CanaryStatus = Literal["pass", "break", "unassessable"]


@attrs.frozen
class CanaryRow:
    """One checked chokepoint: ``static`` is the source check, ``imported`` the import check (or why none ran)."""

    row: str
    module: str
    target: str
    status: CanaryStatus
    static: str
    imported: str
    reason: str | None = None


@attrs.frozen
class MethodSignature:
    """A method read from source: its class, parameter names (``*args``/``**kw`` marked) and abstractness."""

    owner: str
    params: tuple[str, ...]
    abstract: bool = False


def method_signatures(text: str, classes: Sequence[str]) -> dict[str, MethodSignature]:
    """Method name -> signature over the top-level ``classes`` of a source text, earlier classes first.

    Read with ``ast``: the module is never imported, so another release's source (or a wheel read
    as a zip) can be checked on a machine that cannot run it. Raises ``ValueError`` naming any
    class not defined there.
    """
    found: dict[str, ast.ClassDef] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            found[node.name] = node
    missing = [name for name in classes if name not in found]
    if missing:
        raise ValueError(f"{missing} not found in the module")
    out: dict[str, MethodSignature] = {}
    for name in classes:
        for item in found[name].body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name not in out:
                a = item.args
                params = [p.arg for p in (*a.posonlyargs, *a.args)]
                if a.vararg:
                    params.append("*" + a.vararg.arg)
                params += [p.arg for p in a.kwonlyargs]
                if a.kwarg:
                    params.append("**" + a.kwarg.arg)
                abstract = any(
                    (isinstance(d, ast.Name) and d.id == "abstractmethod")
                    or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
                    for d in item.decorator_list
                )
                out[item.name] = MethodSignature(name, tuple(params), abstract)
    return out


def override_rows(
    base: Mapping[str, MethodSignature], ours: Mapping[str, tuple[str, ...]], module: str, what: str
) -> list[CanaryRow]:
    """One row per public method ``what`` overrides (and per abstract base method it must implement).

    A row breaks when the base no longer defines the method, names its parameters differently
    (a trailing ``**kwargs`` only widens an override and is ignored), or declares an abstract
    method ``what`` does not implement.
    """
    rows = []
    default_owner = next(iter(base.values())).owner if base else "?"
    for name, params in sorted(ours.items()):
        if name.startswith("_") and name != "__init__":
            continue  # the implementation's own helpers
        theirs = base.get(name)
        owner = theirs.owner if theirs is not None else default_owner
        why = None
        if theirs is None:
            why = f"no base class defines {name} there"
        elif _comparable(theirs.params) != _comparable(params):
            why = f"takes {list(theirs.params)} there, {what} overrides it as {list(params)}"
        status: CanaryStatus = "break" if why else "pass"
        rows.append(
            CanaryRow(name, module, f"{owner}.{name}", status, "break" if why else "ok", "not run (static)", why)
        )
    for name, sig in sorted(base.items()):
        if sig.abstract and name not in ours:
            why = f"abstract method {name} is not implemented by {what}"
            rows.append(CanaryRow(name, module, f"{sig.owner}.{name}", "break", "break", "not run (static)", why))
    return rows


def _comparable(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if not n.startswith("**"))
