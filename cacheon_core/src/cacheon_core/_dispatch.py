"""The checked dispatcher: the seven-step dispatch contract at one chokepoint.

1. derive a canonical call descriptor from the live tensors (once per distinct call shape);
2. resolve the variant against the registry (cached per descriptor key: steady state is one
   dictionary lookup);
3. allocate every output through the typed contract;
4. prepare layout-sensitive state through the variant's ``prepare`` (once per descriptor);
5. invoke the candidate, only after selection;
6. revalidate: the candidate returned None, every output keeps its storage, shape, dtype, device
   and strides, and no input the contract does not mark ``written`` was written;
7. return the outputs (one tensor, or a tuple in contract order); the engine adapter turns them
   into the model-facing value.

``None`` from a call site means "no eligible candidate": the adapter runs the engine's stock
path, which is legitimate before selection. After selection, the policy decides: ``strict``
raises :class:`CandidateFailure` (and writes a ``failed`` receipt), ``lenient`` restores any
``written`` inputs, serves the trusted fallback and counts a ``fallback`` receipt. ``stock``
routes every call to the engine's path (the pristine reference run).

The written-input check on the hot path uses torch's version counters, which see writes made by
torch operations. Tensors created under ``torch.inference_mode`` have no version counter, and raw
kernel writes (Triton, CUDA) never bump one; ``cacheon verify`` compares every input bitwise and
catches those.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ._errors import CandidateFailure, DescriptorError, RevalidationError
from ._receipts import ReceiptLog
from ._registry import Registry, Resolution
from ._slots import CallDescriptor, SlotSpec, Topology, Variant, contiguous_strides, describe, output_dtype, output_shape

log = logging.getLogger(__name__)


class Policy(str, enum.Enum):
    STOCK = "stock"
    STRICT = "strict"
    LENIENT = "lenient"


@attrs.frozen
class OutputPlan:
    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    stride: tuple[int, ...]


class _Plan:
    """Everything a call with one descriptor key needs, computed once."""

    __slots__ = ("resolution", "descriptor", "variant", "impl", "outputs", "protected", "written", "prepare_error")

    def __init__(self, resolution: Resolution, descriptor: CallDescriptor | None,
                 outputs: tuple[OutputPlan, ...], protected: tuple[str, ...], written: tuple[str, ...]) -> None:
        self.resolution = resolution
        self.descriptor = descriptor
        self.variant: Variant | None = resolution.selected
        self.impl = self.variant.impl if self.variant is not None else None
        self.outputs = outputs
        self.protected = protected
        self.written = written
        self.prepare_error: str | None = None


def _version(tensor: Any) -> int:
    # Inference tensors keep no version counter; -1 means "not observable here".
    return -1 if tensor.is_inference() else int(tensor._version)


class CallSite:
    """One chokepoint's entry into the dispatcher. Adapters hold one per slot they serve."""

    def __init__(self, dispatcher: Dispatcher, spec: SlotSpec, fallback: Callable[..., None] | None) -> None:
        self.dispatcher = dispatcher
        self.spec = spec
        self.fallback = fallback if fallback is not None else spec.reference
        self._tensor_names = spec.tensor_names
        self._scalar_names = tuple(s.name for s in spec.scalars)
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._generation = -1

    # -- the hot path -------------------------------------------------------------------------

    def __call__(self, **args: Any) -> Any:
        dispatcher = self.dispatcher
        registry = dispatcher.registry
        if not registry.enabled or dispatcher.policy is Policy.STOCK:
            return None
        if self._generation != registry.generation:
            self._plans.clear()
            self._generation = registry.generation
        try:
            key = tuple([(t.shape, t.stride(), t.dtype, t.device) for t in map(args.__getitem__, self._tensor_names)])
        except KeyError as exc:
            raise DescriptorError(f"slot {self.spec.id!r}: input {exc.args[0]!r} is missing") from None
        if self._scalar_names:
            key += tuple(map(args.get, self._scalar_names))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(args, key)
        impl = plan.impl
        if impl is None:
            return None
        if plan.prepare_error is not None:
            return self._failed(plan, args, None, plan.prepare_error)
        import torch

        outs = {o.name: torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in plan.outputs}
        ptrs = [t.data_ptr() for t in outs.values()]
        versions = [_version(args[n]) for n in plan.protected]
        saved = None
        if plan.written and dispatcher.policy is Policy.LENIENT:
            saved = {n: args[n].clone() for n in plan.written}
        receipts = dispatcher.receipts
        variant_name = plan.variant.name  # type: ignore[union-attr]
        receipts.count("fired", self.spec.id, variant_name)
        try:
            result = impl(**args, **outs)
        except Exception as exc:
            return self._failed(plan, args, saved, f"raised {type(exc).__name__}: {exc}", exc)
        try:
            if result is not None:
                raise RevalidationError("returned_value", "return",
                                        f"returned {type(result).__name__}; the ABI requires writing outputs in place and returning None")
            for o, ptr in zip(plan.outputs, ptrs):
                t = outs[o.name]
                if t.data_ptr() != ptr or t.shape != o.shape or t.stride() != o.stride or t.dtype != o.dtype or t.device != o.device:
                    self._explain_output(o, t, ptr)
            for name, before in zip(plan.protected, versions):
                if before >= 0 and args[name]._version != before:
                    raise RevalidationError("input_written", name, "an input the contract does not mark written was modified")
        except RevalidationError as exc:
            return self._failed(plan, args, saved, str(exc), exc)
        receipts.count("completed", self.spec.id, variant_name)
        if len(outs) == 1:
            return next(iter(outs.values()))
        return tuple(outs.values())

    # -- slow paths ---------------------------------------------------------------------------

    def resolve(self, **args: Any) -> Resolution:
        """The decision trace for a call (what ``cacheon`` prints about why a variant was chosen)."""
        registry = self.dispatcher.registry
        try:
            descriptor = describe(self.spec, args, {n: args[n] for n in self._scalar_names if n in args},
                                  self.dispatcher.topology)
        except DescriptorError as exc:
            return Resolution(self.spec.id, None, (), f"call breaks the contract: {exc}")
        return registry.resolve(descriptor)

    def _plan(self, args: Mapping[str, Any], key: tuple[Any, ...]) -> _Plan:
        import torch

        spec = self.spec
        try:
            descriptor = describe(spec, args, {n: args[n] for n in self._scalar_names if n in args},
                                  self.dispatcher.topology)
        except DescriptorError as exc:
            # Ineligible before selection: stock routing, recorded in the resolution.
            plan = _Plan(Resolution(spec.id, None, (), f"call breaks the contract: {exc}"), None, (), (), ())
            self._plans[key] = plan
            return plan
        resolution = self.dispatcher.registry.resolve(descriptor)
        device = args[spec.inputs[0].name].device
        dtypes = {t.name: t.dtype for t in descriptor.tensors}
        outputs = tuple(
            OutputPlan(o.name, output_shape(o, descriptor.dims), getattr(torch, output_dtype(o, dtypes)), device,
                       contiguous_strides(output_shape(o, descriptor.dims)))
            for o in spec.outputs
        )
        protected = tuple(t.name for t in spec.inputs if not t.written)
        written = tuple(t.name for t in spec.inputs if t.written)
        plan = _Plan(resolution, descriptor, outputs, protected, written)
        variant = resolution.selected
        if variant is not None and variant.prepare is not None:
            try:
                variant.prepare(descriptor)
            except Exception as exc:
                plan.prepare_error = f"prepare() raised {type(exc).__name__}: {exc}"
        self._plans[key] = plan
        log.debug("cacheon %s: %s -> %s (%s)", spec.id, descriptor, variant.name if variant else "stock",
                  resolution.reason or "selected")
        return plan

    @staticmethod
    def _explain_output(o: OutputPlan, t: Any, ptr: int) -> None:
        if t.dtype != o.dtype:
            raise RevalidationError("dtype", o.name, f"is {t.dtype}, was allocated {o.dtype}")
        if t.device != o.device:
            raise RevalidationError("device", o.name, f"is on {t.device}, was allocated on {o.device}")
        if t.data_ptr() != ptr:
            raise RevalidationError("storage", o.name, "no longer points at the storage the dispatcher allocated")
        if tuple(t.shape) != o.shape:
            raise RevalidationError("shape", o.name, f"is {tuple(t.shape)}, was allocated {o.shape}")
        raise RevalidationError("stride", o.name, f"has strides {t.stride()}, was allocated {o.stride}")

    def _failed(self, plan: _Plan, args: Mapping[str, Any], saved: Mapping[str, Any] | None, reason: str,
                exc: BaseException | None = None) -> Any:
        dispatcher = self.dispatcher
        variant = plan.variant.name  # type: ignore[union-attr]
        if dispatcher.policy is not Policy.LENIENT:
            dispatcher.receipts.event("failed", slot=self.spec.id, variant=variant, reason=reason)
            raise CandidateFailure(self.spec.id, variant, reason) from exc
        if self.fallback is None:
            raise CandidateFailure(self.spec.id, variant, f"{reason}; slot has no trusted fallback") from exc
        import torch

        for name, copy in (saved or {}).items():
            args[name].copy_(copy)
        outs = {o.name: torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in plan.outputs}
        self.fallback(**args, **outs)
        dispatcher.receipts.count("fallback", self.spec.id, variant)
        log.warning("cacheon %s: candidate %s failed (%s); served by the trusted fallback", self.spec.id, variant, reason)
        if len(outs) == 1:
            return next(iter(outs.values()))
        return tuple(outs.values())


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
            site = CallSite(self, self.registry.spec(slot), fallback)
            self._sites[slot] = site
        return site

    def call(self, slot: str, **args: Any) -> Any:
        return self.site(slot)(**args)
