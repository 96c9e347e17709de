"""The example plugin's norms against Liger-Kernel by turns, at a few rows, under CUDA graphs.

At a few rows a norm is a few microseconds of GPU time, and one timing of each kernel (as
benchmarks/norm_sweep.py takes) differs from the next run's by about as much as the kernels differ. Here
every size is timed in rounds: each implementation's calls are captured once in a CUDA graph
(norm_gpu.CallGraph), every implementation with the same number of calls, and each round replays every
graph (one replay to warm, then ``--replays`` timed: their median per call), in a new random order, so a
drift of the card (clocks, temperature, a neighbour) falls on all of them alike. Per implementation it
reports the median over the rounds and the range, and against Liger the median of the rounds' ratios
(Liger's time over the implementation's: above 1, faster than Liger) and the rounds in which it was at
least as fast.

Inputs: rotated (default), every replay reads each of ``--rotate-mib`` MiB of input sets once, so every
call's input comes from memory; or with ``--held``, every call reads one set, warm in L2 (``--held-calls``
calls a graph). Its first runs (BENCHMARKS.md, the two entries of 2026-12-06 on Liger by turns) timed with
Triton's do_bench_cudagraph instead, which captures as many calls as an eager estimate of one call (host time
included) fits in its ``rep``: Liger's functions, slower on the host, got fewer calls, so fewer input sets, and
at some sizes read them from L2 where the others read theirs from memory.

Implementations, every one checked against the float32 reference (norm_sweep.check: row-padded inputs,
the padding untouched) before it is timed; all write their outputs into blocks allocated per call, as
Liger's functions do (under graphs, the block the last call freed):
- plugin: the slot's Triton variant as the plugin launches it (the fused residual updated in place, as the
  slot updates it);
- fresh (fused only): the plugin's fused kernel at its own launch writing the new residual into a new block
  too, as Liger's fused function does (norm_sweep.plugin_fresh_impls);
- liger: LigerRMSNormFunction / LigerFusedAddRMSNormFunction ("llama" casting, as norm_gpu.py calls them);
- S<level>xW<warps>: the plugin's one-read kernel at other launches (norm_sweep's stream family: eviction
  hint level triton_kernels.STREAM_POLICIES[level], warps).
With ``--probes``, what differs between the plugin's one-read kernel and Liger's, one thing at a time, each at the
plugin's warps (Liger's too) with no hints (as Liger): ``ligerk``, Liger's own kernel launched straight, its
outputs allocated as the others' are; and the plugin's kernel (a copy here, ``probe_*``) with ``+rstd``: each
row's rstd also stored, as Liger stores it; ``+llama``: Liger's ("llama") order, the scaled row rounded to bf16
before the weight multiplies it (fused: the sum rounded to bf16 first, as Liger sums); ``+libdev``: libdevice's
rsqrt, as Liger calls it; ``+all``: the three together.
With ``--copy``, the goal's ceiling beside them: ``copy``, one copy of as many bytes as the norm must move (the
read half copied into the written half; its own rotation of as many sets, the same count of calls), and
``plugin_o``, the plugin writing into the rotated sets' outputs (the slot's call, its output given), as
norm_sweep.py's ``copy`` and ``plugin`` columns are placed; and ``copy_a``, the same copy into a block allocated
per call (norm_sweep.py's ``copy_alloc``: the ceiling of ``plugin`` for RMSNorm, and of ``fresh``, both of whose
writes land in such blocks, for fused); each row then also reports the median of the rounds' copy time over its
own (``vs copy``) and of copy_a's (``vs copy_a``). With ``--s-rotated`` the S candidates write into the rotated
outputs too (compare them with ``plugin_o``), not into blocks allocated per call (compare them with ``plugin``).
With ``--bisect``, where Liger's function and its kernel launched straight part: ``lfwd``, Liger's forward function
(``rms_norm_forward``, ``fused_add_rms_norm_forward``) without the autograd Function around it; ``ligerk_e``, Liger's
kernel straight with its outputs allocated as Liger's forward allocates them (``torch.empty`` of the shape);
``pfn``, the plugin's one-read kernel at its launch called inside an autograd Function that allocates and saves
as Liger's does (the output, then rstd's row, saved for backward with the input and the weight); ``ligerk_w`` and
``plugin_w``, Liger's kernel straight and the plugin, reading one input set every call (warm in L2) whichever
inputs the others read.

    python3 benchmarks/norm_turns.py [--rounds 12] [--replays 3] [--rotate-mib 256 | --held [--held-calls 2048]]
                                     [--hidden 4096,8192] [--tokens 4,8,16,32] [--kernels rmsnorm,fused_add_rmsnorm]
                                     [--levels 0,1] [--warps 4,8,16] [--probes] [--bisect] [--copy [--s-rotated]]
                                     [--budget-s 330]
                                     [--out DIR]

writes DIR/norm_turns.json (default /tmp/out), rewritten after every size; no new size is started after
--budget-s.
"""

