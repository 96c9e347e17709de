"""A real Redis Cluster on loopback: Debian's ``redis-server`` processes in cluster mode (3 primaries,
3 replicas by default), for the remote tier's tests and benchmarks. Also a single node."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

NODE_TIMEOUT_MS = 1000  # short, so a killed primary's replica takes over within seconds


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, bus: bool) -> list[int]:
    """``count`` free loopback ports (and their cluster bus ports, port + 10000, when ``bus``)."""
    ports: list[int] = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        start = 20000 + probe.getsockname()[1] % 30000
    port = start
    while len(ports) < count:
        port += 1
        if port > 55000:
            port = 20001
        if _free(port) and (not bus or _free(port + 10000)):
            ports.append(port)
    return ports


def cli(port: int, *args: str, timeout: float = 10, password: str | None = None) -> str:
    auth = ["--no-auth-warning", "-a", password] if password is not None else []
    return subprocess.run(
        ["redis-cli", "-p", str(port), *auth, *args], capture_output=True, text=True, timeout=timeout, check=True
    ).stdout


class RedisNodes:
    """``redis-server`` processes under ``folder``: a cluster of ``primaries`` x (1 + ``replicas``)
    nodes, or one plain node (``primaries=1, replicas=0, cluster=False``)."""

    def __init__(
        self, folder: Path, primaries: int = 3, replicas: int = 1, cluster: bool = True, password: str | None = None
    ) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server and redis-cli are needed (Debian: apt-get install redis-server)")
        self.folder = folder
        self.cluster = cluster
        self.ports = free_ports(primaries * (1 + replicas), bus=cluster)
        self.replicas = replicas
        self.password = password
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The ``--remote`` value naming every node."""
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _spawn(self, port: int) -> None:
        home = self.folder / str(port)
        home.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(home)]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no", "--logfile", str(home / "log")]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(home / "nodes.conf")]
            args += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> RedisNodes:
        for port in self.ports:
            self._spawn(port)
        for port in self.ports:
            self._wait(
                lambda port=port: cli(port, "PING", password=self.password).strip() == "PONG", f"node {port} answering"
            )
        if self.cluster:
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            self.wait_ok()
        return self

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis: timed out waiting for {what}")
            time.sleep(0.1)

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def wait_ok(self, timeout: float = 60) -> None:
        """Until every live node sees the cluster as ok and each slot range has a live primary."""

        def ok() -> bool:
            alive = self.alive()
            return all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in alive) and len(self.primaries()) == len(
                self.ports
            ) // (1 + self.replicas)

        self._wait(ok, "cluster_state:ok", timeout)

    def primaries(self) -> list[int]:
        """Ports of the live primaries, as the first live node sees the cluster."""
        alive = self.alive()
        out = []
        for line in cli(alive[0], "CLUSTER", "NODES").splitlines():
            parts = line.split()
            flags = parts[2].split(",")
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            if "master" in flags and "fail" not in flags and "fail?" not in flags and port in alive:
                out.append(port)
        return sorted(out)

    def primary_of(self, key: bytes) -> int:
        """Port of the live primary serving ``key``'s slot."""
        alive = self.alive()
        slot = int(cli(alive[0], "CLUSTER", "KEYSLOT", key.decode("latin-1")).strip())
        for line in cli(alive[0], "CLUSTER", "NODES").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            for span in parts[8:]:
                if span.startswith("["):
                    continue
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    return port
        raise RuntimeError(f"no live primary serves slot {slot}")

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
