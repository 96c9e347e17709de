from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("msgpack")


class ManagerProcess:
    """orbitkv-cache-manager as a real child process on a unix socket."""

    def __init__(
        self, tmp: Path, sock_dir: Path, pool: str = "64mb", ssd: bool = False, extra: tuple[str, ...] = ()
    ) -> None:
        self.sock = sock_dir / f"m-{time.monotonic_ns()}.sock"
        self.endpoint = f"unix://{self.sock}"
        self.ssd_path = tmp / "ssd.bin"
        self.args = [
            sys.executable,
            "-m",
            "cacheon_orbitkv.manager",
            "--addr",
            self.endpoint,
            "--pool-size",
            pool,
            *(("--ssd-cache-path", str(self.ssd_path), "--ssd-cache-capacity", "256mb") if ssd else ()),
            *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> ManagerProcess:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"manager did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def arenas(self) -> list[Path]:
        """This manager's shared-memory arenas (named orbitkv-<pid>-<token>)."""
        assert self.proc is not None
        return list(Path("/dev/shm").glob(f"orbitkv-{self.proc.pid}-*"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def manager_factory(tmp_path, sock_dir):
    started: list[ManagerProcess] = []

    def make(**kwargs) -> ManagerProcess:
        m = ManagerProcess(tmp_path, sock_dir, **kwargs).start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()
    os.environ.pop("ORBITKV_TEST", None)
