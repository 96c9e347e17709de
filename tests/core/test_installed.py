"""Wheels of every distribution build, and discovery works in a real virtualenv.

The example plugin and three defective plugins are installed from their wheels into a fresh
virtualenv (which borrows torch and friends from the test environment through a ``.pth`` file
over a filtered mirror, so no Cacheon distribution leaks in); the ``cacheon`` console script of
that virtualenv is then driven like a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {
    "cacheon_core": "cacheon_core",
    "plugins_example": "cacheon_example_kernels",
    "cacheon_orbitkv": "cacheon_orbitkv",
    "cacheon_sglang": "cacheon_sglang",
    "cacheon_vllm": "cacheon_vllm",
}
TEST_PLUGINS = ["broken_import", "bad_kernels", "bad_signature"]

pytestmark = pytest.mark.slow


def _build_wheel(source: Path, out: Path) -> Path:
    target = out / source.name
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    [wheel] = target.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    built = {}
    for folder in DISTRIBUTIONS:
        built[folder] = _build_wheel(ROOT / folder, out)
    for name in TEST_PLUGINS:
        built[name] = _build_wheel(Path(__file__).parent / "plugins" / name, out)
    return built


@pytest.fixture(scope="module")
def env(tmp_path_factory, wheels):
    root = tmp_path_factory.mktemp("venv")
    mirror = root / "mirror"
    mirror.mkdir()
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        lowered = entry.name.lower()
        if "cacheon" in lowered or entry.suffix == ".pth" or lowered.startswith("__editable__"):
            continue
        (mirror / entry.name).symlink_to(entry)
    target = root / "env"
    venv.EnvBuilder(with_pip=True).create(target)
    py = target / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "_borrowed.pth").write_text(f"{mirror}\n")
    install = [wheels[k] for k in ("cacheon_core", "plugins_example", *TEST_PLUGINS)]
    subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", *map(str, install)],
        check=True,
        capture_output=True,
        text=True,
    )
    return target


def run(env_dir: Path, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CACHEON_") and k != "TRITON_INTERPRET"}
    environ.update(extra_env or {})
    return subprocess.run(
        [str(env_dir / "bin" / args[0]), *args[1:]], capture_output=True, text=True, env=environ, timeout=600
    )


def test_every_distribution_builds_a_typed_wheel(wheels):
    for folder, package in DISTRIBUTIONS.items():
        with zipfile.ZipFile(wheels[folder]) as zf:
            names = zf.namelist()
        assert f"{package}/py.typed" in names, folder
        assert f"{package}/__init__.py" in names, folder


def test_cacheon_plugins_lists_the_example_and_reports_broken_plugins(env):
    result = run(env, "cacheon", "plugins", "--json")
    assert result.returncode == 1, result.stderr  # some plugin failed to load
    reports = {p["distribution"]: p for p in json.loads(result.stdout)}
    example = reports["cacheon-example-kernels"]
    assert example["status"] == "loaded"
    assert {(v["slot"], v["name"]) for v in example["variants"]} == {
        ("norm.rmsnorm", "example_torch"),
        ("norm.rmsnorm", "example_triton"),
        ("norm.fused_add_rmsnorm", "example_torch_fused"),
        ("attention.decode", "example_torch_decode"),
        ("moe.fused_experts", "example_torch_experts"),
        ("norm.fused_add_rmsnorm", "example_triton_fused"),
        ("moe.finalize", "example_torch_finalize"),
        ("moe.finalize", "example_triton_finalize"),
        ("collective.all_reduce", "example_torch_all_reduce"),
        ("arfusion.allreduce_add_rmsnorm", "example_torch_arfusion"),
    }
    broken = reports["cacheon-test-broken-import"]
    assert broken["status"] == "load_failed"
    assert "No module named 'cacheon_module_that_does_not_exist'" in broken["reason"]
    signature = reports["cacheon-test-bad-signature"]
    assert signature["status"] == "load_failed" and "positional-only" in signature["reason"]
    assert reports["cacheon-test-bad-kernels"]["status"] == "loaded"
    assert reports["cacheon-core"]["status"] == "loaded"


@pytest.mark.parametrize("variant", ["example_torch"])
def test_example_variants_verify_on_cpu(env, variant):
    result = run(env, "cacheon", "verify", "norm.rmsnorm", "--variant", variant, "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout
    fused = run(env, "cacheon", "verify", "norm.fused_add_rmsnorm", "--variant", "example_torch_fused")
    assert fused.returncode == 0, fused.stdout


def test_triton_variants_verify_under_the_interpreter_and_say_unsupported_without(env):
    # The finalize kernel: the norms' declared sizes (1024 rows) take minutes under the interpreter;
    # tests/example verifies the norms there at the slot's sizes and runs their other shapes.
    result = run(
        env,
        "cacheon",
        "verify",
        "moe.finalize",
        "--variant",
        "example_triton_finalize",
        "--device",
        "cpu",
        extra_env={"TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "example_triton_finalize on cpu: PASSED" in result.stdout
    result = run(env, "cacheon", "verify", "norm.rmsnorm", "--variant", "example_triton")
    assert result.returncode == 3
    assert "supports() accepted no verification case on cpu" in result.stdout
    assert "t=1024,h=4200" in result.stdout  # the declared sizes are among the cases, unsupported here


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("bad_returns_new", "returned a Tensor instead of writing its outputs in place"),
        ("bad_writes_nan", "non-finite values (NaN/Inf) into output 'out'"),
        ("bad_writes_x", "wrote into input 'x'"),
    ],
)
def test_third_party_contract_breakers_are_rejected_by_verify(env, variant, reason):
    result = run(env, "cacheon", "verify", "norm.rmsnorm", "--variant", variant, "--json")
    assert result.returncode == 1
    [verdict] = json.loads(result.stdout)
    assert verdict["status"] == "rejected"
    assert reason in verdict["reason"]


SCHEDULER = """
import torch
from cacheon_core import Role, start
rt = start(Role.SCHEDULER)
site = rt.dispatcher.site("norm.rmsnorm")
x, w = torch.randn(4, 64), torch.randn(64)
for _ in range(10):
    out = site(x=x, weight=w, eps=1e-6)
plan = site.plan_for(x=x, weight=w, eps=1e-6)
print(plan.variant.name if plan.variant else "stock")
rt.receipts.close()
"""


def test_a_scheduler_process_leaves_receipts_that_cacheon_receipts_judges(env, tmp_path):
    all_plugins = tmp_path / "all"
    result = run(env, "python", "-c", SCHEDULER, extra_env={"CACHEON_RECEIPT_DIR": str(all_plugins)})
    assert result.returncode == 0, result.stderr
    report = run(env, "cacheon", "receipts", str(all_plugins), "--expect-ranks", "1")
    assert report.returncode == 1
    assert "load_failed" in report.stdout and "cacheon-test-broken-import" in report.stdout

    allowed = tmp_path / "allowed"
    result = run(
        env,
        "python",
        "-c",
        SCHEDULER,
        extra_env={"CACHEON_RECEIPT_DIR": str(allowed), "CACHEON_PLUGINS": "cacheon-example-kernels"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "example_torch"
    report = run(env, "cacheon", "receipts", str(allowed), "--expect-ranks", "1", "--json")
    assert report.returncode == 0, report.stdout
    data = json.loads(report.stdout)
    assert data["coverage"]["norm.rmsnorm"]["0"]["completed"] == 10
    missing = run(env, "cacheon", "receipts", str(allowed), "--expect-ranks", "2")
    assert missing.returncode == 1 and "missing active members" in missing.stdout
