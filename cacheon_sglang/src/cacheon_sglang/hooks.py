"""The ``cacheon`` entry point of cacheon-sglang: the live chokepoints its adapter table exposes."""

from __future__ import annotations

from cacheon_core import SeamAdapter, hookimpl

from .seams import SEAM_ADAPTERS


@hookimpl
def cacheon_seam_adapters() -> list[SeamAdapter]:
    return [
        SeamAdapter(
            engine="sglang", slot=slot, binding=row.binding, module=row.module, target=row.target, requires=row.requires
        )
        for row in SEAM_ADAPTERS
        for slot in row.slots
    ]
