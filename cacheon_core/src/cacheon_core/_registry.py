"""The registry of slots and variants, and variant resolution as a typed decision trace."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ._catalog import BUILTIN_SLOTS
from ._errors import ContractError, UnknownSlot
from ._slots import CallDescriptor, SlotSpec, Variant, check_signature


@attrs.frozen
class Accepted:
    """The variant is eligible for the descriptor."""

    variant: str
    priority: int


@attrs.frozen
class Rejected:
    """The variant is not eligible for the descriptor, and why."""

    variant: str
    reason: str


Decision = Accepted | Rejected


@attrs.frozen
class Resolution:
    """Step 2 of dispatch: which variant serves a descriptor, with every decision that led there."""

    slot: str
    selected: Variant | None
    trace: tuple[Decision, ...] = ()
    reason: str | None = None


class _Cache(dict[Any, Any]):
    """A dict that can be weakly referenced, with the entry served last (``last``): emptied together.
    ``generation`` counts the emptyings, so a reader can tell that one happened while it worked."""

    last: Any = None
    generation = 0

    def clear(self) -> None:
        self.generation += 1
        self.last = None
        super().clear()


class Registry:
    """Slots and their variants. Disabled until a process allowed to run candidates enables it."""

    def __init__(self, slots: Iterable[SlotSpec] = BUILTIN_SLOTS) -> None:
        self._slots: dict[str, SlotSpec] = {}
        self._variants: dict[str, list[Variant]] = {}
        self.enabled = False
        # Call sites' resolution caches, emptied on every change (no check on the hot path).
        self._caches: list[weakref.ref[_Cache]] = []
        for spec in slots:
            self.add_slot(spec)

    @classmethod
    def from_discovery(cls, slots: Mapping[str, SlotSpec], variants: Iterable[Variant]) -> Registry:
        registry = cls(slots.values())
        for variant in variants:
            registry.add_variant(variant)
        return registry

    @property
    def slots(self) -> Mapping[str, SlotSpec]:
        return dict(self._slots)

    def spec(self, slot: str) -> SlotSpec:
        try:
            return self._slots[slot]
        except KeyError:
            raise UnknownSlot(f"slot {slot!r} is not registered; known slots: {sorted(self._slots)}") from None

    def variants(self, slot: str) -> tuple[Variant, ...]:
        self.spec(slot)
        return tuple(self._variants.get(slot, ()))

    def add_slot(self, spec: SlotSpec) -> None:
        if spec.id in self._slots and self._slots[spec.id] != spec:
            raise ContractError(f"slot {spec.id!r} is already registered with a different contract")
        self._slots[spec.id] = spec
        self._invalidate()

    def add_variant(self, variant: Variant) -> None:
        spec = self.spec(variant.slot)
        if variant.slot_version != spec.version:
            raise ContractError(
                f"variant {variant.name!r} serves {variant.slot} v{variant.slot_version}, registry has v{spec.version}"
            )
        why = check_signature(spec, variant.impl)
        if why:
            raise ContractError(f"variant {variant.name!r} for {variant.slot}: impl {why}")
        bucket = self._variants.setdefault(variant.slot, [])
        if any(v.name == variant.name for v in bucket):
            raise ContractError(f"variant {variant.name!r} is already registered for {variant.slot}")
        bucket.append(variant)
        bucket.sort(key=lambda v: (-v.priority, v.name))
        self._invalidate()

    def new_cache(self) -> _Cache:
        """A resolution cache that this registry empties whenever its slots, variants or state change."""
        cache = _Cache()
        self._caches = [ref for ref in self._caches if ref() is not None]
        self._caches.append(weakref.ref(cache))
        return cache

    def _invalidate(self) -> None:
        for ref in self._caches:
            cache = ref()
            if cache is not None:
                cache.clear()

    def enable(self) -> None:
        self.enabled = True
        self._invalidate()

    def disable(self) -> None:
        self.enabled = False
        self._invalidate()

    def resolve(self, descriptor: CallDescriptor) -> Resolution:
        """The highest-priority variant whose ``supports`` accepts the descriptor (ties by name)."""
        spec = self.spec(descriptor.slot)
        if not self.enabled:
            return Resolution(spec.id, None, (), "registry disabled in this process")
        if descriptor.version != spec.version:
            return Resolution(spec.id, None, (), f"descriptor is for v{descriptor.version}, slot is v{spec.version}")
        trace: list[Decision] = []
        selected = None
        for variant in self._variants.get(spec.id, ()):
            decision = _decide(variant, descriptor)
            trace.append(decision)
            if selected is None and isinstance(decision, Accepted):
                selected = variant
        reason = None if selected else ("no variant registered" if not trace else "no variant accepted the call")
        return Resolution(spec.id, selected, tuple(trace), reason)


def _decide(variant: Variant, descriptor: CallDescriptor) -> Decision:
    if variant.supports is None:
        return Accepted(variant.name, variant.priority)
    try:
        ok = variant.supports(descriptor)
    except Exception as exc:  # a crashing eligibility check makes the variant ineligible, with the reason
        return Rejected(variant.name, f"supports() raised {type(exc).__name__}: {exc}")
    if ok is True:
        return Accepted(variant.name, variant.priority)
    if ok is False:
        return Rejected(variant.name, "supports() returned False")
    return Rejected(variant.name, f"supports() returned {ok!r}, not a bool")
