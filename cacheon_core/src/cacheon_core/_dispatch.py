"""The checked dispatcher: the seven-step dispatch contract at one chokepoint.

1. derive a canonical call descriptor from the live tensors (once per distinct call shape);
2. resolve the variant against the registry (cached per descriptor key: in the steady state one
   tensor check says the call is shaped as the last plan's, else a key and one dictionary lookup);
3. allocate every output through the typed contract;
4. prepare layout-sensitive state through the variant's ``prepare`` (once per descriptor, when the
   plan is made: before the first call's step 3);
5. invoke the candidate, only after selection (by keyword, outputs included);
6. revalidate: the candidate returned None, every output keeps its storage, shape, dtype, device
   and strides, no input the contract does not mark ``written`` was written, and every ``written``
   input keeps its storage;
7. return the outputs (one tensor, or a tuple in contract order); the engine adapter turns them
   into the model-facing value.

``None`` from a call site means "no eligible candidate": the adapter runs the engine's stock
path, which is legitimate before selection. After selection, the policy decides: ``strict``
raises :class:`CandidateFailure` (and writes a ``failed`` receipt), ``lenient`` restores any
``written`` inputs, serves the trusted fallback and counts a ``fallback`` receipt, except when the
candidate wrote a protected input (nothing to restore it from: raised as under strict). ``stock``
routes every call to the engine's path (the pristine reference run).

The written-input check on the hot path uses torch's version counters, which see writes made by
torch operations. Tensors created under ``torch.inference_mode`` have no version counter, and raw
kernel writes (Triton, CUDA) never bump one; ``cacheon verify`` compares every input bitwise and
catches those.

A ``collective`` slot's call site (:class:`CollectiveCallSite`) adds two rules. Before a candidate
serves a descriptor key, the ranks of the group agree on the route (one gather of every rank's
choice through the control group, once per key): unanimous routes to the candidate, anything else
routes stock on every rank, and each rank writes a ``route`` receipt. After agreement, a rank-local
failure of the candidate is never served by a fallback (peers may already be inside the
candidate's communication): the rank writes ``failed`` and exits the process with
``COLLECTIVE_ABORT_EXIT``, and its peers fail at their next communication with it.

Every slot's call site runs as straight-line code generated once from its contract (the way attrs
builds its methods): loops, comprehensions and argument dictionaries cost more than the checks
themselves at this scale.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import attrs

from ._errors import CandidateFailure, CollectiveAbort, DescriptorError, RevalidationError
from ._receipts import ReceiptLog
from ._registry import Registry, Resolution
from ._slots import (
    CallDescriptor,
    SlotSpec,
    TensorSpec,
    Topology,
    Variant,
    contiguous_strides,
    describe,
    output_dtype,
    output_shape,
)

log = logging.getLogger(__name__)


class Policy(str, enum.Enum):
    STOCK = "stock"
    STRICT = "strict"
    LENIENT = "lenient"


@attrs.frozen
class OutputPlan:
    """How one output is allocated: like a contiguous input of its shape and dtype, or from scratch."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    stride: tuple[int, ...]
    like: str | None = None


@attrs.define(eq=False)
class Plan:
    """Everything a call with one descriptor key needs, computed once.

    ``check(*inputs)`` is true only when every input has this plan's shape, strides, dtype and
    device (see :func:`_tensor_check`); with ``scalars`` equal too, a call has this plan's key.

    ``fast`` is the tuple the call site's generated code unpacks (None routes to ``slow``): the
    implementation, its ``completed`` tally cell, whether to snapshot written inputs, the CUDA graph
    receipts (None off CUDA), the outputs' tensor check, then per output
    (allocate like its input?, shape, strides, dtype, device), then per protected input whether
    torch keeps its version counter (not an inference tensor).
    """

    resolution: Resolution
    descriptor: CallDescriptor | None = None
    outputs: tuple[OutputPlan, ...] = ()
    protected: tuple[str, ...] = ()
    observed: tuple[str, ...] = ()
    written: tuple[str, ...] = ()
    prepare_error: str | None = None
    fast: tuple[Any, ...] | None = None
    check: Callable[..., bool] = attrs.field(default=lambda *tensors: False)
    scalars: tuple[Any, ...] = ()

    @property
    def variant(self) -> Variant | None:
        return self.resolution.selected


