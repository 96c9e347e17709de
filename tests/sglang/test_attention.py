"""attention.decode at SGLang's real Triton decode kernel (run on the CPU by Triton's interpreter)."""

from __future__ import annotations

from cacheon_core import read_receipts
from cacheon_sglang.engine import launch_environment

DECODE = """
    import json, torch
    import sglang.kernels.ops.attention.decode_attention as da
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from cacheon_sglang import seam
    from cacheon_core._catalog import decode_reference

    torch.manual_seed(0)
    b, hq, hkv, d, slots = 4, 8, 2, 64, 256
    q = torch.randn(b, hq, d)
    k, v = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    lengths = torch.tensor([5, 31, 1, 12])
    # A CUDA-graph-sized indptr (longer than the batch) and an over-allocated indices buffer.
    indptr = torch.zeros(b + 3, dtype=torch.int32)
    indptr[1 : b + 1] = lengths.cumsum(0)
    indptr[b + 1 :] = indptr[b]
    indices = torch.cat([torch.randperm(slots)[: int(lengths.sum())], torch.zeros(16, dtype=torch.int64)])
    splits = 4
    logits = torch.empty(b, hq, splits, d)
    lse = torch.empty(b, hq, splits)
    nsplits = torch.full((b,), 2, dtype=torch.int32)

    def run(**extra):
        o = torch.zeros(b, hq, d)
        decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, nsplits, splits, 0.125, 1.0, 1.0, **extra)
        return o

    stock = run()  # SGLang's kernel: this process is not a scheduler yet
    seam.enter_scheduler(tp_rank=0)
    served = run()
    capped = run(logit_cap=30.0)  # outside the slot's semantics: SGLang's kernel again
    ref = torch.empty(b, hq, d)
    decode_reference(q=q, k_cache=k, v_cache=v, kv_indptr=indptr[: b + 1], kv_indices=indices, scale=0.125, out=ref)
    seam.STATE.runtime.receipts.close()
    print(json.dumps({
        "adapter": bool(getattr(da.decode_attention_fwd, "__cacheon_adapter__", False)),
        "stock_vs_ref": (stock - ref).abs().max().item(),
        "served_vs_stock": (served - stock).abs().max().item(),
        "capped_vs_stock": (capped - stock).abs().max().item(),
    }))
"""


def test_the_decode_kernel_is_served_by_the_candidate_where_its_semantics_match(scenario, tmp_path):
    receipts = tmp_path / "r"
    env = {
        **launch_environment(["attention_decode", "norm", "scheduler_gate"]),
        "TRITON_INTERPRET": "1",
        "CACHEON_RECEIPT_DIR": str(receipts),
        "CACHEON_PLUGINS": "cacheon-example-kernels",
    }
    out = scenario(DECODE, env=env, timeout=600)
    assert out["adapter"]
    assert out["stock_vs_ref"] < 1e-5  # SGLang's own kernel agrees with the slot's reference
    assert out["served_vs_stock"] < 1e-5  # and the example's torch variant agrees with SGLang's kernel
    assert out["capped_vs_stock"] > 1e-4  # logit capping changed the answer: SGLang's kernel ran it
    counts = {}
    for r in read_receipts(receipts):
        counts[(r.kind, r.slot, r.variant)] = counts.get((r.kind, r.slot, r.variant), 0) + r.count
    assert counts[("completed", "attention.decode", "example_torch_decode")] == 1
    assert counts[("fired", "attention.decode", "example_torch_decode")] == 1
