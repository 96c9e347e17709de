"""Spawned processes, as SGLang starts them: only the one entering run_scheduler_process loads candidates."""

from __future__ import annotations

from cacheon_core import coverage_report, read_receipts

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