# ruff: noqa: N803  (Triton's constexpr parameters are upper case, as in the plugin)

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from norm_gpu import EPS, CallGraph, Rotation
from norm_sweep import (
    DTYPE,
    KERNELS,
    allocating,
    candidate_impl,
    check,
    liger_impls,
    op_bytes,
    plugin_alloc_impls,
    plugin_fresh_impls,
    plugin_impls,
    rotated_call,
    version,
)

from cacheon_example_kernels import triton_kernels

ROTATION_CAP = 16384  # sets: at T 2 of h 4096 a set is 32 KiB, and 256 MiB takes 8192 of them


@triton.jit
def _rsqrt(v, LIBDEV: tl.constexpr):
    if LIBDEV:
        return libdevice.rsqrt(v)
    return tl.rsqrt(v)


@triton.jit
def _probe_norm(
    v, w, out_ptr, rstd_ptr, row, out_row, cols, mask, h, eps,
    RSTD: tl.constexpr, LLAMA: tl.constexpr, LIBDEV: tl.constexpr,
):  # fmt: skip
    # The probes' norm of the float32 row v, written to out's row: rstd stored (RSTD), Liger's order (LLAMA).
    rstd = _rsqrt(tl.sum(v * v, axis=0) / h + eps, LIBDEV)
    if RSTD:
        tl.store(rstd_ptr + row, rstd)
    if LLAMA:
        y = ((v * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w).to(out_ptr.dtype.element_ty)
    else:
        y = (v * rstd * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row + cols, y, mask=mask)


@triton.jit
def probe_rmsnorm_kernel(
    x_ptr, w_ptr, out_ptr, rstd_ptr, x_row, out_row, h, eps,
    BLOCK: tl.constexpr, RSTD: tl.constexpr, LLAMA: tl.constexpr, LIBDEV: tl.constexpr,
):  # fmt: skip
    # The plugin's one-read RMSNorm (triton_kernels: no hints) with Liger's differences switched on one by one.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    _probe_norm(x, w, out_ptr, rstd_ptr, row, out_row, cols, mask, h, eps, RSTD, LLAMA, LIBDEV)


@triton.jit
def probe_fused_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, ro_ptr, rstd_ptr, x_row, r_row, out_row, ro_row, h, eps,
    BLOCK: tl.constexpr, RSTD: tl.constexpr, LLAMA: tl.constexpr, LIBDEV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if LLAMA:  # noqa: SIM108 (one branch compiled: LLAMA is a constant)
        s = (x + r).to(tl.float32)  # the sum in bf16, as Liger adds
    else:
        s = x.to(tl.float32) + r.to(tl.float32)
    tl.store(ro_ptr + row * ro_row + cols, s.to(ro_ptr.dtype.element_ty), mask=mask)
    _probe_norm(s, w, out_ptr, rstd_ptr, row, out_row, cols, mask, h, eps, RSTD, LLAMA, LIBDEV)


PROBES = {  # name: (RSTD, LLAMA, LIBDEV)
    "+none": (False, False, False),
    "+rstd": (True, False, False),
    "+llama": (False, True, False),
    "+libdev": (False, False, True),
    "+all": (True, True, True),
}


def probe_impls(kernel: str, t: int, h: int) -> dict[str, Any]:
    """The probes at this size: outputs (and, fused, the new residual, as ``fresh`` and Liger place it)
    allocated per call, and rstd's float32 row where a probe stores it."""
    fused = kernel == "fused_add_rmsnorm"
    _, options = triton_kernels._norm_launch(t, h, fused=fused)
    launch = {"BLOCK": options["BLOCK"], "num_warps": options["num_warps"]}
    impls: dict[str, Any] = {}
    for name, (rstd, llama, libdev) in PROBES.items():
        flags = {"RSTD": rstd, "LLAMA": llama, "LIBDEV": libdev, **launch}
        if fused:

            def run_fused(x: Any, r: Any, w: Any, out: Any, flags: dict[str, Any] = flags) -> tuple[Any, ...]:
                own, new_r = torch.empty_like(x), torch.empty_like(r)
                rs = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
                args = (x, r, w, own, new_r, rs, x.stride(0), r.stride(0), own.stride(0), new_r.stride(0))
                probe_fused_kernel[(x.shape[0],)](*args, x.shape[1], EPS, **flags)
                return own, new_r

            impls[name] = run_fused
        else:

            def run(x: Any, w: Any, out: Any, flags: dict[str, Any] = flags) -> Any:
                own = torch.empty_like(x)
                rs = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
                probe_rmsnorm_kernel[(x.shape[0],)](x, w, own, rs, x.stride(0), own.stride(0), x.shape[1], EPS, **flags)
                return own

            impls[name] = run
    impls["ligerk"] = liger_kernel_direct(kernel)
    return impls


def liger_kernel_direct(kernel: str, like: bool = True) -> Any:
    """Liger's forward kernel launched as Liger's function launches it ("llama", no offset), without the
    function around it; outputs allocated as the probes' are (``torch.empty_like`` the input), or, ``like``
    false, as Liger's forward allocates them (``torch.empty`` of the shape)."""

    def alloc(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x) if like else torch.empty(x.shape, dtype=x.dtype, device=x.device)

    from liger_kernel.ops.utils import calculate_settings

    if kernel == "rmsnorm":
        from liger_kernel.ops.rms_norm import _rms_norm_forward_kernel

        def run(x: Any, w: Any, out: Any) -> Any:
            t, h = x.shape
            block, warps = calculate_settings(h)
            y = alloc(x)
            rs = torch.empty(t, device=x.device, dtype=torch.float32)
            _rms_norm_forward_kernel[(t,)](
                y, y.stride(0), x, x.stride(0), w, w.stride(0), rs, rs.stride(0), h, EPS, 0.0, 0,
                elementwise_affine=True, BLOCK_SIZE=block, num_warps=warps,
            )  # fmt: skip
            return y

        return run
    from liger_kernel.ops.fused_add_rms_norm import _fused_add_rms_norm_forward_kernel

    def run_fused(x: Any, r: Any, w: Any, out: Any) -> tuple[Any, ...]:
        t, h = x.shape
        block, warps = calculate_settings(h)
        y, s = alloc(x), alloc(r)
        rs = torch.empty(t, device=x.device, dtype=torch.float32)
        _fused_add_rms_norm_forward_kernel[(t,)](
            y, y.stride(0), s, s.stride(0), x, x.stride(0), r, r.stride(0), w, w.stride(0), rs, rs.stride(0),
            h, EPS, 0.0, 0, BLOCK_SIZE=block, num_warps=warps, num_stages=2,
        )  # fmt: skip
        return y, s

    return run_fused


_TIMING = {"on": False}  # the bisect set's held-input variants read their held sets only while timing


class _PluginFunction(torch.autograd.Function):
    """The plugin's RMSNorm kernel at its launch inside an autograd Function shaped as Liger's (bisect only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        t, h = x.shape
        y = torch.empty((t, h), dtype=x.dtype, device=x.device)
        rs = torch.empty(t, dtype=torch.float32, device=x.device)
        triton_kernels.rmsnorm(x=x, weight=w, eps=EPS, out=y)
        ctx.save_for_backward(x, w, rs)
        return y


_FRESH_FUSED = plugin_fresh_impls()["fused_add_rmsnorm"]  # built once, not per call


class _PluginFusedFunction(torch.autograd.Function):
    """The plugin's fused kernel at its launch, new residual and output allocated, inside an autograd Function."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        y, s = _FRESH_FUSED(x, r, w, None)
        rs = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(s, w, rs)
        return y, s


def bisect_impls(kernel: str, t: int, h: int, w: torch.Tensor) -> dict[str, Any]:
    fused = kernel == "fused_add_rmsnorm"
    impls: dict[str, Any] = {}
    direct = liger_kernel_direct(kernel, like=False)
    direct_like = liger_kernel_direct(kernel)
    plugin = plugin_fresh_impls()[kernel] if fused else plugin_alloc_impls()[kernel]
    warm = [torch.randn(t, h, device=w.device, dtype=DTYPE) for _ in range(2)]

    def held(x: torch.Tensor, i: int) -> torch.Tensor:  # checked on the given input, timed on one held set
        return warm[i] if _TIMING["on"] else x

    if fused:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward

        impls["lfwd"] = lambda x, r, w, out: fused_add_rms_norm_forward(x, r, w, EPS, 0.0, "llama")[:2]
        impls["pfn"] = lambda x, r, w, out: _PluginFusedFunction.apply(x, r, w)
        impls["ligerk_w"] = lambda x, r, w, out: direct_like(held(x, 0), held(r, 1), w, out)
        impls["plugin_w"] = lambda x, r, w, out: plugin(held(x, 0), held(r, 1), w, out)
    else:
        from liger_kernel.ops.rms_norm import rms_norm_forward

        impls["lfwd"] = lambda x, w, out: rms_norm_forward(x, w, EPS, 0.0, "llama", None)[0]
        impls["pfn"] = lambda x, w, out: _PluginFunction.apply(x, w)
        impls["ligerk_w"] = lambda x, w, out: direct_like(held(x, 0), w, out)
        impls["plugin_w"] = lambda x, w, out: plugin(held(x, 0), w, out)
    impls["ligerk_e"] = direct
    return impls


def implementations(
    kernel: str,
    t: int,
    h: int,
    levels: list[int],
    warps: list[int],
    probes: bool = False,
    bisect_weight: torch.Tensor | None = None,
    copy: bool = False,
    rotated_outputs: bool = False,
) -> dict[str, Any]:
    """Every implementation timed at this size; ``bisect_weight``: the weight, where --bisect adds its set;
    ``copy``: with the plugin writing into the rotated outputs (--copy); ``rotated_outputs``: the S candidates
    writing into the rotated outputs too (--s-rotated), not into blocks allocated per call."""
    fused = kernel == "fused_add_rmsnorm"
    impls: dict[str, Any] = {"plugin": plugin_alloc_impls()[kernel]}
    if copy:
        impls["plugin_o"] = plugin_impls()[kernel]
    if fused:
        impls["fresh"] = plugin_fresh_impls()[kernel]
    liger = liger_impls()[0][kernel]
    if liger is None:
        raise SystemExit(f"liger-kernel's {kernel} cannot be imported: nothing to compare with")
    impls["liger"] = liger
    for level in levels:
        for w in warps:
            cfg = {"family": "stream", "rows": 1, "num_warps": w, "stream": level}
            candidate = candidate_impl(kernel, cfg)
            impls[f"S{level}xW{w}"] = candidate if rotated_outputs else allocating(candidate, fused)
    if probes:
        impls.update(probe_impls(kernel, t, h))
    if bisect_weight is not None:
        impls.update(bisect_impls(kernel, t, h, bisect_weight))
    return impls


def input_sets(make: Any, kernel: str, t: int, h: int, args: argparse.Namespace) -> Any:
    """What each call reads: with --held one set, warm in L2 from the call before, as a layer's output often is;
    else the next of rotated sets of as many bytes as the norm moves, args.rotate_mib in all (a Rotation: a graph of
    its ``count`` calls reads each once a replay, cold)."""
    if args.held:
        held = make()
        return lambda: held
    return Rotation(make, op_bytes(kernel, t, h), total=args.rotate_mib << 20, cap=ROTATION_CAP)


def copy_call(
    kernel: str, t: int, h: int, device: torch.device, args: argparse.Namespace, allocated: bool = False
) -> Any:
    """One copy of as many bytes as the norm moves (op_bytes: half read, half written), on its own input_sets:
    as many of as many bytes as the norm's, so a graph of as many calls reads each once a replay. ``allocated``:
    into a block allocated per call (under graphs, the one the last call freed), as the plugin's output is placed,
    instead of the set's own destination."""
    half = op_bytes(kernel, t, h) // 2 // DTYPE.itemsize

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.randn(half, device=device, dtype=DTYPE)
        return src, torch.empty_like(src)

    pick = input_sets(make, kernel, t, h, args)

    def call() -> None:
        src, dst = pick()
        (torch.empty_like(src) if allocated else dst).copy_(src)

    return call


def plugin_launch(kernel: str, t: int, h: int) -> str:
    """The plugin's own launch at this size on this device, in the S<level>xW<warps> names where it is the one-read
    kernel; else RMSNorm's persistent grid (its programs and options) or the two reads' options."""
    if kernel == "rmsnorm":
        persistent = triton_kernels._persistent_launch(t, h, triton_kernels._sm_count(torch.device("cuda")))
        if persistent is not None:
            return f"persistent grid of {persistent[0]} programs: {persistent[1]}"
    two_reads, options = triton_kernels._norm_launch(t, h, fused=kernel == "fused_add_rmsnorm")
    if two_reads:
        return f"two reads: {options}"
    level = next(
        i
        for i, p in enumerate(triton_kernels.STREAM_POLICIES)
        if p["ROW_EVICT"] == options["ROW_EVICT"] and p["OUT_EVICT"] == options["OUT_EVICT"]
    )
    return f"S{level}xW{options['num_warps']}"


def measure(kernel: str, t: int, h: int, args: argparse.Namespace, w: torch.Tensor) -> dict[str, Any]:
    fused = kernel == "fused_add_rmsnorm"
    impls = implementations(
        kernel, t, h, args.levels, args.warps, args.probes, w if args.bisect else None, args.copy, args.s_rotated
    )
    _TIMING["on"] = False
    checks = {name: check(kernel, impl, t, h, w) for name, impl in impls.items()}
    _TIMING["on"] = True
    bad = {name: c for name, c in checks.items() if not c["ok"]}
    timed = {name: impl for name, impl in impls.items() if name not in bad}

    def make_inputs() -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(t, h, device=w.device, dtype=DTYPE) for _ in range(3 if fused else 2))

    pick = input_sets(make_inputs, kernel, t, h, args)
    graph_calls = args.held_calls if args.held else pick.count
    graphs = {name: CallGraph(rotated_call(impl, pick, w, fused), graph_calls) for name, impl in timed.items()}
    if args.copy:
        graphs["copy"] = CallGraph(copy_call(kernel, t, h, w.device, args), graph_calls)
        graphs["copy_a"] = CallGraph(copy_call(kernel, t, h, w.device, args, allocated=True), graph_calls)
    order = list(graphs)
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        random.shuffle(order)
        rounds.append({name: graphs[name].per_call_us(args.replays) for name in order})
    del graphs
    torch.cuda.empty_cache()
    summary = {}
    for name in rounds[0]:
        times = [r[name] for r in rounds]
        vs = [r["liger"] / r[name] for r in rounds]
        summary[name] = {
            "median_us": statistics.median(times),
            "min_us": min(times),
            "max_us": max(times),
            "liger_over_median": statistics.median(vs),
            "rounds_not_slower": sum(v >= 1.0 for v in vs),
        }
        if args.copy:
            summary[name]["copy_over_median"] = statistics.median(r["copy"] / r[name] for r in rounds)
            summary[name]["copy_a_over_median"] = statistics.median(r["copy_a"] / r[name] for r in rounds)
    return {
        "kernel": kernel,
        "h": h,
        "t": t,
        "plugin_launch": plugin_launch(kernel, t, h),
        "graph_calls": graph_calls,
        "checks": checks,
        "failed_checks": sorted(bad),
        "rounds": rounds,
        "summary": summary,
    }


