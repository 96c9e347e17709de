"""Entry-point discovery of Cacheon plugins into a pluggy PluginManager.

Each distribution's ``cacheon`` entry points are loaded one by one, so that a plugin that fails
to import, registers an unknown hook, or contributes an invalid slot or variant is reported with
its distribution name and the reason (and a ``load_failed`` receipt), and never takes the host or
the other plugins down with it. A plugin is all or nothing: one invalid variant fails it whole.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any, Literal

import attrs
import pluggy

from . import _catalog
from ._hookspecs import PROJECT, CacheonSpec, SeamAdapter
from ._receipts import ReceiptLog
from ._slots import SlotSpec, Variant, check_signature

log = logging.getLogger(__name__)

CORE = "cacheon-core"
ENTRY_POINT_GROUP = "cacheon"


def normalize_name(name: str) -> str:
    """PEP 503 normalization of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class VariantInfo:
    slot: str
    name: str
    priority: int
    graph_safe: bool
    slot_version: int


@attrs.frozen
class PluginReport:
    """What discovery did with one entry point."""

    name: str
    distribution: str
    version: str
    value: str
    status: Literal["loaded", "load_failed", "skipped"]
    reason: str | None = None
    slots: tuple[str, ...] = ()
    variants: tuple[VariantInfo, ...] = ()
    adapters: tuple[SeamAdapter, ...] = ()


@attrs.frozen
class Discovery:
    plugins: tuple[PluginReport, ...]
    slots: Mapping[str, SlotSpec]
    variants: tuple[Variant, ...]
    adapters: tuple[SeamAdapter, ...]
    slot_owner: Mapping[str, str]

    @property
    def failures(self) -> tuple[PluginReport, ...]:
        return tuple(p for p in self.plugins if p.status == "load_failed")


class _Rejected(Exception):
    """A plugin contributed something invalid; the message says what."""


@attrs.define
class _Candidate:
    name: str
    distribution: str
    version: str
    value: str
    load: Any  # () -> plugin object


def _entry_point_candidates() -> list[_Candidate]:
    seen: set[tuple[str, str]] = set()
    found = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        dist_name = dist.metadata["Name"] if dist is not None else "?"
        version = dist.version if dist is not None else "?"
        key = (normalize_name(dist_name), ep.name)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        found.append(_Candidate(ep.name, dist_name, version, ep.value, ep.load))
    return sorted(found, key=lambda c: (normalize_name(c.distribution), c.name))


