"""The static override check every engine canary uses, on small sources."""

from __future__ import annotations

import pytest

from cacheon_core import method_signatures, override_rows

BASE = """
import abc

class Base(abc.ABC):
    @abc.abstractmethod
    def load(self, rid, transfers): ...

    @abstractmethod
    def close(self): ...

    def hook(self, x, **kw): ...

class Mixin:
    def load(self, other): ...
    def extra(self, *args): ...
"""


def test_signatures_are_read_from_source_with_their_class_and_abstractness():
    sigs = method_signatures(BASE, ["Base", "Mixin"])
    assert sigs["load"].owner == "Base" and sigs["load"].params == ("self", "rid", "transfers")
    assert sigs["load"].abstract and sigs["close"].abstract and not sigs["hook"].abstract
    assert sigs["hook"].params == ("self", "x", "**kw") and sigs["extra"].params == ("self", "*args")
    with pytest.raises(ValueError, match="'Gone'"):
        method_signatures(BASE, ["Base", "Gone"])


def test_overrides_pass_break_and_missing_abstract_methods_are_reported():
    base = method_signatures(BASE, ["Base", "Mixin"])
    ours = {"load": ("self", "rid", "transfers"), "hook": ("self", "y"), "ours": ("self",), "_private": ("self",)}
    rows = {r.row: r for r in override_rows(base, ours, "m", "Impl")}
    assert rows["load"].status == "pass" and rows["load"].target == "Base.load"
    assert rows["hook"].status == "break" and "takes ['self', 'x', '**kw'] there" in rows["hook"].reason
    assert rows["ours"].status == "break" and rows["ours"].reason == "no base class defines ours there"
    assert rows["close"].status == "break"
    assert rows["close"].reason == "abstract method close is not implemented by Impl"
    assert "_private" not in rows
    # A trailing **kwargs only widens an override.
    assert override_rows(base, {"hook": ("self", "x")}, "m", "Impl")[0].status == "pass"
