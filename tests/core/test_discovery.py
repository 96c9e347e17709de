"""Discovery: every plugin failure is reported with its name and reason, never fatal."""

from __future__ import annotations

import types

import pytest
import torch

from cacheon_core import ReceiptLog, Role, SlotSpec, TensorSpec, Tolerance, Variant, discover, hookimpl, read_receipts
from cacheon_core import start as start_runtime
from cacheon_core._catalog import rmsnorm_reference


def plugin(**hooks):
    module = types.SimpleNamespace()
    for name, fn in hooks.items():
        setattr(module, name, hookimpl(fn))
    return module


def ok_impl(*, x, weight, eps, out):
    rmsnorm_reference(x=x, weight=weight, eps=eps, out=out)


def good_variants():
    return [Variant(slot="norm.rmsnorm", name="third_party", impl=ok_impl)]


def find(found, name):
    return next(p for p in found.plugins if p.name == name)


def test_a_good_plugin_contributes_its_variants():
    found = discover(entry_points=False, extra=[("good", plugin(cacheon_variants=good_variants))])
    report = find(found, "good")
    assert report.status == "loaded"
    assert [(v.slot, v.name) for v in report.variants] == [("norm.rmsnorm", "third_party")]
    assert "norm.rmsnorm" in found.slots and found.slot_owner["norm.rmsnorm"] == "cacheon-core"


@pytest.mark.parametrize(
    ("hooks", "reason"),
    [
        (
            {"cacheon_variants": lambda: [Variant(slot="norm.nope", name="v", impl=ok_impl)]},
            "targets unknown slot 'norm.nope'",
        ),
        (
            {"cacheon_variants": lambda: [Variant(slot="norm.rmsnorm", name="v", impl=lambda x, w: None)]},
            "parameter 'w' is required but the contract of 'norm.rmsnorm' has no such argument",
        ),
        (
            {"cacheon_variants": lambda: [Variant(slot="norm.rmsnorm", name="v", impl=ok_impl, slot_version=2)]},
            "serves norm.rmsnorm v2, installed contract is v1",
        ),
        ({"cacheon_variants": lambda: [Variant(slot="norm.rmsnorm", name="v", impl=ok_impl)] * 2}, "registered twice"),
        ({"cacheon_variants": lambda: 1 / 0}, "division by zero"),
        ({"cacheon_variants": lambda: "norm.rmsnorm"}, "returned str, expected an iterable of Variant"),
        ({"cacheon_variants": lambda: [object()]}, "expected Variant"),
        ({"cacheon_kernels": lambda: []}, "hook 'cacheon_kernels' is not a cacheon hook"),
    ],
)
def test_a_bad_plugin_is_reported_with_the_reason_and_a_receipt(hooks, reason, tmp_path):
    receipts = ReceiptLog(tmp_path, role="scheduler", flush_interval=0)
    found = discover(
        entry_points=False,
        receipts=receipts,
        extra=[("bad", plugin(**hooks)), ("good", plugin(cacheon_variants=good_variants))],
    )
    bad = find(found, "bad")
    assert bad.status == "load_failed"
    assert reason in bad.reason
    assert find(found, "good").status == "loaded"  # one bad plugin takes nobody else down
    assert [v.name for v in found.variants] == ["third_party"]
    receipts.close()
    failed = [r for r in read_receipts(tmp_path) if r.kind == "load_failed"]
    assert len(failed) == 1 and failed[0].plugin == "bad" and reason in failed[0].reason


def test_a_plugin_is_all_or_nothing():
    def half_good():
        return [
            Variant(slot="norm.rmsnorm", name="fine", impl=ok_impl),
            Variant(slot="norm.rmsnorm", name="broken", impl=lambda: None),
        ]

    found = discover(entry_points=False, extra=[("half", plugin(cacheon_variants=half_good))])
    assert find(found, "half").status == "load_failed"
    assert found.variants == ()


