"""The compatibility canary against the installed SGLang 0.5.23 and a patched copy of its source."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cacheon_sglang.canary import LINKER_BASE, LINKER_FACTORY, installed_source_root, run_canary
from cacheon_sglang.seams import SEAM_ADAPTERS


def cacheon(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("cacheon")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, check=False)


def test_the_canary_passes_on_the_pinned_sglang():
    result = cacheon("canary", "sglang", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["pin"] == "0.5.23" and data["installed"] == "0.5.23" and data["ok"]
    statuses = {r["row"]: r["status"] for r in data["rows"]}
    linker = {"__init__", "lookup", "load", "start_layer_wise_loading", "finish_layer_wise_loading"}
    linker |= {"cancel_queued_load", "offload", "num_completed_offloads", "pop_completed_offload", "reset", "close"}
    assert statuses == {row.name: "pass" for row in SEAM_ADAPTERS} | {f"linker.{name}": "pass" for name in linker}


def _copy_rows(tmp_path: Path) -> Path:
    """A source tree holding just the files the rows live in, as a patched checkout would."""
    src = installed_source_root()
    for module in [row.module for row in SEAM_ADAPTERS] + [LINKER_BASE, LINKER_FACTORY]:
        rel = Path(*module.split(".")).with_suffix(".py")
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, tmp_path / rel)
    return tmp_path


def test_a_renamed_symbol_breaks_the_canary_with_a_clear_message(tmp_path):
    tree = _copy_rows(tmp_path)
    assert all(r.status == "pass" for r in run_canary(tree))
    scheduler = tree / "sglang/srt/managers/scheduler.py"
    scheduler.write_text(scheduler.read_text().replace("def run_scheduler_process(", "def run_scheduler(", 1))
    result = cacheon("canary", "sglang", "--source", str(tree))
    assert result.returncode == 1
    assert "break        scheduler_gate" in result.stdout
    assert "function run_scheduler_process not found in scheduler.py" in result.stdout


def test_a_changed_signature_breaks_the_canary(tmp_path):
    tree = _copy_rows(tmp_path)
    layernorm = tree / "sglang/srt/layers/layernorm.py"
    text = layernorm.read_text()
    marker = "class GemmaRMSNorm"
    head, tail = text.split(marker, 1)
    before, method = tail.split("def forward_native(", 1)
    method = method.replace("post_residual_addition: Optional[torch.Tensor] = None,", "extra_bias=None,", 1)
    layernorm.write_text(head + marker + before + "def forward_native(" + method)
    [row] = [r for r in run_canary(tree) if r.row == "gemma_rmsnorm"]
    assert row.status == "break"
    assert "GemmaRMSNorm.forward_native takes ['self', 'x', 'residual', 'extra_bias']" in row.reason


def test_a_changed_or_missing_fused_moe_apply_breaks_the_canary(tmp_path):
    def patched(tree: Path, old: str, new: str) -> Path:
        unquant = tree / "sglang/srt/layers/quantization/unquant.py"
        head, tail = unquant.read_text().split("class UnquantizedFusedMoEMethod", 1)
        assert old in tail
        unquant.write_text(head + "class UnquantizedFusedMoEMethod" + tail.replace(old, new, 1))
        return tree

    signature = "        dispatch_output: StandardDispatchOutput,\n    ) -> CombineInput:\n        return self.forward("
    tree = patched(_copy_rows(tmp_path / "a"), signature, signature.replace("dispatch_output:", "dispatch:"))
    [row] = [r for r in run_canary(tree) if r.row == "fused_moe"]
    assert row.status == "break"
    assert "UnquantizedFusedMoEMethod.apply takes ['self', 'layer', 'dispatch']" in row.reason
    tree = patched(_copy_rows(tmp_path / "b"), "    def apply(\n        self,", "    def apply_moe(\n        self,")
    [row] = [r for r in run_canary(tree) if r.row == "fused_moe"]
    assert row.status == "break" and row.reason == "function UnquantizedFusedMoEMethod.apply not found in unquant.py"


@pytest.mark.parametrize(
    ("row_name", "path", "cls", "old", "new", "reason"),
    [
        (
            "tp_all_reduce",
            "sglang/srt/distributed/parallel_state.py",
            "class GroupCoordinator",
            "def all_reduce(self, input_: torch.Tensor)",
            "def all_reduce(self, tensor: torch.Tensor)",
            "GroupCoordinator.all_reduce takes ['self', 'tensor']",
        ),
        (
            "rmsnorm_arfusion",
            "sglang/srt/layers/layernorm.py",
            "class RMSNorm",
            "def forward_with_allreduce_fusion(",
            "def forward_with_fused_allreduce(",
            "function RMSNorm.forward_with_allreduce_fusion not found in layernorm.py",
        ),
        (
            "gemma_rmsnorm_arfusion",
            "sglang/srt/layers/layernorm.py",
            "class GemmaRMSNorm",
            "use_attn_tp_group: bool = True,",
            "use_tp_group: bool = True,",
            "GemmaRMSNorm.forward_with_allreduce_fusion takes ['self', 'x', 'residual', 'post_residual_addition', "
            "'use_tp_group']",
        ),
        (
            "epilogue_defer_gate",
            "sglang/srt/layers/layer_boundary/fusions/custom_all_reduce_fusion.py",
            "class CustomAllReduceFusion",
            "def can_defer_finalize(self, plan, forward_batch: ForwardBatch)",
            "def can_defer_finalize(self, plan, batch: ForwardBatch)",
            "CustomAllReduceFusion.can_defer_finalize takes ['self', 'plan', 'batch']",
        ),
        (
            "epilogue_moe_export",
            "sglang/srt/layers/layer_boundary/fusions/moe_finalize.py",
            "class MoeDeferredFinalize",
            "def from_flashinfer(",
            "def from_trtllm(",
            "function MoeDeferredFinalize.from_flashinfer not found in moe_finalize.py",
        ),
        (
            "epilogue_consume",
            "sglang/srt/layers/layer_boundary/fusions/custom_all_reduce_fusion.py",
            "class CustomAllReduceFusion",
            "self, plan, owed, residual, forward_batch, post_residual_addition",
            "self, plan, owed, residual, forward_batch",
            "CustomAllReduceFusion._finalize_add_norm takes ['self', 'plan', 'owed', 'residual', 'forward_batch']",
        ),
    ],
)
def test_a_changed_collective_or_arfusion_chokepoint_breaks_its_row(tmp_path, row_name, path, cls, old, new, reason):
    tree = _copy_rows(tmp_path)
    source = tree / path
    head, tail = source.read_text().split("\n" + cls, 1)
    assert old in tail.split("\nclass ", 1)[0], old  # the text patched is inside that class
    source.write_text(head + "\n" + cls + tail.replace(old, new, 1))
    rows = {r.row: r for r in run_canary(tree)}
    assert rows[row_name].status == "break" and reason in (rows[row_name].reason or ""), rows[row_name]
    assert all(r.status == "pass" for name, r in rows.items() if name != row_name)


def test_rows_whose_requirements_are_missing_are_unassessable_never_pass(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    [row] = [r for r in run_canary(_copy_rows(tmp_path)) if r.row == "triton_decode"]
    assert row.status == "unassessable" and "triton" in row.reason


def test_a_changed_linker_interface_breaks_the_canary(tmp_path):
    tree = _copy_rows(tmp_path)
    base = tree / "sglang/srt/mem_cache/unified_cache/unified_cache_linker.py"
    text = base.read_text()
    text = text.replace("def lookup(self, rid: str, transfers: list[PoolTransfer])", "def lookup(self, rid, pools)", 1)
    text = text.replace(
        "    @abstractmethod\n    def close(self) -> None:",
        "    @abstractmethod\n    def prefetch(self, rid: str) -> None:\n        ...\n\n"
        "    @abstractmethod\n    def close(self) -> None:",
        1,
    )
    base.write_text(text)
    factory = tree / "sglang/srt/mem_cache/unified_cache/linker_factory.py"
    factory.write_text(factory.read_text().replace("forward_stream=forward_stream,", "stream=forward_stream,"))
    rows = {r.row: r for r in run_canary(tree)}
    assert rows["linker.lookup"].status == "break" and "['self', 'rid', 'pools']" in rows["linker.lookup"].reason
    assert rows["linker.prefetch"].status == "break"
    assert rows["linker.prefetch"].reason == "abstract method prefetch is not implemented by OrbitKVLinker"
    assert rows["linker.__init__"].status == "break" and "'stream'" in rows["linker.__init__"].reason
    assert rows["linker.load"].status == "pass"
