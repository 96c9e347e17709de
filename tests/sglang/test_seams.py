"""The adapter table is the single source of the watched modules, integrations and bindings."""

from __future__ import annotations

import importlib

from cacheon_sglang import seams
from cacheon_sglang.seam import VOCABULARY


def test_everything_derives_from_the_one_table():
    rows = seams.SEAM_ADAPTERS
    assert {r.module for r in rows} == seams.WATCHED_MODULES
    assert set(seams.SEAM_BINDINGS) == {r.binding for r in rows} == VOCABULARY.bindings
    assert set(seams.INTEGRATIONS) == {r.integration for r in rows}
    assert set(seams.DEFAULT_BINDINGS) == {"norm", "scheduler_gate"}
    for row in rows:
        assert callable(importlib.import_module(row.integration).install)


def test_rows_may_share_a_binding():
    assert {r.name for r in seams.rows_for("norm")} == {"rmsnorm", "gemma_rmsnorm"}


def test_the_engine_package_reports_its_chokepoints_to_cacheon_slots():
    from cacheon_core import discover

    found = discover(load_variants=False)
    live = {(a.slot, a.target) for a in found.adapters if a.engine == "sglang"}
    assert ("norm.rmsnorm", "RMSNorm.forward_native") in live
    assert ("norm.rmsnorm", "GemmaRMSNorm.forward_native") in live
    assert ("norm.fused_add_rmsnorm", "RMSNorm.forward_native") in live
    assert ("attention.decode", "decode_attention_fwd") in live
    assert ("moe.fused_experts", "UnquantizedFusedMoEMethod.apply") in live
    assert not any(a.slot == "attention.msa_block_score" for a in found.adapters)
