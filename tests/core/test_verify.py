"""cacheon verify: a variant against the slot reference, with every kind of misbehaviour named."""

from __future__ import annotations

import pytest
import torch

from cacheon_core import Variant, verify_variant
from cacheon_core._catalog import (
    ATTENTION_DECODE,
    FUSED_ADD_RMSNORM,
    FUSED_EXPERTS,
    MOE_FINALIZE,
    RMSNORM,
    fused_experts_reference,
    rmsnorm_reference,
)


def good(*, x, weight, eps, out):
    rmsnorm_reference(x=x, weight=weight, eps=eps, out=out)


def returns_new(*, x, weight, eps, out):
    result = torch.empty_like(out)
    rmsnorm_reference(x=x, weight=weight, eps=eps, out=result)
    return result


def writes_nan(*, x, weight, eps, out):
    rmsnorm_reference(x=x, weight=weight, eps=eps, out=out)
    out[0, 0] = float("nan")


def writes_x(*, x, weight, eps, out):
    rmsnorm_reference(x=x, weight=weight, eps=eps, out=out)
    x.zero_()


def writes_padding(*, x, weight, eps, out):
    rmsnorm_reference(x=x, weight=weight, eps=eps, out=out)
    if x.stride(0) > x.shape[1]:
        # Reaches past the row: the padding of a strided x, which belongs to someone else.
        x.as_strided((x.shape[0],), (x.stride(0),), x.storage_offset() + x.shape[1]).fill_(0)


def skips_last_row(*, x, weight, eps, out):
    rmsnorm_reference(x=x[:-1], weight=weight, eps=eps, out=out[:-1])


def wrong_eps(*, x, weight, eps, out):
    rmsnorm_reference(x=x, weight=weight, eps=eps + 0.5, out=out)


def assumes_dense_rows(*, x, weight, eps, out):
    dense = torch.as_strided(x, x.shape, (x.shape[1], 1))
    rmsnorm_reference(x=dense, weight=weight, eps=eps, out=out)


@pytest.mark.parametrize(
    ("impl", "reason"),
    [
        (returns_new, "returned a Tensor instead of writing its outputs in place"),
        (writes_nan, "wrote 1 non-finite values (NaN/Inf) into output 'out'"),
        (writes_x, "wrote into input 'x'"),
        (writes_padding, "wrote into input 'x'"),
        (skips_last_row, "elements of output 'out' unwritten"),
        (wrong_eps, "elements differ from the reference"),
        (assumes_dense_rows, "elements differ from the reference"),
    ],
)
def test_bad_variants_are_rejected_with_the_reason(impl, reason):
    result = verify_variant(RMSNORM, Variant(slot="norm.rmsnorm", name="bad", impl=impl))
    assert result.status == "rejected"
    assert reason in result.reason


def test_a_correct_variant_passes_every_case():
    result = verify_variant(RMSNORM, Variant(slot="norm.rmsnorm", name="good", impl=good))
    assert result.status == "passed", result.reason
    assert {c.layout for c in result.cases} == {"contiguous", "padded"}
    assert {c.dtype for c in result.cases} == {"float32", "float16", "bfloat16"}
    assert all(c.status == "passed" for c in result.cases)


def test_a_variant_that_supports_nothing_here_is_unsupported_not_passed():
    v = Variant(slot="norm.rmsnorm", name="gpu_only", impl=good, supports=lambda d: d.device.startswith("cuda"))
    result = verify_variant(RMSNORM, v)
    assert result.status == "unsupported"


def wrong_from_1024_rows(*, x, weight, eps, out):  # another code path for many rows, and a wrong one
    rmsnorm_reference(x=x, weight=weight, eps=eps + (0.5 if x.shape[0] >= 1024 else 0.0), out=out)


def test_the_sizes_a_variant_declares_are_verified_after_the_slots():
    # The slot's own sizes never reach the wrong path: passed. Declared, its size is run and rejects it.
    plain = Variant(slot="norm.rmsnorm", name="paths", impl=wrong_from_1024_rows)
    assert verify_variant(RMSNORM, plain).status == "passed"
    declared = Variant(slot="norm.rmsnorm", name="paths", impl=wrong_from_1024_rows, verify_dims=[{"t": 1024, "h": 64}])
    result = verify_variant(RMSNORM, declared)
    assert result.status == "rejected" and "elements differ from the reference" in result.reason
    assert "'t': 1024" in result.reason
    fine = Variant(slot="norm.rmsnorm", name="paths", impl=good, verify_dims=[{"t": 1024, "h": 64}])
    result = verify_variant(RMSNORM, fine)
    assert result.status == "passed", result.reason
    assert {c.dims["t"] for c in result.cases} == {1, 7, 33, 1024}


@pytest.mark.parametrize(
    ("dims", "reason"),
    [
        ({"t": 4}, "must bind exactly the symbols ['h', 't']"),
        ({"t": 4, "h": 8, "k": 2}, "must bind exactly the symbols ['h', 't']"),
        ({"t": 1 << 13, "h": 1 << 12}, "more than 16777216"),
    ],
)
def test_declared_sizes_that_cannot_run_reject_the_variant(dims, reason):
    result = verify_variant(RMSNORM, Variant(slot="norm.rmsnorm", name="v", impl=good, verify_dims=[dims]))
    assert result.status == "rejected" and reason in result.reason, result.reason
    assert result.cases == ()  # nothing ran


@pytest.mark.parametrize("dims", [{"t": -1, "h": 8}, {"t": 1.5, "h": 8}, {"t": True, "h": 8}, [("t", 1)], "t=1"])
def test_declared_sizes_must_be_maps_of_symbols_to_integers(dims):
    from cacheon_core import ContractError

    with pytest.raises(ContractError, match="verify_dims entries"):
        Variant(slot="norm.rmsnorm", name="v", impl=good, verify_dims=[dims])


