"""The compiled hybrid recovery contract: which pages each state group needs to resume at a boundary.

Pure Python (no torch, no engine import); every OrbitKV lookup and restore in both engines goes
through it. ``RecoveryContract.compile`` normalizes the declared groups once per engine:

- a prefix group (``attention``, ``mla``) needs the whole queried tail;
- a ``window`` group of W tokens needs ceil(W / page_size) pages, capped by the tail;
- a checkpoint group (``recurrent``, ``convolution``) needs only the page that ends at the
  boundary (recurrent and convolution state restore together: each is its own group, and a
  boundary is legal only when every group has its page there).

``required_ranges`` turns a span into absolute, half-open, page-aligned demand per group in time
independent of the span's length. ``restorable_boundaries`` returns every boundary the evidence
supports (ranks intersect these sets: the minimum of per-rank maxima could pick a boundary one
rank lacks). The demand is information only: it grants no lease and proves no availability.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs

__all__ = [
    "ContractError",
    "GroupDemand",
    "GroupRule",
    "InvalidContract",
    "InvalidCoverage",
    "InvalidDemand",
    "InvalidGroup",
    "InvalidSpan",
    "NamespaceMismatch",
    "RecoveryContract",
]

Kind = Literal["attention", "mla", "window", "recurrent", "convolution"]
PREFIX_KINDS = frozenset({"attention", "mla"})
CHECKPOINT_KINDS = frozenset({"recurrent", "convolution"})
KINDS = PREFIX_KINDS | CHECKPOINT_KINDS | {"window"}


class ContractError(ValueError):
    """Base of every recovery-contract error."""


class InvalidContract(ContractError):
    """The declared groups or page size cannot be compiled."""


class NamespaceMismatch(ContractError):
    """A query names another namespace than the contract was compiled for."""


class InvalidSpan(ContractError):
    """A span is unordered, negative or not page-aligned."""


class InvalidGroup(ContractError):
    """A group is missing, duplicated or unknown (in evidence or in the contract)."""


class InvalidCoverage(ContractError):
    """Evidence page ends are not strictly increasing, not aligned, or outside ``(start, end]``."""


class InvalidDemand(ContractError):
    """An engine's restore plan does not match the compiled range of a group."""


@attrs.frozen
class GroupRule:
    """One compiled group: ``pages`` is None for a prefix (the whole tail), else a page count."""

    group: int
    kind: str
    window_tokens: int
    pages: int | None


@attrs.frozen
class GroupDemand:
    """One group's part of a restore at a boundary: the compiled range ``[start, end)`` split into the
    page ends the engine has copied (``transferred``) and those it attests it already holds (``retained``)."""

    group: int
    start: int
    end: int
    transferred: tuple[int, ...]
    retained: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen
