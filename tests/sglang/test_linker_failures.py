"""The cache never takes SGLang down: every manager-side failure is a miss or a recompute, with a
warning naming the cause, on SGLang's real pools and scheduler pieces with a real manager process.

Each case runs requests through SGLang's own match, admission, load, forward hand-off and insert
(tests/sglang/sglang_cache.py): a request served during a failure is computed in full (nothing
restored, its forward reads no prefix it did not write), and the linker's counters say which
path it took.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from cacheon_orbitkv import link as link_module
from cacheon_orbitkv.client import CacheClient
from cacheon_sglang import linker as orbit
from tests.sglang import sglang_cache as sc

IDS = list(range(100, 118))  # 18 tokens: SGLang looks up 16, four pages of 4


@pytest.fixture
def orbit_log() -> Iterator[list[logging.LogRecord]]:
    """The linker's log records (its logger is SGLang's, which need not propagate to the root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("sglang.cacheon.orbitkv")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def _computed_in_full(out: dict) -> bool:
    """SGLang ran the request without a restore and nothing failed."""
    return out["host_loaded"] == 0 and out["prefix_len"] == 0 and out["failed"] == []


def _assert_recomputed(sched: sc.Scheduler, rid: str, after_match=None) -> dict:
    out = sched.run(rid, IDS, after_match)
    assert _computed_in_full(out), out
    sched.flush()
    return out


# -- the arena -----------------------------------------------------------------------------------


def test_an_arena_gone_from_dev_shm_is_a_miss_with_one_warning(manager_factory, orbit_log):
    m = manager_factory()
    arenas = m.arenas()
    assert arenas
    for arena in arenas:  # /dev/shm not shared with the engine, or cleaned under the manager
        arena.unlink()
    fx = sc.build_mha(m.endpoint)
    sched = sc.Scheduler(fx)
    for rid in ("first", "again"):
        _assert_recomputed(sched, rid)
    warnings = _warnings(orbit_log)
    assert len(warnings) == 1, warnings
    assert "FileNotFoundError" in warnings[0] and arenas[0].name in warnings[0]
    stats = fx["linker"].stats
    assert stats["lookups"] == stats["loads"] == stats["offloads"] == 0
    assert m.proc.poll() is None  # the manager itself keeps running
    fx["linker"].close()


CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