def test_a_collective_variants_bad_binding_is_rejected_before_any_rank_starts():
    from cacheon_core._catalog import ALL_REDUCE

    def all_reduce(*, x, out, group):
        raise AssertionError("never called")

    v = Variant(slot="collective.all_reduce", name="v", impl=all_reduce, verify_dims=[{"t": 4}])
    result = verify_variant(ALL_REDUCE, v)
    assert result.status == "rejected" and "must bind exactly the symbols" in result.reason, result.reason
    assert result.cases == ()


def test_declared_sizes_are_copied_and_none_means_none():
    dims = {"t": 1024, "h": 64}
    v = Variant(slot="norm.rmsnorm", name="v", impl=good, verify_dims=[dims])
    dims["t"] = 1
    assert v.verify_dims == ({"t": 1024, "h": 64},)
    assert Variant(slot="norm.rmsnorm", name="v", impl=good, verify_dims=None).verify_dims == ()


def test_declared_sizes_must_pass_the_slots_rule():
    def finalize(*, routed_output, expert_weights, permuted_indices, out):
        raise AssertionError("never called")

    v = Variant(
        slot="moe.finalize", name="v", impl=finalize, slot_version=2, verify_dims=[{"t": 4, "k": 2, "p": 3, "h": 8}]
    )
    result = verify_variant(MOE_FINALIZE, v)
    assert result.status == "rejected" and "breaks the contract" in result.reason, result.reason


def test_written_inputs_are_checked_against_the_reference():
    def forgets_residual(*, x, residual, weight, eps, out):
        total = x.float() + residual.float()
        out.copy_(total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.float())

    result = verify_variant(FUSED_ADD_RMSNORM, Variant(slot="norm.fused_add_rmsnorm", name="f", impl=forgets_residual))
    assert result.status == "rejected"
    assert "written input 'residual'" in result.reason


def test_references_verify_against_themselves_for_every_catalog_slot():
    from cacheon_core import BUILTIN_SLOTS

    for spec in BUILTIN_SLOTS:
        result = verify_variant(spec, Variant(slot=spec.id, name="self", impl=spec.reference))
        assert result.status == "passed", (spec.id, result.reason)


def test_decode_variant_that_ignores_sequence_bounds_is_rejected():
    from cacheon_core._catalog import _gqa_attend

    def ignores_bounds(*, q, k_cache, v_cache, kv_indptr, kv_indices, scale, out):
        slots = kv_indices.long()  # every sequence attends to every slot of the batch
        for b in range(q.shape[0]):
            out[b].copy_(_gqa_attend(q[b], k_cache[slots], v_cache[slots], scale))

    result = verify_variant(ATTENTION_DECODE, Variant(slot="attention.decode", name="x", impl=ignores_bounds))
    assert result.status == "rejected" and "differ from the reference" in result.reason


def test_a_catalog_only_slot_verifies_a_third_party_variant():
    def combine(*, routed_output, expert_weights, permuted_indices, out):
        rows = routed_output.float()[permuted_indices.long().clamp(min=0)]
        weights = expert_weights.float() * (permuted_indices >= 0)
        out.copy_(torch.einsum("tkh,tk->th", rows, weights))

    def padding_counted(*, routed_output, expert_weights, permuted_indices, out):
        rows = routed_output.float()[permuted_indices.long()]  # -1 reads the last row instead of nothing
        out.copy_(torch.einsum("tkh,tk->th", rows, expert_weights.float()))

    result = verify_variant(MOE_FINALIZE, Variant(slot="moe.finalize", name="c", impl=combine, slot_version=2))
    assert result.status == "passed", result.reason
    wrong = Variant(slot="moe.finalize", name="p", impl=padding_counted, slot_version=2)
    result = verify_variant(MOE_FINALIZE, wrong)
    assert result.status == "rejected" and "differ from the reference" in (result.reason or ""), result.reason


def test_fused_experts_sampler_routes_each_token_to_distinct_experts():
    gen = torch.Generator().manual_seed(0)
    inputs = FUSED_EXPERTS.sampler({"t": 50, "h": 8, "e": 6, "n2": 8, "i": 4, "k": 3}, "bfloat16", "cpu", gen)
    ids, padding = inputs["topk_ids"][:-1], inputs["topk_ids"][-1]
    assert ids.dtype == torch.int32 and int(ids.min()) >= 0 and int(ids.max()) < 6
    assert all(len(set(row.tolist())) == 3 for row in ids)
    assert padding.tolist() == [-1, -1, -1]  # the last token is padding, as SGLang's top-k marks it
    assert torch.allclose(inputs["topk_weights"].sum(-1), torch.ones(50))


@pytest.mark.parametrize("mistake", ["unweighted", "gate_and_up_swapped", "padding_routed"])
def test_fused_experts_variants_with_the_wrong_meaning_are_rejected(mistake):
    def wrong(*, hidden_states, w13, w2, topk_weights, topk_ids, out):
        if mistake == "unweighted":
            topk_weights = torch.ones_like(topk_weights) / topk_weights.shape[1]
        elif mistake == "padding_routed":
            topk_ids = topk_ids % w13.shape[0]  # -1 read as the last expert
        else:
            inter = w2.shape[2]
            w13 = torch.cat([w13[:, inter:], w13[:, :inter]], dim=1)
        fused_experts_reference(
            hidden_states=hidden_states, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, out=out
        )

    result = verify_variant(FUSED_EXPERTS, Variant(slot="moe.fused_experts", name="w", impl=wrong))
    assert result.status == "rejected" and "differ from the reference" in result.reason