class _Captures:
    """Whether the current CUDA stream is capturing, asked of the driver only while a capture that
    went through ``torch.cuda.CUDAGraph`` (what ``torch.cuda.graph``, vLLM, SGLang and torch.compile's
    CUDA graphs use) is open in this process: outside captures, the per-call check is one attribute
    read instead of a driver query. Installed once, by the first CUDA plan."""

    open = 0
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        import torch

        graph = torch.cuda.CUDAGraph
        begin, end = graph.capture_begin, graph.capture_end

        @functools.wraps(begin)
        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
            cls.open += 1
            try:
                return begin(self, *args, **kwargs)
            except BaseException:
                cls.open -= 1
                raise

        @functools.wraps(end)
        def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return end(self, *args, **kwargs)
            finally:
                cls.open = max(cls.open - 1, 0)

        graph.capture_begin, graph.capture_end = capture_begin, capture_end  # type: ignore[method-assign]
        cls.installed = True
        if torch.cuda.is_current_stream_capturing():
            cls.open += 1  # a capture begun before the hook: its capture_end comes through the hook

    @classmethod
    def capturing(cls) -> bool:
        if cls.open <= 0:
            return False
        import torch

        return torch.cuda.is_current_stream_capturing()


class _GraphCount:
    """Receipts of a CUDA plan's calls that are captured into a CUDA graph instead of run.

    A captured call counts ``captured`` (graph membership) and records an increment of this
    (slot, variant)'s replay counter into the graph with it, so each replay is counted on the device.
    """

    __slots__ = ("capturing", "cell", "counts", "key")

    def __init__(self, receipts: Any, slot: str, variant: str, device: Any) -> None:
        import torch

        # called from the call site (the hot path of every CUDA call): a driver query only while a
        # capture is open; a capture already open when the hook is installed is seen by torch's own check
        _Captures.install()
        self.capturing: Callable[[], bool] = _Captures.capturing
        self.counts = receipts.counts
        self.key = ("captured", slot, variant)
        # The counter is made outside capture (it allocates); a plan first made while capturing
        # still records membership, but its replays cannot be counted.
        self.cell = None if torch.cuda.is_current_stream_capturing() else receipts.replay_counter(slot, variant, device)
        if self.cell is None:
            log.warning(
                "cacheon %s: %s first called inside a CUDA graph capture; its replays are not counted", slot, variant
            )

    def captured(self) -> None:
        self.counts[self.key] += 1
        if self.cell is not None:
            self.cell.add_(1)


