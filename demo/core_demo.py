"""Dispatch through the installed example plugin as a scheduler process would, and show the evidence.

Run by ``nox -s demo`` with ``CACHEON_RECEIPT_DIR`` set; ``cacheon receipts`` then judges the
receipts this process wrote.
"""

from __future__ import annotations

import time

import torch

from cacheon_core import Accepted, Role, start
from cacheon_core._catalog import fused_add_rmsnorm_reference, rmsnorm_reference


def main() -> None:
    runtime = start(Role.SCHEDULER)
    print(
        f"role={runtime.role.value} policy={runtime.dispatcher.policy.value} "
        f"registry enabled={runtime.registry.enabled}"
    )
    for report in runtime.discovery.plugins:
        print(f"  plugin {report.distribution} {report.version}: {report.status}")

    rms = runtime.dispatcher.site("norm.rmsnorm")
    fused = runtime.dispatcher.site("norm.fused_add_rmsnorm")
    for tokens, hidden, dtype in ((1, 4096, torch.bfloat16), (16, 4096, torch.bfloat16), (128, 2048, torch.float32)):
        x = torch.randn(tokens, hidden, dtype=dtype)
        w = torch.randn(hidden, dtype=dtype)
        plan = rms.plan_for(x=x, weight=w, eps=1e-6)
        trace = ", ".join(
            f"{d.variant}: {'accepted' if isinstance(d, Accepted) else 'rejected (' + d.reason + ')'}"
            for d in plan.resolution.trace
        )
        start_ns = time.perf_counter_ns()
        for _ in range(20):
            out = rms(x=x, weight=w, eps=1e-6)
        per_call = (time.perf_counter_ns() - start_ns) / 20 / 1e3
        expected = torch.empty_like(x)
        rmsnorm_reference(x=x, weight=w, eps=1e-6, out=expected)
        err = (out.float() - expected.float()).abs().max().item()
        print(
            f"norm.rmsnorm [{tokens}x{hidden} {str(dtype)[6:]}] -> {plan.variant.name if plan.variant else 'stock'}"
            f" ({per_call:.1f} us/call, max |err| {err:.2e}); trace: {trace}"
        )

        residual = torch.randn_like(x)
        ref_residual = residual.clone()
        out = fused(x=x, residual=residual, weight=w, eps=1e-6)
        fused_add_rmsnorm_reference(x=x, residual=ref_residual, weight=w, eps=1e-6, out=expected)
        err = max(
            (out.float() - expected.float()).abs().max().item(),
            (residual.float() - ref_residual.float()).abs().max().item(),
        )
        name = fused.plan_for(x=x, residual=residual, weight=w, eps=1e-6).variant
        print(f"norm.fused_add_rmsnorm [{tokens}x{hidden}] -> {name.name if name else 'stock'} (max |err| {err:.2e})")
    decode = runtime.dispatcher.site("attention.decode")
    from cacheon_core._catalog import ATTENTION_DECODE, decode_reference

    args = ATTENTION_DECODE.sampler(
        {"b": 8, "hq": 32, "d": 128, "ns": 4096, "hkv": 8, "b1": 9, "nnz": 3000},
        "bfloat16",
        "cpu",
        torch.Generator().manual_seed(0),
    )
    out = decode(**args, scale=128**-0.5)
    expected = torch.empty_like(args["q"])
    decode_reference(**args, scale=128**-0.5, out=expected)
    name = decode.plan_for(**args, scale=128**-0.5).variant
    print(
        f"attention.decode [8 sequences, 3000 KV slots, GQA 32/8] -> {name.name if name else 'stock'} "
        f"(max |err| {(out.float() - expected.float()).abs().max().item():.2e})"
    )
    runtime.receipts.close()
    print(f"receipts written to {runtime.receipts.path}")


if __name__ == "__main__":
    main()