def allowed_plugins(environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """The allow-list from ``CACHEON_PLUGINS`` (distribution or entry-point names), or None for all."""
    value = (environ if environ is not None else os.environ).get("CACHEON_PLUGINS")
    if value is None:
        return None
    return frozenset(normalize_name(n.strip()) for n in value.split(",") if n.strip())


def _as_tuple(result: object, what: str, kind: type) -> tuple[Any, ...]:
    if result is None:
        return ()
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise _Rejected(f"{what} returned {type(result).__name__}, expected an iterable of {kind.__name__}")
    items = tuple(result)
    for item in items:
        if not isinstance(item, kind):
            raise _Rejected(f"{what} yielded {item!r}, expected {kind.__name__}")
    return items


def discover(
    *,
    load_variants: bool = True,
    receipts: ReceiptLog | None = None,
    extra: Sequence[tuple[str, object]] = (),
    entry_points: bool = True,
    environ: Mapping[str, str] | None = None,
) -> Discovery:
    """Load the built-in catalog, every allowed ``cacheon`` entry point, and ``extra`` plugins.

    ``extra`` are (name, plugin object) pairs registered as if found through an entry point (an
    engine package's own module, or a test's). Variants are collected only when
    ``load_variants``: only a scheduler, or a tool such as ``cacheon verify``, imports candidate
    code through them.
    """
    allow = allowed_plugins(environ)
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(CacheonSpec)
    candidates = [_Candidate(CORE, CORE, _core_version(), "cacheon_core._catalog", lambda: _catalog)]
    if entry_points:
        candidates += _entry_point_candidates()
    candidates += [_Candidate(name, name, "?", repr(obj), (lambda o=obj: o)) for name, obj in extra]

    reports: dict[str, PluginReport] = {}
    loaded: list[tuple[_Candidate, object]] = []
    for cand in candidates:
        if (
            cand.name != CORE
            and allow is not None
            and not ({normalize_name(cand.distribution), normalize_name(cand.name)} & allow)
        ):
            reports[cand.name] = PluginReport(
                cand.name, cand.distribution, cand.version, cand.value, "skipped", "not in CACHEON_PLUGINS"
            )
            continue
        try:
            obj = cand.load()
            manager.register(obj, name=cand.name)
            _check_known_hooks(manager, obj, cand.name)
        except Exception as exc:  # a broken plugin is reported, never fatal to the host
            _fail(reports, cand, f"{type(exc).__name__}: {exc}", receipts, manager)
            continue
        loaded.append((cand, obj))

    slots: dict[str, SlotSpec] = {}
    owner: dict[str, str] = {}
    contributed: dict[str, tuple[tuple[str, ...], tuple[SeamAdapter, ...]]] = {}
    for cand, obj in loaded:
        try:
            new = _call(manager, "cacheon_slots", obj, SlotSpec)
            for spec in new:
                if spec.id in slots:
                    raise _Rejected(f"slot {spec.id!r} is already defined by {owner[spec.id]}")
            adapters = _call(manager, "cacheon_seam_adapters", obj, SeamAdapter)
        except Exception as exc:
            _fail(reports, cand, str(exc), receipts, manager)
            continue
        for spec in new:
            slots[spec.id] = spec
            owner[spec.id] = cand.distribution
        contributed[cand.name] = (tuple(s.id for s in new), adapters)

    variants: list[Variant] = []
    for cand, obj in loaded:
        if cand.name not in contributed:
            continue
        try:
            mine = _call(manager, "cacheon_variants", obj, Variant) if load_variants else ()
            _validate_variants(mine, slots, variants)
        except Exception as exc:
            _fail(reports, cand, str(exc), receipts, manager)
            continue
        variants.extend(mine)
        slot_ids, adapters = contributed[cand.name]
        infos = tuple(VariantInfo(v.slot, v.name, v.priority, v.graph_safe, v.slot_version) for v in mine)
        reports[cand.name] = PluginReport(
            cand.name, cand.distribution, cand.version, cand.value, "loaded", None, slot_ids, infos, adapters
        )

    # Slots whose defining plugin failed later (in its variants) leave the catalog with it.
    failed = {r.distribution for r in reports.values() if r.status == "load_failed"}
    slots = {k: v for k, v in slots.items() if owner[k] not in failed}
    order = [c.name for c in candidates if c.name in reports]
    adapters_all = tuple(a for r in reports.values() if r.status == "loaded" for a in r.adapters)
    return Discovery(
        tuple(reports[n] for n in order), slots, tuple(variants), adapters_all, {k: owner[k] for k in slots}
    )


def _core_version() -> str:
    try:
        return metadata.version(CORE)
    except metadata.PackageNotFoundError:
        return "?"


def _check_known_hooks(manager: pluggy.PluginManager, obj: object, name: str) -> None:
    for attr in dir(obj):
        hooked = attr.startswith("cacheon_") and manager.parse_hookimpl_opts(obj, attr) is not None
        if hooked and not hasattr(CacheonSpec, attr):
            raise _Rejected(
                f"hook {attr!r} is not a cacheon hook (known: "
                f"{sorted(a for a in dir(CacheonSpec) if a.startswith('cacheon_'))})"
            )


def _call(manager: pluggy.PluginManager, hook: str, obj: object, kind: type) -> tuple[Any, ...]:
    caller = getattr(manager.hook, hook)
    result: list[Any] = []
    for impl in caller.get_hookimpls():
        if impl.plugin is obj:
            result.extend(_as_tuple(impl.function(), f"{hook}()", kind))
    return tuple(result)


def _validate_variants(new: Iterable[Variant], slots: Mapping[str, SlotSpec], existing: Iterable[Variant]) -> None:
    taken = {(v.slot, v.name) for v in existing}
    for variant in new:
        spec = slots.get(variant.slot)
        if spec is None:
            raise _Rejected(f"variant {variant.name!r} targets unknown slot {variant.slot!r}")
        if variant.slot_version != spec.version:
            raise _Rejected(
                f"variant {variant.name!r} serves {variant.slot} v{variant.slot_version}, "
                f"installed contract is v{spec.version}"
            )
        why = check_signature(spec, variant.impl)
        if why:
            raise _Rejected(f"variant {variant.name!r} for {variant.slot}: impl {why}")
        if (variant.slot, variant.name) in taken:
            raise _Rejected(f"variant {variant.name!r} for {variant.slot} is registered twice")
        taken.add((variant.slot, variant.name))


def _fail(
    reports: dict[str, PluginReport],
    cand: _Candidate,
    reason: str,
    receipts: ReceiptLog | None,
    manager: pluggy.PluginManager,
) -> None:
    log.error("cacheon plugin %s (%s) failed to load: %s", cand.name, cand.distribution, reason)
    if manager.get_plugin(cand.name) is not None:
        manager.unregister(name=cand.name)
    reports[cand.name] = PluginReport(cand.name, cand.distribution, cand.version, cand.value, "load_failed", reason)
    if receipts is not None:
        receipts.event("load_failed", plugin=cand.distribution, reason=reason)