class CallSite:
    """One chokepoint's entry into the dispatcher. Adapters hold one per slot they serve.

    ``site(**inputs_and_scalars)`` returns the outputs (one tensor, or a tuple in contract order),
    or None for the engine's stock path. Each slot gets a subclass whose ``__call__`` is generated
    from its contract (keyword-only parameters named after it, so a missing or unknown argument is
    Python's own TypeError).
    """

    def __init__(self, dispatcher: Dispatcher, spec: SlotSpec, fallback: Callable[..., None] | None) -> None:
        self.dispatcher = dispatcher
        self.spec = spec
        self.fallback = fallback if fallback is not None else spec.reference
        self._registry = dispatcher.registry
        self._stock = dispatcher.policy is Policy.STOCK
        self._counts = dispatcher.receipts.counts
        self._scalar_names = tuple(s.name for s in spec.scalars)
        self._plans = dispatcher.registry.new_cache()
        self._key = _key_function(spec)

    def __call__(self, **args: Any) -> Any:  # replaced in every per-slot subclass
        raise NotImplementedError

    def call(self, **args: Any) -> Any:  # the same function as __call__ in every per-slot subclass
        """``site.call(**args)`` is ``site(**args)``, without the cost of calling an instance.

        Python calls an instance through its type's ``__call__`` with the keyword arguments packed
        into a new dict (about 0.3 us here); a method call passes them as they are. Adapters on a
        hot path use ``call``.
        """
        return self(**args)

    def plan_for(self, **args: Any) -> Plan:
        """The cached plan (resolution, trace, allocation) a call with these arguments uses."""
        for sc in self.spec.scalars:
            args.setdefault(sc.name, sc.default)
        key = self._key(args)
        return self._plans.get(key) or self._plan(args, key)

    # -- slow paths ---------------------------------------------------------------------------

    def _plan(self, args: Mapping[str, Any], key: tuple[Any, ...]) -> Plan:
        import torch

        spec = self.spec
        generation = self._plans.generation
        missing = [sc.name for sc in spec.scalars if args.get(sc.name) is None]
        if missing:
            raise DescriptorError(f"slot {spec.id!r}: scalars {missing} are required (no default in the contract)")
        try:
            descriptor = describe(spec, args, {n: args[n] for n in self._scalar_names}, self.dispatcher.topology)
        except DescriptorError as exc:
            # Ineligible before selection: stock routing, with the reason kept in the resolution.
            plan = Plan(Resolution(spec.id, None, (), f"call breaks the contract: {exc}"))
            self._plans[key] = plan
            return plan
        scalars = tuple(args[n] for n in self._scalar_names)
        resolution = self._registry.resolve(descriptor)
        device = args[spec.inputs[0].name].device
        dtypes = {t.name: t.dtype for t in descriptor.tensors}
        outputs = []
        fast_outputs: list[Any] = []
        for o in spec.outputs:
            shape = output_shape(o, descriptor.dims)
            dtype = output_dtype(o, dtypes)
            dense = contiguous_strides(shape)
            # empty_like of a contiguous input of the same shape and dtype is the engines' own idiom and the
            # cheapest allocation; it gives a contiguous output exactly when that input is contiguous.
            source = _like_source(spec, o)
            like = None
            if source is not None and descriptor.tensor(source).stride == dense:
                like = source
            plan_out = OutputPlan(o.name, torch.Size(shape), getattr(torch, dtype), device, dense, like)
            outputs.append(plan_out)
            fast_outputs += [like is not None, plan_out.shape, dense, plan_out.dtype, device]
        protected = tuple(t.name for t in spec.inputs if not t.written)
        observable = tuple(not args[n].is_inference() for n in protected)
        written = tuple(t.name for t in spec.inputs if t.written)
        plan = Plan(
            resolution,
            descriptor,
            tuple(outputs),
            protected,
            tuple(n for n, ok in zip(protected, observable, strict=True) if ok),
            written,
            check=_tensor_check([args[t.name] for t in spec.inputs]),
            scalars=scalars,
        )
        variant = resolution.selected
        if variant is not None and variant.prepare is not None:
            try:
                variant.prepare(descriptor)
            except Exception as exc:
                plan.prepare_error = f"prepare() raised {type(exc).__name__}: {exc}"
        if variant is not None and plan.prepare_error is None:
            snapshot = bool(written) and self.dispatcher.policy is Policy.LENIENT
            completed = self.dispatcher.receipts.tally("completed", spec.id, variant.name)
            graph = None
            if device.type == "cuda":
                graph = _GraphCount(self.dispatcher.receipts, spec.id, variant.name, device)
            # The outputs' shapes, strides, dtype and device, checked in one call after the candidate
            # (a tensor made like each output is checked against; a call the check rejects gets the
            # field-by-field revalidation, which alone decides a failure).
            exemplars = [torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=o.device) for o in outputs]
            checked = _tensor_check(exemplars)
            plan.fast = (variant.impl, completed, snapshot, graph, checked, *fast_outputs, *observable)
        if self._plans.generation == generation:  # else the registry changed while planning: not cached
            self._plans[key] = plan
        log.debug(
            "cacheon %s: %s -> %s (%s)",
            spec.id,
            descriptor,
            variant.name if variant else "stock",
            resolution.reason or "selected",
        )
        return plan

    def _slow(self, plan: Plan, args: dict[str, Any]) -> Any:
        if plan.prepare_error is None:
            return None  # no eligible candidate: the engine's stock path
        return self._failed(plan, args, None, plan.prepare_error)

    def _replan(self, args: dict[str, Any]) -> Any:
        # An input became an inference tensor since the plan was made: plan again, call again.
        self._plans.pop(self._key(args), None)
        self._plans.last = None
        return self(**args)

    def _failed(
        self,
        plan: Plan,
        args: dict[str, Any],
        saved: Mapping[str, Any] | None,
        reason: str,
        exc: BaseException | None = None,
    ) -> Any:
        dispatcher = self.dispatcher
        variant = plan.variant.name if plan.variant is not None else "?"
        dispatcher.receipts.count("fired", self.spec.id, variant)
        # A protected input the candidate wrote was never snapshotted (that would copy every weight on
        # every call), so no fallback can serve a trusted answer from it: that failure is always raised.
        unrecoverable = isinstance(exc, RevalidationError) and exc.kind == "input_written"
        if dispatcher.policy is not Policy.LENIENT or unrecoverable:
            dispatcher.receipts.event("failed", slot=self.spec.id, variant=variant, reason=reason)
            raise CandidateFailure(self.spec.id, variant, reason) from exc
        if self.fallback is None:
            raise CandidateFailure(self.spec.id, variant, f"{reason}; slot has no trusted fallback") from exc
        import torch

        # The failed candidate's outputs are discarded; inputs it may have half-written are restored.
        names = {o.name for o in plan.outputs}
        inputs = {k: v for k, v in args.items() if k not in names}
        for name, copy in (saved or {}).items():
            inputs[name].copy_(copy)
        outs = {o.name: torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in plan.outputs}
        self.fallback(**inputs, **outs)
        dispatcher.receipts.count("fallback", self.spec.id, variant)
        log.warning(
            "cacheon %s: candidate %s failed (%s); served by the trusted fallback", self.spec.id, variant, reason
        )
        if len(outs) == 1:
            return next(iter(outs.values()))
        return tuple(outs.values())


