from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from tests.manager_process import ManagerProcess
from tests.redis_cluster import RedisNodes

# Two shared cores: timing deadlines would measure the machine, not the property.
settings.register_profile("cacheon", deadline=None, max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cacheon"))

GPU_SKIP = "needs a CUDA device; results of the last GPU run are in BENCHMARKS.md"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the keyword (tests/gpu is one)
            item.add_marker(skip)


# No suite passes by skipping: the only skip allowed is a gpu-marked test on a machine without CUDA
# (engine sessions deselect those with -m "not gpu"). Anything else skipped fails the run.
_unexpected_skips: list[str] = []


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and GPU_SKIP not in str(report.longrepr):
        _unexpected_skips.append(report.nodeid or str(report.fspath))


def pytest_collectreport(report):
    _note_skip(report)


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.write_line(
            f"FAILED: {len(_unexpected_skips)} tests skipped without a gpu mark (no suite may pass by skipping): "
            + ", ".join(_unexpected_skips[:20]),
            red=True,
        )


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _clean_cacheon_env(monkeypatch):
    # Ambient CACHEON_* values from the developer's shell must never steer a test.
    for name in list(os.environ):
        if name.startswith("CACHEON_") or name == "TRITON_INTERPRET":
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def sock_dir():
    """A short folder for unix sockets: sun_path caps a path at 107 bytes, and pytest's tmp_path under
    a nox session can be longer than that."""
    path = Path(tempfile.mkdtemp(prefix="okv-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def manager_factory(tmp_path, sock_dir):
    """Start real cache manager processes (``ManagerProcess`` keywords); all are stopped afterwards."""
    started: list[ManagerProcess] = []

    def make(**kwargs) -> ManagerProcess:
        m = ManagerProcess(tmp_path, sock_dir, **kwargs).start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A real Redis Cluster on loopback: 3 primaries, 3 replicas (Debian's redis-server), for a module."""
    nodes = RedisNodes(tmp_path_factory.mktemp("redis")).start()
    yield nodes
    nodes.stop()
