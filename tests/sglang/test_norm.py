"""Real SGLang RMSNorm and GemmaRMSNorm, built on CPU, called through the seam in a scheduler."""

from __future__ import annotations

from tests.sglang.receipts import receipt_counts

LAYERS = """
    import json, torch
    import sglang.srt.layers.layernorm as ln
    from cacheon_sglang import seam
    from cacheon_core import CandidateFailure

    torch.manual_seed(0)
    rms = ln.RMSNorm(256, eps=1e-5).to(torch.bfloat16)
    gemma = ln.GemmaRMSNorm(256, eps=1e-6)
    with torch.no_grad():
        rms.weight.copy_(torch.randn(256))
        gemma.weight.weight_loader(gemma.weight, torch.randn(256) * 0.1)
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)   # [batch, tokens, hidden]: viewed as rows
    res = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    xg = torch.randn(9, 256)
    resg = torch.randn(9, 256)

    # SGLang's own answers, before this process becomes a scheduler (pass-through adapters).
    stock = rms(x)
    stock_fused, stock_res = rms(x.clone(), res.clone())
    stock_gemma = gemma(xg)
    stock_gemma_fused, stock_gemma_res = gemma(xg.clone(), resg.clone())

    seam.enter_scheduler(tp_rank=0)
    result = {"sites": sorted(seam.STATE.sites)}
    try:
        got = rms(x)
        fused_res = res.clone()
        got_fused, got_res = rms(x.clone(), fused_res)
        got_gemma = gemma(xg)
        gres = resg.clone()
        got_gemma_fused, got_gemma_res = gemma(xg.clone(), gres)
        def err(a, b):
            return (a.float() - b.float()).abs().max().item()
        result.update({
            "rms": err(got, stock), "rms_shape": list(got.shape), "rms_dtype": str(got.dtype),
            "fused": err(got_fused, stock_fused), "fused_res": err(got_res, stock_res),
            "res_in_place": got_res is fused_res,
            "gemma": err(got_gemma, stock_gemma), "gemma_fused": err(got_gemma_fused, stock_gemma_fused),
            "gemma_res": err(got_gemma_res, stock_gemma_res),
        })
    except CandidateFailure as exc:
        result["failure"] = str(exc)
    seam.STATE.runtime.receipts.close()
    print(json.dumps(result))
"""


def test_the_example_torch_variant_serves_both_classes_and_both_paths(scenario, tmp_path):
    receipts = tmp_path / "r"
    out = scenario(LAYERS, env={"CACHEON_RECEIPT_DIR": str(receipts), "CACHEON_PLUGINS": "cacheon-example-kernels"})
    assert out["sites"] == ["norm.fused_add_rmsnorm", "norm.rmsnorm"]
    assert out["rms_shape"] == [2, 7, 256] and out["rms_dtype"] == "torch.bfloat16"
    for key in ("rms", "fused", "fused_res", "gemma", "gemma_fused", "gemma_res"):
        assert out[key] <= 0.0625, (key, out[key])  # one bf16 ulp at these magnitudes
    assert out["res_in_place"]
    counts = receipt_counts(receipts)
    assert counts[("fired", "norm.rmsnorm", "example_torch")] == 2
    assert counts[("completed", "norm.rmsnorm", "example_torch")] == 2
    assert counts[("completed", "norm.fused_add_rmsnorm", "example_torch_fused")] == 2
    assert counts[("active",)] == 1


def test_with_no_eligible_variant_the_stock_path_runs_and_no_candidate_receipt_appears(scenario, tmp_path):
    receipts = tmp_path / "r"
    out = scenario(LAYERS, env={"CACHEON_RECEIPT_DIR": str(receipts), "CACHEON_PLUGINS": "no-such-plugin"})
    assert out["rms"] == 0 and out["fused"] == 0 and out["gemma"] == 0 and out["gemma_fused"] == 0
    kinds = {key[0] for key in receipt_counts(receipts)}
    assert kinds == {"load_failed"}  # "no candidate variant was registered", and nothing else


def test_a_failing_variant_raises_under_strict(scenario, tmp_path):
    receipts = tmp_path / "r"
    out = scenario(LAYERS, env={"CACHEON_RECEIPT_DIR": str(receipts), "CACHEON_PLUGINS": "cacheon-test-failing-norm"})
    assert "failing_rmsnorm" in out["failure"] and "kernel launch failed" in out["failure"]
    counts = receipt_counts(receipts)
    assert counts[("failed", "norm.rmsnorm", "failing_rmsnorm")] == 1
    assert ("completed", "norm.rmsnorm", "failing_rmsnorm") not in counts


def test_a_failing_variant_leaves_fallback_under_lenient(scenario, tmp_path):
    receipts = tmp_path / "r"
    out = scenario(
        LAYERS,
        env={
            "CACHEON_RECEIPT_DIR": str(receipts),
            "CACHEON_PLUGINS": "cacheon-test-failing-norm",
            "CACHEON_POLICY": "lenient",
        },
    )
    assert "failure" not in out
    for key in ("rms", "fused", "fused_res", "gemma", "gemma_fused", "gemma_res"):
        assert out[key] <= 0.0625, (key, out[key])  # the trusted reference served, residual restored
    counts = receipt_counts(receipts)
    assert counts[("fallback", "norm.rmsnorm", "failing_rmsnorm")] == 2
    assert counts[("fallback", "norm.fused_add_rmsnorm", "failing_fused")] == 2
