"""Both bootstrap paths: the .pth import hook and SGLang's own plugin loader, alone and together."""

from __future__ import annotations

REPORT = """
    import json, sys
    import sglang.srt.layers.layernorm as ln
    import sglang.srt.managers.scheduler as sched
    from sglang.kernels.fused_op import BaseFusedOp
    from cacheon_sglang import seam
    {extra}
    fwd = ln.RMSNorm.__dict__.get("forward")
    gemma = ln.GemmaRMSNorm.__dict__.get("forward")
    gate = sched.run_scheduler_process
    print(json.dumps({{
        "rmsnorm_adapter": bool(getattr(fwd, "__cacheon_adapter__", False)),
        "rmsnorm_wraps_base": getattr(fwd, "__wrapped__", None) is BaseFusedOp.forward,
        "gemma_adapter": bool(getattr(gemma, "__cacheon_adapter__", False)),
        "gate": bool(getattr(gate, "__cacheon_gate__", False)),
        "gate_wraps_original": not getattr(getattr(gate, "__wrapped__", None), "__cacheon_gate__", False),
        "installed": sorted(seam.STATE.installed),
        "entry_point_ran": seam.STATE.entry_point_ran,
        "role": __import__("cacheon_core").current_role().value,
        "runtime": seam.STATE.runtime is not None,
    }}))
"""


def test_bootstrap_is_import_light(scenario):
    out = scenario("""
        import json, sys
        finder = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "SeamFinder"]
        import cacheon_sglang.bootstrap, cacheon_sglang.seams
        print(json.dumps({"finder": finder, "torch": "torch" in sys.modules, "sglang": "sglang" in sys.modules}))
    """)
    assert out == {"finder": ["SeamFinder"], "torch": False, "sglang": False}


def test_pth_bootstrap_installs_pass_through_adapters_when_sglang_loads(scenario):
    out = scenario(REPORT.format(extra=""))
    assert out["rmsnorm_adapter"] and out["rmsnorm_wraps_base"] and out["gemma_adapter"] and out["gate"]
    assert out["installed"] == ["gemma_rmsnorm", "rmsnorm", "scheduler_gate"]
    assert not out["entry_point_ran"] and not out["runtime"] and out["role"] == "other"


def test_sglang_load_plugins_discovers_and_runs_the_entry_point(scenario):
    out = scenario(
        REPORT.format(
            extra="""
    from sglang.srt.plugins import load_plugins, load_plugins_by_group, GENERAL_PLUGINS_GROUP
    assert "cacheon" in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert not seam.STATE.installed  # the .pth bootstrap is off in this scenario
    load_plugins()
    """
        ),
        env={"CACHEON_SGLANG_BOOTSTRAP": "0"},
    )
    assert out["entry_point_ran"]
    assert out["rmsnorm_adapter"] and out["rmsnorm_wraps_base"] and out["gate"]
    assert not out["runtime"]  # not inside run_scheduler_process: no candidates


def test_both_paths_together_never_wrap_twice(scenario):
    out = scenario(
        REPORT.format(
            extra="""
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from cacheon_sglang import plugin
    plugin.load()
    seam.activate()
    """
        )
    )
    assert out["entry_point_ran"]
    assert out["rmsnorm_wraps_base"] and out["gate_wraps_original"]


def test_gated_bindings_are_armed_only_by_the_launch_environment(scenario):
    code = """
        import json
        import sglang.kernels.ops.attention.decode_attention as da
        from cacheon_sglang import seam
        print(json.dumps({"armed": list(seam.STATE.armed), "decode": "triton_decode" in seam.STATE.installed,
                          "marked": bool(getattr(da.decode_attention_fwd, "__cacheon_adapter__", False))}))
    """
    out = scenario(code)
    assert out == {"armed": ["norm", "scheduler_gate"], "decode": False, "marked": False}
    from cacheon_sglang.engine import launch_environment

    env = launch_environment(["attention_decode", "norm", "scheduler_gate"])
    out = scenario(code, env=env)
    assert out == {"armed": ["attention_decode", "norm", "scheduler_gate"], "decode": True, "marked": True}


def test_a_partial_gate_environment_is_refused(scenario):
    import pytest

    with pytest.raises(AssertionError, match="CACHEON_BIND_ARFUSION=None"):
        scenario(
            """
            import sglang.srt.layers.layernorm
            print("{}")
        """,
            env={"CACHEON_BIND_ATTENTION_DECODE": "1"},
        )