def _tensor_check(tensors: list[Any]) -> Callable[..., bool]:
    """A test that tensors have exactly these tensors' shapes, strides, dtypes and devices.

    It is torch's own C++ tensor check (the one ``torch.compile`` guards run): about a third of the
    cost of reading those four facts in Python to build a descriptor key. It also compares dispatch
    keys and ``requires_grad``, so it can say "different" for a call with the same key (that call
    then takes the key path, which is always right), never "same" for a different one. A torch
    without it gets a test that always says "different".
    """
    try:
        from torch._C._dynamo.guards import TensorGuards

        # one list per tensor, every dimension fixed (the stub's element type says otherwise)
        sizes: Any = [list(t.shape) for t in tensors]
        strides: Any = [list(t.stride()) for t in tensors]
        guards = TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        check: Callable[..., bool] = guards.check
        if not check(*tensors):
            raise TypeError("the check rejects the tensors it was made from")
    except Exception as exc:  # an absent or changed private API: the key path serves every call
        log.debug("cacheon: no tensor check (%s); every call computes its descriptor key", exc)
        return _different
    return check


def _different(*tensors: Any) -> bool:
    return False


def _like_source(spec: SlotSpec, output: TensorSpec) -> str | None:
    """The input an output may be allocated like: same symbolic shape, and its dtype source."""
    if output.same_dtype_as is None:
        return None
    source = spec.tensor(output.same_dtype_as)
    return source.name if tuple(source.shape) == tuple(output.shape) else None


