"""The deep MoE epilogue's state machine, and its consumer through the real dispatcher: a stack of
MoE layers whose pre-finalize outputs are consumed by the next layer's finalize + all-reduce +
residual add + RMSNorm, against the path that finalizes in the MoE layer itself."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheon_core import (
    DeepEpilogue,
    Dispatcher,
    EpilogueError,
    Handoff,
    ReceiptLog,
    Registry,
    Variant,
    read_receipts,
)
from cacheon_core._catalog import (
    allreduce_add_rmsnorm_reference,
    fused_experts_reference,
    moe_finalize_reference,
)
from cacheon_core._epilogue import finalize_add_norm

LAYERS, T, H, E, INTER, K = 3, 6, 32, 4, 16, 2


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group: the consumer's all-reduce and its route agreement run for real."""
    assert not dist.is_initialized(), "another test left a process group in this process"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def torch_finalize(*, routed_output, expert_weights, permuted_indices, out):
    moe_finalize_reference(
        routed_output=routed_output, expert_weights=expert_weights, permuted_indices=permuted_indices, out=out
    )


def torch_arfusion(*, x, residual, weight, eps, out, residual_out, group):
    allreduce_add_rmsnorm_reference(
        x=x, residual=residual, weight=weight, eps=eps, out=out, residual_out=residual_out, group=group
    )


def dispatcher(receipts):
    registry = Registry()
    registry.add_variant(Variant(slot="moe.finalize", name="fin", impl=torch_finalize, slot_version=2))
    registry.add_variant(
        Variant(slot="arfusion.allreduce_add_rmsnorm", name="arf", impl=torch_arfusion, slot_version=2)
    )
    registry.enable()
    return Dispatcher(registry, receipts=receipts)


def make_layers(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w13": torch.randn(E, 2 * INTER, H, generator=g) / H**0.5,
            "w2": torch.randn(E, H, INTER, generator=g) / INTER**0.5,
            "router": torch.randn(H, E, generator=g),
            "norm": torch.rand(H, generator=g) + 0.5,
        }
        for _ in range(LAYERS)
    ]


def route(x, layer):
    weights, ids = torch.softmax(x @ layer["router"], dim=-1).topk(K, dim=-1)
    ids = ids.to(torch.int32)
    ids[-1] = -1  # the last token is padding, as SGLang's top-k marks it
    return weights / weights.sum(-1, keepdim=True), ids


def moe(x, layer):
    weights, ids = route(x, layer)
    out = torch.empty_like(x)
    fused_experts_reference(
        hidden_states=x, w13=layer["w13"], w2=layer["w2"], topk_weights=weights, topk_ids=ids, out=out
    )
    return out


def export_of(x, layer, seed):
    """The MoE layer's pre-finalize tensors: every (token, k) expert output as one row of a permuted
    [p, h] buffer (p > t*k, as an expert GEMM's padded output), weights and the row of each entry."""
    weights, ids = route(x, layer)
    rows = torch.empty(T, K, H)
    for t in range(T):
        for k in range(K):
            e = max(int(ids[t, k]), 0)
            gate_up = layer["w13"][e] @ x[t]
            rows[t, k] = layer["w2"][e] @ (torch.nn.functional.silu(gate_up[:INTER]) * gate_up[INTER:])
    p = T * K + 5
    perm = torch.randperm(p, generator=torch.Generator().manual_seed(seed))[: T * K]
    routed = torch.randn(p, H)  # rows no entry names: must not matter
    routed[perm.long()] = rows.view(-1, H)
    indices = perm.view(T, K).to(torch.int32)
    indices[ids < 0] = -1
    return Handoff(routed_output=routed, expert_weights=weights, permuted_indices=indices)


def norm(x, residual, weight):
    out, new = torch.empty_like(x), torch.empty_like(x)
    allreduce_add_rmsnorm_reference(
        x=x, residual=residual, weight=weight, eps=1e-6, out=out, residual_out=new, group=None
    )
    return out, new


