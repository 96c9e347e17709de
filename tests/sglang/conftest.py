"""SGLang seam tests: real sglang==0.5.23 imported on CPU (run by `nox -s sglang`).

Each scenario runs in its own interpreter of the session's virtualenv, where cacheon_sglang.pth
bootstraps the seam exactly as it would for a user; a process's role cannot change once it has
entered the scheduler, so no scenario shares a process with another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run_script(code: str, tmp_path: Path, env: dict[str, str] | None = None, timeout: int = 300) -> dict:
    """Run ``code`` as a script file (spawned children can re-import it); it prints one JSON line last."""
    script = tmp_path / f"scenario_{abs(hash(code)) % 10**8}.py"
    script.write_text(textwrap.dedent(code))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CACHEON_") and k != "TRITON_INTERPRET"}
    environ.update(env or {})
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
        check=False,
        cwd=tmp_path,
    )
    if result.returncode != 0:
        raise AssertionError(f"scenario failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def scenario(tmp_path):
    def run(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> dict:
        return run_script(code, tmp_path, env, timeout)

    return run
