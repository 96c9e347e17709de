"""Nothing let in: the auth token on TCP, a unix socket that opens nothing on the network, and a
metrics server on loopback unless told otherwise."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import urllib.request

import msgpack
import pytest

from cacheon_orbitkv.client import AsyncCacheClient, CacheClient, page_hashes
from cacheon_orbitkv.wire import PROTOCOL_VERSION, ManagerUnavailable, Unauthorized

NS = "model-0123:bf16:nhd:p16:r0"
PAGE = 4096


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def replies(s: socket.socket) -> list[dict]:
    """Every reply until the manager closes the connection."""
    out = []
    while True:
        header = s.recv(4, socket.MSG_WAITALL)
        if len(header) < 4:
            return out
        (size,) = struct.unpack(">I", header)
        out.append(msgpack.unpackb(s.recv(size, socket.MSG_WAITALL), raw=False, strict_map_key=False))


def listening_tcp_inodes() -> dict[int, str]:
    """Socket inode -> local address (hex, as the kernel prints it) of every listening TCP socket."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    found[int(fields[9])] = fields[1]
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    monkeypatch.delenv("ORBITKV_AUTH_TOKEN_FILE", raising=False)
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    path.chmod(0o600)
    return path


def test_a_tcp_manager_with_a_token_lets_no_one_without_it_read_or_write(manager_factory, token_file, monkeypatch):
    m = manager_factory(addr=f"127.0.0.1:{free_port()}", extra=("--auth-token-file", str(token_file)))
    host, _, port = m.endpoint.rpartition(":")
    poison = page_hashes(NS, list(range(16)), 16)[0]
    # A writer without the token pipelines hello, reserve and commit: only the refusal comes back.
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            frame({"id": 0, "op": "hello", "args": {"version": PROTOCOL_VERSION}})
            + frame({"id": 1, "op": "reserve", "args": {"namespace": NS, "group": 0, "pages": [[poison, PAGE]]}})
            + frame({"id": 2, "op": "commit", "args": {"reservation": 1, "checksums": [0]}})
            + frame({"id": 3, "op": "lookup", "args": {"namespace": NS, "groups": {0: [poison]}}})
        )
        [refusal] = replies(s)
    assert refusal["ok"] is False and refusal["error"]["type"] == "Unauthorized"
    assert "requires the token of its --auth-token-file" in refusal["error"]["message"]
    with pytest.raises(Unauthorized, match="got no token"):
        CacheClient(m.endpoint)
    with pytest.raises(Unauthorized, match="got a wrong token"):
        CacheClient(m.endpoint, token="s3cret-tokem")
    assert issubclass(Unauthorized, ManagerUnavailable)  # to an engine: no cache, a miss

    async def refused_async() -> None:
        await AsyncCacheClient(m.endpoint).connect()

    with pytest.raises(Unauthorized):
        asyncio.run(refused_async())
    # With the token (given, or read from the file the environment names) everything works, and
    # the poisoned page was never there.
    with CacheClient(m.endpoint, token="s3cret-token") as c:
        assert c.lookup(NS, {0: [poison]})[0] == {"dram": [], "ssd": []}
        stats = c.stats()
        assert stats["bytes_written"]["dram"] == 0 and stats["reservations"] == 0
        assert stats["free_bytes"]["dram"] == 64 << 20
    monkeypatch.setenv("ORBITKV_AUTH_TOKEN_FILE", str(token_file))
    data = os.urandom(PAGE)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, [(poison, data)])
        rec = c.read_recovery(NS, 16, [(0, [poison])])
        assert rec is not None and bytes(c.verified(rec.pages[0][0])) == data
    monkeypatch.setenv("ORBITKV_AUTH_TOKEN_FILE", str(token_file.parent / "missing"))
    with pytest.raises(ManagerUnavailable, match="cannot read the auth token named by ORBITKV_AUTH_TOKEN_FILE"):
        CacheClient(m.endpoint)


def test_a_manager_refuses_to_listen_beyond_loopback_without_a_token(manager_factory, token_file):
    for addr in (f"0.0.0.0:{free_port()}", f"[::]:{free_port()}"):
        out = subprocess.run(
            [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", addr, "--pool-size", "8mb"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert f"error: --addr {addr} listens on" in out.stderr and "without --auth-token-file" in out.stderr
        assert "Traceback" not in out.stderr
    empty = token_file.parent / "empty-token"
    empty.write_text("\n")
    out = subprocess.run(
        [
            *(sys.executable, "-m", "cacheon_orbitkv.manager", "--pool-size", "8mb"),
            *("--addr", f"0.0.0.0:{free_port()}", "--auth-token-file", str(empty)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "is empty" in out.stderr
    # Loopback needs no token; a non-loopback address with one starts.
    for m in (
        manager_factory(addr=f"127.0.0.1:{free_port()}"),
        manager_factory(addr=f"localhost:{free_port()}"),
        manager_factory(addr=f"0.0.0.0:{free_port()}", extra=("--auth-token-file", str(token_file))),
    ):
        with CacheClient(m.endpoint, token="s3cret-token") as c:
            assert c.stats()["leases"] == 0


def test_a_unix_manager_opens_nothing_on_the_network_and_metrics_bind_loopback(manager_factory):
    plain = manager_factory()
    with CacheClient(plain.endpoint) as c:
        assert c.stats()["leases"] == 0
    assert not socket_inodes(plain.proc.pid) & set(listening_tcp_inodes())
    port = free_port()
    metered = manager_factory(extra=("--metrics-port", str(port)))
    listening = listening_tcp_inodes()
    [address] = [listening[i] for i in socket_inodes(metered.proc.pid) if i in listening]
    assert address == f"0100007F:{port:04X}"  # 127.0.0.1
    assert b"orbitkv_hits" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    port = free_port()
    everywhere = manager_factory(extra=("--metrics-port", str(port), "--metrics-addr", "0.0.0.0"))
    listening = listening_tcp_inodes()
    [address] = [listening[i] for i in socket_inodes(everywhere.proc.pid) if i in listening]
    assert address == f"00000000:{port:04X}"