def run_stack(x, layers, epilogue, d, group, forward, seed):
    """One forward: each layer's input norm consumes the previous layer's export when it deferred."""
    residual = torch.zeros_like(x)
    owed, handoff = x, None
    for index, layer in enumerate(layers):
        if handoff is not None:
            taken = epilogue.consume(forward, index, handoff, residual)
            h, residual = finalize_add_norm(d, taken, residual, layer["norm"], 1e-6, group)
        else:
            h, residual = norm(owed, residual, layer["norm"])
        if epilogue.gate(forward, index, requested=True):
            handoff = export_of(h, layer, seed + index)
            epilogue.export(forward, index, handoff)
        else:
            owed, handoff = moe(h, layer), None
    assert handoff is None  # the final layer never defers
    return norm(owed, residual, torch.ones(H))[0]


def reference_stack(x, layers):
    residual = torch.zeros_like(x)
    owed = x
    for layer in layers:
        h, residual = norm(owed, residual, layer["norm"])
        owed = moe(h, layer)
    return norm(owed, residual, torch.ones(H))[0]


def test_each_export_is_consumed_once_by_the_next_layer_and_the_outputs_equal_the_finalized_path(group, tmp_path):
    receipts = ReceiptLog(tmp_path, role="scheduler", flush_interval=0)
    d = dispatcher(receipts)
    layers = make_layers()
    epilogue = DeepEpilogue(num_layers=LAYERS, receipts=receipts)
    for forward in range(2):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(10 + forward))
        batch = object()  # the engine's batch of this forward
        got = run_stack(x, layers, epilogue, d, group, batch, seed=100 * forward)
        assert torch.allclose(got, reference_stack(x, layers), atol=1e-5, rtol=1e-5)
    assert epilogue.consumed == 2 * (LAYERS - 1) and epilogue.vetoed == 2  # one veto per forward: the last layer
    receipts.flush()
    counts: dict[tuple[str, str | None], int] = {}
    for r in read_receipts(tmp_path):
        if r.kind == "completed":
            counts[(r.kind, r.slot)] = counts.get((r.kind, r.slot), 0) + r.count
    assert counts == {("completed", "moe.finalize"): 4, ("completed", "arfusion.allreduce_add_rmsnorm"): 4}
    assert not [r for r in read_receipts(tmp_path) if r.kind == "failed"]


def _exported(epilogue, batch, layer=0):
    assert epilogue.gate(batch, layer, requested=True)
    handoff = export_of(torch.randn(T, H), make_layers()[layer], seed=layer)
    epilogue.export(batch, layer, handoff)
    return handoff


def test_a_stale_export_from_the_previous_forward_is_rejected_and_never_consumed(tmp_path):
    receipts = ReceiptLog(tmp_path, role="scheduler", flush_interval=0)
    epilogue = DeepEpilogue(LAYERS, receipts)
    first, second = object(), object()
    handoff = _exported(epilogue, first)
    with pytest.raises(EpilogueError) as err:
        epilogue.consume(second, 1, handoff, torch.zeros(T, H))
    assert err.value.kind == "stale"
    with pytest.raises(EpilogueError) as err:  # rejected once, gone: not offered again
        epilogue.consume(second, 1, handoff, torch.zeros(T, H))
    assert err.value.kind == "scope"
    receipts.flush()
    failed = [r.reason for r in read_receipts(tmp_path) if r.kind == "failed"]
    assert len(failed) == 2 and "stale" in failed[0] and all(r.startswith("deep epilogue") for r in failed)


@pytest.mark.parametrize(
    ("layer", "residual", "why"),
    [
        (2, torch.zeros(T, H), "handed the export of layer 0"),
        (1, torch.zeros(T - 1, H), "rows x width"),
        (1, torch.zeros(T, H + 1), "rows x width"),
        (1, torch.zeros(T, H, dtype=torch.bfloat16), "rows x width"),
    ],
)
def test_a_mismatched_export_other_layer_rows_width_or_dtype_is_rejected(layer, residual, why):
    epilogue = DeepEpilogue(LAYERS)
    batch = object()
    handoff = _exported(epilogue, batch)
    with pytest.raises(EpilogueError, match=why) as err:
        epilogue.consume(batch, layer, handoff, residual)
    assert err.value.kind == "mismatch" and epilogue.consumed == 0