def table(results: list[dict[str, Any]], rounds: int) -> str:
    lines = [
        f"median us over {rounds} rounds [range]; vs liger: the median of the rounds' Liger time over this one's "
        "(above 1: faster than Liger); n: rounds in which it was at least as fast as Liger; vs copy, vs "
        "copy_a (--copy): the median of the rounds' copy time (into the rotated outputs; into a block allocated per "
        "call) over this one's",
        f"{'kernel':18} {'h':>5} {'T':>4}  {'impl':8} {'us':>6} {'range':>13} {'vs liger':>8} {'n':>5} {'vs copy':>7} "
        f"{'vs copy_a':>9}",
    ]
    for row in results:
        for name, s in sorted(row["summary"].items(), key=lambda kv: kv[1]["median_us"]):
            mark = " (plugin's launch)" if name == row["plugin_launch"] else ""
            vs_copy = f"{s['copy_over_median']:7.3f}" if "copy_over_median" in s else f"{'-':>7}"
            vs_copy += f" {s['copy_a_over_median']:9.3f}" if "copy_a_over_median" in s else f" {'-':>9}"
            lines.append(
                f"{row['kernel']:18} {row['h']:>5} {row['t']:>4}  {name:8} {s['median_us']:6.2f} "
                f"[{s['min_us']:5.2f}-{s['max_us']:5.2f}] {s['liger_over_median']:8.3f} "
                f"{s['rounds_not_slower']:>2}/{rounds} {vs_copy}{mark}"
            )
        if row["failed_checks"]:
            lines.append(f"  failed their check, not timed: {row['failed_checks']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds per size (default 12)")
    parser.add_argument("--replays", type=int, default=3, help="timed replays of each graph per round (default 3)")
    parser.add_argument(
        "--rotate-mib",
        type=int,
        default=256,
        help="MiB of input sets rotated, each read once per replay (default 256: five times an H100's L2)",
    )
    parser.add_argument(
        "--held", action="store_true", help="every call reads one held input set (warm in L2) instead of rotated sets"
    )
    parser.add_argument("--held-calls", type=int, default=2048, help="calls in each graph with --held (default 2048)")
    parser.add_argument("--hidden", default="4096,8192", help="a comma list of h (default 4096,8192)")
    parser.add_argument("--tokens", default="4,8,16,32", help="a comma list of T (default 4,8,16,32)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="rmsnorm, fused_add_rmsnorm or both")
    parser.add_argument("--levels", default="0,1", help="eviction hint levels of the S candidates (default 0,1)")
    parser.add_argument("--warps", default="4,8,16", help="warps of the S candidates (default 4,8,16)")
    parser.add_argument(
        "--probes", action="store_true", help="also the probes: Liger's kernel straight, the plugin's with Liger's ways"
    )
    parser.add_argument(
        "--bisect", action="store_true", help="also the bisect set: where Liger's function and its kernel part"
    )
    parser.add_argument(
        "--copy",
        action="store_true",
        help="also a copy of the norm's bytes (into the rotated outputs, and into a block allocated per call) and the "
        "plugin writing into the rotated outputs, and each row's time against the copies'",
    )
    parser.add_argument(
        "--s-rotated",
        action="store_true",
        help="the S candidates write into the rotated outputs (as plugin_o of --copy), not into blocks allocated "
        "per call",
    )
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="start no new size after this many seconds (default 330)"
    )
    parser.add_argument("--out", default="/tmp/out", help="folder for norm_turns.json (default /tmp/out)")
    args = parser.parse_args()
    args.levels = [int(v) for v in args.levels.split(",") if v]
    args.warps = [int(v) for v in args.warps.split(",") if v]
    if not torch.cuda.is_available():
        raise SystemExit("norm_turns needs a CUDA GPU")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(0)
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(),
        "machine": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger_kernel": version("liger-kernel"),
        "cacheon_example_kernels": version("cacheon-example-kernels"),
        "settings": {
            "rounds": args.rounds,
            "replays": args.replays,
            "inputs": "held" if args.held else f"rotated, {args.rotate_mib} MiB",
            "dtype": "bfloat16",
            "outputs": "allocated per call",
        },
        "results": [],
    }
    start = time.perf_counter()
    with torch.inference_mode():
        for h in (int(v) for v in args.hidden.split(",")):
            w = torch.randn(h, device="cuda", dtype=DTYPE)
            for kernel in args.kernels.split(","):
                for t in (int(v) for v in args.tokens.split(",")):
                    if time.perf_counter() - start > args.budget_s:
                        print(f"budget spent: {kernel} h={h} T={t} not measured", flush=True)
                        continue
                    row = measure(kernel, t, h, args, w)
                    result["results"].append(row)
                    (out_dir / "norm_turns.json").write_text(json.dumps(result, indent=1))
                    print(f"[{time.perf_counter() - start:6.1f}s] {kernel} h={h} T={t} done", flush=True)
    print(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, liger {result['liger_kernel']}")
    print(table(result["results"], args.rounds))


if __name__ == "__main__":
    main()
