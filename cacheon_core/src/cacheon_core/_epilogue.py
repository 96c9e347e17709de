"""The deep MoE epilogue's state machine: one MoE layer's pre-finalize output handed to the next
layer's fused consumer (finalize + all-reduce + residual add + RMSNorm), and nothing else.

Three engine points drive it, and they are one semantic path (their adapters share one binding):

1. ``gate(forward, layer, requested)``: the layer's decision to defer its finalize and reduction,
   scoped to this forward and layer. A defer on the model's final layer (known from the model's
   own layer count) is vetoed: no later layer would consume it. A gate opened while an earlier
   export is still unconsumed fails loudly (``unconsumed``): the output it carried would be lost.
2. ``export(forward, layer, handoff)``: the MoE layer's pre-finalize tensors, accepted only inside
   the open defer gate of that forward and layer (``scope`` otherwise).
3. ``consume(forward, layer, handoff, residual)``: the next layer's consumer takes the pending
   export exactly once. An export from an earlier forward is ``stale``; one from another layer,
   or whose rows, width or dtype do not match the residual it is added to, is ``mismatch``; a
   handoff that is not the pending export is ``scope``. A rejected export is never consumed: the
   consumer completes it the engine's own way.

Every rejection is an :class:`EpilogueError` (its ``kind`` names the rule) and a ``failed``
receipt. ``forward`` is any object identifying one model forward (the engine's batch object):
a new one starts a new forward.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import attrs

from ._errors import CacheonError
from ._receipts import ReceiptLog

log = logging.getLogger(__name__)

Kind = Literal["stale", "mismatch", "scope", "unconsumed"]
SLOT = "moe.finalize"  # the contract of the exported tensors; receipts are filed under it


class EpilogueError(CacheonError):
    """An export the deep epilogue must not consume, or a protocol step out of order."""

    def __init__(self, kind: Kind, detail: str) -> None:
        super().__init__(f"deep epilogue: {kind}: {detail}")
        self.kind = kind
        self.detail = detail


@attrs.frozen
class Handoff:
    """The pre-finalize tensors, in ``moe.finalize`` version 2's terms, and an optional shared
    expert term the consumer adds after the finalize (``out[t] = finalize[t] + shared[t]``)."""

    routed_output: Any  # [p, h]
    expert_weights: Any  # [t, k]
    permuted_indices: Any  # [t, k], -1 adds nothing
    shared_output: Any = None  # [t, h] or None

    @property
    def rows(self) -> int:
        return int(self.expert_weights.shape[0])


@attrs.define
class _Export:
    forward: int
    layer: int
    handoff: Handoff


@attrs.define
class _Gate:
    forward: int
    layer: int
    deferred: bool


class DeepEpilogue:
    """The state of one process's model forwards (an engine runs one forward at a time per process)."""

    def __init__(self, num_layers: int, receipts: ReceiptLog | None = None) -> None:
        if num_layers < 1:
            raise ValueError(f"a model has at least one layer, not {num_layers}")
        self.num_layers = num_layers
        self.receipts = receipts
        self._forward_object: Any = None
        self._forward = 0
        self._gate: _Gate | None = None
        self._pending: _Export | None = None
        self.vetoed = 0
        self.consumed = 0

    def _serial(self, forward: Any) -> int:
        """The serial of ``forward``, starting a new forward when it is another object."""
        if forward is not self._forward_object:
            self._forward_object = forward
            self._forward += 1
            self._gate = None
        return self._forward

    def _reject(self, kind: Kind, detail: str) -> EpilogueError:
        error = EpilogueError(kind, detail)
        if self.receipts is not None:
            self.receipts.event("failed", slot=SLOT, reason=str(error))
        log.warning("cacheon %s", error)
        return error

    @property
    def current_forward(self) -> Any:
        """The object of the forward the epilogue is in (None before the first gate)."""
        return self._forward_object

    @property
    def open_gate(self) -> tuple[Any, int] | None:
        """``(forward, layer)`` of the defer gate now open, or None (no gate, or one that did not defer)."""
        gate = self._gate
        if gate is None or not gate.deferred:
            return None
        return self._forward_object, gate.layer

    def gate(self, forward: Any, layer: int, requested: bool, final: bool = False) -> bool:
        """Whether ``layer`` of ``forward`` defers its finalize; the decision holds for its export.
        ``final`` says the engine itself knows the layer ends the stack (vetoed like the last layer)."""
        serial = self._serial(forward)
        pending = self._pending
        if pending is not None:
            self._pending = None
            raise self._reject(
                "unconsumed",
                f"layer {pending.layer} of forward {pending.forward} exported its output and no consumer "
                f"took it before layer {layer} of forward {serial} began",
            )
        if not 0 <= layer < self.num_layers:
            raise self._reject("scope", f"layer {layer} is outside the model's {self.num_layers} layers")
        deferred = requested
        if requested and (final or layer == self.num_layers - 1):
            deferred = False  # the final layer: nothing after it would consume the export
            self.vetoed += 1
        self._gate = _Gate(serial, layer, deferred)
        return deferred

    def export(self, forward: Any, layer: int, handoff: Handoff) -> None:
        serial = self._serial(forward)
        gate = self._gate
        if gate is None or not gate.deferred or gate.forward != serial or gate.layer != layer:
            opened = "no open defer gate" if gate is None or not gate.deferred else f"the gate of layer {gate.layer}"
            raise self._reject("scope", f"layer {layer} of forward {serial} exported under {opened}")
        self._gate = None  # one export per gate
        self._pending = _Export(serial, layer, handoff)

    def consume(self, forward: Any, layer: int, handoff: Handoff, residual: Any) -> Handoff:
        """Take the pending export for ``layer``'s consumer, or raise (the export stays unconsumed)."""
        serial = self._serial(forward)
        pending = self._pending
        if pending is None or pending.handoff is not handoff:
            raise self._reject("scope", f"layer {layer} was handed an output that is not the pending export")
        self._pending = None  # rejected or taken, it is never offered again
        if pending.forward != serial:
            raise self._reject(
                "stale", f"the export of layer {pending.layer} comes from forward {pending.forward}, not {serial}"
            )
        if pending.layer != layer - 1:
            raise self._reject("mismatch", f"layer {layer} was handed the export of layer {pending.layer}")
        want = (tuple(residual.shape), residual.dtype)
        routed = handoff.routed_output
        got = ((handoff.rows, int(routed.shape[-1])), routed.dtype)
        if got != want or (handoff.shared_output is not None and tuple(handoff.shared_output.shape) != want[0]):
            raise self._reject("mismatch", f"the export has rows x width, dtype {got}; the residual {want}")
        self.consumed += 1
        return handoff