class RecoveryContract:
    namespace: str
    page_size: int
    rules: tuple[GroupRule, ...]

    @classmethod
    def compile(cls, namespace: str, page_size: int, groups: Iterable[Sequence[object]]) -> RecoveryContract:
        """Normalize ``(group_id, kind, window_tokens)`` declarations into page requirements."""
        if not isinstance(namespace, str) or not namespace:
            raise InvalidContract(f"namespace {namespace!r} must be a non-empty string")
        if not _is_int(page_size) or page_size <= 0:
            raise InvalidContract(f"page size {page_size!r} must be a positive integer")
        rules: dict[int, GroupRule] = {}
        for declared in groups:
            if len(declared) != 3:
                raise InvalidContract(f"group {declared!r} must be (group_id, kind, window_tokens)")
            group, kind, window = declared
            if not _is_int(group) or group < 0:  # type: ignore[operator]
                raise InvalidContract(f"group id {group!r} must be a non-negative integer")
            if kind not in KINDS:
                raise InvalidContract(f"group {group}: kind {kind!r} is not one of {sorted(KINDS)}")
            if not _is_int(window) or window < 0:  # type: ignore[operator]
                raise InvalidContract(f"group {group}: window_tokens {window!r} must be a non-negative integer")
            if kind == "window" and window == 0:
                raise InvalidContract(f"group {group}: a window group needs window_tokens > 0, got 0")
            if kind != "window" and window != 0:
                raise InvalidContract(f"group {group}: kind {kind!r} takes window_tokens 0, got {window}")
            assert isinstance(group, int) and isinstance(window, int) and isinstance(kind, str)
            if group in rules:
                raise InvalidGroup(f"group {group} is declared twice")
            if kind in PREFIX_KINDS:
                pages = None
            elif kind == "window":
                pages = -(-window // page_size)
            else:
                pages = 1
            rules[group] = GroupRule(group, kind, window, pages)
        if not rules:
            raise InvalidContract("a contract needs at least one group")
        if 0 not in rules:
            raise InvalidContract(f"group 0 must supply the attention prefix; groups are {sorted(rules)}")
        if rules[0].kind not in PREFIX_KINDS:
            raise InvalidContract(f"group 0 must be a prefix (attention or mla), got {rules[0].kind!r}")
        return cls(namespace, page_size, tuple(rules[g] for g in sorted(rules)))

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(rule.group for rule in self.rules)

    # -- validation ---------------------------------------------------------------------------

    def _check(self, namespace: str, start: int, end: int) -> None:
        if namespace != self.namespace:
            raise NamespaceMismatch(f"namespace {namespace!r} does not match the contract's {self.namespace!r}")
        if not (_is_int(start) and _is_int(end)) or start < 0 or end < start:
            raise InvalidSpan(f"span [{start!r}, {end!r}) must satisfy 0 <= start <= end")
        if start % self.page_size or end % self.page_size:
            raise InvalidSpan(f"span [{start}, {end}) is not aligned to page size {self.page_size}")

    def _evidence(self, start: int, end: int, evidence: object) -> dict[int, list[int]]:
        pairs = list(evidence.items()) if isinstance(evidence, Mapping) else list(evidence)  # type: ignore[call-overload]
        found: dict[int, list[int]] = {}
        known = set(self.groups)
        for item in pairs:
            group, ends = item
            if group not in known:
                raise InvalidGroup(f"evidence names unknown group {group!r}; the contract has {sorted(known)}")
            if group in found:
                raise InvalidGroup(f"evidence names group {group} twice")
            found[group] = self._coverage(group, start, end, ends)
        missing = sorted(known - set(found))
        if missing:
            raise InvalidGroup(f"evidence is missing groups {missing} (give an empty list for a group with no pages)")
        return found

    def _coverage(self, group: int, start: int, end: int, ends: Iterable[int]) -> list[int]:
        page = self.page_size
        checked = list(ends)
        previous = start
        for value in checked:
            # One pass, locals only: this runs once per page of evidence on every lookup.
            if type(value) is not int and not _is_int(value):
                raise InvalidCoverage(f"group {group}: page end {value!r} is not an integer")
            if value % page:
                raise InvalidCoverage(f"group {group}: page end {value} is not aligned to page size {page}")
            if value <= previous:
                if value <= start:
                    raise InvalidCoverage(f"group {group}: page end {value} is outside ({start}, {end}]")
                raise InvalidCoverage(f"group {group}: page ends are not strictly increasing at {value}")
            previous = value
        if checked and previous > end:
            raise InvalidCoverage(f"group {group}: page end {previous} is outside ({start}, {end}]")
        return checked

    # -- the contract ---------------------------------------------------------------------------

    def required_ranges(self, namespace: str, start: int, end: int) -> list[tuple[int, int, int]]:
        """Per group, the absolute half-open page-aligned range needed to resume at ``end``."""
        self._check(namespace, start, end)
        tail_pages = (end - start) // self.page_size
        out = []
        for rule in self.rules:
            pages = tail_pages if rule.pages is None else min(rule.pages, tail_pages)
            out.append((rule.group, end - pages * self.page_size, end))
        return out

    def split_demand(
        self,
        namespace: str,
        start: int,
        end: int,
        transferred: Mapping[int, Iterable[int]],
        retained: Mapping[int, Iterable[int]] | None = None,
    ) -> list[GroupDemand]:
        """Check an engine's plan to resume at ``end`` against the compiled ranges, per group.

        ``transferred`` and ``retained`` give, per group, page ends (absolute tokens): pages the
        engine copies from the store and pages it attests it already holds. For every group the two
        must be disjoint and together exactly the compiled range; anything else (a page outside the
        range, a page named twice, a page neither copied nor held, an unknown group) raises
        ``InvalidDemand`` and nothing is restored.
        """
        ranges = self.required_ranges(namespace, start, end)
        known = {group for group, _, _ in ranges}
        held = dict(retained or {})
        for source in (transferred, held):
            extra = sorted(set(source) - known)
            if extra:
                raise InvalidDemand(f"plan names unknown groups {extra}; the contract has {sorted(known)}")
        out = []
        page = self.page_size
        for group, lo, hi in ranges:
            want = set(range(lo + page, hi + 1, page))
            moved = list(transferred.get(group, ()))
            kept = list(held.get(group, ()))
            for name, ends in (("transferred", moved), ("retained", kept)):
                if len(set(ends)) != len(ends):
                    raise InvalidDemand(f"group {group}: a {name} page is named twice")
                outside = sorted(set(ends) - want)
                if outside:
                    raise InvalidDemand(f"group {group}: {name} page ends {outside} are outside [{lo}, {hi})")
            both = sorted(set(moved) & set(kept))
            if both:
                raise InvalidDemand(f"group {group}: page ends {both} are both transferred and retained")
            missing = sorted(want - set(moved) - set(kept))
            if missing:
                raise InvalidDemand(
                    f"group {group}: page ends {missing} of [{lo}, {hi}) are neither transferred nor retained"
                )
            out.append(GroupDemand(group, lo, hi, tuple(sorted(moved)), tuple(sorted(kept))))
        return out

    def restorable_boundaries(
        self,
        namespace: str,
        start: int,
        end: int,
        evidence: Mapping[int, Iterable[int]] | Iterable[tuple[int, Iterable[int]]],
    ) -> list[int]:
        """Every boundary in ``(start, end]`` at which each group has exactly the pages it needs."""
        self._check(namespace, start, end)
        found = self._evidence(start, end, evidence)
        page = self.page_size
        # The prefix must be dense from start: it ends at the first gap (in every prefix group).
        dense_end = end
        for rule in self.rules:
            if rule.pages is None:
                reach = start
                for value in found[rule.group]:
                    if value != reach + page:
                        break
                    reach = value
                dense_end = min(dense_end, reach)
        if dense_end <= start:
            return []
        checkpoints = [set(found[r.group]) for r in self.rules if r.kind in CHECKPOINT_KINDS]
        windows: list[tuple[int, dict[int, int]]] = []
        for rule in self.rules:
            if rule.kind == "window" and rule.pages is not None:
                # run[e]: how many consecutive pages of this group end at e.
                run: dict[int, int] = {}
                for value in found[rule.group]:
                    run[value] = run.get(value - page, 0) + 1
                windows.append((rule.pages, run))
        if checkpoints:
            candidates = sorted(set.intersection(*checkpoints))
        else:
            candidates = list(range(start + page, dense_end + 1, page))
        legal = []
        for boundary in candidates:
            if boundary > dense_end:
                break
            tail = (boundary - start) // page
            if all(run.get(boundary, 0) >= min(pages, tail) for pages, run in windows):
                legal.append(boundary)
        return legal

    def common_boundaries(
        self,
        namespace: str,
        start: int,
        end: int,
        shards: Iterable[Mapping[int, Iterable[int]] | Iterable[tuple[int, Iterable[int]]]],
    ) -> list[int]:
        """The boundaries legal on every shard (set intersection, independent of shard order)."""
        common: set[int] | None = None
        for evidence in shards:
            legal = set(self.restorable_boundaries(namespace, start, end, evidence))
            common = legal if common is None else common & legal
        if common is None:
            raise InvalidCoverage("common_boundaries needs the evidence of at least one shard")
        return sorted(common)

    @staticmethod
    def select_boundary(boundaries: Iterable[int], limit: int) -> int | None:
        """The largest boundary not past ``limit`` (an engine's match limit), or None."""
        best = None
        for boundary in boundaries:
            if boundary <= limit and (best is None or boundary > best):
                best = boundary
        return best
