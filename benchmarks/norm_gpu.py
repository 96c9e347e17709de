"""The example plugin's Triton RMSNorm kernels on a CUDA GPU, against the memory-bandwidth ceiling
measured in the same run, Liger-Kernel's RMSNorm, and torch's eager and compiled references.

Every timing is the median of ``triton.testing.do_bench`` with inputs rotated among several sets
so that nothing is served from L2. Bytes are the fewest each op must move: RMSNorm reads x and
writes out (the weight is one row); fused add + RMSNorm reads x and residual and writes residual and
out. The ceiling is a device-to-device copy of a 2 GiB buffer (bytes read + bytes written).

    python benchmarks/norm_gpu.py [--out DIR] [--append FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

from cacheon_example_kernels import triton_kernels

EPS = 1e-6
DECODE = [1, 16, 64, 256]
PREFILL = [4096, 16384, 32768]
HIDDEN = [4096, 8192]


class Rotation:
    """Input sets taken in turn, enough of them (at least 2; ``total`` bytes in all, at most ``cap`` sets; by
    default about 512 MiB: ten times an H200's L2) to keep the working set out of L2. Calling it returns the next
    set; ``count`` is how many there are. (Until 2026-12-02 at most 16 sets: at 4 MiB a set, T 256 at h 4096,
    that is 64 MiB, and part of it was still served from L2.)"""

    def __init__(self, make: Any, bytes_per_set: int, total: int = 512 << 20, cap: int = 1024) -> None:
        self.count = max(2, min(cap, total // max(bytes_per_set, 1)))
        self.sets = [make() for _ in range(self.count)]
        self.i = 0

    def __call__(self) -> Any:
        self.i = (self.i + 1) % self.count
        return self.sets[self.i]


class CallGraph:
    """``calls`` calls of ``fn`` captured in one CUDA graph, to time one call's GPU time without the host's.

    Every implementation timed beside another must be captured with the same ``calls``: a graph replays the
    input sets its calls took while it was captured, so the count decides how many bytes a replay reads and
    whether a replay finds the last replay's inputs still in L2. (Triton's do_bench_cudagraph captures as many
    calls as fit in ``rep`` by an eager estimate of one call, host time included: an implementation with a slow
    Python path got fewer calls, so fewer sets, and read them from L2 where a fast one read them from memory.)
    With a Rotation, ``calls`` = its count makes every replay read every set once."""

    def __init__(self, fn: Any, calls: int) -> None:
        self.calls = calls
        fn()  # compiled and warm before the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()

    def per_call_us(self, replays: int = 3) -> float:
        """The median over ``replays`` replays of one call's time, after one replay to warm (a replay's L2 is
        what the replay before it left)."""
        self.graph.replay()
        times = []
        for _ in range(replays):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.calls)
        return statistics.median(times)


def median_us(fn: Any) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3


def ceiling_gbps() -> float:
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * n * 2 / (us * 1e-6) / 1e9


def torch_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def torch_fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    total = x.float() + r.float()
    r.copy_(total)
    return (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def liger_fns() -> tuple[Any, Any]:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    def rms(x: torch.Tensor, w: torch.Tensor) -> Any:
        return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)

    def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> Any:
        return LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)

    return rms, fused


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"{what}: relative error {err:.2e} against the float32 reference")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for results.json")
    parser.add_argument("--append", metavar="FILE", help="append the result tables to this markdown file")
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.inference_mode():
        result = run()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "norm_gpu.json").write_text(json.dumps(result, indent=2))
    table = render(result)
    print(table)
    if args.append:
        with open(args.append, "a") as fh:
            fh.write("\n" + table)


def candidates(fused: bool, pick: Any, w: torch.Tensor, impls: dict[str, Any]) -> dict[str, Any]:
    """name -> a zero-argument callable running that implementation on the next input set."""
    out: dict[str, Any] = {}
    for name, impl in impls.items():

        def call(impl: Any = impl, name: str = name) -> None:
            x, r, o = pick()
            if name == "example_triton":
                if fused:
                    triton_kernels.fused_add_rmsnorm(x=x, residual=r, weight=w, eps=EPS, out=o)
                else:
                    triton_kernels.rmsnorm(x=x, weight=w, eps=EPS, out=o)
            elif fused:
                impl(x, r, w)
            else:
                impl(x, w)

        out[name] = call
    return out


def run() -> dict[str, Any]:
    peak = ceiling_gbps()
    liger_rms, liger_fused = liger_fns()
    impls = {
        False: {
            "example_triton": None,
            "liger": liger_rms,
            "torch_eager": torch_rmsnorm,
            "torch_compile": torch.compile(torch_rmsnorm),
        },
        True: {
            "example_triton": None,
            "liger": liger_fused,
            "torch_eager": torch_fused,
            "torch_compile": torch.compile(torch_fused),
        },
    }
    rows = []
    for h in HIDDEN:
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        for t in DECODE + PREFILL:
            row: dict[str, Any] = {"h": h, "t": t}
            for op in ("rmsnorm", "fused_add_rmsnorm"):
                fused = op == "fused_add_rmsnorm"
                nbytes = (4 if fused else 2) * t * h * 2

                def make(t: int = t, h: int = h) -> tuple[torch.Tensor, ...]:
                    return tuple(torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(3))

                pick = Rotation(make, 3 * t * h * 2)
                x, r, out = pick()
                if fused:  # correctness first, on fresh random inputs
                    r_ref, r_ours = r.clone(), r.clone()
                    want = torch_fused(x, r_ref, w)
                    triton_kernels.fused_add_rmsnorm(x=x, residual=r_ours, weight=w, eps=EPS, out=out)
                    check(r_ours, r_ref, f"{op} residual T={t} H={h}")
                else:
                    want = torch_rmsnorm(x, w)
                    triton_kernels.rmsnorm(x=x, weight=w, eps=EPS, out=out)
                    check(liger_rms(x, w), want, f"liger {op} T={t} H={h}")
                check(out, want, f"{op} T={t} H={h}")
                times = {name: median_us(fn) for name, fn in candidates(fused, pick, w, impls[fused]).items()}
                # the same bytes as one copy at this size: the ceiling where launches dominate
                src = torch.randn(nbytes // 4, device="cuda", dtype=torch.bfloat16)
                dst = torch.empty_like(src)
                times["copy_same_bytes"] = median_us(partial(dst.copy_, src))
                row[op] = {"us": times, "bytes": nbytes, "gbps": nbytes / (times["example_triton"] * 1e-6) / 1e9}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "ceiling_gbps": peak,
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"### RMSNorm kernels on {result['gpu']}, {result['date']}",
        "",
        f"torch {result['torch']}, triton {result['triton']}, bf16, eps 1e-6. "
        "Command: `python3 benchmarks/norm_gpu.py`.",
        f"Ceiling: a 2 GiB device-to-device copy, {result['ceiling_gbps']:.0f} GB/s (read + write).",
        "Times are medians in microseconds; `% ceiling` is the example kernel's bytes/time over that copy;",
        "`vs liger` is Liger's time over the example kernel's (above 1: the example kernel is faster).",
        "",
    ]
    for op in ("rmsnorm", "fused_add_rmsnorm"):
        lines += [
            f"| {op} H | T | example_triton | liger | torch eager | torch compile | copy of same bytes "
            "| GB/s | % ceiling | vs liger |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in result["rows"]:
            c = row[op]
            us = c["us"]
            lines.append(
                f"| {row['h']} | {row['t']} | {us['example_triton']:.1f} | {us['liger']:.1f} | "
                f"{us['torch_eager']:.1f} | "
                f"{us['torch_compile']:.1f} | {us['copy_same_bytes']:.1f} | {c['gbps']:.0f} | "
                f"{100 * c['gbps'] / result['ceiling_gbps']:.0f}% | {us['liger'] / us['example_triton']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