def test_exports_outside_their_gate_and_foreign_handoffs_are_scope_errors():
    epilogue = DeepEpilogue(LAYERS)
    batch = object()
    handoff = export_of(torch.randn(T, H), make_layers()[0], seed=0)
    with pytest.raises(EpilogueError) as err:  # no gate opened
        epilogue.export(batch, 0, handoff)
    assert err.value.kind == "scope"
    assert epilogue.gate(batch, 0, requested=False) is False
    with pytest.raises(EpilogueError, match="no open defer gate"):  # the gate did not defer
        epilogue.export(batch, 0, handoff)
    assert epilogue.gate(batch, 1, requested=True)
    with pytest.raises(EpilogueError, match="the gate of layer 1"):  # another layer's gate
        epilogue.export(batch, 0, handoff)
    pending = _exported(epilogue, batch, layer=1)
    with pytest.raises(EpilogueError) as err:
        epilogue.consume(batch, 2, handoff, torch.zeros(T, H))  # not the pending export
    assert err.value.kind == "scope" and pending is not handoff


def test_the_final_layer_never_defers_and_an_unconsumed_export_fails_loudly():
    epilogue = DeepEpilogue(LAYERS)
    batch = object()
    assert epilogue.gate(batch, LAYERS - 1, requested=True) is False and epilogue.vetoed == 1
    assert epilogue.open_gate is None
    # an engine that knows a layer ends its stack (a pipeline stage's last) vetoes it the same way
    assert epilogue.gate(batch, 0, requested=True, final=True) is False and epilogue.vetoed == 2
    assert epilogue.gate(batch, 0, requested=True) is True and epilogue.open_gate == (batch, 0)
    assert epilogue.current_forward is batch
    _exported(epilogue, batch, layer=0)
    with pytest.raises(EpilogueError) as err:
        epilogue.gate(batch, 1, requested=True)  # layer 1 began; nobody took layer 0's output
    assert err.value.kind == "unconsumed"
    with pytest.raises(ValueError):
        DeepEpilogue(0)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["gate", "export", "consume", "new_forward"]),
        st.integers(0, LAYERS - 1),
        st.booleans(),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_any_sequence_consumes_an_export_at_most_once_only_in_its_forward_at_the_next_layer(ops):
    epilogue = DeepEpilogue(LAYERS)
    batch = object()
    forward = 0
    handoffs: list[tuple[int, int, Handoff]] = []  # (forward, layer, handoff) of every accepted export
    taken: set[int] = set()
    residual = torch.zeros(2, 4)
    for op, layer, flag in ops:
        if op == "new_forward":
            batch, forward = object(), forward + 1
        elif op == "gate":
            try:
                deferred = epilogue.gate(batch, layer, requested=flag)
            except EpilogueError as exc:
                assert exc.kind == "unconsumed"
                continue
            assert not (deferred and layer == LAYERS - 1)
        elif op == "export":
            handoff = Handoff(torch.zeros(5, 4), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32))
            try:
                epilogue.export(batch, layer, handoff)
                handoffs.append((forward, layer, handoff))
            except EpilogueError as exc:
                assert exc.kind == "scope"
        elif handoffs:
            origin, source, handoff = handoffs[-1] if flag else handoffs[0]
            try:
                assert epilogue.consume(batch, layer, handoff, residual) is handoff
            except EpilogueError:
                continue
            assert id(handoff) not in taken and origin == forward and layer == source + 1
            taken.add(id(handoff))


def test_a_finalize_that_routes_stock_is_computed_by_the_reference_so_the_all_reduce_still_runs(group):
    registry = Registry()  # no moe.finalize candidate on this rank; the all-reduce candidate is there
    registry.add_variant(
        Variant(slot="arfusion.allreduce_add_rmsnorm", name="arf", impl=torch_arfusion, slot_version=2)
    )
    registry.enable()
    d = Dispatcher(registry)
    x = torch.randn(T, H)
    layer = make_layers()[0]
    handoff = export_of(x, layer, seed=3)
    residual = torch.randn(T, H)
    out, new_residual = finalize_add_norm(d, handoff, residual, layer["norm"], 1e-6, group)
    want, want_residual = norm(moe(x, layer), residual, layer["norm"])
    assert torch.allclose(out, want, atol=1e-5) and torch.allclose(new_residual, want_residual, atol=1e-5)
    assert d.receipts.counts[("completed", "arfusion.allreduce_add_rmsnorm", "arf")] == 1
