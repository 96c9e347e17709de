"""``cacheon verify``: a variant against its slot's trusted reference on random inputs.

The cases are the slot's ``verify_dims``, then those the variant declares (``Variant.verify_dims``:
sizes at which it takes another code path), each input of the latter at most
``MAX_VARIANT_CASE_ELEMENTS`` elements. Every case runs the candidate twice on fresh copies of the
same inputs, once with its outputs pre-filled with NaN and once with a finite sentinel, so an output
element the candidate never wrote is told apart from one it wrote as NaN. Inputs are compared
bitwise afterwards (padding included, for strided cases), so a write into an input is caught
whatever made it.

On a CUDA device every variant is also qualified inside a CUDA graph: captured once (after an
eager warm-up on a side stream), then replayed on fresh random inputs written in place into the
captured tensors, each replay checked against the reference recomputed on those inputs. A variant
that fails to capture (works only eagerly), replays a cached answer, changes an output's storage or
allocates device memory during capture fails qualification; for a variant that claims
``graph_safe`` that is a rejection, for others the verdict is reported as ``eager only``.

A collective slot's variant is verified on a group of its own: ``COLLECTIVE_RANKS`` processes
(forked on the CPU, spawned on CUDA) joined over gloo on the loopback interface, as a group inside
a world of one more rank, which leaves at once (a candidate that ignores ``group`` and talks to the
whole world fails). Each rank samples its own inputs and runs every case at once with the others;
the reference on each rank is the float32 sum by ``torch.distributed`` itself. A rank that fails,
hangs past the deadline or dies rejects the variant.
Collective variants are not graph-qualified (they run eagerly here).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from ._errors import DescriptorError
from ._slots import (
    FLOAT_DTYPES,
    CallDescriptor,
    Scalar,
    SlotSpec,
    TensorSpec,
    Variant,
    describe,
    output_dtype,
    output_shape,
)

Status = Literal["passed", "rejected", "unsupported"]
SENTINEL = 12345.0
COLLECTIVE_RANKS = 2
COLLECTIVE_DEADLINE_S = 180.0
COLLECTIVE_TIMEOUT_S = 30.0
MAX_VARIANT_CASE_ELEMENTS = 1 << 24  # per input tensor of a binding a variant declares (verify_dims)
_IN_GROUP: list[Any] = []  # inside a verification rank: [its process group]


@attrs.frozen
class CaseResult:
    dims: Mapping[str, int]
    dtype: str
    layout: str
    status: Status
    reason: str | None = None


@attrs.frozen
class VerifyResult:
    slot: str
    variant: str
    device: str
    status: Status
    reason: str | None
    cases: tuple[CaseResult, ...]
    # CUDA devices only: "qualified", or why the variant does not work inside a CUDA graph
    graph: str | None = None


class _CaseFailure(Exception):
    pass


def _case_dtype(tspec: TensorSpec, dtype: str) -> str:
    if dtype in tspec.dtypes or not tspec.dtypes:
        return dtype
    return tspec.dtypes[0]


def _sample_inputs(
    spec: SlotSpec, dims: Mapping[str, int], dtype: str, device: str, gen: Any, padded: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(inputs, bases): bases are the allocations behind padded views, compared whole."""
    import torch

    if spec.sampler is not None:
        raw = spec.sampler(dims, dtype, device, gen)
    else:
        raw = {}
        for tspec in spec.inputs:
            shape = output_shape(tspec, dims)
            dt = _case_dtype(tspec, dtype)
            if dt in FLOAT_DTYPES:
                raw[tspec.name] = torch.randn(shape, generator=gen, device=device).to(getattr(torch, dt))
            else:
                low, high = tspec.value_range or (0, 10)
                raw[tspec.name] = torch.randint(
                    low, high, shape, generator=gen, device=device, dtype=getattr(torch, dt)
                )
    inputs, bases = {}, {}
    for tspec in spec.inputs:
        t = raw[tspec.name]
        if padded and tspec.layout != "contiguous" and t.dim() >= 2:
            # Same values, rows padded by 3 elements: catches kernels that assume dense rows.
            base = torch.full((*t.shape[:-1], t.shape[-1] + 3), 7.0, device=device).to(t.dtype)
            base[..., : t.shape[-1]].copy_(t)
            inputs[tspec.name] = base[..., : t.shape[-1]]
            bases[tspec.name] = base
        else:
            inputs[tspec.name] = t
            bases[tspec.name] = t
    return inputs, bases


