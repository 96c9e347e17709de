"""Activation and the scheduler-only candidate gate.

``activate()`` runs in every process that loads a watched SGLang module (through the bootstrap or
SGLang's own plugin loader). It installs the pass-through adapters of the armed bindings whose
targets exist now, and never imports candidate code: adapters route to SGLang's stock path while
this process has no call sites. Only ``enter_scheduler()``, called when a process positively
enters ``run_scheduler_process``, loads the installed ``cacheon`` plugins, enables the registry,
writes ``active`` and hands the call sites to the adapters. Both are idempotent.

Arming: with no ``CACHEON_BIND_*`` gate in the environment, the default-on bindings are armed
(the norms and the scheduler gate) and gated ones (attention) are not. A launcher that emits the
seam environment (``cacheon env sglang``) sets every gate explicitly; a partial or garbled set is
refused with a ``BindingError``.

Sealed serving: with ``CACHEON_BUNDLE`` set, the scheduler opens that engine tree (it must be the
configured mount, ``CACHEON_BUNDLE_MOUNT``, default /cacheon/engine-tree), and its candidates come
from the tree's sealed namespaces only. A refused tree is a ``load_failed`` receipt and the stock
path; with ``CACHEON_BUNDLE_PUBKEY`` (signed serving) a refused tree or signature, a contribution
that fails, no activation, or an armed adapter that is not installed stops startup.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from cacheon_core import (
    DEFAULT_BUNDLE_MOUNT,
    BindingVocabulary,
    BundleError,
    CacheonError,
    Role,
    Runtime,
    Topology,
    mark_role,
    open_bundle,
)
from cacheon_core import start as start_runtime

from .seams import DEFAULT_BINDINGS, SEAM_ADAPTERS, SEAM_BINDINGS, SeamRow, joint_rows

log = logging.getLogger(__name__)

VOCABULARY = BindingVocabulary(SEAM_BINDINGS)


@attrs.define
class SeamState:
    """What this process has done at the seam."""

    armed: tuple[str, ...] | None = None
    installed: set[str] = attrs.Factory(set)
    unassessable: dict[str, str] = attrs.Factory(dict)
    # row name -> why its install raised (pin drift); a scheduler reports each as load_failed.
    failed: dict[str, str] = attrs.Factory(dict)
    runtime: Runtime | None = None
    # slot id -> CallSite; None until this process has entered the scheduler.
    sites: dict[str, Any] | None = None
    entry_point_ran: bool = False


STATE = SeamState()
_lock = threading.RLock()


def armed_bindings(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    env = os.environ if environ is None else environ
    if not any(gate in env for gate in VOCABULARY.gates.values()):
        return DEFAULT_BINDINGS
    return VOCABULARY.armed(env)


def _requirements_missing(row: SeamRow) -> list[str]:
    return [name for name in row.requires if importlib.util.find_spec(name) is None]


def activate(loaded: str | None = None) -> set[str]:
    """Install every armed adapter whose target module is loaded; returns the installed row names.

    ``loaded`` names a module whose body has just finished executing (the bootstrap's loader
    calls this from inside the import, before the import system marks the module initialized).
    """
    with _lock:
        if STATE.armed is None:
            STATE.armed = armed_bindings()
        for row in SEAM_ADAPTERS:
            if row.name in STATE.installed or row.binding not in STATE.armed:
                continue
            if row.joint:
                _activate_joint(row.joint, loaded)
                continue
            if not _ready(row, loaded):
                continue  # not loaded, or still executing its body (a circular import reached us)
            module = sys.modules[row.module]
            missing = _requirements_missing(row)
            if missing:
                STATE.unassessable[row.name] = f"requires {missing}"
                continue
            try:
                integration = importlib.import_module(row.integration)
                done = integration.install(row, module)
            except Exception as exc:  # the pinned target moved: SGLang keeps its stock path, the failure is kept
                if row.name not in STATE.failed:
                    STATE.failed[row.name] = f"{type(exc).__name__}: {exc}"
                    log.error("cacheon-sglang: adapter %s not installed: %s", row.name, STATE.failed[row.name])
                continue
            if done:
                STATE.installed.add(row.name)
                STATE.failed.pop(row.name, None)
                log.debug("cacheon-sglang: installed %s at %s.%s", row.name, row.module, row.target)
        return set(STATE.installed)


def _ready(row: SeamRow, loaded: str | None) -> bool:
    module = sys.modules.get(row.module)
    initializing = getattr(getattr(module, "__spec__", None), "_initializing", False)
    return module is not None and not (initializing and row.module != loaded)


def joint_ready(joint: str) -> bool:
    """Whether every row of the ``joint`` set is installed (its adapters pass through otherwise)."""
    return all(row.name in STATE.installed for row in joint_rows(joint))


def _activate_joint(joint: str, loaded: str | None) -> None:
    """Install every row of ``joint`` once all their modules are loaded and every target matches
    its recorded signature; otherwise none of them (each reported failed with the set's reasons)."""
    from .canary import import_check

    rows = joint_rows(joint)
    names = {row.name for row in rows}
    if names & (STATE.installed | set(STATE.failed) | set(STATE.unassessable)):
        return  # decided already
    if not all(_ready(row, loaded) for row in rows):
        return
    missing = sorted({name for row in rows for name in _requirements_missing(row)})
    if missing:
        for row in rows:
            STATE.unassessable[row.name] = f"requires {missing}"
        return
    problems: list[str] = []
    for row in rows:
        try:
            why = import_check(row)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            problems.append(f"{row.name}: {why}")
    installed: list[str] = []
    if not problems:
        for row in rows:
            try:
                if importlib.import_module(row.integration).install(row, sys.modules[row.module]):
                    installed.append(row.name)
            except Exception as exc:
                problems.append(f"{row.name}: {type(exc).__name__}: {exc}")
    if problems or len(installed) != len(rows):
        reason = f"the {joint} set is refused as a whole: " + "; ".join(problems or ["not every row installed"])
        for row in rows:
            STATE.failed[row.name] = reason
        log.error("cacheon-sglang: %s", reason)
        return  # rows patched before the failure pass through: joint_ready() is False
    STATE.installed.update(installed)
    log.debug("cacheon-sglang: installed the %s set", joint)


@attrs.define
class _Bundle:
    """The configured engine tree as this scheduler opened it."""

    plugins: list[tuple[str, object]]
    refused: str | None
    signed: bool

    def settle(self, runtime: Runtime, armed: tuple[str, ...]) -> None:
        """Record a refusal; under signed serving, stop startup on any missing piece."""
        if self.refused is not None:
            runtime.receipts.event("load_failed", plugin="bundle", reason=self.refused)
        if not self.signed:
            return
        problems = [self.refused] if self.refused else []
        failed = [p for p in runtime.discovery.failures if p.name in {n for n, _ in self.plugins}]
        problems += [f"contribution {p.name}: {p.reason}" for p in failed]
        if not runtime.registry.enabled:
            problems.append("no sealed variant was activated")
        problems += [f"required adapter {name}: {reason}" for name, reason in sorted(STATE.failed.items())]
        missing = sorted(row.name for row in SEAM_ADAPTERS if row.binding in armed and row.name not in STATE.installed)
        problems += [f"required adapter {name} is not installed" for name in missing if name not in STATE.failed]
        if problems:
            runtime.receipts.flush()
            raise CacheonError("signed serving stops: " + "; ".join(p for p in problems if p))


def _open_configured_bundle() -> _Bundle | None:
    """``CACHEON_BUNDLE`` (the engine tree, which must be ``CACHEON_BUNDLE_MOUNT``, default
    /cacheon/engine-tree) and, for signed serving, ``CACHEON_BUNDLE_PUBKEY`` (an Ed25519 PEM)."""
    tree = os.environ.get("CACHEON_BUNDLE")
    if not tree:
        return None
    key_path = os.environ.get("CACHEON_BUNDLE_PUBKEY")
    mount = os.environ.get("CACHEON_BUNDLE_MOUNT", DEFAULT_BUNDLE_MOUNT)
    try:
        key = Path(key_path).read_bytes() if key_path else None
        return _Bundle(open_bundle(tree, mount=mount, public_key_pem=key), None, key_path is not None)
    except (BundleError, OSError) as exc:
        return _Bundle([], str(exc), key_path is not None)


def site(slot: str) -> Any:
    """The call site an adapter dispatches through, or None (stock path) outside a scheduler."""
    sites = STATE.sites
    return None if sites is None else sites.get(slot)


def enter_scheduler(*, tp_rank: int, tp_size: int = 1, dp_rank: int | None = None) -> Runtime:
    """The positive role boundary: load candidates, enable the registry, write ``active``."""
    with _lock:
        if STATE.runtime is not None:
            return STATE.runtime
        activate()
        armed = STATE.armed or ()
        served = {slot for row in SEAM_ADAPTERS if row.binding in armed for slot in row.slots}
        topology = Topology(tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank or 0)
        mark_role(Role.SCHEDULER)
        bundle = _open_configured_bundle()
        if bundle is None:
            runtime = start_runtime(Role.SCHEDULER, topology=topology, serve=served)
        else:
            # Sealed serving: candidates come from the bundle only, never from installed entry points.
            environ = {k: v for k, v in os.environ.items() if k != "CACHEON_PLUGINS"}
            runtime = start_runtime(
                Role.SCHEDULER,
                topology=topology,
                serve=served,
                extra=bundle.plugins,
                entry_points=False,
                environ=environ,
            )
        for name, reason in sorted(STATE.failed.items()):
            runtime.receipts.event("load_failed", plugin="cacheon-sglang", reason=f"adapter {name}: {reason}")
        if bundle is not None:
            bundle.settle(runtime, armed)
        STATE.runtime = runtime
        STATE.sites = {slot: runtime.dispatcher.site(slot) for slot in sorted(served) if slot in runtime.registry.slots}
        log.info("cacheon-sglang: scheduler rank %d armed %s; serving %s", tp_rank, list(armed), sorted(STATE.sites))
        return runtime
