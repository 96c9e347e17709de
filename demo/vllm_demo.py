"""The demo's main act: a real vLLM engine (CPU build) restoring its KV cache through OrbitKV.

Starts an OrbitKV cache manager process, writes a tiny random-weight model, then runs two engine
lifetimes on the same 300-token prompt: cold (computes and saves the prompt's pages) and warm (a
new engine process that restores them). Prints both timings, the bytes restored and the outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cacheon_orbitkv.client import CacheClient

HERE = Path(__file__).parent
PROMPT = 300


def engine(model: Path, endpoint: str) -> tuple[dict, float]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(HERE / "vllm_engine.py"), str(model), endpoint, "-", str(PROMPT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    wall = time.perf_counter() - start
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"engine failed:\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :]), wall


def main() -> None:
    sys.path.insert(0, str(HERE))
    import tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model.build(Path(tmp) / "model")
        endpoint = f"unix://{tmp}/orbitkv.sock"
        manager = subprocess.Popen(
            [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", endpoint, "--pool-size", "256mb"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert manager.stdout is not None and manager.stdout.readline().startswith("ready")
            print(f"orbitkv-cache-manager on {endpoint}; tiny Llama at {model}; prompt of {PROMPT} tokens")
            cold, cold_wall = engine(model, endpoint)
            with CacheClient(endpoint) as c:
                saved = c.stats()["bytes_written"]["dram"]
            print(
                f"cold engine: generate {cold['seconds'] * 1e3:.0f} ms (process {cold_wall:.1f} s); "
                f"{saved} bytes of KV pages saved to OrbitKV"
            )
            warm, warm_wall = engine(model, endpoint)
            with CacheClient(endpoint) as c:
                stats = c.stats()
            print(
                f"warm engine (new process): generate {warm['seconds'] * 1e3:.0f} ms (process {warm_wall:.1f} s); "
                f"{stats['bytes_read']['dram']} bytes restored from OrbitKV in {stats['hits']['dram']} pages"
            )
            same = cold["ids"] == warm["ids"]
            print(f"output token ids cold {cold['ids']} warm {warm['ids']}: {'identical' if same else 'DIFFERENT'}")
            if not same or stats["bytes_read"]["dram"] == 0:
                sys.exit("the warm engine did not restore the same state")
        finally:
            manager.terminate()
            manager.wait()


if __name__ == "__main__":
    main()
