"""The slot ABI: contract validation and descriptor normalization."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheon_core import (
    CallDescriptor,
    ContractError,
    DescriptorError,
    ScalarSpec,
    SlotSpec,
    TensorSpec,
    Tolerance,
    Variant,
    canonical_device,
    canonical_dtype,
    canonical_strides,
    describe,
)
from cacheon_core._catalog import ATTENTION_DECODE, FUSED_ADD_RMSNORM, FUSED_EXPERTS, RMSNORM
from cacheon_core._slots import check_signature, contiguous_strides
from cacheon_core._wire import converter

shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=4)


@st.composite
def strided_shapes(draw):
    shape = draw(shapes)
    strides = [draw(st.integers(min_value=0, max_value=64)) for _ in shape]
    return tuple(shape), tuple(strides)


@given(strided_shapes())
def test_canonical_strides_is_idempotent(case):
    shape, strides = case
    once = canonical_strides(shape, strides)
    assert canonical_strides(shape, once) == once


@given(strided_shapes(), st.data())
def test_strides_of_size_one_dims_never_change_the_descriptor(case, data):
    shape, strides = case
    changed = tuple(
        data.draw(st.integers(min_value=0, max_value=999)) if size == 1 else s for size, s in zip(shape, strides)
    )
    assert canonical_strides(shape, strides) == canonical_strides(shape, changed)


@given(strided_shapes())
def test_only_irrelevant_strides_are_rewritten(case):
    shape, strides = case
    out = canonical_strides(shape, strides)
    if 0 in shape:
        assert out == contiguous_strides(shape)
    else:
        for size, before, after in zip(shape, strides, out):
            assert after == before or size == 1


@given(st.integers(1, 9), st.integers(1, 9), st.sampled_from(["float32", "float16", "bfloat16"]))
def test_describe_of_a_sliced_contiguous_tensor_equals_the_dense_one(t, h, dtype):
    # x[:, :h] of a [t, h] tensor is itself; x[:1] of a [t, h] tensor has a size-1 leading dim.
    dense = torch.zeros(1, h, dtype=getattr(torch, dtype))
    sliced = torch.zeros(t, h, dtype=getattr(torch, dtype))[:1]
    w = torch.ones(h, dtype=getattr(torch, dtype))
    a = describe(RMSNORM, {"x": dense, "weight": w}, {"eps": 1e-6})
    b = describe(RMSNORM, {"x": sliced, "weight": w}, {"eps": 1e-6})
    assert a == b
    assert a.dims == {"t": 1, "h": h}


@given(st.integers(1, 6), st.integers(2, 6), st.integers(1, 4))
def test_describe_binds_symbols_and_rejects_inconsistent_ones(t, h, extra):
    x = torch.zeros(t, h)
    with pytest.raises(DescriptorError, match="symbol 'h'"):
        describe(RMSNORM, {"x": x, "weight": torch.zeros(h + extra)})
    d = describe(RMSNORM, {"x": x, "weight": torch.zeros(h)})
    assert d.dims == {"t": t, "h": h}
    assert d.scalar("eps") == 1e-6  # the contract's default


def test_describe_names_the_bad_value_and_the_rule():
    x, w = torch.zeros(2, 8), torch.zeros(8)
    with pytest.raises(DescriptorError, match="'x' has rank 3, contract says 2"):
        describe(RMSNORM, {"x": torch.zeros(1, 2, 8), "weight": w})
    with pytest.raises(DescriptorError, match="'x' has dtype float64, contract allows"):
        describe(RMSNORM, {"x": x.double(), "weight": w})
    with pytest.raises(DescriptorError, match="'weight' .* breaks layout 'contiguous'"):
        describe(RMSNORM, {"x": x, "weight": torch.zeros(16)[::2]})
    with pytest.raises(DescriptorError, match="'x' .* breaks layout 'rows'"):
        describe(RMSNORM, {"x": torch.zeros(8, 2).t(), "weight": w})
    with pytest.raises(DescriptorError, match="input 'weight' is missing"):
        describe(RMSNORM, {"x": x})
    with pytest.raises(DescriptorError, match="scalar 'eps'=.* is not a float"):
        describe(RMSNORM, {"x": x, "weight": w}, {"eps": "small"})
    with pytest.raises(DescriptorError, match="unknown scalars"):
        describe(RMSNORM, {"x": x, "weight": w}, {"epsilon": 1e-5})


def test_rows_layout_accepts_padded_rows():
    x = torch.zeros(4, 10)[:, :8]
    d = describe(RMSNORM, {"x": x, "weight": torch.zeros(8)})
    assert d.tensor("x").stride == (10, 1)


def test_fused_experts_dims_rule():
    args = {
        "hidden_states": torch.zeros(3, 16),
        "topk_weights": torch.zeros(3, 2),
        "topk_ids": torch.zeros(3, 2, dtype=torch.int64),
    }
    with pytest.raises(DescriptorError, match=r"n2=24 rows per expert, gate and up of i=8 need 2\*i=16"):
        describe(FUSED_EXPERTS, {**args, "w13": torch.zeros(4, 24, 16), "w2": torch.zeros(4, 16, 8)})
    with pytest.raises(DescriptorError, match="top-k=2 exceeds the e=1 experts"):
        describe(FUSED_EXPERTS, {**args, "w13": torch.zeros(1, 16, 16), "w2": torch.zeros(1, 16, 8)})
    d = describe(FUSED_EXPERTS, {**args, "w13": torch.zeros(4, 16, 16), "w2": torch.zeros(4, 16, 8)})
    assert d.slot == "moe.fused_experts"


def test_decode_dims_rule():
    kv = torch.zeros(16, 4, 8)
    indices = torch.arange(5, dtype=torch.int32)
    args = {"k_cache": kv, "v_cache": kv, "kv_indices": indices}
    with pytest.raises(DescriptorError, match="hq=6 must be a multiple of kv heads hkv=4"):
        describe(
            ATTENTION_DECODE,
            {**args, "q": torch.zeros(2, 6, 8), "kv_indptr": torch.zeros(3, dtype=torch.int32)},
            {"scale": 0.1},
        )
    with pytest.raises(DescriptorError, match=r"kv_indptr has 2 entries, a batch of b=2 needs b\+1=3"):
        describe(
            ATTENTION_DECODE,
            {**args, "q": torch.zeros(2, 8, 8), "kv_indptr": torch.zeros(2, dtype=torch.int32)},
            {"scale": 0.1},
        )


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("bf16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        (torch.float16, "float16"),
        ("fp32", "float32"),
        ("int", "int32"),
        (torch.int64, "int64"),
    ],
)
def test_dtype_aliases(alias, canonical):
    assert canonical_dtype(alias) == canonical


@given(st.sampled_from(["cpu", "cpu:0", "cuda", "cuda:0", "cuda:3", "xpu:1"]))
def test_canonical_device_is_idempotent(device):
    once = canonical_device(device)
    assert canonical_device(once) == once
    assert once != "cuda"


def test_bad_devices_and_dtypes_are_typed_errors():
    with pytest.raises(DescriptorError, match="unknown dtype 'complex7'"):
        canonical_dtype("complex7")
    with pytest.raises(DescriptorError, match="unknown device 'cuda:x'"):
        canonical_device("cuda:x")


def _spec(**overrides):
    fields = dict(
        id="test.op",
        version=1,
        summary="s",
        inputs=(TensorSpec("x", ("n",), ("float32",)),),
        outputs=(TensorSpec("out", ("n",), same_dtype_as="x"),),
        reference=lambda *, x, out: None,
        tolerances={"float32": Tolerance(0, 0)},
    )
    fields.update(overrides)
    return SlotSpec(**fields)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"id": "NoFamily"}, "not of the form family.operation"),
        ({"version": 0}, "version 0 must be >= 1"),
        ({"outputs": ()}, "at least one output"),
        ({"outputs": (TensorSpec("out", ("m",), same_dtype_as="x"),)}, r"symbols \['m'\] no input binds"),
        ({"outputs": (TensorSpec("x", ("n",), same_dtype_as="x"),)}, r"names \['x'\] are used more than once"),
        ({"outputs": (TensorSpec("out", ("n",)),)}, "exactly one dtype or same_dtype_as"),
        ({"outputs": (TensorSpec("out", ("n",), same_dtype_as="y"),)}, "unknown input 'y'"),
        ({"tolerances": {}}, r"no tolerance for dtypes \['float32'\]"),
    ],
)
def test_malformed_contracts_are_rejected(overrides, message):
    with pytest.raises(ContractError, match=message):
        _spec(**overrides)


def test_tensor_and_scalar_specs_validate_themselves():
    with pytest.raises(ContractError, match="dtype 'bf16' is not canonical"):
        TensorSpec("x", ("n",), ("bf16",))
    with pytest.raises(ContractError, match="layout 'strided'"):
        TensorSpec("x", ("n",), layout="strided")  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="kind 'str'"):
        ScalarSpec("eps", "str")  # type: ignore[arg-type]


def test_signature_check():
    def good(*, x, weight, eps, out):
        return None

    def loose(**kwargs):
        return None

    def positional_only(x, weight, eps, out, /):
        return None

    def missing(*, x, weight, out):
        return None

    def extra_required(*, x, weight, eps, out, stream):
        return None

    assert check_signature(RMSNORM, good) is None
    assert check_signature(RMSNORM, loose) is None
    assert "positional-only" in check_signature(RMSNORM, positional_only)
    assert "does not accept contract arguments ['eps']" in check_signature(RMSNORM, missing)
    assert "'stream' is required" in check_signature(RMSNORM, extra_required)


def test_variant_names_are_checked():
    with pytest.raises(ContractError, match="variant name 'Bad Name'"):
        Variant(slot="norm.rmsnorm", name="Bad Name", impl=print)


def test_contracts_serialize_with_cattrs():
    data = converter.unstructure(FUSED_ADD_RMSNORM)
    assert data["id"] == "norm.fused_add_rmsnorm"
    assert data["inputs"][1]["written"] is True
    assert data["reference"].endswith(":fused_add_rmsnorm_reference")
    d = describe(RMSNORM, {"x": torch.zeros(3, 4), "weight": torch.zeros(4)})
    assert converter.structure(converter.unstructure(d), CallDescriptor) == d


@settings(max_examples=25)
@given(st.integers(1, 4), st.integers(1, 64))
def test_references_agree_with_the_formula(t, h):
    x = torch.randn(t, h, dtype=torch.float64).float()
    w = torch.randn(h)
    out = torch.empty_like(x)
    RMSNORM.reference(x=x, weight=w, eps=1e-6, out=out)
    expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
