"""Spawned processes, as SGLang starts them: only the one entering run_scheduler_process loads candidates."""

from __future__ import annotations

from pathlib import Path

from cacheon_core import build_bundle, coverage_report, read_receipts, sign_bundle

DRIVER = """
    import json, multiprocessing as mp, os, sys
    from cacheon_core import Role, mark_role

    def detokenizer_like():
        # A non-scheduler child: imports watched modules and runs SGLang's plugin loader, as the
        # detokenizer does, and must stay pass-through.
        import sglang.srt.layers.layernorm
        import sglang.srt.managers.detokenizer_manager
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from cacheon_sglang import seam
        assert seam.STATE.sites is None and "rmsnorm" in seam.STATE.installed

    if __name__ == "__main__":
        mark_role(Role.DRIVER)  # before SGLang is imported, as a launcher does
        import sglang.srt.entrypoints.engine as engine
        from sglang.srt.managers.scheduler import run_scheduler_process
        from sglang.srt.plugins import load_plugins
        load_plugins()
        ctx = mp.get_context("spawn")
        detok = ctx.Process(target=detokenizer_like)
        detok.start(); detok.join(240)
        # The real, wrapped run_scheduler_process, reached the way the Engine reaches it; the bogus
        # arguments make SGLang fail after the gate, which is all this needs.
        target = engine.Engine.run_scheduler_process_func
        sched = ctx.Process(target=target, args=(None, None, 0, 0, 0, None, None))
        sched.start(); sched.join(240)
        from cacheon_sglang import seam
        print(json.dumps({"driver": os.getpid(), "detok": detok.pid, "detok_exit": detok.exitcode,
                          "sched": sched.pid, "sched_exit": sched.exitcode,
                          "driver_sites": seam.STATE.sites is not None,
                          "target_is_gate": bool(getattr(target, "__cacheon_gate__", False))}))
"""


def test_only_the_scheduler_child_imports_candidates_and_writes_active(scenario, tmp_path):
    receipts, probes = tmp_path / "receipts", tmp_path / "probes"
    probes.mkdir()
    out = scenario(
        DRIVER,
        env={
            "CACHEON_RECEIPT_DIR": str(receipts),
            "CACHEON_TEST_PROBE_DIR": str(probes),
            "CACHEON_PLUGINS": "cacheon-test-import-probe,cacheon-example-kernels",
        },
        timeout=600,
    )
    assert out["target_is_gate"] and not out["driver_sites"]
    assert out["detok_exit"] == 0
    assert out["sched_exit"] != 0  # SGLang itself failed on the bogus server args, after the gate
    imported = sorted(int(p.name.split("-")[1]) for p in probes.iterdir())
    assert imported == [out["sched"]]
    records = read_receipts(receipts)
    active = [r for r in records if r.kind == "active"]
    assert [(r.pid, r.role, r.rank) for r in active] == [(out["sched"], "scheduler", 0)]
    assert set(active[0].slots) == {"norm.rmsnorm", "norm.fused_add_rmsnorm"}  # attention is not armed
    assert {r.pid for r in records} == {out["sched"]}
    report = coverage_report(records, expect_ranks=1)
    assert report.ok, report.problems


PROBE_SOURCE = Path(__file__).parent / "plugins" / "import_probe" / "src" / "cacheon_test_import_probe"


def _sealed_env(tree: Path, receipts: Path, probes: Path, **extra: str) -> dict[str, str]:
    return {
        "CACHEON_RECEIPT_DIR": str(receipts),
        "CACHEON_TEST_PROBE_DIR": str(probes),
        "CACHEON_BUNDLE": str(tree),
        "CACHEON_BUNDLE_MOUNT": str(tree),
        # ignored under sealed serving: installed entry-point plugins never load
        "CACHEON_PLUGINS": "cacheon-example-kernels",
        **extra,
    }


def test_sealed_serving_loads_the_bundle_only_in_the_scheduler(scenario, tmp_path):
    tree, receipts, probes = tmp_path / "tree", tmp_path / "receipts", tmp_path / "probes"
    probes.mkdir()
    build_bundle([str(PROBE_SOURCE)], tree)
    out = scenario(DRIVER, env=_sealed_env(tree, receipts, probes), timeout=600)
    assert out["detok_exit"] == 0 and not out["driver_sites"]
    assert sorted(int(p.name.split("-")[1]) for p in probes.iterdir()) == [out["sched"]]
    records = read_receipts(receipts)
    active = [r for r in records if r.kind == "active"]
    # only the sealed probe's slot: the installed example plugin (fused norm too) was not loaded
    assert [(r.pid, set(r.slots)) for r in active] == [(out["sched"], {"norm.rmsnorm"})]
    assert not [r for r in records if r.kind == "load_failed"]


def test_a_tampered_bundle_is_refused_and_signed_serving_stops_startup(scenario, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    tree, probes = tmp_path / "tree", tmp_path / "probes"
    probes.mkdir()
    build_bundle([str(PROBE_SOURCE)], tree)
    key = Ed25519PrivateKey.generate()
    sign_bundle(
        tree,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    public = tmp_path / "release.pub"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    [module] = [p for p in tree.glob("cacheon_c_*/__init__.py")]
    module.write_text(module.read_text() + "\n# changed after signing\n")

    unsigned = tmp_path / "receipts-unsigned"
    scenario(DRIVER, env=_sealed_env(tree, unsigned, probes), timeout=600)
    reasons = [r.reason for r in read_receipts(unsigned) if r.kind == "load_failed"]
    assert any("__init__.py does not match its digest" in (r or "") for r in reasons), reasons
    assert not [r for r in read_receipts(unsigned) if r.kind == "active"]  # the stock path serves
    assert list(probes.iterdir()) == []  # the tampered module never ran

    signed = tmp_path / "receipts-signed"
    out = scenario(SIGNED_DRIVER, env=_sealed_env(tree, signed, probes, CACHEON_BUNDLE_PUBKEY=str(public)), timeout=600)
    assert "signed serving stops" in out["error"] and "does not match its digest" in out["error"]
    assert list(probes.iterdir()) == []
    records = read_receipts(signed)
    assert not [r for r in records if r.kind == "active"]
    assert any("does not match its digest" in (r.reason or "") for r in records if r.kind == "load_failed")


# Enters the scheduler gate directly and reports the exception that stops startup.
SIGNED_DRIVER = """
    import json
    from cacheon_sglang import seam
    try:
        seam.enter_scheduler(tp_rank=0)
        print(json.dumps({"error": ""}))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""
