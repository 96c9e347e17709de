"""The per-process runtime: discovery, registry, dispatcher and receipts, wired by role.

Every process may hold a runtime with pass-through call sites; only a scheduler loads candidate
variants, enables its registry and writes ``active``. Configuration comes from the launch
environment: ``CACHEON_RECEIPT_DIR``, ``CACHEON_POLICY`` (strict|lenient|stock, default strict),
``CACHEON_RANK`` and ``CACHEON_PLUGINS``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ._dispatch import Dispatcher, Policy
from ._errors import CacheonError
from ._plugins import Discovery, discover
from ._receipts import ReceiptLog
from ._registry import Registry
from ._roles import Role, current_role, mark_role
from ._slots import Topology

log = logging.getLogger(__name__)


@attrs.define
class Runtime:
    role: Role
    discovery: Discovery
    registry: Registry
    dispatcher: Dispatcher
    receipts: ReceiptLog


def start(
    role: Role | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    extra: Sequence[tuple[str, object]] = (),
    entry_points: bool = True,
    topology: Topology | None = None,
    serve: Iterable[str] | None = None,
) -> Runtime:
    """Build this process's runtime. A scheduler loads variants and enables the registry.

    ``serve`` limits the registered variants to these slots (an engine seam passes the slots of
    its armed adapters); variants for other slots are loaded with their plugin but never
    registered, so they cannot be selected and do not appear in ``active``.
    """
    env = environ if environ is not None else os.environ
    if role is not None:
        mark_role(role)
    role = current_role()
    policy_text = env.get("CACHEON_POLICY", "strict")
    try:
        policy = Policy(policy_text)
    except ValueError:
        raise CacheonError(f"CACHEON_POLICY={policy_text!r} is not one of {[p.value for p in Policy]}") from None
    rank_text = env.get("CACHEON_RANK", "0")
    if not rank_text.isdigit():
        raise CacheonError(f"CACHEON_RANK={rank_text!r} is not a non-negative integer")
    topology = topology or Topology(tp_rank=int(rank_text))
    receipts = ReceiptLog(
        env.get("CACHEON_RECEIPT_DIR") or None, role=role.value, rank=topology.tp_rank, policy=policy.value
    )
    scheduler = role is Role.SCHEDULER
    discovery = discover(
        load_variants=scheduler, receipts=receipts, extra=extra, entry_points=entry_points, environ=env
    )
    variants = discovery.variants
    if serve is not None:
        wanted = set(serve)
        variants = tuple(v for v in variants if v.slot in wanted)
    registry = Registry.from_discovery(discovery.slots, variants)
    dispatcher = Dispatcher(registry, policy=policy, receipts=receipts, topology=topology)
    if scheduler:
        served = sorted({v.slot for v in variants})
        if served:
            registry.enable()
            receipts.event("active", slots=served)
        else:
            receipts.event("load_failed", reason="no candidate variant was registered")
    log.info(
        "cacheon runtime: role=%s policy=%s slots=%d variants=%d failures=%d",
        role.value,
        policy.value,
        len(discovery.slots),
        len(discovery.variants),
        len(discovery.failures),
    )
    return Runtime(role, discovery, registry, dispatcher, receipts)
