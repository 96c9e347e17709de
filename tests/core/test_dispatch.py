"""The checked dispatcher: selection, the strict/lenient/stock policies and revalidation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cacheon_core import (
    Accepted,
    CandidateFailure,
    DescriptorError,
    Dispatcher,
    ReceiptLog,
    Registry,
    Rejected,
    Variant,
)
from cacheon_core._catalog import fused_add_rmsnorm_reference, rmsnorm_reference


def torch_rmsnorm(*, x, weight, eps, out):
    rmsnorm_reference(x=x, weight=weight, eps=eps, out=out)


def build(*variants, policy="strict", enabled=True):
    registry = Registry()
    for v in variants:
        registry.add_variant(v)
    if enabled:
        registry.enable()
    receipts = ReceiptLog(None, policy=policy)
    return Dispatcher(registry, policy=policy, receipts=receipts), receipts


def inputs(t=3, h=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(t * 100 + h)
    return torch.randn(t, h, generator=g).to(dtype), torch.randn(h, generator=g).to(dtype)


def test_dispatch_selects_the_candidate_and_counts_it():
    d, receipts = build(Variant(slot="norm.rmsnorm", name="ref", impl=torch_rmsnorm))
    x, w = inputs()
    out = d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-5)
    expected = torch.empty_like(x)
    rmsnorm_reference(x=x, weight=w, eps=1e-5, out=expected)
    assert torch.equal(out, expected)
    assert receipts.counts[("completed", "norm.rmsnorm", "ref")] == 1


def test_omitted_scalars_take_the_contract_default():
    seen = {}

    def impl(*, x, weight, eps, out):
        seen["eps"] = eps
        out.copy_(x)

    d, _ = build(Variant(slot="norm.rmsnorm", name="v", impl=impl))
    x, w = inputs()
    d.site("norm.rmsnorm")(x=x, weight=w)
    assert seen["eps"] == 1e-6


def test_highest_priority_eligible_variant_wins_and_the_trace_says_why():
    calls = []

    def make(name):
        def impl(*, x, weight, eps, out):
            calls.append(name)
            out.copy_(x)

        return impl

    d, _ = build(
        Variant(slot="norm.rmsnorm", name="b_low", impl=make("b_low"), priority=1),
        Variant(slot="norm.rmsnorm", name="a_low", impl=make("a_low"), priority=1),
        Variant(
            slot="norm.rmsnorm",
            name="high_but_picky",
            impl=make("picky"),
            priority=9,
            supports=lambda desc: desc.dims["h"] >= 1024,
        ),
        Variant(slot="norm.rmsnorm", name="crashy", impl=make("crashy"), priority=5, supports=lambda desc: 1 / 0),
    )
    x, w = inputs()
    site = d.site("norm.rmsnorm")
    site(x=x, weight=w, eps=1e-6)
    assert calls == ["a_low"]
    trace = site.plan_for(x=x, weight=w, eps=1e-6).resolution.trace
    assert trace[0] == Rejected("high_but_picky", "supports() returned False")
    assert trace[1] == Rejected("crashy", "supports() raised ZeroDivisionError: division by zero")
    assert trace[2] == Accepted("a_low", 1)
    x2, w2 = inputs(2, 1024)
    site(x=x2, weight=w2, eps=1e-6)
    assert calls == ["a_low", "picky"]


def test_resolution_is_cached_per_descriptor_and_dropped_when_the_registry_changes():
    asked = []

    def supports(desc):
        asked.append(desc.dims["t"])
        return True

    d, _ = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm, supports=supports))
    site = d.site("norm.rmsnorm")
    x, w = inputs(3)
    for _ in range(5):
        site(x=x, weight=w, eps=1e-6)
    assert asked == [3]
    x5, _ = inputs(5)
    site(x=x5, weight=w, eps=1e-6)
    assert asked == [3, 5]
    d.registry.add_variant(Variant(slot="norm.rmsnorm", name="w", impl=torch_rmsnorm))
    site(x=x, weight=w, eps=1e-6)
    assert asked == [3, 5, 3]


CALLS = {
    "base": lambda: (*inputs(3), 1e-6),
    "strided": lambda: (inputs(16, 3)[0].t(), inputs(3)[1], 1e-6),  # same shape, other strides
    "dtype": lambda: (*inputs(3, dtype=torch.bfloat16), 1e-6),
    "shape": lambda: (*inputs(4), 1e-6),
    "eps": lambda: (*inputs(3), 1e-5),
    "meta": lambda: (torch.empty(3, 16, device="meta"), torch.empty(16, device="meta"), 1e-6),
}


@given(st.lists(st.sampled_from(sorted(CALLS)), min_size=1, max_size=12))
def test_alternating_calls_are_each_served_by_their_own_plan(sequence):
    # The call site first asks whether a call has the last plan's key (torch's tensor check and the
    # scalars): it must never say yes for a call with another shape, stride, dtype, device or eps.
    served = []

    def impl(*, x, weight, eps, out):
        served.append((tuple(x.shape), x.stride(), x.dtype, x.device.type, eps))
        out.copy_(x)

    def supports(desc):
        x = desc.tensor("x")
        return x.shape == (3, 16) and x.stride == (16, 1) and x.dtype == "float32" and desc.scalar("eps") == 1e-6

    d, receipts = build(Variant(slot="norm.rmsnorm", name="v", impl=impl, supports=supports))
    site = d.site("norm.rmsnorm")
    for kind in ["base", *sequence]:
        x, w, eps = CALLS[kind]()
        out = site.call(x=x, weight=w, eps=eps)
        assert (out is not None) == (kind in ("base", "meta")), kind
        if out is not None:
            assert served[-1] == (tuple(x.shape), x.stride(), x.dtype, x.device.type, eps)
    expected = 1 + sum(kind in ("base", "meta") for kind in sequence)
    assert receipts.counts[("completed", "norm.rmsnorm", "v")] == expected == len(served)


def test_tensor_check_tells_every_fact_of_the_key_apart():
    from cacheon_core._dispatch import _different, _tensor_check

    x = torch.randn(3, 16)
    check = _tensor_check([x])
    assert check is not _different, "torch's tensor check is missing: every call computes its key"
    assert check(torch.empty(3, 16))
    assert not check(torch.empty(4, 16))
    assert not check(torch.empty(16, 3).t())  # same shape, column-major
    assert not check(torch.empty(3, 16, dtype=torch.float64))
    assert not check(torch.empty(3, 16, device="meta"))
    assert not check(torch.empty(3, 32)[:, :16])  # same shape, rows 32 apart
    if torch.cuda.device_count() > 1:
        on0 = _tensor_check([torch.empty(3, 16, device="cuda:0")])
        assert on0(torch.empty(3, 16, device="cuda:0")) and not on0(torch.empty(3, 16, device="cuda:1"))


def test_an_output_the_tensor_check_rejects_is_still_judged_field_by_field():
    # A plan made under inference mode checks its outputs against inference tensors; a later call
    # outside inference mode allocates a normal tensor, which torch's check calls different. The
    # field-by-field revalidation decides: the same shape, strides, dtype and storage pass.
    d, receipts = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm))
    site = d.site("norm.rmsnorm")
    with torch.inference_mode():
        xi, wi = inputs()
        assert site.call(x=xi, weight=wi, eps=1e-6) is not None
    x, w = inputs()
    out = site.call(x=x, weight=w, eps=1e-6)
    assert out is not None and not out.is_inference()
    plan = site.plan_for(x=x, weight=w, eps=1e-6)
    assert not plan.fast[4](out), "the output check should have said no here"
    assert receipts.counts[("completed", "norm.rmsnorm", "v")] == 2


def test_registry_changes_reach_a_site_between_two_identical_calls():
    d, receipts = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm))
    site = d.site("norm.rmsnorm")
    x, w = inputs()
    assert site.call(x=x, weight=w, eps=1e-6) is not None
    d.registry.disable()
    assert site.call(x=x, weight=w, eps=1e-6) is None
    d.registry.enable()
    d.registry.add_variant(Variant(slot="norm.rmsnorm", name="w", impl=torch_rmsnorm, priority=5))
    assert site.call(x=x, weight=w, eps=1e-6) is not None
    assert site(x=x, weight=w, eps=1e-6) is not None
    assert receipts.counts[("completed", "norm.rmsnorm", "v")] == 1
    assert receipts.counts[("completed", "norm.rmsnorm", "w")] == 2


def test_a_registry_change_while_a_call_plans_reaches_the_next_call():
    # A plugin's supports() (or another thread) disables the registry while a call is being planned:
    # that plan may serve the call in flight, never a later one.
    calls = []

    def impl(*, x, weight, eps, out):
        calls.append(1)
        out.copy_(x)

    d, _ = build()

    def supports(desc):
        d.registry.disable()
        return True

    d.registry.add_variant(Variant(slot="norm.rmsnorm", name="v", impl=impl, supports=supports))
    d.registry.enable()
    site = d.site("norm.rmsnorm")
    x, w = inputs()
    site.call(x=x, weight=w, eps=1e-6)
    assert site.call(x=x, weight=w, eps=1e-6) is None
    assert site.call(x=x, weight=w, eps=1e-6) is None
    assert len(calls) <= 1


def test_no_eligible_candidate_routes_to_stock():
    d, receipts = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm, supports=lambda d: False))
    x, w = inputs()
    assert d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6) is None
    assert not receipts.counts


def test_a_call_that_breaks_the_contract_routes_to_stock_with_the_reason():
    d, _ = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm))
    x, w = inputs()
    site = d.site("norm.rmsnorm")
    assert site(x=x.double(), weight=w.double(), eps=1e-6) is None
    reason = site.plan_for(x=x.double(), weight=w.double(), eps=1e-6).resolution.reason
    assert "dtype float64" in reason


def test_disabled_registry_and_stock_policy_never_call_candidates():
    def boom(**kw):
        raise AssertionError("candidate called")

    v = Variant(slot="norm.rmsnorm", name="v", impl=boom)
    x, w = inputs()
    d, _ = build(v, enabled=False)
    assert d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6) is None
    d, _ = build(v, policy="stock")
    assert d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6) is None


def test_adapter_mistakes_are_typed_errors():
    d, _ = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm))
    x, w = inputs()
    site = d.site("norm.rmsnorm")
    # The call site's parameters are the contract's names, so Python itself names the mistake.
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'weight'"):
        site(x=x, eps=1e-6)
    with pytest.raises(TypeError, match="unexpected keyword argument 'residual'"):
        site(x=x, weight=w, residual=x, eps=1e-6)
    with pytest.raises(DescriptorError, match=r"scalars \['scale'\] are required"):
        d.site("attention.decode")(q=x, k_cache=x, v_cache=x, kv_indptr=x, kv_indices=x)


def test_inference_tensors_dispatch_and_are_checked_where_torch_allows():
    d, receipts = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm))
    with torch.inference_mode():
        x, w = inputs()
        out = d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6)
    assert out is not None and out.shape == x.shape
    assert receipts.counts[("completed", "norm.rmsnorm", "v")] == 1


# -- revalidation: every kind of bad candidate is caught ----------------------------------------


def _returns_tensor(*, x, weight, eps, out):
    return x * 2


def _swaps_storage(*, x, weight, eps, out):
    out.set_(torch.zeros_like(out))


def _resizes(*, x, weight, eps, out):
    out.resize_(1, out.shape[1])


def _restrides(*, x, weight, eps, out):
    out.as_strided_(out.shape, (1, out.shape[0]))  # same shape, column-major


def _changes_dtype(*, x, weight, eps, out):
    out.data = out.view(torch.int32)


def _writes_x(*, x, weight, eps, out):
    out.copy_(x)
    x.mul_(2)


def _writes_weight(*, x, weight, eps, out):
    out.copy_(x)
    weight.zero_()


def _raises(*, x, weight, eps, out):
    raise RuntimeError("kernel launch failed")


BAD = {
    "returned_value": _returns_tensor,
    "storage": _swaps_storage,
    "shape": _resizes,
    "stride": _restrides,
    "dtype": _changes_dtype,
    "input_written:x": _writes_x,
    "input_written:weight": _writes_weight,
    "raised": _raises,
}


@given(st.sampled_from(sorted(BAD)), st.integers(2, 5), st.integers(3, 9))
def test_strict_raises_for_every_kind_of_bad_candidate(kind, t, h):
    d, receipts = build(Variant(slot="norm.rmsnorm", name="bad", impl=BAD[kind]))
    x, w = inputs(t, h)
    with pytest.raises(CandidateFailure) as info:
        d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6)
    expected = kind.split(":")[0]
    if expected == "raised":
        assert "raised RuntimeError: kernel launch failed" in info.value.reason
    else:
        assert info.value.__cause__.kind == expected
        if ":" in kind:
            assert info.value.__cause__.tensor == kind.split(":")[1]
    assert receipts.counts[("fired", "norm.rmsnorm", "bad")] == 1
    assert not receipts.counts.get(("completed", "norm.rmsnorm", "bad"))


RECOVERABLE = sorted(k for k in BAD if not k.startswith("input_written"))


@given(st.sampled_from(RECOVERABLE), st.integers(2, 5), st.integers(3, 9))
def test_lenient_serves_the_reference_and_counts_a_fallback(kind, t, h):
    d, receipts = build(Variant(slot="norm.rmsnorm", name="bad", impl=BAD[kind]), policy="lenient")
    x, w = inputs(t, h)
    x0, w0 = x.clone(), w.clone()
    out = d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6)
    expected = torch.empty_like(x)
    rmsnorm_reference(x=x0, weight=w0, eps=1e-6, out=expected)
    assert torch.equal(out, expected)
    assert out.dtype == x.dtype and out.is_contiguous()
    assert torch.equal(x, x0) and torch.equal(w, w0)
    assert receipts.counts[("fallback", "norm.rmsnorm", "bad")] == 1


@pytest.mark.parametrize("kind", ["input_written:x", "input_written:weight"])
def test_lenient_still_raises_when_a_protected_input_was_written(kind):
    d, receipts = build(Variant(slot="norm.rmsnorm", name="bad", impl=BAD[kind]), policy="lenient")
    x, w = inputs()
    with pytest.raises(CandidateFailure, match="input_written"):
        d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6)
    assert not receipts.counts.get(("fallback", "norm.rmsnorm", "bad"))


def test_lenient_restores_a_written_input_before_the_fallback():
    def half_then_crash(*, x, residual, weight, eps, out):
        residual.add_(x)  # the in-place update the contract allows...
        raise RuntimeError("...then the kernel dies")

    d, receipts = build(Variant(slot="norm.fused_add_rmsnorm", name="crash", impl=half_then_crash), policy="lenient")
    x, w = inputs()
    residual = torch.randn_like(x)
    r0 = residual.clone()
    out = d.site("norm.fused_add_rmsnorm")(x=x, residual=residual, weight=w, eps=1e-6)
    expected_res = r0.clone()
    expected_out = torch.empty_like(x)
    fused_add_rmsnorm_reference(x=x, residual=expected_res, weight=w, eps=1e-6, out=expected_out)
    assert torch.equal(residual, expected_res)  # added exactly once, not twice
    assert torch.equal(out, expected_out)
    assert receipts.counts[("fallback", "norm.fused_add_rmsnorm", "crash")] == 1


def test_written_input_moved_to_other_storage_is_caught():
    def moves(*, x, residual, weight, eps, out):
        residual.set_(residual.clone())
        out.copy_(x)

    d, _ = build(Variant(slot="norm.fused_add_rmsnorm", name="moves", impl=moves))
    x, w = inputs()
    with pytest.raises(CandidateFailure) as info:
        d.site("norm.fused_add_rmsnorm")(x=x, residual=torch.randn_like(x), weight=w, eps=1e-6)
    assert info.value.__cause__.kind == "storage" and info.value.__cause__.tensor == "residual"


def test_strict_failure_writes_a_failed_receipt(tmp_path):
    registry = Registry()
    registry.add_variant(Variant(slot="norm.rmsnorm", name="bad", impl=_raises))
    registry.enable()
    receipts = ReceiptLog(tmp_path, role="scheduler", policy="strict", flush_interval=0)
    d = Dispatcher(registry, receipts=receipts)
    x, w = inputs()
    with pytest.raises(CandidateFailure):
        d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6)
    receipts.flush()
    text = receipts.path.read_text()
    assert '"kind": "failed"' in text and "kernel launch failed" in text
    receipts.close()


def test_prepare_runs_once_per_descriptor_and_its_failure_is_a_candidate_failure():
    prepared = []
    d, _ = build(
        Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm, prepare=lambda desc: prepared.append(desc.dims["h"]))
    )
    x, w = inputs()
    site = d.site("norm.rmsnorm")
    site(x=x, weight=w, eps=1e-6)
    site(x=x, weight=w, eps=1e-6)
    assert prepared == [16]

    def bad_prepare(desc):
        raise ValueError("no config for this size")

    d, _ = build(Variant(slot="norm.rmsnorm", name="v", impl=torch_rmsnorm, prepare=bad_prepare))
    with pytest.raises(CandidateFailure, match="prepare\\(\\) raised ValueError"):
        d.site("norm.rmsnorm")(x=x, weight=w, eps=1e-6)