def test_plugins_can_define_new_slots_but_not_redefine_one():
    spec = SlotSpec(
        id="act.silu_mul",
        version=1,
        summary="silu(gate) * up",
        inputs=(TensorSpec("gate", ("t", "h"), ("float32",)), TensorSpec("up", ("t", "h"), ("float32",))),
        outputs=(TensorSpec("out", ("t", "h"), same_dtype_as="gate"),),
        reference=lambda *, gate, up, out: out.copy_(torch.nn.functional.silu(gate) * up),
        tolerances={"float32": Tolerance(1e-6, 1e-6)},
    )
    clash = SlotSpec(id="norm.rmsnorm", version=1, summary="mine", inputs=spec.inputs, outputs=spec.outputs)
    found = discover(
        entry_points=False,
        extra=[
            ("new_slot", plugin(cacheon_slots=lambda: [spec])),
            ("clash", plugin(cacheon_slots=lambda: [clash])),
        ],
    )
    assert found.slot_owner["act.silu_mul"] == "new_slot"
    assert "already defined by cacheon-core" in find(found, "clash").reason


def test_allow_list_skips_everything_else():
    found = discover(
        entry_points=False,
        environ={"CACHEON_PLUGINS": "other-dist"},
        extra=[("good", plugin(cacheon_variants=good_variants))],
    )
    assert find(found, "good").status == "skipped"
    assert found.variants == ()
    found = discover(
        entry_points=False,
        environ={"CACHEON_PLUGINS": "Good"},
        extra=[("good", plugin(cacheon_variants=good_variants))],
    )
    assert find(found, "good").status == "loaded"


def test_only_a_scheduler_loads_candidates_and_enables_its_registry(tmp_path, monkeypatch):
    import cacheon_core._roles as roles

    called = []

    def variants():
        called.append(roles.current_role())
        return good_variants()

    env = {"CACHEON_RECEIPT_DIR": str(tmp_path), "CACHEON_POLICY": "strict"}
    monkeypatch.setattr(roles, "_role", Role.OTHER)
    for role in (Role.DRIVER, None):
        monkeypatch.setattr(roles, "_role", Role.OTHER)
        rt = start_runtime(role, environ=env, entry_points=False, extra=[("p", plugin(cacheon_variants=variants))])
        assert not rt.registry.enabled and called == []
        x = torch.randn(2, 8)
        assert rt.dispatcher.site("norm.rmsnorm")(x=x, weight=torch.ones(8), eps=1e-6) is None
        rt.receipts.close()
    rt = start_runtime(
        Role.SCHEDULER, environ=env, entry_points=False, extra=[("p", plugin(cacheon_variants=variants))]
    )
    assert called == [Role.SCHEDULER] and rt.registry.enabled
    out = rt.dispatcher.site("norm.rmsnorm")(x=torch.randn(2, 8), weight=torch.ones(8), eps=1e-6)
    assert out is not None
    rt.receipts.close()
    kinds = [r.kind for r in read_receipts(tmp_path)]
    assert kinds == ["active", "fired", "completed"]


def test_a_scheduler_with_nothing_to_load_writes_load_failed(tmp_path, monkeypatch):
    import cacheon_core._roles as roles

    monkeypatch.setattr(roles, "_role", Role.OTHER)
    rt = start_runtime(
        Role.SCHEDULER, environ={"CACHEON_RECEIPT_DIR": str(tmp_path), "CACHEON_PLUGINS": "nothing-installed"}
    )
    rt.receipts.close()
    assert not rt.registry.enabled
    [receipt] = read_receipts(tmp_path)
    assert receipt.kind == "load_failed" and "no candidate variant" in receipt.reason


def test_bad_runtime_configuration_is_a_typed_error():
    from cacheon_core import CacheonError

    with pytest.raises(CacheonError, match="CACHEON_POLICY='fast'"):
        start_runtime(environ={"CACHEON_POLICY": "fast"}, entry_points=False)
    with pytest.raises(CacheonError, match="CACHEON_RANK='-1'"):
        start_runtime(environ={"CACHEON_RANK": "-1"}, entry_points=False)
