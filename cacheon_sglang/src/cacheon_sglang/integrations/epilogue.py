"""The deep MoE epilogue at SGLang 0.5.23's layer-boundary fusions: three points, one path.

1. ``epilogue_defer_gate`` wraps ``CustomAllReduceFusion.can_defer_finalize`` (asked once per FFN
   exit, before the FFN runs) and passes SGLang's answer through :meth:`DeepEpilogue.gate`, scoped
   to this forward (the ``ForwardBatch``) and layer. SGLang gives a plan no layer index; each decoder
   layer builds one ``CustomAllReduceFusion`` and gives it to both of its stages, so a layer is the
   construction order of its fusion and the model's layer count is how many were built. A defer on
   the final layer is vetoed (SGLang's own ``plan.terminal`` vetoes too).
2. ``epilogue_moe_export`` wraps ``MoeDeferredFinalize.from_flashinfer`` (where every deferring model
   builds its handoff) and exports the handoff's pre-finalize tensors under the open gate; outside
   the gate's ``defer_moe_finalize`` scope the export is refused (``scope``).
3. ``epilogue_consume`` wraps ``CustomAllReduceFusion._finalize_add_norm`` (the next attention input)
   and consumes the pending export exactly once: ``moe.finalize``, the gated shared-expert term,
   then ``arfusion.allreduce_add_rmsnorm`` over the tensor-parallel group, through the dispatcher.
   A stale, mismatched or wrongly scoped export raises :class:`EpilogueError` with a ``failed``
   receipt and is never consumed. When the all-reduce routes stock, SGLang's own fused kernel runs.

The three rows form one joint set: activation installs all or none, and each adapter passes
through unless the whole set is installed. They pass through outside a scheduler, and while a CUDA
graph is being captured (the ranks' route agreement cannot run inside a capture). SGLang reaches
none of these points on a CPU host; the CPU tests drive SGLang's own layer stack with the push
plane's eligibility granted.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cacheon_core import DeepEpilogue, Handoff, finalize_add_norm

from .. import seam
from ..seams import SeamRow
from . import MARK, capturing, patch_method
from .norm import _weight

JOINT = "deep_epilogue"
log = logging.getLogger(__name__)


class _State:
    """This process's layers (fusion -> construction order), its epilogue and the last export."""

    def __init__(self) -> None:
        self.layers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.counter = itertools.count()
        self.epilogue: DeepEpilogue | None = None
        self.exported: tuple[Any, Handoff] | None = None  # (SGLang's handoff, ours): held, so ids stay unique


STATE = _State()


def _active(tensor: Any = None) -> bool:
    if seam.STATE.sites is None or not seam.joint_ready(JOINT):
        return False
    return tensor is None or not capturing(tensor)


def _epilogue() -> DeepEpilogue:
    count = max(len(STATE.layers), 1)
    epilogue = STATE.epilogue
    if epilogue is None:
        runtime = seam.STATE.runtime
        epilogue = STATE.epilogue = DeepEpilogue(count, None if runtime is None else runtime.receipts)
    epilogue.num_layers = count  # a model built after the first (a draft) extends the count
    return epilogue


def _layer(fusion: Any) -> int:
    return STATE.layers.get(fusion, -1)  # -1: built before the adapters were installed


def _handoff(owed: Any) -> Handoff:
    exported = STATE.exported
    if exported is not None and exported[0] is owed:
        return exported[1]
    return Handoff(owed.routed_output, owed.expert_weights, owed.permuted_indices, owed.gated_shared_output)


def _gate_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def can_defer_finalize(self: Any, plan: Any, forward_batch: Any) -> Any:
        requested = original(self, plan, forward_batch)
        if not _active(forward_batch.input_ids):
            return requested
        layer = _layer(self)
        if layer < 0:  # a fusion built before the adapters: no layer to scope a defer to, so none
            if requested:
                log.warning("cacheon deep epilogue: a layer built before the adapters finalizes in place")
            return False
        # SGLang's own end of the stack (plan.terminal) is vetoed like the model's last layer.
        return _epilogue().gate(forward_batch, layer, bool(requested), final=bool(plan.terminal))

    return can_defer_finalize


def _init_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        STATE.layers[self] = next(STATE.counter)

    return init


def _export_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def from_flashinfer(cls: type, deferred_output: Any, *args: Any, **kwargs: Any) -> Any:
        owed = original(cls, deferred_output, *args, **kwargs)
        if not _active(owed.routed_output):
            return owed
        from sglang.srt.runtime_context import get_forward

        epilogue = _epilogue()
        gate = epilogue.open_gate
        handoff = _handoff(owed)
        if gate is None or not get_forward().defer_moe_finalize:  # outside the FFN exit's defer scope
            epilogue.export(epilogue.current_forward, -1, handoff)  # refused: scope
        else:
            epilogue.export(gate[0], gate[1], handoff)
        STATE.exported = (owed, handoff)
        return owed

    return from_flashinfer


def _consume_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _finalize_add_norm(
        self: Any, plan: Any, owed: Any, residual: Any, forward_batch: Any, post_residual_addition: Any
    ) -> Any:
        from sglang.srt.layers.layer_boundary.fusions.moe_finalize import MoeDeferredFinalize

        if residual is None or not isinstance(owed, MoeDeferredFinalize) or not _active(residual):
            return original(self, plan, owed, residual, forward_batch, post_residual_addition)
        handoff = _epilogue().consume(forward_batch, _layer(self), _handoff(owed), residual)
        STATE.exported = None
        norm = plan.norm
        weight = _weight(norm, type(norm).__name__ == "GemmaRMSNorm")
        runtime = seam.STATE.runtime
        if weight is None or runtime is None:
            return original(self, plan, owed, residual, forward_batch, post_residual_addition)
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        summed = residual if post_residual_addition is None else residual + post_residual_addition
        result = finalize_add_norm(
            runtime.dispatcher,
            handoff,
            summed,
            weight,
            norm.variance_epsilon,
            group.device_group,
            group.cpu_group,
        )
        if result is None:  # the all-reduce routes stock on every rank: SGLang's fused kernel
            return original(self, plan, owed, residual, forward_batch, post_residual_addition)
        return result

    return _finalize_add_norm


def install(row: SeamRow, module: ModuleType) -> bool:
    if row.name == "epilogue_defer_gate":
        patch_method(module, row.target, lambda original, cls: _init_adapter(original), "__init__")
        return patch_method(module, row.target, lambda original, cls: _gate_adapter(original), "can_defer_finalize")
    if row.name == "epilogue_consume":
        return patch_method(module, row.target, lambda original, cls: _consume_adapter(original), "_finalize_add_norm")
    cls = module.MoeDeferredFinalize
    current = cls.__dict__["from_flashinfer"]
    if not getattr(current.__func__, MARK, False):
        adapter = _export_adapter(current.__func__)
        setattr(adapter, MARK, True)
        cls.from_flashinfer = classmethod(adapter)
    return True
