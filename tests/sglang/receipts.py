"""Receipts of an SGLang run, tallied: what the norm and MoE tests compare."""

from __future__ import annotations

from cacheon_core import read_receipts


def receipt_counts(directory) -> dict[tuple[str, ...], int]:
    """Receipt counts by (kind, slot, variant), or (kind,) for receipts of no slot, over every process."""
    counts: dict[tuple[str, ...], int] = {}
    for r in read_receipts(directory):
        key = (r.kind, r.slot, r.variant) if r.slot else (r.kind,)
        counts[key] = counts.get(key, 0) + r.count
    return counts
