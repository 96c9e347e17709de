"""The example plugin's variants, as the dispatcher and the verifier see them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cacheon_core import Dispatcher, Registry, verify_variant
from cacheon_core._catalog import (
    ALL_REDUCE,
    ARFUSION,
    ATTENTION_DECODE,
    FUSED_ADD_RMSNORM,
    MOE_FINALIZE,
    RMSNORM,
    decode_reference,
    fused_add_rmsnorm_reference,
    moe_finalize_reference,
    moe_finalize_sampler,
    rmsnorm_reference,
)
from cacheon_example_kernels import plugin, torch_kernels, triton_kernels


def variants():
    return {v.name: v for v in plugin.cacheon_variants()}


def dispatcher() -> Dispatcher:
    """A dispatcher whose enabled registry holds every example variant, as a scheduler's would."""
    registry = Registry()
    for v in variants().values():
        registry.add_variant(v)
    registry.enable()
    return Dispatcher(registry)


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        (RMSNORM, "example_torch"),
        (FUSED_ADD_RMSNORM, "example_torch_fused"),
        (ATTENTION_DECODE, "example_torch_decode"),
        (MOE_FINALIZE, "example_torch_finalize"),
        (ALL_REDUCE, "example_torch_all_reduce"),  # collective: verified on two gloo ranks of its own
        (ARFUSION, "example_torch_arfusion"),
    ],
)
def test_torch_variants_verify_on_cpu(spec, name):
    result = verify_variant(spec, variants()[name])
    assert result.status == "passed", result.reason


def test_triton_variants_decline_the_cpu_outside_the_interpreter():
    specs = {
        "example_triton": RMSNORM,
        "example_triton_fused": FUSED_ADD_RMSNORM,
        "example_triton_finalize": MOE_FINALIZE,
    }
    for name, spec in specs.items():
        assert verify_variant(spec, variants()[name]).status == "unsupported", name


def test_dispatch_picks_triton_only_where_it_can_run_and_matches_the_reference():
    d = dispatcher()
    x, w = torch.randn(5, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    site = d.site("norm.rmsnorm")
    out = site(x=x, weight=w, eps=1e-5)
    assert site.plan_for(x=x, weight=w, eps=1e-5).variant.name == "example_torch"
    expected = torch.empty_like(x)
    rmsnorm_reference(x=x, weight=w, eps=1e-5, out=expected)
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)

    residual = torch.randn_like(x)
    r_ref = residual.clone()
    out = d.site("norm.fused_add_rmsnorm")(x=x, residual=residual, weight=w, eps=1e-5)
    fused_add_rmsnorm_reference(x=x, residual=r_ref, weight=w, eps=1e-5, out=expected)
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(residual, r_ref, rtol=0, atol=0)


# The head of every script run under Triton's interpreter (read at import: a fresh process each):
# the plugin's variants enabled, and a check of one variant against its slot's reference. The check
# leaves out the sizes the variant declares (1024 rows: minutes under the interpreter); the two-read
# and 256-row tests below run those paths through the dispatcher, `cacheon verify --device cuda` all.
INTERPRETED_HEAD = """
import attrs
import torch
from cacheon_core import Dispatcher, Registry, verify_variant
from cacheon_core import _catalog
from cacheon_example_kernels import plugin
variants = {v.name: v for v in plugin.cacheon_variants()}
def verified(spec, name):
    result = verify_variant(spec, attrs.evolve(variants[name], verify_dims=()), "cpu")
    assert result.status == "passed", (name, result.reason)
def fused_matches(fused, x, w, eps):
    # The dispatched fused norm (the plugin's variant) on a residual of padded rows, against the references: the
    # output, the residual updated in place; its padding untouched.
    t, h = x.shape
    residual_base = torch.randn(t, h + 8)
    residual = residual_base[:, :h]
    pad_before = residual_base[:, h:].clone()
    r_ref, ref = residual.clone(), torch.empty(t, h)
    _catalog.fused_add_rmsnorm_reference(x=x, residual=r_ref, weight=w, eps=eps, out=ref)
    assert fused.plan_for(x=x, residual=residual, weight=w, eps=eps).variant.name == "example_triton_fused"
    out = fused(x=x, residual=residual, weight=w, eps=eps)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, r_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(residual_base[:, h:], pad_before)
registry = Registry()
for v in variants.values():
    registry.add_variant(v)
registry.enable()
dispatcher = Dispatcher(registry)
"""


