"""orbitkv-cache-manager as a real child process on a unix socket, shared by the OrbitKV, vLLM and
SGLang suites."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class ManagerProcess:
    def __init__(
        self,
        tmp: Path,
        sock_dir: Path,
        pool: str = "64mb",
        ssd: bool = False,
        ssd_capacity: str = "256mb",
        extra: tuple[str, ...] = (),
        sock: Path | None = None,
        addr: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``addr``: a TCP ``HOST:PORT`` to listen on instead of a unix socket; ``env``: variables
        added to the manager's environment."""
        stamp = time.monotonic_ns()
        self.sock = sock or sock_dir / f"m-{stamp}.sock"
        self.endpoint = addr or f"unix://{self.sock}"
        self.ssd_path = tmp / "ssd.bin"
        self.log = tmp / f"manager-{stamp}.log"
        self.args = [
            sys.executable,
            "-m",
            "cacheon_orbitkv.manager",
            "--addr",
            self.endpoint,
            "--pool-size",
            pool,
            *(("--ssd-cache-path", str(self.ssd_path), "--ssd-cache-capacity", ssd_capacity) if ssd else ()),
            *extra,
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> ManagerProcess:
        # stderr to a file: a chatty manager never blocks on a pipe nobody reads.
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"manager did not start: {line!r}\n{self.log.read_text()}")
        return self

    def stats(self) -> dict[str, Any]:
        from cacheon_orbitkv.client import CacheClient

        with CacheClient(self.endpoint) as client:
            return client.stats()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def arenas(self) -> list[Path]:
        """This manager's shared-memory arenas (named orbitkv-<pid>-<token>)."""
        assert self.proc is not None
        return list(Path("/dev/shm").glob(f"orbitkv-{self.proc.pid}-*"))

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (an orderly stop: DRAM pages go to the SSD tier first); its exit code, or None if it
        had to be killed after ``timeout`` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return None
        return self.proc.returncode if self.proc is not None else None