@contextlib.contextmanager
def _as_another_user() -> Iterator[None]:
    """This thread without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: root then meets file modes as
    any other user does (the kernel's own permission check; capabilities are per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = ctypes.create_string_buffer(24)
    assert libc.capget(header, data) == 0, os.strerror(ctypes.get_errno())
    saved = data.raw
    effective = struct.unpack_from("I", saved, 0)[0] & ~((1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH))
    dropped = struct.pack("I", effective) + saved[4:]
    assert libc.capset(header, dropped) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        assert libc.capset(header, saved) == 0, os.strerror(ctypes.get_errno())


def test_an_arena_this_process_may_not_open_is_a_miss_with_one_warning(manager_factory, orbit_log):
    m = manager_factory()
    arenas = m.arenas()
    for arena in arenas:
        arena.chmod(0)
    fx = sc.build_mha(m.endpoint)
    sched = sc.Scheduler(fx)
    with _as_another_user():
        with pytest.raises(PermissionError):  # the precondition: this thread may not open the arena
            open(arenas[0], "rb").close()
        for rid in ("first", "again"):
            _assert_recomputed(sched, rid)
    warnings = _warnings(orbit_log)
    assert len(warnings) == 1, warnings
    assert "PermissionError" in warnings[0] and arenas[0].name in warnings[0]
    assert fx["linker"].stats["lookups"] == fx["linker"].stats["loads"] == 0
    fx["linker"].close()


# -- a hung manager ------------------------------------------------------------------------------


def test_a_hung_manager_is_a_miss_within_the_call_timeout_and_is_found_again(manager_factory, orbit_log, monkeypatch):
    monkeypatch.setattr(link_module, "RETRY_S", 0.3)
    m = manager_factory()
    fx = sc.build_mha(m.endpoint)
    linker: orbit.OrbitKVLinker = fx["linker"]
    linker.link.timeout, linker.lookup_link.timeout = 2.0, 0.5  # linker defaults: 30 s and 5 s
    sched = sc.Scheduler(fx)
    sched.run("cold", IDS)
    sched.flush()
    try:
        # Hung under a lookup: the lookup times out, a miss; the request is computed in full.
        m.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        _assert_recomputed(sched, "hung-lookup")
        assert time.monotonic() - started < 5
        m.proc.send_signal(signal.SIGCONT)
        time.sleep(0.4)
        assert sched.run("back", IDS)["host_loaded"] == 16
        sched.flush()
        # Hung between the lookup (a hit) and the lease: the lease times out, SGLang recomputes.
        found = []

        def stop(req):
            found.append(req.host_hit_length)
            m.proc.send_signal(signal.SIGSTOP)

        started = time.monotonic()
        _assert_recomputed(sched, "hung-lease", after_match=stop)
        assert found == [16] and time.monotonic() - started < 10
    finally:
        m.proc.send_signal(signal.SIGCONT)
    time.sleep(0.4)
    assert sched.run("found-again", IDS)["host_loaded"] == 16
    warnings = _warnings(orbit_log)
    assert warnings and all("timed out" in w or "reachable again" in w for w in warnings), warnings
    stats = linker.stats
    assert stats["pages_restored"] == 8 and stats["load_failures"] == 0 and stats["load_misses"] == 1
    linker.close()


# -- replies that are not the protocol -----------------------------------------------------------


def _frame(message: object) -> bytes:
    body = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _recv_frame(sock: socket.socket) -> bytes | None:
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            return None
        header += chunk
    (size,) = struct.unpack(">I", header)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return body


class _Server:
    """A unix socket server answering each connection with ``serve(client_socket)`` on a thread."""

    def __init__(self, path: Path, serve) -> None:
        self.endpoint = f"unix://{path}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            self.serve(conn)

    def close(self) -> None:
        self.sock.close()


def _relay(upstream_path: Path, rewrite):
    """A ``_Server`` handler relaying each request to a real manager and its reply, as
    ``rewrite(request, reply)`` returns it, back."""

    def serve(conn: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(str(upstream_path))
        with upstream:
            while (request := _recv_frame(conn)) is not None:
                message = msgpack.unpackb(request, raw=False, strict_map_key=False)
                upstream.sendall(_frame(request))
                reply = _recv_frame(upstream)
                if reply is None:
                    return
                conn.sendall(_frame(rewrite(message, reply)))

    return serve


GARBAGE_HELLOS = {
    "not-msgpack": b"\xc1\xc1\xc1\xc1",  # 0xc1 is never valid msgpack
    "wrong-shape": {"id": 1, "ok": True, "result": 5},  # a valid frame, not a hello
}


@pytest.mark.parametrize("reply", sorted(GARBAGE_HELLOS))
def test_a_socket_answering_garbage_is_a_miss_with_one_warning(manager_factory, sock_dir, orbit_log, reply):
    def serve(conn: socket.socket) -> None:
        while _recv_frame(conn) is not None:
            conn.sendall(_frame(GARBAGE_HELLOS[reply]))

    server = _Server(sock_dir / "garbage.sock", serve)
    fx = sc.build_mha(server.endpoint)
    sched = sc.Scheduler(fx)
    for rid in ("first", "again"):
        _assert_recomputed(sched, rid)
    warnings = _warnings(orbit_log)
    assert len(warnings) == 1, warnings
    assert {"not-msgpack": "ProtocolError", "wrong-shape": "TypeError"}[reply] in warnings[0]
    assert fx["linker"].stats["lookups"] == fx["linker"].stats["loads"] == 0
    fx["linker"].close()
    server.close()


def _cold_behind_proxy(m, sock_dir: Path, rewrite) -> tuple[_Server, orbit.OrbitKVLinker, sc.Scheduler]:
    """A linker on SGLang's pools reaching manager ``m`` through a proxy that may ``rewrite`` replies,
    after a cold run has saved the prompt's pages."""
    proxy = _Server(sock_dir / "proxy.sock", _relay(m.sock, rewrite))
    fx = sc.build_mha(proxy.endpoint)
    sched = sc.Scheduler(fx)
    sched.run("cold", IDS)
    sched.flush()
    return proxy, fx["linker"], sched


