"""What an eviction hint on a norm's output costs the kernel that reads it next, on a CUDA GPU.

benchmarks/norm_sweep.py times each kernel alone, on inputs rotated out of L2. There, marking the
output's store evict_first (triton_kernels.STREAM_POLICIES[2]) made the plugin's one-read norms faster.
But the next kernel of a layer reads that output, and evict_first asks L2 to drop it first. This script
times the pair: the plugin's norm (no hints, level 0; or level 2) followed by a consumer of its output,
under one CUDA graph (norm_gpu.CallGraph: one call per input set, every case alike), inputs rotated
among sets of about 512 MiB in all (norm_gpu.Rotation). Consumers: the plugin's RMSNorm of the output
(memory-bound: it reads the output once) and a GEMM ``out @ w`` with a fixed bf16 weight of h x 4096 (the
next projection's shape, smaller).

Correctness first: the hinted kernel's output must equal the unhinted one's bit for bit (the hint changes
no arithmetic), and both must match norm_gpu's float32 reference. Each figure is the median over
``--rounds`` rounds, the configurations interleaved within a round.

    python3 benchmarks/norm_consumer.py [--out DIR] [--tokens 256,512,1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from norm_gpu import CallGraph, Rotation, torch_fused, torch_rmsnorm
from norm_sweep import candidate_impl

from cacheon_example_kernels import triton_kernels

DTYPE = torch.bfloat16


def launch(
    kernel: str, level: int, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor
) -> None:
    """The plugin's one-read kernel with the plugin's warps, with eviction hints of ``level`` (the
    sweep's stream family)."""
    t, h = x.shape
    two_reads, options = triton_kernels._norm_launch(t, h, fused=kernel == "fused_add_rmsnorm")
    assert not two_reads, "the one-read kernels only: the hints are theirs"
    impl = candidate_impl(kernel, {"family": "stream", "rows": 1, "num_warps": options["num_warps"], "stream": level})
    if r is None:
        impl(x, w, out)
    else:
        impl(x, r, w, out)


def check(kernel: str, t: int, h: int, w: torch.Tensor) -> None:
    g = torch.Generator(device="cuda").manual_seed(t + h)
    x = torch.randn(t, h, device="cuda", generator=g).to(DTYPE)
    r = torch.randn(t, h, device="cuda", generator=g).to(DTYPE) if kernel == "fused_add_rmsnorm" else None
    outs = []
    for level in (0, 2):
        out, res = torch.empty_like(x), None if r is None else r.clone()
        launch(kernel, level, x, res, w, out)
        outs.append((out, res))
    assert torch.equal(outs[0][0], outs[1][0]), "the hinted output differs"
    if r is None:
        want = torch_rmsnorm(x.float(), w.float())
    else:
        assert torch.equal(outs[0][1], outs[1][1]), "the hinted residual differs"
        want = torch_fused(x.float(), r.float(), w.float())
    torch.testing.assert_close(outs[0][0].float(), want, rtol=2e-2, atol=2e-2)


def measure(kernel: str, t: int, h: int, rounds: int) -> dict[str, Any]:
    fused = kernel == "fused_add_rmsnorm"
    w = torch.randn(h, device="cuda").to(DTYPE)
    proj = torch.randn(h, 4096, device="cuda").to(DTYPE) / h**0.5
    check(kernel, t, h, w)

    def make() -> tuple[torch.Tensor, ...]:  # x, residual (fused), out, the consumers' outputs
        count = 2 if fused else 1
        tensors = [torch.randn(t, h, device="cuda", dtype=DTYPE) for _ in range(count)]
        return (*tensors, torch.empty(t, h, device="cuda", dtype=DTYPE), torch.empty(t, h, device="cuda", dtype=DTYPE))

    pick = Rotation(make, (5 if fused else 3) * t * h * DTYPE.itemsize)

    def call(level: int | None, consumer: str | None) -> Any:
        def run() -> None:
            sets = pick()
            x, r = sets[0], sets[1] if fused else None
            out, out2 = sets[-2], sets[-1]
            if level is not None:
                launch(kernel, level, x, r, w, out)
            if consumer == "rmsnorm":
                launch("rmsnorm", 0, out, None, w, out2)
            elif consumer == "gemm":
                torch.mm(out, proj)

        return run

    cases = {
        "norm, no hints": (0, None),
        "norm, output evict_first": (2, None),
        "rmsnorm consumer alone": (None, "rmsnorm"),
        "norm + rmsnorm consumer, no hints": (0, "rmsnorm"),
        "norm + rmsnorm consumer, output evict_first": (2, "rmsnorm"),
        "gemm consumer alone": (None, "gemm"),
        "norm + gemm consumer, no hints": (0, "gemm"),
        "norm + gemm consumer, output evict_first": (2, "gemm"),
    }
    graphs = {name: CallGraph(call(level, consumer), pick.count) for name, (level, consumer) in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(graph.per_call_us(5))
    row: dict[str, Any] = {"kernel": kernel, "h": h, "t": t, "us": {k: statistics.median(v) for k, v in times.items()}}
    row["rounds"] = times
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/out", help="folder for norm_consumer.json (default /tmp/out)")
    parser.add_argument("--tokens", default="256,512", help="a comma list of T (default 256,512)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size (default 3)")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    results = []
    for kernel in ("rmsnorm", "fused_add_rmsnorm"):
        for h in (4096, 8192):
            for t in tokens:
                if any(triton_kernels._norm_launch(t, h, fused=f)[0] for f in {kernel != "rmsnorm", False}):
                    continue  # two reads there (the norm's, or its RMSNorm consumer's): no one-read kernel to hint
                row = measure(kernel, t, h, args.rounds)
                us = row["us"]
                pair_0 = us["norm + rmsnorm consumer, no hints"]
                pair_2 = us["norm + rmsnorm consumer, output evict_first"]
                gemm_0 = us["norm + gemm consumer, no hints"]
                gemm_2 = us["norm + gemm consumer, output evict_first"]
                print(
                    f"{kernel:18} h={h:5} T={t:5}  norm {us['norm, no hints']:.2f} -> "
                    f"{us['norm, output evict_first']:.2f} us  + rmsnorm {pair_0:.2f} -> {pair_2:.2f}"
                    f"  + gemm {gemm_0:.2f} -> {gemm_2:.2f}",
                    flush=True,
                )
                results.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["norm_consumer.py", *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    (out / "norm_consumer.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
