"""The vLLM API canary: the connector's overrides against 0.32 (installed) and the 0.33.0 CUDA wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cacheon_vllm.canary import BASE, run_canary


def test_every_override_matches_the_installed_base_class():
    rows = run_canary()
    assert rows and all(r.status == "pass" for r in rows), [r for r in rows if r.status != "pass"]
    assert {r.row for r in rows} >= {
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "start_load_kv",
        "wait_for_save",
        "build_connector_meta",
    }


def test_every_override_matches_vllm_033_read_from_its_wheel():
    wheel = os.environ.get("VLLM_033_WHEEL")
    if not wheel:
        pytest.fail("VLLM_033_WHEEL is set by `nox -s vllm` after downloading vllm==0.33.0")
    rows = run_canary(wheel)
    assert all(r.status == "pass" for r in rows), [r for r in rows if r.status != "pass"]
    cli = subprocess.run(
        [str(Path(sys.executable).with_name("cacheon")), "canary", "vllm", "--source", wheel],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cli.returncode == 0 and "OK" in cli.stdout


def test_a_changed_base_class_breaks_the_canary(tmp_path):
    import vllm

    tree = tmp_path / "vllm-next"
    target = tree / BASE
    target.parent.mkdir(parents=True)
    shutil.copy(Path(vllm.__file__).parent.parent / BASE, target)
    text = target.read_text()
    text = text.replace("def wait_for_save(self)", "def wait_for_saves(self)", 1)
    text = text.replace(
        'request: "Request",\n        num_computed_tokens: int,',
        'request: "Request",\n        num_local_computed_tokens: int,',
        1,
    )
    target.write_text(text)
    rows = {r.row: r for r in run_canary(tree)}
    assert rows["wait_for_save"].status == "break"
    assert "no base class defines wait_for_save there" in rows["wait_for_save"].reason
    assert rows["get_num_new_matched_tokens"].status == "break"
    assert "num_local_computed_tokens" in rows["get_num_new_matched_tokens"].reason
