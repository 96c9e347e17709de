"""Eager dispatch overhead: a call through the checked dispatcher versus calling the variant directly.

Both paths allocate the output the same way (``torch.empty_like(x)``, as the engines do),
so the difference is what the dispatcher adds: finding the plan (the last plan's tensor check, or
the descriptor key and the cached resolution), the version-counter snapshot, the receipt counters
and the revalidation. The dispatched path is ``site.call(...)``, what the engine adapters call;
``site(...)`` (the same function, called as the instance: Python packs the keywords into a dict)
is measured too. Batches of the paths are interleaved in one process; the figure is the median
of per-batch differences (each dispatched batch against the direct batch just before it). Its p90
comes with a control: the p90 of the direct call against itself (two direct batches in a row), the
spread the batches' own noise gives any difference. For scale, the
same function registered as a ``torch.library.custom_op`` (which published figures put at 5-18 us
of added cost) is measured in the same run.

The profile table times each piece of the per-call host work on its own, on the same tensors, in
the same run (median of batches): the inputs' tensor check, the descriptor key and plan lookup
(taken only when that check says no), the output allocation, the version snapshot of the two
inputs, the candidate's own call, the output revalidation (and its field-by-field form, taken only
when the output's tensor check says no), the input version check, the CUDA graph capture check and
the receipt counter. On CUDA it also times the
dispatch with torch's own capture query on every call (what the call site did before it asked the
driver only while a capture is open). Each variant is measured twice: on ordinary tensors (as SGLang's
scheduler, under ``torch.no_grad`` unless SGLANG_ENABLE_TORCH_INFERENCE_MODE is set, passes them) and
on inference tensors, every path called under ``torch.inference_mode`` (as vLLM's model runner calls
its model), which keep no version counter: there the dispatcher takes no version snapshot and makes no
version check.

    python benchmarks/dispatch.py [--reps 300] [--batch 200] [--device cpu|cuda] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import report  # benchmarks/report.py: the script's own directory is on sys.path
import torch

from cacheon_core import Dispatcher, Registry, Variant
from cacheon_core._dispatch import _tensor_check

sys.path.insert(0, str(Path(__file__).parent))


def _noop_copy(*, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    out.copy_(x)


def _per_call_us(fn, batch: int, sync) -> float:
    sync()
    start = time.perf_counter_ns()
    for _ in range(batch):
        fn()
    sync()
    return (time.perf_counter_ns() - start) / batch / 1e3


def measure(
    impl, name: str, shape: tuple[int, int], reps: int, batch: int, device: str, inference: bool = False
) -> dict[str, float | str]:
    """``inference``: the tensors made, and every path called, under ``torch.inference_mode`` (as vLLM's
    model runner calls its model): inference tensors keep no version counter, so the dispatcher takes no
    version snapshot and makes no version check of them."""
    if inference:
        with torch.inference_mode():
            return measure(impl, name, shape, reps, batch, device)
    torch.manual_seed(0)
    x = torch.randn(shape, device=device)
    weight = torch.randn(shape[1], device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    eps = 1e-6
    registry = Registry()
    registry.add_variant(Variant(slot="norm.rmsnorm", name=name, impl=impl))
    registry.enable()
    site = Dispatcher(registry, policy="strict").site("norm.rmsnorm")
    disabled = Registry()
    off_site = Dispatcher(disabled).site("norm.rmsnorm")

    def direct() -> None:
        impl(x=x, weight=weight, eps=eps, out=torch.empty_like(x))

    def dispatched() -> None:  # the adapters' entry
        site.call(x=x, weight=weight, eps=eps)

    def called_instance() -> None:  # the same function, called as the instance
        site(x=x, weight=weight, eps=eps)

    def passthrough() -> None:
        off_site(x=x, weight=weight, eps=eps)

    op = _custom_op(impl, name + ("_inference" if torch.is_inference_mode_enabled() else ""))

    def through_custom_op() -> None:
        op(x, weight, eps, torch.empty_like(x))

    for fn in (direct, dispatched, called_instance, passthrough, through_custom_op):  # warm caches, resolve
        _per_call_us(fn, batch, sync)
    diffs, d_direct, d_dispatch, d_pass, d_op, d_instance, d_null = [], [], [], [], [], [], []
    for _ in range(reps):
        a0 = _per_call_us(direct, batch, sync)
        a = _per_call_us(direct, batch, sync)
        b = _per_call_us(dispatched, batch, sync)
        c = _per_call_us(passthrough, batch, sync)
        d = _per_call_us(through_custom_op, batch, sync)
        e = _per_call_us(called_instance, batch, sync)
        d_direct.append(a)
        d_dispatch.append(b)
        d_pass.append(c)
        d_op.append(d - a)
        diffs.append(b - a)
        d_null.append(a - a0)  # the direct call against itself, batches as far apart: the noise floor
        d_instance.append(e - a)
    if device.startswith("cuda"):  # the same dispatch with torch's capture query on every call
        before = Dispatcher(registry, policy="strict").site("norm.rmsnorm")
        before(x=x, weight=weight, eps=eps)
        for plan in before._plans.values():
            if plan.fast is not None and plan.fast[3] is not None:
                plan.fast[3].capturing = torch.cuda.is_current_stream_capturing

        def dispatched_before() -> None:
            before(x=x, weight=weight, eps=eps)

        _per_call_us(dispatched_before, batch, sync)
        d_before = [
            _per_call_us(dispatched_before, batch, sync) - _per_call_us(direct, batch, sync) for _ in range(reps)
        ]
    return {
        "added_with_capture_query_us": statistics.median(d_before) if device.startswith("cuda") else None,
        "variant": name,
        "shape": f"{shape[0]}x{shape[1]} fp32 on {device}"
        + (", inference tensors" if torch.is_inference_mode_enabled() else ""),
        "direct_us": statistics.median(d_direct),
        "dispatch_us": statistics.median(d_dispatch),
        "added_us": statistics.median(diffs),
        "added_p90_us": statistics.quantiles(diffs, n=10)[-1],
        "null_p90_us": statistics.quantiles(d_null, n=10)[-1],
        "added_ratio": statistics.median(diffs) / statistics.median(d_direct),
        "instance_added_us": statistics.median(d_instance),
        "passthrough_us": statistics.median(d_pass),
        "custom_op_added_us": statistics.median(d_op),
    }


def profile(shape: tuple[int, int], reps: int, batch: int, device: str) -> list[tuple[str, float]]:
    """Each piece of the call site's per-call work for ``norm.rmsnorm``, timed on its own (us)."""
    torch.manual_seed(0)
    x = torch.randn(shape, device=device)
    w = torch.randn(shape[1], device=device)
    eps = 1e-6
    out = torch.empty_like(x)
    key = (x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device, eps)
    plans = {key: object()}
    inputs_check = _tensor_check([x, w])
    outputs_check = _tensor_check([out])
    scalars = (eps,)
    shape, strides, dtype, p, vx, vw = out.shape, out.stride(), out.dtype, out.data_ptr(), x._version, w._version
    tally = [0]

    def count() -> None:
        tally[0] += 1

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    pieces = {
        "inputs' tensor check and scalars (the last plan's key?)": lambda: inputs_check(x, w) and (eps,) == scalars,
        "descriptor key (only when that check says no)": lambda: (
            x.shape,
            x.stride(),
            x.dtype,
            x.device,
            w.shape,
            w.stride(),
            w.dtype,
            w.device,
            eps,
        ),
        "plan lookup (dict get, only when that check says no)": lambda: plans.get(key),
        "output allocation (empty_like)": lambda: torch.empty_like(x),
        "version snapshot, 2 inputs": lambda: (x._version, w._version),
        "candidate call (copy_only)": lambda: _noop_copy(x=x, weight=w, eps=eps, out=out),
        "output revalidation (tensor check and storage)": lambda: not outputs_check(out) or out.data_ptr() != p,
        "output revalidation field by field (only when the check says no)": lambda: (
            out.data_ptr() != p or out.shape != shape or out.stride() != strides or out.dtype is not dtype
        ),
        "input version check, 2 inputs": lambda: x._version != vx or w._version != vw,
        "receipt counter (tally cell)": count,
        "empty Python call (floor)": lambda: None,
    }
    if device.startswith("cuda"):
        from cacheon_core._dispatch import _Captures

        pieces["capture check, torch's query"] = torch.cuda.is_current_stream_capturing
        pieces["capture check, no capture open"] = _Captures.capturing
    rows = []
    for name, fn in pieces.items():
        _per_call_us(fn, batch, sync)
        rows.append((name, statistics.median(_per_call_us(fn, batch, sync) for _ in range(reps))))
    return rows