def test_a_manager_whose_replies_turn_to_garbage_is_a_miss_and_is_used_again(
    manager_factory, sock_dir, orbit_log, monkeypatch
):
    """A proxy in front of a real manager replaces the replies to chosen operations with a
    well-framed reply of the wrong shape."""
    monkeypatch.setattr(link_module, "RETRY_S", 0.2)
    m = manager_factory()
    garble: set[str] = set()

    def rewrite(message: dict, reply: bytes) -> bytes:
        if message["op"] in garble:
            return msgpack.packb({"id": message["id"], "ok": True, "result": "garbage"})
        return reply

    proxy, linker, sched = _cold_behind_proxy(m, sock_dir, rewrite)
    for op in ("lookup", "read_recovery"):
        garble.add(op)
        orbit_log.clear()
        _assert_recomputed(sched, f"garbled-{op}")
        warnings = _warnings(orbit_log)
        # The client checks a lookup's reply against the groups asked (a ProtocolError: nothing is held, the
        # connection is kept); a lease's garbage fails untyped in the client's reading of it, which the linker
        # takes as a malformed reply (the connection retired, and with it any lease the reply hid).
        expected = "lookup of groups [0] was answered with 'garbage'" if op == "lookup" else "malformed reply"
        assert warnings and all(expected in w for w in warnings), (op, warnings)
        garble.clear()
        time.sleep(0.3)
        assert sched.run(f"after-{op}", IDS)["host_loaded"] == 16, op
        sched.flush()
    stats = linker.stats
    assert stats["pages_restored"] == 8 and stats["load_failures"] == 0 and stats["load_misses"] == 1
    assert m.stats()["leases"] == 0
    linker.close()
    proxy.close()


# -- bytes that changed after the commit ---------------------------------------------------------


def test_a_page_corrupted_in_the_arena_after_commit_is_a_recompute(manager_factory, orbit_log):
    m = manager_factory()
    fx = sc.build_mha(m.endpoint)
    linker: orbit.OrbitKVLinker = fx["linker"]
    sched = sc.Scheduler(fx)
    sched.run("cold", IDS)
    sched.flush()
    hashes = [orbit.storage_hash(k, 0) for k in sc.storage_keys(IDS[:16], 4)]
    with CacheClient(m.endpoint) as client:
        recovery = client.read_recovery(linker.namespace, 16, [(0, hashes)])
        assert recovery is not None
        ref = recovery.pages[0][2]
        client.view[ref.offset + 8] ^= 0x01  # one bit of the third page
        client.release(recovery.lease)
    out = _assert_recomputed(sched, "warm")
    assert all(out["checks"].values())
    warnings = _warnings(orbit_log)
    assert len(warnings) == 1 and "1 page(s) failed their checksums" in warnings[0], warnings
    stats = linker.stats
    assert stats["loads"] == stats["load_failures"] == 1 and stats["pages_restored"] == 0
    assert m.stats()["leases"] == 0
    linker.close()


# -- lookups and payload work --------------------------------------------------------------------


def test_a_lookup_does_not_wait_behind_a_lease_in_flight(manager_factory, sock_dir):
    """A load's ``read_recovery`` is held at a proxy (a slow SSD promotion); a lookup meanwhile is
    answered at once, on the linker's own lookup connection."""
    m = manager_factory()
    held, go = threading.Event(), threading.Event()

    def rewrite(message: dict, reply: bytes) -> bytes:
        if message["op"] == "read_recovery":
            held.set()
            go.wait(10)
        return reply

    proxy, linker, sched = _cold_behind_proxy(m, sock_dir, rewrite)
    req = sched.new_req("warm", IDS)
    sched.match(req)
    assert req.host_hit_length == 16
    loading = threading.Thread(target=sched.admit, args=(req,))
    loading.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        found = linker.lookup("probe", [PoolTransfer(name=PoolName.KV, keys=sc.storage_keys(IDS[:16], 4))])
        waited = time.monotonic() - started
    finally:
        go.set()
        loading.join(30)
    assert found == [1, 2, 3, 4] and waited < 1.0, (found, waited)
    assert req.host_loaded_length == 16 and linker.stats["pages_restored"] == 4
    linker.close()
    proxy.close()
