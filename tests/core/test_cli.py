"""The cacheon command, in process."""

from __future__ import annotations

import json

from cacheon_core import ReceiptLog
from cacheon_core.cli import main


def test_slots_lists_the_catalog_and_says_which_have_no_live_adapter(capsys):
    from cacheon_core import discover

    assert main(["slots", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    for slot in (
        "norm.rmsnorm",
        "norm.fused_add_rmsnorm",
        "attention.decode",
        "attention.msa_block_score",
        "moe.fused_experts",
        "moe.finalize",
        "arfusion.allreduce_add_rmsnorm",
    ):
        assert slot in rows
    # Live means: an installed engine package contributed an adapter row for the slot.
    adapters = discover(load_variants=False).adapters
    for slot, row in rows.items():
        expected = sorted(f"{a.engine}: {a.module}.{a.target}" for a in adapters if a.slot == slot)
        assert sorted(row["chokepoints"]) == expected and row["live"] == bool(expected)
    assert not rows["attention.msa_block_score"]["live"]  # no engine package exposes it
    assert [r["id"] for r in rows.values() if r["collective"]] == [
        "arfusion.allreduce_add_rmsnorm",
        "collective.all_reduce",
    ]
    assert rows["attention.decode"]["inputs"][3] == {
        "name": "kv_indptr",
        "shape": ["b1"],
        "dtypes": ["int32", "int64"],
        "layout": "contiguous",
        "dynamic": True,
        "written": False,
        "same_dtype_as": None,
        "value_range": None,
    }
    assert rows["norm.rmsnorm"]["reference"].endswith(":rmsnorm_reference")
    assert main(["slots"]) == 0
    text = capsys.readouterr().out
    assert (
        "no live adapter: no installed engine package exposes a chokepoint"
        in text.split("attention.msa_block_score", 1)[1]
    )


def test_verify_usage_errors_exit_2(capsys):
    assert main(["verify", "norm.nope"]) == 2
    assert "unknown slot 'norm.nope'" in capsys.readouterr().err
    assert main(["verify", "norm.rmsnorm", "--variant", "no_such_variant"]) == 2
    assert "has no variant 'no_such_variant'" in capsys.readouterr().err
    assert main(["verify", "attention.msa_block_score"]) == 2
    assert "no variant of attention.msa_block_score is installed" in capsys.readouterr().err


def test_receipts_reports_and_judges(tmp_path, capsys):
    assert main(["receipts", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    log = ReceiptLog(tmp_path, role="scheduler", rank=0, flush_interval=0)
    log.event("active", slots=["norm.rmsnorm"])
    log.count("completed", "norm.rmsnorm", "example_torch")
    log.close()
    assert main(["receipts", str(tmp_path), "--expect-ranks", "1"]) == 0
    out = capsys.readouterr().out
    assert "norm.rmsnorm rank 0: fired 1, completed 1, fallback 0, failed 0" in out and "OK" in out
    assert main(["receipts", str(tmp_path), "--expect-ranks", "2"]) == 1
    assert "PROBLEM: missing active members" in capsys.readouterr().out