def _key_parts(spec: SlotSpec) -> str:
    """Every fact ``describe`` depends on, as one flat tuple expression over the argument names."""
    parts = [f"{t.name}.{attr}" for t in spec.inputs for attr in ("shape", "stride()", "dtype", "device")]
    parts += [s.name for s in spec.scalars]
    return f"({', '.join(parts)},)"


def _key_function(spec: SlotSpec) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    names = [*spec.tensor_names, *(s.name for s in spec.scalars)]
    code = [
        "def key(args):",
        *(f"    {n} = args[{n!r}]" for n in names),
        f"    return {_key_parts(spec)}",
    ]
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(code), f"<cacheon key {spec.id}>", "exec"), namespace)
    key: Callable[[Mapping[str, Any]], tuple[Any, ...]] = namespace["key"]
    return key


@functools.cache
def _site_class(spec: SlotSpec) -> type[CallSite]:
    """A CallSite subclass whose ``__call__`` is the whole dispatch, straight-line, for this contract.

    Steps 1-2 are the last plan's tensor check (and its scalars compared), or else a key and one
    dictionary lookup; steps 3-7 unpack the plan's ``fast`` tuple,
    allocate, snapshot version counters, invoke by keyword, revalidate and count ``completed``.
    """
    inputs = [t.name for t in spec.inputs]
    scalars = [s.name for s in spec.scalars]
    outputs = [o.name for o in spec.outputs]
    protected = [t.name for t in spec.inputs if not t.written]
    written = [t.name for t in spec.inputs if t.written]
    import torch  # only dispatching needs torch; importing cacheon_core does not

    env: dict[str, Any] = {
        "_empty": torch.empty,
        "_empty_like": torch.empty_like,
        "_returned": _returned,
        "_explained": _explained,
        "_input_written": _input_written,
    }
    params = [*inputs]
    for i, sc in enumerate(spec.scalars):
        env[f"_default{i}"] = sc.default
        params.append(f"{sc.name}=_default{i}")
    all_args = "{" + ", ".join(f"{n!r}: {n}" for n in [*inputs, *scalars]) + "}"
    with_outs = (
        "{"
        + ", ".join(f"{n!r}: {n}" for n in [*inputs, *scalars])
        + ", "
        + ", ".join(f"{n!r}: _o{i}" for i, n in enumerate(outputs))
        + "}"
    )
    same_scalars = f" or ({''.join(n + ', ' for n in scalars)}) != _plan.scalars" if scalars else ""
    unpack = ["_impl", "_completed", "_snapshot", "_graph", "_checked"]
    for i in range(len(outputs)):
        unpack += [f"_like{i}", f"_S{i}", f"_T{i}", f"_D{i}", f"_V{i}"]
    unpack += [f"_b{j}" for j in range(len(protected))]
    code = [
        f"def __call__(self, *, {', '.join(params)}):",
        "    _plans = self._plans",
        "    _plan = _plans.last",  # None after every registry change, enable and disable included
        f"    if _plan is None or not _plan.check({', '.join(inputs)}){same_scalars}:",
        "        _generation = _plans.generation",
        "        if self._stock or not self._registry.enabled:",
        "            return None",
        f"        _key = {_key_parts(spec)}",
        "        _plan = _plans.get(_key)",
        "        if _plan is None:",
        f"            _plan = self._plan({all_args}, _key)",
        # a registry change while this call planned (another thread, or a plugin's supports/prepare)
        # emptied the cache: this plan serves this call only, never the next one
        "        if _plans.generation == _generation:",
        "            _plans.last = _plan",
        "    _fast = _plan.fast",
        "    if _fast is None:",
        f"        return self._slow(_plan, {all_args})",
        f"    {', '.join(unpack)}, = _fast",
    ]
    for i, o in enumerate(spec.outputs):
        source = _like_source(spec, o)
        alloc = f"_empty(_S{i}, dtype=_D{i}, device=_V{i})"
        if source is not None:
            alloc = f"_empty_like({source}) if _like{i} else {alloc}"
        code += [f"    _o{i} = {alloc}", f"    _p{i} = _o{i}.data_ptr()"]
    if protected:
        code.append("    try:")
        code += [f"        _v{j} = {n}._version if _b{j} else 0" for j, n in enumerate(protected)]
        code += ["    except RuntimeError:", f"        return self._replan({all_args})"]
    code += [f"    _w{j} = {n}.data_ptr()" for j, n in enumerate(written)]
    if written:
        snap = "{" + ", ".join(f"{n!r}: {n}.clone()" for n in written) + "}"
        code.append(f"    _saved = {snap} if _snapshot else None")
    else:
        code.append("    _saved = None")
    keywords = [f"{n}={n}" for n in [*inputs, *scalars]] + [f"{n}=_o{i}" for i, n in enumerate(outputs)]
    code += [
        "    try:",
        f"        _result = _impl({', '.join(keywords)})",
        "    except Exception as _exc:",
        f"        return self._failed(_plan, {with_outs}, _saved, f'raised {{type(_exc).__name__}}: {{_exc}}', _exc)",
        "    if _result is not None:",
        f"        return self._failed(_plan, {with_outs}, _saved, *_returned(_result))",
    ]
    outs = ", ".join(f"_o{i}" for i in range(len(outputs)))
    same_storage = "".join(f" or _o{i}.data_ptr() != _p{i}" for i in range(len(outputs)))
    code.append(f"    if not _checked({outs}){same_storage}:")
    for i in range(len(outputs)):
        code += [
            f"        if _o{i}.data_ptr() != _p{i} or _o{i}.shape != _S{i} or _o{i}.stride() != _T{i} "
            f"or _o{i}.dtype is not _D{i}:",
            f"            return self._failed(_plan, {with_outs}, _saved, "
            f"*_explained(_plan.outputs[{i}], _o{i}, _p{i}))",
        ]
    for j, n in enumerate(protected):
        code += [
            f"    if _b{j} and {n}._version != _v{j}:",
            f"        return self._failed(_plan, {with_outs}, _saved, *_input_written({n!r}))",
        ]
    for j, n in enumerate(written):
        code += [
            f"    if {n}.data_ptr() != _w{j}:",
            f"        return self._failed(_plan, {with_outs}, _saved, *_input_written({n!r}, moved=True))",
        ]
    code += [
        "    if _graph is not None and _graph.capturing():",
        "        _graph.captured()",
        "    else:",
        "        _completed[0] += 1",
    ]
    names = [f"_o{i}" for i in range(len(outputs))]
    code.append(f"    return {names[0]}" if len(names) == 1 else f"    return ({', '.join(names)},)")
    exec(compile("\n".join(code), f"<cacheon call site {spec.id}>", "exec"), env)
    call = env["__call__"]
    return type(f"CallSite[{spec.id}]", (CallSite,), {"__call__": call, "call": call, "__slots__": ()})


