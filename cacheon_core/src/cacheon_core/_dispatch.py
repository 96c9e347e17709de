"""The checked dispatcher: the seven-step dispatch contract at one chokepoint.

1. derive a canonical call descriptor from the live tensors (once per distinct call shape);
2. resolve the variant against the registry (cached per descriptor key: steady state is one
   dictionary lookup);
3. allocate every output through the typed contract;
4. prepare layout-sensitive state through the variant's ``prepare`` (once per descriptor);
5. invoke the candidate, only after selection (by keyword, outputs included);
6. revalidate: the candidate returned None, every output keeps its storage, shape, dtype, device
   and strides, and no input the contract does not mark ``written`` was written;
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

Steps 3 to 7 run as straight-line code generated once per descriptor key (the way attrs builds
its methods): loops and comprehensions cost more than the checks themselves at this scale.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ._errors import CandidateFailure, DescriptorError, RevalidationError
from ._receipts import ReceiptLog
from ._registry import Registry, Resolution
from ._slots import (
    CallDescriptor,
    SlotSpec,
    Topology,
    Variant,
    contiguous_strides,
    describe,
    output_dtype,
    output_shape,
)

log = logging.getLogger(__name__)

try:
    import torch as _torch

    _empty, _empty_like = _torch.empty, _torch.empty_like
except ImportError:  # cacheon-core imports without torch; dispatching needs it
    _empty = _empty_like = None  # type: ignore[assignment]


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
    """Everything a call with one descriptor key needs, computed once."""

    resolution: Resolution
    descriptor: CallDescriptor | None = None
    outputs: tuple[OutputPlan, ...] = ()
    # Inputs the contract protects, and those whose version counter torch keeps (not inference tensors).
    protected: tuple[str, ...] = ()
    observed: tuple[str, ...] = ()
    written: tuple[str, ...] = ()
    prepare_error: str | None = None
    run: Callable[[dict[str, Any]], Any] = attrs.field(default=lambda args: None)

    @property
    def variant(self) -> Variant | None:
        return self.resolution.selected


class CallSite:
    """One chokepoint's entry into the dispatcher. Adapters hold one per slot they serve.

    ``site(**inputs_and_scalars)`` returns the outputs, or None for the engine's stock path.
    """

    def __init__(self, dispatcher: Dispatcher, spec: SlotSpec, fallback: Callable[..., None] | None) -> None:
        self.dispatcher = dispatcher
        self.spec = spec
        self.fallback = fallback if fallback is not None else spec.reference
        self._registry = dispatcher.registry
        self._stock = dispatcher.policy is Policy.STOCK
        self._scalar_names = tuple(s.name for s in spec.scalars)
        self._plans: dict[tuple[Any, ...], Plan] = dispatcher.registry.new_cache()
        self._key = _key_function(spec)

    def _missing(self, exc: KeyError) -> Any:
        raise DescriptorError(f"slot {self.spec.id!r}: input {exc.args[0]!r} is missing") from None

    def __call__(self, **args: Any) -> Any:
        # Each slot's CallSite subclass replaces this with straight-line code (see _site_class).
        if self._stock or not self._registry.enabled:
            return None
        key = self._key(args)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(args, key)
        return plan.run(args)

    def plan_for(self, **args: Any) -> Plan:
        """The cached plan (resolution, trace, allocation) a call with these arguments uses."""
        key = self._key(args)
        return self._plans.get(key) or self._plan(args, key)

    # -- slow paths ---------------------------------------------------------------------------

    def _plan(self, args: Mapping[str, Any], key: tuple[Any, ...]) -> Plan:
        import torch

        spec = self.spec
        unknown = sorted(set(args) - set(spec.tensor_names) - set(self._scalar_names))
        if unknown:
            raise DescriptorError(
                f"slot {spec.id!r}: unknown arguments {unknown}; the contract takes "
                f"{[*spec.tensor_names, *self._scalar_names]}"
            )
        try:
            scalars = {n: args[n] for n in self._scalar_names if n in args}
            descriptor = describe(spec, args, scalars, self.dispatcher.topology)
        except DescriptorError as exc:
            # Ineligible before selection: stock routing, with the reason kept in the resolution.
            plan = Plan(Resolution(spec.id, None, (), f"call breaks the contract: {exc}"))
            self._plans[key] = plan
            return plan
        resolution = self._registry.resolve(descriptor)
        device = args[spec.inputs[0].name].device
        dtypes = {t.name: t.dtype for t in descriptor.tensors}
        outputs = []
        for o in spec.outputs:
            shape = output_shape(o, descriptor.dims)
            dtype = output_dtype(o, dtypes)
            dense = contiguous_strides(shape)
            # empty_like of a contiguous input of the same shape and dtype is the engines' own idiom and the
            # cheapest allocation; it gives a contiguous output exactly when the input is contiguous.
            like = next(
                (t.name for t in descriptor.tensors if t.shape == shape and t.dtype == dtype and t.stride == dense),
                None,
            )
            outputs.append(OutputPlan(o.name, torch.Size(shape), getattr(torch, dtype), device, dense, like))
        protected = tuple(t.name for t in spec.inputs if not t.written)
        plan = Plan(
            resolution,
            descriptor,
            tuple(outputs),
            protected,
            tuple(n for n in protected if not args[n].is_inference()),
            tuple(t.name for t in spec.inputs if t.written),
        )
        variant = resolution.selected
        if variant is not None:
            if variant.prepare is not None:
                try:
                    variant.prepare(descriptor)
                except Exception as exc:
                    plan.prepare_error = f"prepare() raised {type(exc).__name__}: {exc}"
            plan.run = self._compile(plan, key)
        self._plans[key] = plan
        log.debug(
            "cacheon %s: %s -> %s (%s)",
            spec.id,
            descriptor,
            variant.name if variant else "stock",
            resolution.reason or "selected",
        )
        return plan

    def _compile(self, plan: Plan, key: tuple[Any, ...]) -> Callable[[dict[str, Any]], Any]:
        """Steps 3-7 for this plan as straight-line code."""
        variant = plan.variant
        assert variant is not None
        if plan.prepare_error is not None:
            reason = plan.prepare_error
            return lambda args: self._failed(plan, args, None, reason)
        lenient = self.dispatcher.policy is Policy.LENIENT
        env: dict[str, Any] = {
            "impl": variant.impl,
            "counts": self.dispatcher.receipts.counts,
            "empty": _empty,
            "empty_like": _empty_like,
            "fail": self._failed,
            "plan": plan,
            "replan": self._replan,
            "key": key,
            "completed": ("completed", self.spec.id, variant.name),
            "returned": _returned,
            "explained": _explained,
            "input_written": _input_written,
            "outputs": plan.outputs,
        }
        spec = self.spec
        code = ["def run(args):"]
        code += [f"    t{i} = args[{t.name!r}]" for i, t in enumerate(spec.inputs)]
        for i, sc in enumerate(spec.scalars):
            env[f"default{i}"] = sc.default
            code.append(f"    s{i} = args.get({sc.name!r}, default{i})")
        tensor_var = {t.name: f"t{i}" for i, t in enumerate(spec.inputs)}
        for i, o in enumerate(plan.outputs):
            env[f"S{i}"], env[f"T{i}"], env[f"D{i}"], env[f"V{i}"] = o.shape, o.stride, o.dtype, o.device
            alloc = f"empty_like({tensor_var[o.like]})" if o.like else f"empty(S{i}, dtype=D{i}, device=V{i})"
            code += [f"    o{i} = args[{o.name!r}] = {alloc}", f"    p{i} = o{i}.data_ptr()"]
        if plan.observed:
            code.append("    try:")
            code += [f"        v{j} = {tensor_var[n]}._version" for j, n in enumerate(plan.observed)]
            code += ["    except RuntimeError:", "        return replan(key, args)"]
        code += [f"    w{j} = {tensor_var[n]}.data_ptr()" for j, n in enumerate(plan.written)]
        if lenient and plan.written:
            code.append("    saved = {" + ", ".join(f"{n!r}: {tensor_var[n]}.clone()" for n in plan.written) + "}")
        else:
            code.append("    saved = None")
        keywords = [f"{t.name}=t{i}" for i, t in enumerate(spec.inputs)]
        keywords += [f"{sc.name}=s{i}" for i, sc in enumerate(spec.scalars)]
        keywords += [f"{o.name}=o{i}" for i, o in enumerate(plan.outputs)]
        code += [
            "    try:",
            f"        result = impl({', '.join(keywords)})",
            "    except Exception as exc:",
            "        return fail(plan, args, saved, f'raised {type(exc).__name__}: {exc}', exc)",
            "    if result is not None:",
            "        return fail(plan, args, saved, *returned(result))",
        ]
        for i in range(len(plan.outputs)):
            code += [
                f"    if o{i}.data_ptr() != p{i} or o{i}.shape != S{i} or o{i}.stride() != T{i} "
                f"or o{i}.dtype is not D{i}:",
                f"        return fail(plan, args, saved, *explained(outputs[{i}], o{i}, p{i}))",
            ]
        for j, n in enumerate(plan.observed):
            code += [
                f"    if {tensor_var[n]}._version != v{j}:",
                f"        return fail(plan, args, saved, *input_written({n!r}))",
            ]
        for j, n in enumerate(plan.written):
            code += [
                f"    if {tensor_var[n]}.data_ptr() != w{j}:",
                f"        return fail(plan, args, saved, *input_written({n!r}, moved=True))",
            ]
        code.append("    counts[completed] += 1")
        names = [f"o{i}" for i in range(len(plan.outputs))]
        code.append(f"    return {names[0]}" if len(names) == 1 else f"    return ({', '.join(names)},)")
        exec(compile("\n".join(code), f"<cacheon run {self.spec.id} {variant.name}>", "exec"), env)
        run: Callable[[dict[str, Any]], Any] = env["run"]
        return run

    def _replan(self, key: tuple[Any, ...], args: dict[str, Any]) -> Any:
        # An input became an inference tensor since the plan was made: plan again, call again.
        for o in self.spec.outputs:
            args.pop(o.name, None)
        self._plans.pop(key, None)
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
        inputs: dict[str, Any] = {sc.name: sc.default for sc in self.spec.scalars}
        inputs.update((k, v) for k, v in args.items() if k not in names)
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


def _key_lines(spec: SlotSpec, indent: str) -> list[str]:
    """Straight-line code binding ``key``: every fact ``describe`` depends on, as one flat tuple."""
    lines = [f"{indent}t{i} = args[{name!r}]" for i, name in enumerate(spec.tensor_names)]
    parts = [f"t{i}.{attr}" for i in range(len(spec.tensor_names)) for attr in ("shape", "stride()", "dtype", "device")]
    parts += [f"args.get({s.name!r})" for s in spec.scalars]
    return [*lines, f"{indent}key = ({', '.join(parts)},)"]


def _key_function(spec: SlotSpec) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    namespace: dict[str, Any] = {}
    code = ["def key(args):", *_key_lines(spec, "    "), "    return key"]
    exec(compile("\n".join(code), f"<cacheon key {spec.id}>", "exec"), namespace)
    key: Callable[[Mapping[str, Any]], tuple[Any, ...]] = namespace["key"]
    return key


@functools.cache
def _site_class(spec: SlotSpec) -> type[CallSite]:
    """A CallSite subclass whose ``__call__`` computes this slot's key inline (one frame per call)."""
    code = [
        "def __call__(self, **args):",
        "    if self._stock or not self._registry.enabled:",
        "        return None",
        "    try:",
        *_key_lines(spec, "        "),
        "    except KeyError as exc:",
        "        return self._missing(exc)",
        "    plan = self._plans.get(key)",
        "    if plan is None:",
        "        plan = self._plan(args, key)",
        "    return plan.run(args)",
    ]
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(code), f"<cacheon call site {spec.id}>", "exec"), namespace)
    return type(f"CallSite[{spec.id}]", (CallSite,), {"__call__": namespace["__call__"], "__slots__": ()})


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
        self.policy = Policy(policy)
        self.receipts = receipts if receipts is not None else ReceiptLog(None, policy=self.policy.value)
        self.topology = topology
        self._sites: dict[str, CallSite] = {}

    def site(self, slot: str, *, fallback: Callable[..., None] | None = None) -> CallSite:
        """The call site for ``slot``; ``fallback`` (default: the slot's reference) serves lenient failures."""
        site = self._sites.get(slot)
        if site is None or (fallback is not None and site.fallback is not fallback):
            spec = self.registry.spec(slot)
            site = _site_class(spec)(self, spec, fallback)
            self._sites[slot] = site
        return site

    def call(self, slot: str, **args: Any) -> Any:
        return self.site(slot)(**args)
