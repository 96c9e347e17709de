"""The launch helper and what `cacheon slots` says once the SGLang seam is installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def cacheon(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("cacheon")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, check=False)


def test_env_emits_every_gate_explicitly():
    default = cacheon("env", "sglang")
    assert default.returncode == 0
    assert default.stdout.split() == [
        "CACHEON_BIND_ARFUSION=0",
        "CACHEON_BIND_ATTENTION_DECODE=0",
        "CACHEON_BIND_COLLECTIVE=0",
        "CACHEON_BIND_MOE=0",
        "CACHEON_BIND_NORM=1",
        "CACHEON_BIND_SCHEDULER_GATE=1",
    ]
    armed = json.loads(
        cacheon("env", "sglang", "--bind", "attention_decode", "--bind", "scheduler_gate", "--json").stdout
    )
    assert armed == {
        "CACHEON_BIND_ARFUSION": "0",
        "CACHEON_BIND_ATTENTION_DECODE": "1",
        "CACHEON_BIND_COLLECTIVE": "0",
        "CACHEON_BIND_MOE": "0",
        "CACHEON_BIND_NORM": "0",
        "CACHEON_BIND_SCHEDULER_GATE": "1",
    }
    bad = cacheon("env", "sglang", "--bind", "Attention")
    assert bad.returncode == 2 and "not canonical" in bad.stderr
    unknown = cacheon("env", "vllm")
    assert unknown.returncode == 2 and "no engine package for 'vllm'" in unknown.stderr


def test_slots_lists_live_chokepoints_and_says_no_live_adapter_otherwise():
    rows = {r["id"]: r for r in json.loads(cacheon("slots", "--json").stdout)}
    assert rows["norm.rmsnorm"]["live"]
    assert "sglang: sglang.srt.layers.layernorm.GemmaRMSNorm.forward_native" in rows["norm.rmsnorm"]["chokepoints"]
    assert rows["attention.decode"]["chokepoints"] == [
        "sglang: sglang.kernels.ops.attention.decode_attention.decode_attention_fwd"
    ]
    assert rows["moe.fused_experts"]["chokepoints"] == [
        "sglang: sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod.apply"
    ]
    assert rows["collective.all_reduce"]["chokepoints"] == [
        "sglang: sglang.srt.distributed.parallel_state.GroupCoordinator.all_reduce"
    ]
    fusions = "sglang.srt.layers.layer_boundary.fusions"
    consume = f"sglang: {fusions}.custom_all_reduce_fusion.CustomAllReduceFusion._finalize_add_norm"
    assert sorted(rows["arfusion.allreduce_add_rmsnorm"]["chokepoints"]) == [
        consume,
        "sglang: sglang.srt.layers.layernorm.GemmaRMSNorm.forward_with_allreduce_fusion",
        "sglang: sglang.srt.layers.layernorm.RMSNorm.forward_with_allreduce_fusion",
    ]
    assert rows["moe.finalize"]["live"] and rows["moe.finalize"]["chokepoints"] == [consume]  # the deep epilogue
    assert not rows["attention.msa_block_score"]["live"]
    text = cacheon("slots").stdout
    assert "no live adapter" in text.split("attention.msa_block_score", 1)[1].split("\n", 4)[3]