COLLECTIVE_ABORT_EXIT = 86  # the exit status of a rank that aborted on a failed collective candidate


class CollectiveCallSite(CallSite):
    """The call site of a collective slot: ``site(group=..., control_group=..., **args)``.

    ``group`` is the process group the operation spans (handed to the candidate); ``control_group``
    (default ``group``) is a group over the same ranks that can gather Python objects from the CPU
    (gloo), used for the route agreement. Every rank must call with the same descriptor key at the
    same point, as every rank of a collective already does.
    """

    def __init__(self, dispatcher: Dispatcher, spec: SlotSpec, fallback: Callable[..., None] | None) -> None:
        super().__init__(dispatcher, spec, fallback)
        self._routes: dict[tuple[Any, ...], str] = {}  # key -> the agreed variant, or "" for stock
        self._groups: dict[int, Any] = {}  # keeps every keyed group alive, so its id is never reused

    def __call__(self, **args: Any) -> Any:
        group = args.pop("group")
        control_group = args.pop("control_group", None)
        if self._stock:  # the launch policy, the same on every rank: no rank asks the others
            return None
        for sc in self.spec.scalars:
            args.setdefault(sc.name, sc.default)
        self._groups.setdefault(id(group), group)
        key = (id(group), *self._key(args))
        # A rank whose registry is not enabled (its plugins failed to load) still takes part in the
        # agreement, choosing stock: its peers are waiting for its answer.
        plan = (self._plans.get(key) or self._plan(args, key)) if self._registry.enabled else None
        agreed = self._routes.get(key)
        if agreed is None:
            agreed = self._agree(plan, group, group if control_group is None else control_group)
            self._routes[key] = agreed
        if not agreed:
            return None
        return self._serve(plan, args, group, agreed)

    def _agree(self, plan: Plan | None, group: Any, control_group: Any) -> str:
        """Every rank's choice for this key, gathered: the variant all ranks chose, or "" (stock)."""
        import torch.distributed as dist

        variant = None if plan is None else plan.variant
        choice = variant.name if plan is not None and variant is not None and plan.prepare_error is None else None
        descriptor = None if plan is None else plan.descriptor
        # The key as every rank sees it: shapes, strides, dtypes and device type, not the device index.
        facts = repr(
            (
                self.spec.id,
                None if descriptor is None else [(t.name, t.shape, t.stride, t.dtype) for t in descriptor.tensors],
                None if descriptor is None else descriptor.device.split(":")[0],
            )
        )
        mine = (hashlib.blake2b(facts.encode(), digest_size=16).hexdigest(), choice)
        world = dist.get_world_size(control_group)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=control_group)
        agreed = choice is not None and all(theirs == mine for theirs in everyone)
        if agreed:
            reason = f"candidate: {world} ranks agreed"
        else:
            choices = ", ".join(
                f"rank {r}: {c or 'stock'}{'' if d == mine[0] else ' (other call)'}"
                for r, (d, c) in enumerate(everyone)
            )
            reason = f"stock: the ranks did not agree ({choices})"
        self.dispatcher.receipts.event("route", slot=self.spec.id, variant=choice if agreed else None, reason=reason)
        log.info("cacheon %s: route %s", self.spec.id, reason)
        return choice if agreed and choice is not None else ""

    def _serve(self, plan: Plan | None, args: dict[str, Any], group: Any, agreed: str) -> Any:
        import torch

        variant = None if plan is None else plan.variant
        if plan is None or variant is None or variant.name != agreed or plan.prepare_error is not None:
            # This rank's registry changed after the ranks agreed (plans are rebuilt on a change, the
            # agreement is not): it can no longer serve what its peers are about to run.
            now = "stock" if plan is None or variant is None else variant.name
            why = f"agreed on {agreed} but this rank now resolves {now}"
            self._abort(plan, why if plan is None or plan.prepare_error is None else plan.prepare_error)
        outs = {o.name: torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in plan.outputs}
        ptrs = {n: t.data_ptr() for n, t in outs.items()}
        # inference tensors keep no version counter: those are checked bitwise by cacheon verify only
        versions = {n: args[n]._version for n in plan.observed if not args[n].is_inference()}
        written = {n: args[n].data_ptr() for n in plan.written}
        try:
            result = variant.impl(**args, **outs, group=group)
        except Exception as exc:
            self._abort(plan, f"raised {type(exc).__name__}: {exc}")
        if result is not None:
            self._abort(plan, _returned(result)[0])
        for o in plan.outputs:
            t = outs[o.name]
            if t.data_ptr() != ptrs[o.name] or t.shape != o.shape or t.stride() != o.stride or t.dtype is not o.dtype:
                self._abort(plan, _explained(o, t, ptrs[o.name])[0])
        for n, version in versions.items():
            if args[n]._version != version:
                self._abort(plan, _input_written(n)[0])
        for n, ptr in written.items():
            if args[n].data_ptr() != ptr:
                self._abort(plan, _input_written(n, moved=True)[0])
        self._counts[("completed", self.spec.id, variant.name)] += 1
        values = tuple(outs.values())
        return values[0] if len(values) == 1 else values

    def _abort(self, plan: Plan | None, reason: str) -> NoReturn:
        """A rank-local failure after the ranks agreed: receipts, one clear message, then exit."""
        dispatcher = self.dispatcher
        variant = plan.variant.name if plan is not None and plan.variant is not None else "?"
        dispatcher.receipts.count("fired", self.spec.id, variant)
        dispatcher.receipts.event("failed", slot=self.spec.id, variant=variant, reason=f"collective abort: {reason}")
        dispatcher.receipts.flush()
        error = CollectiveAbort(self.spec.id, variant, reason, dispatcher.topology.tp_rank)
        dispatcher.abort(error)
        raise error  # an abort hook that returned: the call still never completes


