"""Tensor parallelism over two real ranks: SGLang 0.5.23's own parallel state over gloo on the
loopback interface, the TP all-reduce (``GroupCoordinator.all_reduce``, reached through
``tensor_model_parallel_all_reduce``) and the AR-fusion norms (``forward_with_allreduce_fusion``,
called directly: SGLang reaches them only with FlashInfer on SM90/SM100) served through the seam.

The scenario process imports SGLang once and forks both ranks; each rank is a scheduler of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cacheon_core import read_receipts
from cacheon_core._dispatch import COLLECTIVE_ABORT_EXIT
from cacheon_sglang.engine import launch_environment
from tests.sglang.tp_scenario import HEAD, LAUNCH

RANKS = (
    HEAD
    + """
    import torch.distributed as dist
    from sglang.srt.distributed import (
        attention_tensor_model_parallel_all_reduce, tensor_model_parallel_all_reduce,
    )
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    def run(rank, init):
        publish_rank(rank)
        join_group(rank, init)
        torch.manual_seed(0)  # the same weights and residual on every rank, a partial sum of its own
        norms = {"rmsnorm": RMSNorm(64), "gemma": GemmaRMSNorm(64)}
        with torch.no_grad():
            for norm in norms.values():
                norm.weight.normal_(0, 0.5)
            norms["gemma"].refresh_gemma_weight()
        residual = torch.randn(5, 64, dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(100 + rank)
        partial = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
        ar_in = torch.randn(3, 4, 32, generator=gen)
        # SGLang's own answers, before this process becomes a scheduler (the adapters pass through).
        stock_sum = tensor_model_parallel_all_reduce(ar_in.clone())
        # SGLang's forward_with_allreduce_fusion itself cannot run here at TP=2 (its FlashInfer custom
        # op has no CPU kernel); its fallback branch, which this computes with SGLang's own functions,
        # is what it does when the fused kernel declines: all-reduce, then add and norm into a new residual.
        try:
            norms["rmsnorm"].forward_with_allreduce_fusion(partial.clone(), residual.clone())
            own = "ran"
        except NotImplementedError as exc:
            own = "no CPU kernel" if "flashinfer_allreduce_residual_rmsnorm" in str(exc) else repr(exc)
        stock = {
            n: m.forward(attention_tensor_model_parallel_all_reduce(partial.clone()), residual.clone(), None)
            for n, m in norms.items()
        }
        seam.enter_scheduler(tp_rank=rank, tp_size=WORLD)
        result = {"sites": sorted(seam.STATE.sites), "installed": sorted(seam.STATE.installed), "own": own}
        if PHASE == "fault":
            tensor_model_parallel_all_reduce(ar_in.clone())
            result["went_on"] = True  # never reached: the fault ends both ranks
            return result
        x = ar_in.clone()
        got = tensor_model_parallel_all_reduce(x)
        result["all_reduce"] = {
            "same_tensor": got is x, "equal_stock": bool(torch.equal(got, stock_sum)),
            "shape": list(got.shape),
        }
        # Another group's all-reduce (the world group: the same ranks, another coordinator) is not
        # the slot's: SGLang's own path serves it, and no candidate call is counted for it.
        world = get_world_group().all_reduce(torch.ones(2, 8))
        result["world_group_sum"] = world.sum().item()
        if PHASE == "disagree":  # the norms' stock path cannot run at TP=2 on the CPU (see above)
            seam.STATE.runtime.receipts.flush()
            return result
        for name, norm in norms.items():
            res_in = residual.clone()
            out, new_residual = norm.forward_with_allreduce_fusion(partial.clone(), res_in)
            s_out, s_res = stock[name]
            result[name] = {
                "out_vs_stock": (out.float() - s_out.float()).abs().max().item(),
                "residual_vs_stock": (new_residual.float() - s_res.float()).abs().max().item(),
                "residual_kept": bool(torch.equal(res_in, residual)),
                "dtype": str(out.dtype),
            }
        seam.STATE.runtime.receipts.flush()
        return result
"""
    + LAUNCH
)

ARMED = launch_environment(["collective", "arfusion"])  # CACHEON_BIND_COLLECTIVE=1, ARFUSION=1, others 0


def _run(scenario, receipts, phase: str, plugin: str, fault: str | None = None) -> dict:
    """Both ranks of the scenario, armed for the collective and arfusion rows, with one plugin."""
    env = {**ARMED, "SCENARIO_PHASE": phase, "CACHEON_RECEIPT_DIR": str(receipts), "CACHEON_PLUGINS": plugin}
    if fault is not None:
        env["CACHEON_TEST_COLLECTIVE_FAULT"] = fault
    return scenario(RANKS, env=env)


def _receipts_cli(directory) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("cacheon")), "receipts", str(directory), "--expect-ranks", "2", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )


def test_both_ranks_serve_the_all_reduce_and_the_arfusion_norms_through_the_candidates(scenario, tmp_path):
    receipts = tmp_path / "receipts"
    out = _run(scenario, receipts, "serve", "cacheon-example-kernels")
    for rank, entry in enumerate(out["ranks"]):
        assert entry["exit"] == 0 and entry["report"][0] == "ok", f"rank {rank}: {entry}"
        result = entry["report"][1]
        # the arfusion binding also arms the deep epilogue's consumer, which serves moe.finalize
        assert result["sites"] == ["arfusion.allreduce_add_rmsnorm", "collective.all_reduce", "moe.finalize"]
        assert {"tp_all_reduce", "rmsnorm_arfusion", "gemma_rmsnorm_arfusion"} <= set(result["installed"])
        # in place on the CPU, as SGLang's own all_reduce; sum of two fp32 partials: exact
        assert result["all_reduce"] == {"same_tensor": True, "equal_stock": True, "shape": [3, 4, 32]}
        assert result["world_group_sum"] == 2 * 16
        assert result["own"] == "no CPU kernel"  # SGLang's own method; the candidate serves it below
        for name in ("rmsnorm", "gemma"):
            case = result[name]
            assert case["residual_kept"] and case["dtype"] == "torch.bfloat16", (name, case)
            # SGLang's fallback rounds the reduced sum to bf16 before the add; the slot adds in fp32
            assert case["out_vs_stock"] <= 0.07 and case["residual_vs_stock"] <= 0.07, (name, case)
            assert case["out_vs_stock"] > 0 or case["residual_vs_stock"] > 0  # not SGLang's own arithmetic
    counts: dict = {}
    for r in read_receipts(receipts):
        if r.kind in ("completed", "route"):
            key = (r.kind, r.rank, r.slot, r.variant)
            counts[key] = counts.get(key, 0) + r.count
    for rank in (0, 1):
        assert counts[("completed", rank, "collective.all_reduce", "example_torch_all_reduce")] == 1
        assert counts[("completed", rank, "arfusion.allreduce_add_rmsnorm", "example_torch_arfusion")] == 2
        assert counts[("route", rank, "collective.all_reduce", "example_torch_all_reduce")] == 1
    cli = _receipts_cli(receipts)
    report = json.loads(cli.stdout)
    assert cli.returncode == 0 and report["ok"], report["problems"]
    assert report["routes"]["collective.all_reduce"] == {"0": ["example_torch_all_reduce"]} | {
        "1": ["example_torch_all_reduce"]
    }


def test_a_rank_local_fault_after_agreement_ends_both_ranks_with_one_clear_error(scenario, tmp_path):
    receipts = tmp_path / "receipts"
    out = _run(scenario, receipts, "fault", "cacheon-test-failing-norm", fault="raise_on_rank_1")
    assert [r["exit"] for r in out["ranks"]] == [COLLECTIVE_ABORT_EXIT, COLLECTIVE_ABORT_EXIT], out
    assert all(r["report"] is None for r in out["ranks"])  # no rank went on after the fault
    assert out["seconds"] < 60, out  # bounded: the peer fails at its communication, not at a timeout
    failed = {r.rank: r.reason for r in read_receipts(receipts) if r.kind == "failed"}
    assert set(failed) == {0, 1} and "rank-local fault" in failed[1], failed
    assert not any(r.kind == "fallback" for r in read_receipts(receipts))
    cli = _receipts_cli(receipts)
    assert cli.returncode != 0 and any("failed" in p for p in json.loads(cli.stdout)["problems"])


def test_ranks_that_disagree_on_the_route_both_run_sglangs_own_all_reduce(scenario, tmp_path):
    receipts = tmp_path / "receipts"
    out = _run(scenario, receipts, "disagree", "cacheon-test-failing-norm", fault="supports_rank_0")
    for entry in out["ranks"]:
        assert entry["exit"] == 0 and entry["report"][0] == "ok", entry
        assert entry["report"][1]["all_reduce"]["equal_stock"]
    all_receipts = read_receipts(receipts)
    routes = [r for r in all_receipts if r.kind == "route" and r.slot == "collective.all_reduce"]
    assert sorted(r.rank for r in routes) == [0, 1], routes
    assert all(r.variant is None and "rank 0: failing_all_reduce, rank 1: stock" in r.reason for r in routes)
    assert not any(r.kind == "completed" and r.slot == "collective.all_reduce" for r in all_receipts)