def _custom_op(impl, name: str):
    @torch.library.custom_op(f"cacheon_bench::{name}", mutates_args=("out",))
    def op(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        impl(x=x, weight=weight, eps=eps, out=out)

    return op


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300, help="interleaved batches per path (default 300)")
    parser.add_argument("--batch", type=int, default=200, help="calls per batch (default 200)")
    parser.add_argument("--append", metavar="FILE", help="append the result table to this markdown file")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()

    from cacheon_example_kernels import torch_kernels, triton_kernels

    torch.set_num_threads(1)
    cases = [(torch_kernels.rmsnorm, "example_torch"), (_noop_copy, "copy_only")]
    if args.device.startswith("cuda"):
        cases.append((triton_kernels.rmsnorm, "example_triton"))
    rows = [measure(impl, name, (4, 128), args.reps, args.batch, args.device) for impl, name in cases]
    # The same under torch.inference_mode, as vLLM calls its model (SGLang's scheduler runs under no_grad by
    # default: its tensors keep their version counters, as in the rows above).
    rows += [measure(impl, name, (4, 128), args.reps, args.batch, args.device, inference=True) for impl, name in cases]
    header = (
        "| variant | input | direct call (us) | through site.call (us) | added, median (us) | added, p90 (us) "
        "| direct against direct, p90 (us) | added / direct call | added through site(...), median (us) "
        "| registry off, pass-through (us) | torch custom_op added, median (us) |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['shape']} | {r['direct_us']:.2f} | {r['dispatch_us']:.2f} | "
            f"{r['added_us']:.2f} | {r['added_p90_us']:.2f} | {r['null_p90_us']:.2f} | {r['added_ratio']:.2f} | "
            f"{r['instance_added_us']:.2f} | {r['passthrough_us']:.2f} | {r['custom_op_added_us']:.2f} |"
        )
    if args.device.startswith("cuda"):
        lines.append("")
        lines.append("| variant | added with torch's capture query on every call, median (us) |")
        lines.append("|---|---|")
        lines += [f"| {r['variant']} | {r['added_with_capture_query_us']:.2f} |" for r in rows]
    lines += ["", "| piece of the per-call work (copy_only, 4x128) | us, median |", "|---|---|"]
    lines += [f"| {name} | {us:.3f} |" for name, us in profile((4, 128), args.reps, args.batch, args.device)]
    table = "\n".join(lines)
    print(table)
    if args.append:
        report.append(
            args.append,
            "Eager dispatch overhead",
            table,
            "Target: at most 2.5 us added at the median.",
            extra_machine=f"torch {torch.__version__}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