def run_interpreted(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED_HEAD + script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_triton_kernel_verifies_and_dispatches_under_the_interpreter_on_padded_rows():
    run_interpreted("""
verified(_catalog.RMSNORM, "example_triton")
site = dispatcher.site("norm.rmsnorm")
x = torch.randn(6, 200)[:, :130]  # padded rows
w = torch.randn(130)
out = site(x=x, weight=w, eps=1e-6)
assert site.plan_for(x=x, weight=w, eps=1e-6).variant.name == "example_triton"
ref = torch.empty(6, 130)
_catalog.rmsnorm_reference(x=x, weight=w, eps=1e-6, out=ref)
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
print("ok")
""")


def test_triton_fused_kernel_verifies_and_dispatches_under_the_interpreter_on_padded_rows():
    run_interpreted("""
verified(_catalog.FUSED_ADD_RMSNORM, "example_triton_fused")
site = dispatcher.site("norm.fused_add_rmsnorm")
x = torch.randn(6, 200)[:, :130]  # padded rows, the residual's padded differently
residual_base = torch.randn(6, 170)
residual = residual_base[:, :130]
pad_before = residual_base[:, 130:].clone()
r_ref, ref = residual.clone(), torch.empty(6, 130)
w = torch.randn(130)
_catalog.fused_add_rmsnorm_reference(x=x, residual=r_ref, weight=w, eps=1e-6, out=ref)
assert site.plan_for(x=x, residual=residual, weight=w, eps=1e-6).variant.name == "example_triton_fused"
out = site(x=x, residual=residual, weight=w, eps=1e-6)
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(residual, r_ref, rtol=1e-6, atol=1e-6)
assert torch.equal(residual_base[:, 130:], pad_before)
print("ok")
""")


def test_triton_norms_read_many_wide_rows_in_pieces_under_the_interpreter():
    # 1024 rows of 2100 and of 4200 columns: the two-read kernels (RMSNorm of 4200 columns in two
    # pieces of 4096, the second masked past h, the weight loaded in the second pass; fused of 2100 with the
    # weight first; fused of 4200 reads once at every T), dispatched, against the references; padding and
    # nothing else untouched. The shape starts at the first step of TWO_READ_LAUNCH.
    run_interpreted("""
from cacheon_example_kernels import triton_kernels
rms, fused = dispatcher.site("norm.rmsnorm"), dispatcher.site("norm.fused_add_rmsnorm")
assert (True, 8192) not in triton_kernels.TWO_READ_LAUNCH
assert not triton_kernels._norm_launch(1024, 4200, fused=True)[0]
for h in (2100, 4200):
    for is_fused in (False, True) if h <= 4096 else (False,):
        least = triton_kernels.TWO_READ_LAUNCH[is_fused, 4096 if h <= 4096 else 8192][0][0]
        assert least <= 1024
        assert triton_kernels._norm_launch(least, h, fused=is_fused)[0]
        assert not triton_kernels._norm_launch(least - 1, h, fused=is_fused)[0]
    assert "WEIGHT_FIRST" not in triton_kernels._norm_launch(1024, 4200, fused=False)[1]
    assert triton_kernels._norm_launch(1024, 2100, fused=True)[1]["WEIGHT_FIRST"]
    x = torch.randn(1024, h + 40)[:, :h]
    w = torch.randn(h)
    ref = torch.empty(1024, h)
    _catalog.rmsnorm_reference(x=x, weight=w, eps=1e-6, out=ref)
    assert rms.plan_for(x=x, weight=w, eps=1e-6).variant.name == "example_triton"
    torch.testing.assert_close(rms(x=x, weight=w, eps=1e-6), ref, rtol=1e-5, atol=1e-5)
    fused_matches(fused, x, w, 1e-6)
print("ok")
""")


def test_triton_norms_load_the_weight_first_under_the_interpreter():
    # Rows of 2100 (pieces of 2048 or one of 4096, masked past h) and of 4200 columns (RMSNorm: two
    # pieces of 4096; fused: one of 8192): the weight loaded before the row, in every launch of
    # TWO_READ_LAUNCH, against the references and against the very bytes of the same pieces with the
    # weight loaded in the second pass (fused: of that RMSNorm of x + residual, summed in float32 as the
    # kernel sums); and dispatched, padding untouched. The launches are those of
    # their row counts (checked first); the interpreter runs them on 64 rows (the thresholds lowered for
    # the dispatched calls), as it takes about a second per 100 rows and launch. The interpreter ignores
    # num_warps: launches that differ only in warps run the same program here (the GPU tests run them).
    run_interpreted("""
from cacheon_example_kernels import triton_kernels
kernels = triton_kernels._kernels()
t, eps = 64, 1e-6
launches = []
for (is_fused, block), steps in triton_kernels.TWO_READ_LAUNCH.items():
    h = {4096: 2100, 8192: 4200}[block]
    assert not triton_kernels._norm_launch(steps[0][0] - 1, h, fused=is_fused)[0]
    for least, rblock, warps, first in steps:
        options = {"RBLOCK": rblock, "CHUNKS": -(-h // rblock), "num_warps": warps}
        if first:
            options["WEIGHT_FIRST"] = True
        assert triton_kernels._norm_launch(least, h, fused=is_fused) == (True, options)
        assert triton_kernels._norm_launch(least - 1, h, fused=is_fused)[1] != options
        if first and (is_fused, h, options) not in launches:
            launches.append((is_fused, h, options))
assert {o["CHUNKS"] for _, _, o in launches} == {1, 2}
for is_fused, h, options in launches:
    x = torch.randn(t, h + 40)[:, :h]
    w = torch.randn(h)
    ref, got, second = torch.empty(t, h), torch.empty(t, h), torch.empty(t, h)
    pieces = {k: v for k, v in options.items() if k != "WEIGHT_FIRST"}
    if not is_fused:
        _catalog.rmsnorm_reference(x=x, weight=w, eps=eps, out=ref)
        kernels.rmsnorm_weight_first[(t,)](x, w, got, x.stride(0), got.stride(0), t, h, eps, ROWS=1, **pieces)
        kernels.rmsnorm_loop[(t,)](x, w, second, x.stride(0), second.stride(0), h, eps, **pieces)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, second), options
        continue
    residual = torch.randn(t, h)
    r_ref, r_got = residual.clone(), residual.clone()
    _catalog.fused_add_rmsnorm_reference(x=x, residual=r_ref, weight=w, eps=eps, out=ref)
    strides = (x.stride(0), r_got.stride(0), got.stride(0), r_got.stride(0))
    kernels.fused_add_rmsnorm_weight_first[(t,)](x, r_got, w, got, r_got, *strides, t, h, eps, ROWS=1, **pieces)
    summed = x + residual  # float32 in, float32 sum: what the fused kernel normalizes
    kernels.rmsnorm_loop[(t,)](summed, w, second, summed.stride(0), second.stride(0), h, eps, **pieces)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r_got, r_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(r_got, summed) and torch.equal(got, second), options
# Every fused step loads the weight first (there is no fused second-pass kernel); a table that broke this
# would raise rather than launch the one-read kernel with the two-read options.
assert all(first for (is_fused, _), steps in triton_kernels.TWO_READ_LAUNCH.items() if is_fused for *_, first in steps)
# Several rows per program (the sweep's wpre family): rows past T untouched (a sentinel row), the others the
# bytes of one row per program. bf16 rows: the fused kernel's output is the norm of the float32 sum, not of
# the residual it stores (the RMSNorm kernel run on that float32 sum gives the same bytes).
h, t5 = 2100, 5
pieces = {"RBLOCK": 2048, "CHUNKS": 2, "num_warps": 8}
x = torch.randn(t5 + 1, h).to(torch.bfloat16)
r0 = torch.randn(t5 + 1, h).to(torch.bfloat16)
w = torch.randn(h).to(torch.bfloat16)
one = torch.empty(t5, h, dtype=torch.bfloat16)
kernels.rmsnorm_weight_first[(t5,)](x, w, one, x.stride(0), one.stride(0), t5, h, eps, ROWS=1, **pieces)
summed = x[:t5].float() + r0[:t5].float()
from_sum = torch.empty(t5, h, dtype=torch.bfloat16)
kernels.rmsnorm_loop[(t5,)](summed, w, from_sum, summed.stride(0), from_sum.stride(0), h, eps, **pieces)
for rows in (1, 2, 4):
    out = torch.full((t5 + 1, h), 7.0, dtype=torch.bfloat16)
    grid = (-(-t5 // rows),)
    kernels.rmsnorm_weight_first[grid](x, w, out, x.stride(0), out.stride(0), t5, h, eps, ROWS=rows, **pieces)
    assert torch.equal(out[:t5], one) and out[t5].eq(7.0).all(), rows
    out.fill_(7.0)
    r = r0.clone()
    strides = (x.stride(0), r.stride(0), out.stride(0), r.stride(0))
    kernels.fused_add_rmsnorm_weight_first[grid](x, r, w, out, r, *strides, t5, h, eps, ROWS=rows, **pieces)
    assert torch.equal(out[:t5], from_sum) and out[t5].eq(7.0).all() and torch.equal(r[t5], r0[t5]), rows
    torch.testing.assert_close(r[:t5].float(), summed, rtol=2**-7, atol=0)  # bf16 of the sum
saved = triton_kernels.TWO_READ_LAUNCH
triton_kernels.TWO_READ_LAUNCH = {**saved, (True, 4096): ((1, 2048, 8, False),)}
triton_kernels._fused_plan.cache_clear()  # the launches kept were picked from the tables as they were
try:
    triton_kernels.fused_add_rmsnorm(x=x[:4], residual=r0[:4].clone(), weight=w, eps=eps, out=one[:4])
except ValueError as exc:
    assert "must load the weight first" in str(exc)
else:
    raise AssertionError("a fused two-read step without the weight first launched")
triton_kernels.TWO_READ_LAUNCH = saved
rms, fused = dispatcher.site("norm.rmsnorm"), dispatcher.site("norm.fused_add_rmsnorm")
triton_kernels.TWO_READ_LAUNCH = {  # every first step from t rows; fused h 4200 (one read at every T) in one piece
    **{key: ((t, *steps[0][1:]), *steps[1:]) for key, steps in triton_kernels.TWO_READ_LAUNCH.items()},
    (True, 8192): ((t, 8192, 16, True),),
}
triton_kernels._rmsnorm_plan.cache_clear()
triton_kernels._fused_plan.cache_clear()
for h in (2100, 4200):
    x = torch.randn(t, h + 40)[:, :h]
    w = torch.randn(h)
    assert all(triton_kernels._norm_launch(t, h, fused=f)[1]["WEIGHT_FIRST"] for f in (False, True))
    ref = torch.empty(t, h)
    _catalog.rmsnorm_reference(x=x, weight=w, eps=eps, out=ref)
    assert rms.plan_for(x=x, weight=w, eps=eps).variant.name == "example_triton"
    torch.testing.assert_close(rms(x=x, weight=w, eps=eps), ref, rtol=1e-5, atol=1e-5)
    fused_matches(fused, x, w, eps)
print("ok")
""")


def test_triton_one_read_norms_from_256_rows_under_the_interpreter():
    # 256 rows of 2100 and of 4200 columns: the one-read kernels with at most 8 warps (255 rows of 4200:
    # 16; fused, 256 rows of 4200: 16, ONE_READ_WARPS), dispatched, against the references; padding
    # untouched. Each level of eviction hints the sweep times (STREAM_POLICIES) computes the very same bytes.
    run_interpreted("""
from cacheon_example_kernels import triton_kernels
rms, fused = dispatcher.site("norm.rmsnorm"), dispatcher.site("norm.fused_add_rmsnorm")
kernels = triton_kernels._kernels()
for h in (2100, 4200):
    for is_fused in (False, True):
        two_reads, options = triton_kernels._norm_launch(256, h, fused=is_fused)
        assert not two_reads and options["num_warps"] == (16 if is_fused and h > 4096 else 8), options
        assert options["ROW_EVICT"] == options["OUT_EVICT"] == "", options
    assert triton_kernels._norm_launch(255, h, fused=True)[1]["num_warps"] == (16 if h > 4096 else 8)
    x = torch.randn(256, h + 40)[:, :h]
    w = torch.randn(h)
    ref = torch.empty(256, h)
    _catalog.rmsnorm_reference(x=x, weight=w, eps=1e-6, out=ref)
    assert rms.plan_for(x=x, weight=w, eps=1e-6).variant.name == "example_triton"
    got = rms(x=x, weight=w, eps=1e-6)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    options = triton_kernels._norm_launch(256, h, fused=False)[1]
    for policies in triton_kernels.STREAM_POLICIES:
        hinted = torch.empty(256, h)
        kernels.rmsnorm[(256,)](x, w, hinted, x.stride(0), hinted.stride(0), h, 1e-6, **{**options, **policies})
        assert torch.equal(hinted, got), policies
    fused_matches(fused, x, w, 1e-6)
print("ok")
""")


def test_norms_read_once_again_at_one_read_again_rows():
    # ONE_READ_AGAIN: past TWO_READ_LAUNCH's first step, RMSNorm of h 4097-8192 at 3072-8191 rows and fused of h
    # 2049-4096 at 2048-10751 read once again, 16 warps, no hints; the two reads either side (RMSNorm of h 2049-4096
    # at 3072 rows and fused of 4097-8192 keep their launches); past them the two reads' step of the table.
    policies = triton_kernels.STREAM_POLICIES[0]
    assert triton_kernels.ONE_READ_AGAIN == {(False, 8192): (3072, 8192, 16), (True, 4096): (2048, 10752, 16)}
    for (fused, block), (least, below, warps) in triton_kernels.ONE_READ_AGAIN.items():
        for h in (block // 2 + 1, block):
            assert triton_kernels._norm_launch(least - 1, h, fused=fused)[0]
            for t in (least, below - 1):
                assert triton_kernels._norm_launch(t, h, fused=fused) == (
                    False,
                    {"BLOCK": block, "num_warps": warps, **policies},
                )
            assert triton_kernels._norm_launch(below, h, fused=fused) == (
                True,
                {"RBLOCK": 4096, "CHUNKS": -(-h // 4096), "num_warps": 16, "WEIGHT_FIRST": True},
            )
    assert triton_kernels._norm_launch(3072, 4096, fused=False)[0]  # RMSNorm of 2049-4096: two reads
    assert triton_kernels._norm_launch(3072, 8192, fused=True)[1]["num_warps"] == 16  # one read at every T anyway
    sms = 132
    assert triton_kernels._rmsnorm_plan(3072, 8192, sms)[0] is triton_kernels._kernels().rmsnorm
    assert triton_kernels._fused_plan(2048, 4096)[0] is triton_kernels._kernels().fused_add_rmsnorm


def test_norms_read_once_again_under_the_interpreter():
    # The one-read launch of ONE_READ_AGAIN's rows, dispatched, against the references, padding untouched: its
    # rows lowered to 48-63 (the interpreter takes about a second per 100 rows), each norm's two-read step from 32.
    run_interpreted("""
from cacheon_example_kernels import triton_kernels
rms, fused = dispatcher.site("norm.rmsnorm"), dispatcher.site("norm.fused_add_rmsnorm")
triton_kernels.TWO_READ_LAUNCH = {
    (False, 8192): ((32, 4096, 16, True),),
    (True, 4096): ((32, 2048, 8, True),),
}
triton_kernels.ONE_READ_AGAIN = {(False, 8192): (48, 64, 16), (True, 4096): (48, 64, 16)}
triton_kernels._rmsnorm_plan.cache_clear()
triton_kernels._fused_plan.cache_clear()
kernels = triton_kernels._kernels()
eps = 1e-6
for t in (47, 48, 63, 64):
    again = 48 <= t < 64
    h = 4200
    assert triton_kernels._norm_launch(t, h, fused=False)[0] == (not again)
    x = torch.randn(t, h + 40)[:, :h]
    w = torch.randn(h)
    ref = torch.empty(t, h)
    _catalog.rmsnorm_reference(x=x, weight=w, eps=eps, out=ref)
    assert (triton_kernels._rmsnorm_plan(t, h, 1)[0] is kernels.rmsnorm) == again
    torch.testing.assert_close(rms(x=x, weight=w, eps=eps), ref, rtol=1e-5, atol=1e-5)
    h = 2100
    assert triton_kernels._norm_launch(t, h, fused=True)[0] == (not again)
    assert (triton_kernels._fused_plan(t, h)[0] is kernels.fused_add_rmsnorm) == again
    x = torch.randn(t, h + 40)[:, :h]
    w = torch.randn(h)
    fused_matches(fused, x, w, eps)
print("ok")
""")


def test_launch_arithmetic_matches_tritons():
    # The launches size blocks and grids with plain-integer twins of triton.next_power_of_2 and triton.cdiv
    # (Triton's own are costly host calls): the same answers at every width a norm or finalize may take.
    import triton

    for n in range(triton_kernels.MAX_BLOCK + 2):
        assert triton_kernels._next_pow2(n) == triton.next_power_of_2(n), n
    for a in range(0, 5000, 7):
        for b in (1, 2, 3, 512, 1024, 2048, 4096, 8192):
            assert triton_kernels._cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_rmsnorm_walks_a_persistent_grid_under_the_interpreter():
    # PERSISTENT_LAUNCH: RMSNorm of h 2049-4096 at its rows (not fused, not wider rows) on the grid whose
    # programs' last rows are fullest. Then, under the interpreter (one "SM": a grid of 4 or 5 programs,
    # the table's rows lowered to 40-99), dispatched: the persistent kernel launched (counted), the very
    # bytes of the one-read kernel, the reference; launched directly into padded rows over a sentinel row,
    # the padding and the row past T untouched.
    least, below, _ = triton_kernels.PERSISTENT_LAUNCH[4096]
    policies = triton_kernels.STREAM_POLICIES[0]
    for h in (2100, 4096):
        assert triton_kernels._persistent_launch(least - 1, h, 132) is None
        assert triton_kernels._persistent_launch(below, h, 132) is None
        assert triton_kernels._persistent_launch(least, h, 132) is not None
    assert triton_kernels._persistent_launch(least, 4200, 132) is None
    # 1280 rows: two per program of 660 (4 warps), against three per program of 528 (8 warps), 0.81 full
    assert triton_kernels._persistent_launch(1280, 4096, 132) == (660, {"BLOCK": 4096, "num_warps": 4, **policies})
    assert triton_kernels._persistent_launch(1536, 4096, 132) == (528, {"BLOCK": 4096, "num_warps": 8, **policies})
    # past 2112 rows: five per program of either grid (a tie), the first, 528 programs of 8 warps
    assert triton_kernels._persistent_launch(2176, 4096, 132) == (528, {"BLOCK": 4096, "num_warps": 8, **policies})
    run_interpreted("""
from cacheon_example_kernels import triton_kernels
kernels = triton_kernels._kernels()
shipped, launched = kernels.rmsnorm_persistent, []
class Counted:
    def __getitem__(self, grid):
        launched.append(grid[0])
        return shipped[grid]
kernels.rmsnorm_persistent = Counted()
triton_kernels.PERSISTENT_LAUNCH = {4096: (40, 100, ((4, 8), (5, 4)))}
triton_kernels._rmsnorm_plan.cache_clear()
rms = dispatcher.site("norm.rmsnorm")
h, eps = 2100, 1e-6
assert triton_kernels._persistent_launch(39, h, 1) is None
for t, grid in ((64, 4), (45, 5)):  # 16 rows per program of 4; 9 per program of 5
    assert triton_kernels._persistent_launch(t, h, 1)[0] == grid
    x = torch.randn(t, h + 40)[:, :h]
    w = torch.randn(h)
    assert rms.plan_for(x=x, weight=w, eps=eps).variant.name == "example_triton"
    got = rms(x=x, weight=w, eps=eps)
    assert launched[-1] == grid, launched
    one = torch.empty(t, h)
    kernels.rmsnorm[(t,)](x, w, one, x.stride(0), one.stride(0), h, eps, BLOCK=4096, ROW_EVICT="", OUT_EVICT="")
    assert torch.equal(got, one)
    ref = torch.empty(t, h)
    _catalog.rmsnorm_reference(x=x, weight=w, eps=eps, out=ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    base = torch.full((t + 1, h + 8), 7.0)
    out = base[:t, :h]
    walk, policies = -(-t // grid), triton_kernels.STREAM_POLICIES[0]
    shipped[(grid,)](x, w, out, x.stride(0), out.stride(0), t, walk, h, eps, BLOCK=4096, **policies)
    assert torch.equal(out, one) and base[t].eq(7.0).all() and base[:, h:].eq(7.0).all()
assert launched == [4, 5], launched
print("ok")
""")


def _global_accesses(kernel, names: list[str], policies: dict[str, str]) -> tuple[set[str], set[str]]:
    """The global loads and stores of one of the plugin's one-read norm kernels, compiled for sm_90
    (Triton compiles on a machine without a GPU): PTX instruction names, qualifiers included."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {"BLOCK": 4096, **policies}
    types = {name: "*bf16" for name in names} | {"h": "i32", "eps": "fp32"} | dict.fromkeys(constexprs, "constexpr")
    signature = {name: types.get(name, "i64") for name in kernel.arg_names}  # the rest: row strides
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    return set(re.findall(r"ld\.global\S*", ptx)), set(re.findall(r"st\.global\S*", ptx))


def test_fused_one_read_warps_from_their_step_to_the_two_reads():
    # ONE_READ_WARPS: fused, below TWO_READ_LAUNCH's first step, each step's warps from its T to the next
    # step's: at h 2049-4096, 4 warps from 793 rows; at 4097-8192 (one read at every T), 16 at 256-415, 8 at
    # 416-559, 16 from 560. Below the first step, the default (8 for 4096-wide blocks, 16 for 8192); RMSNorm
    # keeps its own launch (8 warps, or two reads from its own first step); nothing else changes.
    policies = triton_kernels.STREAM_POLICIES[0]
    for block, widths, default in ((4096, (2100, 4096), 8), (8192, (4200, 8192), 16)):
        steps = triton_kernels.ONE_READ_WARPS[True, block]
        two_reads_from = triton_kernels.TWO_READ_LAUNCH.get((True, block), ((1 << 40,),))[0][0]
        assert (block == 8192) == (two_reads_from == 1 << 40)
        ends = [least for least, _ in steps[1:]] + [two_reads_from]
        for h in widths:
            below = triton_kernels._norm_launch(steps[0][0] - 1, h, fused=True)
            assert below == (False, {"BLOCK": block, "num_warps": default, **policies})
            for (least, warps), end in zip(steps, ends, strict=True):
                for t in (least, end - 1):
                    launch = triton_kernels._norm_launch(t, h, fused=True)
                    assert launch == (False, {"BLOCK": block, "num_warps": warps, **policies})
            assert triton_kernels._norm_launch(two_reads_from, h, fused=True)[0] == (block == 4096)
            for least, _ in steps:  # RMSNorm keeps its own launch at the fused steps' rows
                twice, options = triton_kernels._norm_launch(least, h, fused=False)
                assert twice == (least >= triton_kernels.TWO_READ_LAUNCH[False, block][0][0])
                assert twice or options["num_warps"] == 8
    assert triton_kernels.ONE_READ_WARPS[True, 4096] == ((793, 4),)
    assert triton_kernels.ONE_READ_WARPS[True, 8192] == ((256, 16), (416, 8), (560, 16))
    assert triton_kernels._norm_launch(793, 2048, fused=True)[1]["num_warps"] == 4  # block 2048: 4 anyway


def test_the_plugin_hints_evictions_only_at_a_few_rows_and_level_1_spares_the_output():
    # The plugin's one-read kernels as launched hint nothing but at HINTED_ROWS, level 1: it hints the row's
    # loads and the residual's store, never the output's store, which the next kernel reads; level 2 (the
    # sweep's only) hints that too. Both norms of 2049-8192 columns, from 2 rows to 191.
    assert triton_kernels.HINTED_ROWS == {
        (False, 4096): (2, 192),
        (False, 8192): (2, 192),
        (True, 4096): (2, 192),
        (True, 8192): (2, 192),
    }
    for h in (1000, 2048, 2100, 4096, 8192, 8200):  # hinted at h 2049-8192 only, the widths the sweeps measured
        for fused in (False, True):
            least = 2
            for t in (1, 2, 15, 16, 23, 24, 191, 192):
                level = int(2048 < h <= 8192 and least <= t < 192)
                launched = triton_kernels._norm_launch(t, h, fused=fused)
                assert launched == (False, {**launched[1], **triton_kernels.STREAM_POLICIES[level]}), (t, h, fused)
    kernels = triton_kernels._kernels()
    names = {
        kernels.rmsnorm: ["x_ptr", "w_ptr", "out_ptr"],
        kernels.fused_add_rmsnorm: ["x_ptr", "r_ptr", "w_ptr", "out_ptr", "ro_ptr"],
    }
    hinted = lambda ops: {op for op in ops if "evict_first" in op}  # noqa: E731
    for t in (255, 256):
        for fused in (False, True):
            launched = triton_kernels._norm_launch(t, 4096, fused=fused)[1]
            kernel = kernels.fused_add_rmsnorm if fused else kernels.rmsnorm
            loads, stores = _global_accesses(
                kernel, names[kernel], {k: launched[k] for k in ("ROW_EVICT", "OUT_EVICT")}
            )
            assert not hinted(loads | stores), (t, fused, loads, stores)
    level_1, level_2 = triton_kernels.STREAM_POLICIES[1], triton_kernels.STREAM_POLICIES[2]
    loads, stores = _global_accesses(kernels.rmsnorm, names[kernels.rmsnorm], level_1)
    assert hinted(loads) and not hinted(stores), (loads, stores)
    loads, stores = _global_accesses(kernels.fused_add_rmsnorm, names[kernels.fused_add_rmsnorm], level_1)
    assert hinted(loads) and hinted(stores) and stores - hinted(stores), (loads, stores)  # residual, output
    loads, stores = _global_accesses(kernels.rmsnorm, names[kernels.rmsnorm], level_2)
    assert hinted(stores) == stores, stores


def test_triton_finalize_verifies_and_dispatches_under_the_interpreter():
    run_interpreted("""
verified(_catalog.MOE_FINALIZE, "example_triton_finalize")
site = dispatcher.site("moe.finalize")
# bfloat16 router weights (the sampler gives float32 ones) over rows wider than one block of columns
args = _catalog.moe_finalize_sampler(
    {"t": 6, "k": 3, "p": 25, "h": 1500}, "bfloat16", "cpu", torch.Generator().manual_seed(1)
)
args["expert_weights"] = args["expert_weights"].to(torch.bfloat16)
out = site(**args)
assert site.plan_for(**args).variant.name == "example_triton_finalize"
ref = torch.empty_like(out)
_catalog.moe_finalize_reference(**args, out=ref)
torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
assert out[-1].eq(0).all()  # the padded token
print("ok")
""")


def test_zero_token_batches_are_fine():
    x, w = torch.empty(0, 64), torch.ones(64)
    out = torch.empty_like(x)
    torch_kernels.rmsnorm(x=x, weight=w, eps=1e-6, out=out)
    triton_kernels.rmsnorm(x=x, weight=w, eps=1e-6, out=out)  # returns before touching Triton
    routed, weights, indices = torch.randn(4, 64), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32)
    out = torch.empty(0, 64)
    torch_kernels.finalize(routed_output=routed, expert_weights=weights, permuted_indices=indices, out=out)
    triton_kernels.finalize(routed_output=routed, expert_weights=weights, permuted_indices=indices, out=out)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("spec", "name"),
    [
        (RMSNORM, "example_triton"),
        (FUSED_ADD_RMSNORM, "example_triton_fused"),
        (MOE_FINALIZE, "example_triton_finalize"),
    ],
)
def test_triton_variants_verify_on_cuda(spec, name):
    result = verify_variant(spec, variants()[name], device="cuda")
    assert result.status == "passed", result.reason
    declared = [dict(d) for d in variants()[name].verify_dims]
    assert all(any(dict(c.dims) == d and c.status == "passed" for c in result.cases) for d in declared)
    assert result.graph == "qualified"  # they claim graph_safe: captured and replayed on fresh inputs


@pytest.mark.gpu
@pytest.mark.parametrize("h", [4096, 5000, 8192])
@pytest.mark.parametrize(
    "t",
    [
        255,
        256,
        415,
        416,
        559,
        560,
        575,
        576,
        767,
        768,
        792,
        793,
        831,
        832,
        895,
        896,
        1023,
        1024,
        1056,
        1057,
        1151,
        1152,
        1280,
        1408,
        1535,
        1536,
        1664,
        2047,
        2048,
        2049,
        2112,
        2113,
        2272,
        2273,
        3071,
        3072,
        4096,
        8191,
        8192,
        10751,
        10752,
    ],
)
def test_triton_norms_on_cuda_either_side_of_the_two_read_shape(t, h):
    # bf16 rows padded to a wider stride, against the float32 reference: below 793 rows of RMSNorm (at
    # h > 4096: 576) and 896 of fused (at h > 4096: every T) the one-read kernels, at most 8 warps from 256
    # rows, but 4 for fused at 793-895 rows of h <= 4096 and 16 at 256-415 and from 560 of h > 4096; from
    # there the two-read ones, with the weight loaded first but at 793-1056 rows of RMSNorm at h > 4096;
    # RMSNorm at 1057-2272 rows of h <= 4096 on the persistent grid instead (PERSISTENT_LAUNCH); one read again,
    # 16 warps, at 2048-10751 rows of fused at h <= 4096 and 3072-8191 of RMSNorm at h > 4096 (ONE_READ_AGAIN).
    wide = h > 4096
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    persistent = not wide and 1057 <= t <= 2272
    assert (triton_kernels._persistent_launch(t, h, sms) is not None) == persistent
    again = {True: not wide and 2048 <= t < 10752, False: wide and 3072 <= t < 8192}
    two_reads = {
        True: not wide and t >= 896 and not again[True],
        False: t >= (576 if wide else 793) and not again[False],
    }
    weight_first = {True: two_reads[True], False: two_reads[False] and not (wide and 793 <= t < 1057)}
    for fused in (False, True):
        launched, options = triton_kernels._norm_launch(t, h, fused=fused)
        assert launched == two_reads[fused] and options.get("WEIGHT_FIRST", False) == weight_first[fused]
        assert not again[fused] or options["num_warps"] == 16
    if not two_reads[True]:
        warps = 16 if again[True] or (wide and not 416 <= t < 560) else 4 if not wide and t >= 793 else 8
        assert triton_kernels._norm_launch(t, h, fused=True)[1]["num_warps"] == warps
    g = torch.Generator(device="cuda").manual_seed(t + h)
    x = torch.randn(t, h + 64, device="cuda", generator=g).to(torch.bfloat16)[:, :h]
    w = torch.randn(h, device="cuda", generator=g).to(torch.bfloat16)
    out_base = torch.full((t, h + 32), 7.0, device="cuda", dtype=torch.bfloat16)
    out = out_base[:, :h]
    triton_kernels.rmsnorm(x=x, weight=w, eps=1e-6, out=out)
    torch.testing.assert_close(out, _rms(x, w, 1e-6), rtol=2e-2, atol=2e-2)
    r_base = torch.randn(t, h + 16, device="cuda", generator=g).to(torch.bfloat16)
    residual = r_base[:, :h]
    pad = r_base[:, h:].clone()
    s = (x.float() + residual.float()).to(torch.bfloat16)
    want = _rms(x.float() + residual.float(), w, 1e-6).to(torch.bfloat16)  # the norm of the float32 sum
    triton_kernels.fused_add_rmsnorm(x=x, residual=residual, weight=w, eps=1e-6, out=out)
    torch.testing.assert_close(residual, s, rtol=0, atol=0)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert torch.equal(r_base[:, h:], pad) and out_base[:, h:].eq(7.0).all()


@pytest.mark.gpu
def test_weight_first_kernels_compile_once_for_every_row_count():
    # T is a kernel argument that only masks rows past it (the persistent kernel's walk only bounds its
    # loop): compiled for sm_90 the code is the same whether T is a multiple of 16 or not, so Triton must not
    # compile again when a batch's T changes parity. Each run of rows below takes one launch of one kernel.
    kernels = triton_kernels._kernels()
    h = 4096
    w = torch.randn(h, device="cuda").to(torch.bfloat16)
    device = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    runs = {
        kernels.fused_add_rmsnorm_weight_first: ((1152, 1153, 1160, 1168, 1169), (2046, 2047)),
        kernels.rmsnorm_weight_first: ((2273, 2274, 2280, 2288, 2289), (4095, 4096)),
        kernels.rmsnorm_persistent: ((1152, 1153, 1160, 1168, 1169), (2047, 2048)),
    }
    for kernel, row_runs in runs.items():
        fused = kernel is kernels.fused_add_rmsnorm_weight_first
        for rows in row_runs:
            counts = []
            for t in rows:
                persistent = None if fused else triton_kernels._persistent_launch(t, h, sms)  # RMSNorm's
                assert (persistent is not None) == (kernel is kernels.rmsnorm_persistent)
                assert persistent is not None or triton_kernels._norm_launch(t, h, fused=fused)[1].get("WEIGHT_FIRST")
                assert persistent is None or persistent[1] == triton_kernels._persistent_launch(rows[0], h, sms)[1]
                x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
                out = torch.empty_like(x)
                if fused:
                    triton_kernels.fused_add_rmsnorm(x=x, residual=x.clone(), weight=w, eps=1e-6, out=out)
                else:
                    triton_kernels.rmsnorm(x=x, weight=w, eps=1e-6, out=out)
                counts.append(len(kernel.device_caches[device][0]))
            assert counts[0] == counts[-1], (kernel, rows, counts)


def _rms(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _eager_only(*, x, weight, eps, out):
    if float(x.abs().max()) > 1e30:  # a host sync: fine eagerly, illegal while capturing
        raise ValueError("overflow")
    out.copy_(_rms(x, weight, eps))


_CACHE: dict = {}


def _cached(*, x, weight, eps, out):
    # Answers from a cache keyed by the input's address (the input is kept alive, so the address
    # is never reused): every eager call sees a new tensor, but a graph replays the capture's answer.
    if x.data_ptr() not in _CACHE:
        _CACHE[x.data_ptr()] = (x, _rms(x, weight, eps))
    out.copy_(_CACHE[x.data_ptr()][1])


def _allocating(*, x, weight, eps, out):
    scratch = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # a fresh buffer every call
    scratch.copy_(x)
    out.copy_(_rms(scratch, weight, eps).to(out.dtype))


def _swaps_output(*, x, weight, eps, out):
    if torch.cuda.is_current_stream_capturing():
        out.set_(out.clone())
    out.copy_(_rms(x, weight, eps))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("impl", "reason"),
    [
        (_eager_only, "fails under CUDA graph capture, so works only eagerly"),
        (_cached, "replay 1 of 3 on fresh inputs: output 'out'"),
        (_allocating, "allocated device memory"),
        (_swaps_output, "changed the storage of output 'out' during capture"),
    ],
)
def test_graph_qualification_rejects_what_only_works_eagerly(impl, reason):
    from cacheon_core import Variant

    claimed = Variant(slot="norm.rmsnorm", name=impl.__name__.strip("_"), impl=impl, graph_safe=True)
    result = verify_variant(RMSNORM, claimed, device="cuda")
    assert result.status == "rejected" and "claims graph_safe but" in result.reason, result
    assert reason in result.reason, result.reason
    unclaimed = Variant(slot="norm.rmsnorm", name="unclaimed", impl=impl, graph_safe=False)
    result = verify_variant(RMSNORM, unclaimed, device="cuda")
    assert result.status == "passed" and reason in result.graph, result  # eager only, reported not rejected


def test_decode_dispatches_through_the_segment_softmax_variant():
    d = dispatcher()
    g = torch.Generator().manual_seed(0)
    dims = {"b": 5, "hq": 8, "d": 32, "ns": 300, "hkv": 2, "b1": 6, "nnz": 170}
    args = ATTENTION_DECODE.sampler(dims, "bfloat16", "cpu", g)
    out = d.site("attention.decode")(**args, scale=0.2)
    expected = torch.empty_like(args["q"])
    decode_reference(**args, scale=0.2, out=expected)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def _ignores_padding(*, routed_output, expert_weights, permuted_indices, out):
    rows = routed_output.float()[permuted_indices.long()]  # -1 reads the last row instead of nothing
    out.copy_((rows * expert_weights.float().unsqueeze(-1)).sum(dim=1))


def _weights_swapped(*, routed_output, expert_weights, permuted_indices, out):
    torch_kernels.finalize(
        routed_output=routed_output, expert_weights=expert_weights.flip(1), permuted_indices=permuted_indices, out=out
    )


def _masks_weights_in_place(*, routed_output, expert_weights, permuted_indices, out):
    expert_weights.masked_fill_(permuted_indices < 0, 0.0)  # right answer, but into a read-only input
    torch_kernels.finalize(
        routed_output=routed_output, expert_weights=expert_weights, permuted_indices=permuted_indices, out=out
    )


@pytest.mark.parametrize(
    ("impl", "reason"),
    [
        (_ignores_padding, "256 of 1280 elements differ from the reference (first at (4, 0)"),  # the padded token
        (_weights_swapped, "output 'out'"),
        (_masks_weights_in_place, "wrote into input 'expert_weights'"),
    ],
)
def test_verify_rejects_a_wrong_finalize(impl, reason):
    from cacheon_core import Variant

    wrong = Variant(slot="moe.finalize", name=impl.__name__.strip("_"), impl=impl, slot_version=2)
    result = verify_variant(MOE_FINALIZE, wrong)
    assert result.status == "rejected", result
    assert reason in result.reason, result.reason


def test_finalize_dispatches_with_bfloat16_router_weights():
    d = dispatcher()
    args = moe_finalize_sampler({"t": 7, "k": 4, "p": 40, "h": 96}, "float16", "cpu", torch.Generator().manual_seed(0))
    args["expert_weights"] = args["expert_weights"].to(torch.bfloat16)  # the contract's other weight dtype
    site = d.site("moe.finalize")
    out = site(**args)
    assert site.plan_for(**args).variant.name == "example_torch_finalize"
    expected = torch.empty_like(out)
    moe_finalize_reference(**args, out=expected)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)
    assert out[-1].eq(0).all()  # the padded token: every entry -1


@pytest.mark.gpu
def test_receipts_count_graph_replays_on_the_device(tmp_path):
    from cacheon_core import ReceiptLog, coverage_report, read_receipts
    from cacheon_core.cli import main as cli

    receipts = ReceiptLog(tmp_path, role="scheduler", rank=0, policy="strict", flush_interval=3600)
    registry = Registry()
    for v in variants().values():
        registry.add_variant(v)
    registry.enable()
    receipts.event("active", slots=["norm.rmsnorm"])
    d = Dispatcher(registry, receipts=receipts)
    site = d.site("norm.rmsnorm")
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # eager warm-up, as engines do before capturing
        site(x=x, weight=w, eps=1e-6)
    assert site.plan_for(x=x, weight=w, eps=1e-6).variant.name == "example_triton"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = site(x=x, weight=w, eps=1e-6)  # recorded, not run: the Python dispatch never sees replays
    expected = torch.empty_like(x)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        rmsnorm_reference(x=x, weight=w, eps=1e-6, out=expected)
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)
    receipts.flush()
    graph.replay()  # a sixth replay, counted in the next flush
    torch.cuda.synchronize()
    receipts.close()
    cell = coverage_report(read_receipts(tmp_path)).coverage["norm.rmsnorm"][0]
    assert (cell.completed, cell.captured, cell.replayed, cell.ran) == (2, 1, 6, 8), cell
    assert cli(["receipts", str(tmp_path)]) == 0


@pytest.mark.gpu
def test_receipt_logs_made_and_dropped_one_after_another_each_count_cuda_plans(tmp_path):
    """A receipt log's replay counters are host memory registered with CUDA; a later log must still
    register its own after an earlier one is gone (freed registered memory reused at the same address
    used to fail with error 712, already registered)."""
    import gc

    from cacheon_core import ReceiptLog

    x = torch.randn(4, 128, device="cuda")
    w = torch.randn(128, device="cuda")
    for i in range(4):
        receipts = ReceiptLog(tmp_path / str(i), role="scheduler", rank=0, policy="strict", flush_interval=3600)
        registry = Registry()
        for v in variants().values():
            registry.add_variant(v)
        registry.enable()
        site = Dispatcher(registry, receipts=receipts).site("norm.rmsnorm")
        assert site(x=x, weight=w, eps=1e-6) is not None
        receipts.close()
        del site, registry, receipts
        gc.collect()