def finalize_add_norm(
    dispatcher: Any, handoff: Handoff, residual: Any, weight: Any, eps: float, group: Any, control_group: Any = None
) -> tuple[Any, Any] | None:
    """The consumer's work through the dispatcher: ``moe.finalize``, the shared term, then
    ``arfusion.allreduce_add_rmsnorm`` (all-reduce + residual add + RMSNorm) over ``group``.
    Returns ``(out, new residual)``, or None when the all-reduce routes stock (the caller completes
    the handoff the engine's own way). A finalize that routes stock on this rank is computed by the
    slot's reference instead, so every rank reaches the collective's route agreement."""
    import torch

    tensors = {
        "routed_output": handoff.routed_output,
        "expert_weights": handoff.expert_weights,
        "permuted_indices": handoff.permuted_indices,
    }
    site = dispatcher.site("moe.finalize")
    finalized = site.call(**tensors)
    if finalized is None:
        routed = handoff.routed_output
        finalized = torch.empty((handoff.rows, routed.shape[-1]), dtype=routed.dtype, device=routed.device)
        site.spec.reference(**tensors, out=finalized)
    if handoff.shared_output is not None:
        finalized += handoff.shared_output
    result = dispatcher.site("arfusion.allreduce_add_rmsnorm")(
        group=group, control_group=control_group, x=finalized, residual=residual, weight=weight, eps=eps
    )
    return None if result is None else (result[0], result[1])
