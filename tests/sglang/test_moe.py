"""Real SGLang FusedMoE layers, built on CPU, whose experts run through the seam in a scheduler."""

from __future__ import annotations

from cacheon_core._catalog import FUSED_EXPERTS
from cacheon_sglang.engine import launch_environment
from tests.sglang.receipts import receipt_counts

LAYERS = """
    import json, os, socket, torch
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment, initialize_model_parallel, set_custom_all_reduce,
    )
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import TopK
    from cacheon_sglang import seam
    from cacheon_core._catalog import fused_experts_reference

    # A one-rank tensor-parallel world over gloo, as SGLang's scheduler sets up before building layers.
    publish(ServerArgs(model_path="dummy", device="cpu"), role="scheduler", ranks=SpawnRanks(world_rank=0))
    os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
    set_custom_all_reduce(False)
    init_distributed_environment(
        backend="gloo", world_size=1, rank=0, local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=60,
    )
    initialize_model_parallel()

    torch.manual_seed(0)
    cases = {}
    # 8 experts, top-2; "scaled" has a routed scaling factor, which the slot does not mean.
    for layer_id, (name, dtype, scale) in enumerate(
        (("bf16", torch.bfloat16, None), ("fp32", torch.float32, None), ("scaled", torch.bfloat16, 2.5))
    ):
        moe = FusedMoE(
            num_experts=8, hidden_size=64, intermediate_size=32, layer_id=layer_id, top_k=2,
            params_dtype=dtype, routed_scaling_factor=scale,
        )
        with torch.no_grad():
            moe.w13_weight.normal_(0, 64 ** -0.5)
            moe.w2_weight.normal_(0, 32 ** -0.5)
        x = torch.randn(7, 64, dtype=dtype)
        topk = TopK(top_k=2, renormalize=True, layer_id=layer_id)(x, torch.randn(7, 8))
        ref = torch.empty_like(x)
        fused_experts_reference(
            hidden_states=x, w13=moe.w13_weight.data, w2=moe.w2_weight.data,
            topk_weights=topk.topk_weights, topk_ids=topk.topk_ids, out=ref,
        )
        # SGLang's own answer, before this process becomes a scheduler (the adapter passes through).
        cases[name] = (moe, x, topk, moe(x.clone(), topk), ref)

    seam.enter_scheduler(tp_rank=0)
    result = {"sites": sorted(seam.STATE.sites), "installed": sorted(seam.STATE.installed)}
    def need(a, b):  # the smallest atol = rtol at which a matches b
        a, b = a.double(), b.double()
        return ((a - b).abs() / (1 + b.abs())).max().item()
    with torch.no_grad():
        for name, (moe, x, topk, stock, ref) in cases.items():
            got = moe(x.clone(), topk)
            result[name] = {
                "vs_stock": need(got, stock), "stock_vs_ref": need(stock, ref), "vs_ref": need(got, ref),
                "equal_stock": bool(torch.equal(got, stock)),
                "shape": list(got.shape), "dtype": str(got.dtype), "ids": str(topk.topk_ids.dtype),
            }
    seam.STATE.runtime.receipts.close()
    print(json.dumps(result))
"""

ARMED = launch_environment(["moe"])  # CACHEON_BIND_MOE=1, every other gate 0


def test_the_example_variant_serves_sglangs_fused_moe_within_the_slot_tolerance(scenario, tmp_path):
    receipts = tmp_path / "r"
    env = {**ARMED, "CACHEON_RECEIPT_DIR": str(receipts), "CACHEON_PLUGINS": "cacheon-example-kernels"}
    out = scenario(LAYERS, env=env)
    assert out["sites"] == ["moe.fused_experts"] and out["installed"] == ["fused_moe"]
    for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        case, tol = out[name], FUSED_EXPERTS.tolerances[dtype]
        assert case["shape"] == [7, 64] and case["dtype"] == f"torch.{dtype}"
        assert case["ids"] == "torch.int64"  # SGLang's CPU top-k hands out int64 ids
        assert case["vs_ref"] <= tol.atol, (name, case)
        assert case["stock_vs_ref"] <= tol.atol, (name, case)
        assert case["vs_stock"] <= 2 * tol.atol, (name, case)
    assert not out["bf16"]["equal_stock"]  # computed in float32 by the candidate, not in bf16 steps by SGLang
    assert out["scaled"]["equal_stock"]  # declined: a routed scaling factor is not the slot's meaning
    counts = receipt_counts(receipts)
    assert counts[("fired", "moe.fused_experts", "example_torch_experts")] == 2
    assert counts[("completed", "moe.fused_experts", "example_torch_experts")] == 2
    assert counts[("active",)] == 1


def test_with_no_eligible_variant_sglangs_own_path_runs(scenario, tmp_path):
    receipts = tmp_path / "r"
    out = scenario(LAYERS, env={**ARMED, "CACHEON_RECEIPT_DIR": str(receipts), "CACHEON_PLUGINS": "no-such-plugin"})
    assert out["installed"] == ["fused_moe"]
    assert all(out[name]["equal_stock"] for name in ("bf16", "fp32", "scaled"))
    assert {key[0] for key in receipt_counts(receipts)} == {"load_failed"}  # no candidate registered, nothing fired