def _scalars(spec: SlotSpec) -> dict[str, Scalar]:
    values: dict[str, Scalar] = {}
    for s in spec.scalars:
        value = s.default if s.default is not None else s.example
        if value is None:
            value = {"float": 0.5, "int": 1, "bool": False}[s.kind]
        values[s.name] = value
    return values


def _fresh(
    spec: SlotSpec, bases: Mapping[str, Any], inputs: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of the inputs with the same strides, and their bases."""
    views, new_bases = {}, {}
    for tspec in spec.inputs:
        base = bases[tspec.name].clone()
        view = inputs[tspec.name]
        new_bases[tspec.name] = base
        views[tspec.name] = base.as_strided(
            view.shape, view.stride(), view.storage_offset() - bases[tspec.name].storage_offset()
        )
    return views, new_bases


def _close(out: Any, ref: Any, tol: Any) -> tuple[bool, str]:
    import torch

    if out.dtype.is_floating_point:
        o, r = out.double(), ref.double()
        bad = ~((o - r).abs() <= tol.atol + tol.rtol * r.abs())
    else:
        bad = out != ref
    if not bool(bad.any()):
        return True, ""
    index = tuple(int(i) for i in torch.nonzero(bad)[0])
    count = int(bad.sum())
    got, want = out[index].item(), ref[index].item()
    return False, f"{count} of {out.numel()} elements differ from the reference (first at {index}: {got!r} vs {want!r})"


def verify_variant(spec: SlotSpec, variant: Variant, device: str = "cpu", seed: int = 0) -> VerifyResult:
    import torch

    if spec.reference is None:
        return VerifyResult(
            spec.id, variant.name, device, "rejected", f"slot {spec.id} has no reference implementation", ()
        )
    problem = _variant_dims_problem(spec, variant)  # before a collective slot's ranks start
    if problem is not None:
        return VerifyResult(spec.id, variant.name, device, "rejected", problem, ())
    if spec.collective and not _IN_GROUP:
        return _verify_collective(spec, variant, device, seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    float_dtypes = [d for d in spec.inputs[0].dtypes if d in FLOAT_DTYPES] or list(spec.inputs[0].dtypes[:1])
    layouts = ["contiguous"] + (["padded"] if any(t.layout != "contiguous" for t in spec.inputs) else [])
    cases: list[CaseResult] = []
    for dims in (*spec.verify_dims, *variant.verify_dims):
        for dtype in float_dtypes:
            for layout in layouts:
                cases.append(_run_case(spec, variant, dict(dims), dtype, layout, device, gen))
    failed = [c for c in cases if c.status == "rejected"]
    passed = [c for c in cases if c.status == "passed"]
    if failed:
        first = failed[0]
        why = f"{first.reason} [dims {dict(first.dims)}, {first.dtype}, {first.layout}]"
        return VerifyResult(spec.id, variant.name, device, "rejected", why, tuple(cases))
    graph = None
    if passed and torch.device(device).type == "cuda" and not spec.collective:
        case = next((c for c in passed if c.layout == "contiguous"), passed[0])
        try:
            problem = _graph_qualify(spec, variant, dict(case.dims), case.dtype, device, gen)
        except Exception as exc:  # the harness around the candidate failed: say so, never pass silently
            problem = f"graph qualification raised {type(exc).__name__}: {exc}"
        graph = "qualified" if problem is None else problem
        if problem is not None and variant.graph_safe:
            why = f"claims graph_safe but {problem} [dims {dict(case.dims)}, {case.dtype}]"
            return VerifyResult(spec.id, variant.name, device, "rejected", why, tuple(cases), graph)
    if not passed:
        return VerifyResult(
            spec.id,
            variant.name,
            device,
            "unsupported",
            f"supports() accepted no verification case on {device}",
            tuple(cases),
        )
    return VerifyResult(spec.id, variant.name, device, "passed", None, tuple(cases), graph)


def _variant_dims_problem(spec: SlotSpec, variant: Variant) -> str | None:
    """Why a binding the variant declares for verification cannot be run, or None: it must bind
    exactly the slot's symbols, pass the slot's rule, and keep each input within
    MAX_VARIANT_CASE_ELEMENTS elements."""
    symbols = {d for t in spec.inputs for d in t.shape if isinstance(d, str)}
    for dims in variant.verify_dims:
        if set(dims) != symbols:
            return f"verify_dims binding {dict(dims)} must bind exactly the symbols {sorted(symbols)} of {spec.id}"
        why = spec.dims_rule(dims) if spec.dims_rule is not None else None
        if why:  # as describe() reads the rule
            return f"verify_dims binding {dict(dims)} breaks the contract: {why}"
        for tspec in spec.inputs:
            elements = math.prod(output_shape(tspec, dims))
            if elements > MAX_VARIANT_CASE_ELEMENTS:
                return (
                    f"verify_dims binding {dict(dims)} gives {tspec.name} {elements} elements, "
                    f"more than {MAX_VARIANT_CASE_ELEMENTS}"
                )
    return None


GRAPH_REPLAYS = 3


def _allocations(device: str) -> int:
    import torch

    return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))


def _graph_qualify(
    spec: SlotSpec, variant: Variant, dims: dict[str, int], dtype: str, device: str, gen: Any
) -> str | None:
    """None when the variant captures and replays correctly on fresh inputs, else the reason."""
    import torch

    assert spec.reference is not None
    scalars = _scalars(spec)
    inputs, _ = _sample_inputs(spec, dims, dtype, device, gen, False)
    descriptor = describe(spec, inputs, scalars)
    dtypes = {t.name: t.dtype for t in descriptor.tensors}
    shapes = {o.name: (output_shape(o, descriptor.dims), getattr(torch, output_dtype(o, dtypes))) for o in spec.outputs}
    outs = {name: torch.empty(shape, dtype=dt, device=device) for name, (shape, dt) in shapes.items()}
    if variant.prepare is not None:
        variant.prepare(descriptor)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (compilation, autotuning) outside the capture
        variant.impl(**inputs, **scalars, **outs)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    ptrs = {name: t.data_ptr() for name, t in outs.items()}
    # What capturing itself allocates, measured on a capture that allocates nothing of its own.
    probe = torch.cuda.CUDAGraph()
    before = _allocations(device)
    with torch.cuda.graph(probe):
        next(iter(outs.values())).add_(0)
    baseline = _allocations(device) - before
    del probe
    graph = torch.cuda.CUDAGraph()
    before = _allocations(device)
    try:
        with torch.cuda.graph(graph):
            result = variant.impl(**inputs, **scalars, **outs)
    except Exception as exc:
        return f"fails under CUDA graph capture, so works only eagerly ({type(exc).__name__}: {exc})"
    allocated = _allocations(device) - before - baseline
    if result is not None:
        return f"returned a {type(result).__name__} during capture"
    for name, t in outs.items():
        if t.data_ptr() != ptrs[name]:
            return f"changed the storage of output {name!r} during capture"
    if allocated > 0:
        return f"allocated device memory {allocated} time(s) during capture"
    tol_key = dtype if dtype in spec.tolerances else next(iter(spec.tolerances), None)
    tol = spec.tolerances[tol_key] if tol_key else None
    for replay in range(1, GRAPH_REPLAYS + 1):
        fresh, _ = _sample_inputs(spec, dims, dtype, device, gen, False)
        for name, t in inputs.items():
            t.copy_(fresh[name])  # graph-dynamic inputs refreshed in place
        for t in outs.values():
            t.fill_(float("nan") if t.dtype.is_floating_point else -7)
        graph.replay()
        torch.cuda.synchronize(device)
        ref_outs = {name: torch.empty(shape, dtype=dt, device=device) for name, (shape, dt) in shapes.items()}
        spec.reference(**fresh, **scalars, **ref_outs)
        for name, t in outs.items():
            if t.data_ptr() != ptrs[name]:
                return f"changed the storage of output {name!r} on replay {replay}"
            ok, why = _close(t, ref_outs[name], tol)
            if not ok:
                return (
                    f"replay {replay} of {GRAPH_REPLAYS} on fresh inputs: output {name!r}: {why} "
                    "(a cached answer, or state outside the captured inputs)"
                )
        for tspec in spec.inputs:
            if tspec.written:
                ok, why = _close(inputs[tspec.name], fresh[tspec.name], tol)
                if not ok:
                    return f"replay {replay} of {GRAPH_REPLAYS}: written input {tspec.name!r}: {why}"
    return None


def _run_case(
    spec: SlotSpec, variant: Variant, dims: dict[str, int], dtype: str, layout: str, device: str, gen: Any
) -> CaseResult:
    import torch

    inputs, bases = _sample_inputs(spec, dims, dtype, device, gen, layout == "padded")
    scalars = _scalars(spec)
    try:
        descriptor: CallDescriptor = describe(spec, inputs, scalars)
    except DescriptorError as exc:
        return CaseResult(dims, dtype, layout, "rejected", f"verification input breaks the contract: {exc}")
    if variant.supports is not None:
        try:
            ok = variant.supports(descriptor)
        except Exception as exc:
            return CaseResult(dims, dtype, layout, "rejected", f"supports() raised {type(exc).__name__}: {exc}")
        if not ok:
            return CaseResult(dims, dtype, layout, "unsupported", "supports() returned False")
    out_specs = [
        (
            o,
            output_shape(o, descriptor.dims),
            getattr(torch, output_dtype(o, {t.name: t.dtype for t in descriptor.tensors})),
        )
        for o in spec.outputs
    ]

    extra = {"group": _IN_GROUP[0]} if spec.collective else {}
    ref_inputs, _ = _fresh(spec, bases, inputs)
    ref_outs = {o.name: torch.empty(shape, dtype=dt, device=device) for o, shape, dt in out_specs}
    assert spec.reference is not None
    spec.reference(**ref_inputs, **scalars, **ref_outs, **extra)
    try:
        if variant.prepare is not None:
            variant.prepare(descriptor)
        runs = []
        for fill in (float("nan"), SENTINEL):
            run_inputs, run_bases = _fresh(spec, bases, inputs)
            outs = {
                o.name: torch.full(shape, fill if dt.is_floating_point else -7, dtype=dt, device=device)
                for o, shape, dt in out_specs
            }
            ptrs = {n: t.data_ptr() for n, t in outs.items()}
            try:
                result = variant.impl(**run_inputs, **scalars, **outs, **extra)
            except Exception as exc:
                raise _CaseFailure(f"raised {type(exc).__name__}: {exc}") from exc
            if result is not None:
                raise _CaseFailure(
                    f"returned a {type(result).__name__} instead of writing its outputs in place "
                    "(the ABI requires returning None)"
                )
            for o, shape, dt in out_specs:
                t = outs[o.name]
                if t.data_ptr() != ptrs[o.name] or tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous():
                    raise _CaseFailure(f"output {o.name!r} lost its storage, shape, dtype or layout")
            for tspec in spec.inputs:
                if tspec.written:
                    continue
                if not torch.equal(run_bases[tspec.name], bases[tspec.name]):
                    raise _CaseFailure(f"wrote into input {tspec.name!r}, which the contract does not mark written")
            runs.append((outs, run_inputs))
        tol_key = dtype if dtype in spec.tolerances else next(iter(spec.tolerances), None)
        for o, _shape, _dt in out_specs:
            first, second = runs[0][0][o.name], runs[1][0][o.name]
            ref = ref_outs[o.name]
            if first.dtype.is_floating_point:
                stored = torch.full((), SENTINEL, dtype=first.dtype).item()  # the sentinel as this dtype rounds it
                unwritten = torch.isnan(first) & (second == stored)
                if bool(unwritten.any()):
                    raise _CaseFailure(
                        f"left {int(unwritten.sum())} of {first.numel()} elements of output {o.name!r} unwritten"
                    )
                nonfinite = ~torch.isfinite(first) & torch.isfinite(ref)
                if bool(nonfinite.any()):
                    raise _CaseFailure(
                        f"wrote {int(nonfinite.sum())} non-finite values (NaN/Inf) into output "
                        f"{o.name!r} where the reference is finite"
                    )
            ok, why = _close(first, ref, spec.tolerances[tol_key] if tol_key else None)
            if not ok:
                raise _CaseFailure(f"output {o.name!r}: {why}")
        for tspec in spec.inputs:
            if tspec.written:
                ok, why = _close(
                    runs[0][1][tspec.name], ref_inputs[tspec.name], spec.tolerances[tol_key] if tol_key else None
                )
                if not ok:
                    raise _CaseFailure(f"written input {tspec.name!r}: {why}")
    except _CaseFailure as exc:
        return CaseResult(dims, dtype, layout, "rejected", str(exc))
    except Exception as exc:  # prepare() or the comparison itself failed: a rejection, with the reason
        return CaseResult(dims, dtype, layout, "rejected", f"{type(exc).__name__}: {exc}")
    return CaseResult(dims, dtype, layout, "passed")


def _verify_collective(spec: SlotSpec, variant: Variant, device: str, seed: int) -> VerifyResult:
    """Run the verification on ``COLLECTIVE_RANKS`` ranks at once, as a group inside a world of one
    rank more (a candidate that talks to the whole world instead of ``group`` fails); every rank's
    verdict counts, the most severe decides."""
    import gc
    import multiprocessing
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # On the CPU the ranks are forked (the variant, any callable, goes with them); CUDA cannot be used
    # in a child forked from a process that has touched it, so there they are spawned (the variant
    # must then be importable, as every plugin's is).
    ctx = multiprocessing.get_context("fork") if device == "cpu" else multiprocessing.get_context("spawn")
    if device == "cpu":
        # Garbage the parent still holds would be collected in each child, running destructors of
        # native objects (a thread pool's join) whose threads live only in the parent: an abort.
        gc.collect()
    pipes, procs = [], []
    joined = ctx.Barrier(COLLECTIVE_RANKS + 1)
    for rank in range(COLLECTIVE_RANKS + 1):
        receive, send = ctx.Pipe(duplex=False)
        args = (spec, variant, device, seed, rank, port, joined, send)
        proc = ctx.Process(target=_collective_rank, args=args, daemon=True)
        proc.start()
        send.close()
        pipes.append(receive)
        procs.append(proc)
    deadline = time.monotonic() + COLLECTIVE_DEADLINE_S
    results: list[VerifyResult | str] = []
    for rank, (pipe, proc) in enumerate(zip(pipes[:COLLECTIVE_RANKS], procs, strict=False)):
        left = max(deadline - time.monotonic(), 0.0)
        if pipe.poll(left):
            try:
                results.append(pipe.recv())
            except EOFError:
                proc.join(5)
                results.append(f"rank {rank} exited with status {proc.exitcode} before reporting")
        else:
            results.append(f"rank {rank} did not finish within {COLLECTIVE_DEADLINE_S:.0f} s")
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    where = f"{device}, {COLLECTIVE_RANKS} gloo ranks"
    verdicts = [("rejected", r, ()) if isinstance(r, str) else (r.status, f"{r.reason}", r.cases) for r in results]
    for status in ("rejected", "unsupported"):
        bad = [(rank, why, cases) for rank, (s, why, cases) in enumerate(verdicts) if s == status]
        if bad:
            reason = "; ".join(f"rank {rank}: {why}" for rank, why, _ in bad)
            return VerifyResult(spec.id, variant.name, where, status, reason, bad[0][2])
    first = results[0]
    assert not isinstance(first, str)
    return VerifyResult(spec.id, variant.name, where, "passed", None, first.cases)


def _collective_rank(
    spec: SlotSpec, variant: Variant, device: str, seed: int, rank: int, port: int, joined: Any, send: Any
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked: no inherited OpenMP pool
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=COLLECTIVE_RANKS + 1,
            # a peer missing from a communication (a candidate that talks to the bystander, one that
            # failed on the other rank) fails the case after this long, well within the deadline
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        group = dist.new_group(list(range(COLLECTIVE_RANKS)))
        # Every rank has built the world and the group before the bystander leaves: a rank still
        # connecting to it when it went would fail with "Connection closed by peer" (seen under load).
        if rank == COLLECTIVE_RANKS:  # the bystander: in the world, not in the group; it leaves now
            try:
                joined.wait(COLLECTIVE_TIMEOUT_S)
            finally:
                os._exit(0)
        joined.wait(COLLECTIVE_TIMEOUT_S)
        _IN_GROUP.append(group)
        if device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(device))
        result = verify_variant(spec, variant, device, seed=seed * COLLECTIVE_RANKS + rank)
    except Exception as exc:
        result = VerifyResult(spec.id, variant.name, device, "rejected", f"{type(exc).__name__}: {exc}", ())
    send.send(result)
    send.close()
    os._exit(0)  # no atexit hooks of the parent's process state in a forked rank


def verify_all(spec: SlotSpec, variants: Iterable[Variant], device: str = "cpu") -> list[VerifyResult]:
    return [verify_variant(spec, v, device) for v in variants]