def _exit_now(error: CollectiveAbort) -> None:
    log.critical(
        "cacheon %s; its peers may already be inside its communication, so no fallback can serve the call: "
        "this process exits now with status %d",
        error,
        COLLECTIVE_ABORT_EXIT,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(COLLECTIVE_ABORT_EXIT)


def _returned(result: object) -> tuple[str, RevalidationError]:
    err = RevalidationError(
        "returned_value",
        "return",
        f"returned a {type(result).__name__}; the ABI requires writing outputs in place and returning None",
    )
    return str(err), err


def _input_written(name: str, moved: bool = False) -> tuple[str, RevalidationError]:
    if moved:
        err = RevalidationError("storage", name, "a written input no longer points at its own storage")
    else:
        err = RevalidationError("input_written", name, "an input the contract does not mark written was modified")
    return str(err), err


def _explained(o: OutputPlan, t: Any, ptr: int) -> tuple[str, RevalidationError]:
    if t.dtype != o.dtype:
        err = RevalidationError("dtype", o.name, f"is {t.dtype}, was allocated {o.dtype}")
    elif t.device != o.device:
        # A device change always moves the storage too; named first because it is the clearer fault.
        err = RevalidationError("device", o.name, f"is on {t.device}, was allocated on {o.device}")
    elif t.data_ptr() != ptr:
        err = RevalidationError("storage", o.name, "no longer points at the storage the dispatcher allocated")
    elif tuple(t.shape) != tuple(o.shape):
        err = RevalidationError("shape", o.name, f"is {tuple(t.shape)}, was allocated {tuple(o.shape)}")
    else:
        err = RevalidationError("stride", o.name, f"has strides {t.stride()}, was allocated {o.stride}")
    return str(err), err


class Dispatcher:
    """Owns the call sites of one process, its policy, topology and receipts."""

    def __init__(
        self,
        registry: Registry,
        *,
        policy: Policy | str = Policy.STRICT,
        receipts: ReceiptLog | None = None,
        topology: Topology = Topology(),
    ) -> None:
        self.registry = registry
        self._policy = Policy(policy)
        self.receipts = receipts if receipts is not None else ReceiptLog(None, policy=self._policy.value)
        self.topology = topology
        self._sites: dict[str, CallSite] = {}
        # What a rank-local collective failure does: exit the process (never returns). Embedders
        # that own process teardown may replace it with something that also never returns.
        self.abort: Callable[[CollectiveAbort], Any] = _exit_now

    @property
    def policy(self) -> Policy:
        """Fixed for the dispatcher's life: call sites compile it into their plans."""
        return self._policy

    def site(self, slot: str, *, fallback: Callable[..., None] | None = None) -> CallSite:
        """The call site for ``slot``; ``fallback`` (default: the slot's reference) serves lenient failures."""
        site = self._sites.get(slot)
        if site is None or (fallback is not None and site.fallback is not fallback):
            spec = self.registry.spec(slot)
            site = (CollectiveCallSite if spec.collective else _site_class(spec))(self, spec, fallback)
            self._sites[slot] = site
        return site

    def call(self, slot: str, **args: Any) -> Any:
        return self.site(slot)(**args)
