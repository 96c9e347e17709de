"""The cache manager as users run it: a real process, real sockets, shared memory and SSD files."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cacheon_orbitkv import client as client_module
from cacheon_orbitkv.client import CacheClient, StorePart, page_hashes
from cacheon_orbitkv.wire import (
    PROTOCOL_VERSION,
    BadRequest,
    ManagerUnavailable,
    ProtocolError,
    UnknownLease,
    copy_with_checksum,
    encode,
    lookup_work,
    parse_size,
)

NS = "model-0123:bf16:nhd:p16:r0"
PAGE = 64 << 10


def payloads(seed: int, n: int, size: int = PAGE) -> list[bytes]:
    return [
        os.urandom(8) * (size // 8)
        if seed < 0
        else bytes([(seed * 31 + i * 7 + j) % 251 for j in range(256)]) * (size // 256)
        for i in range(n)
    ]


def test_sizes_parse_with_suffixes():
    assert parse_size("8gb") == 8 << 30 and parse_size("512MB") == 512 << 20 and parse_size("64kb") == 64 << 10
    assert parse_size("4096") == 4096 and parse_size("1tb") == 1 << 40 and parse_size("1.5TB") == 3 << 39
    for bad in ("lots", "tb", "1pb", "-1gb", "0", "inf", "nan", "infgb"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_size(bad)


def test_socket_is_private_and_the_arena_is_shared_memory(manager_factory):
    m = manager_factory()
    assert stat.S_IMODE(os.stat(m.sock).st_mode) == 0o600
    with CacheClient(m.endpoint) as c:
        assert c.info["arena"].startswith("/dev/shm/")
        assert stat.S_IMODE(os.stat(c.info["arena"]).st_mode) == 0o600


def test_store_lookup_recover_release_round_trip(manager_factory):
    m = manager_factory()
    tokens = list(range(16 * 8))
    hashes = page_hashes(NS, tokens, 16)
    data = payloads(1, 8)
    with CacheClient(m.endpoint) as c:
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 8 * PAGE
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 0  # equal prefixes share pages
        before = c.stats()
        assert c.lookup(NS, {0: hashes, 1: hashes[:2]}) == {
            0: {"dram": list(range(8)), "ssd": []},
            1: {"dram": [], "ssd": []},
        }
        assert c.stats()["bytes_read"] == before["bytes_read"]  # discovery read no payload
        assert c.stats()["leases"] == 0 and c.stats()["reservations"] == 0  # and reserved nothing
        # A changed identity always misses.
        assert c.lookup("model-0123:fp8:nhd:p16:r0", {0: hashes}) == {0: {"dram": [], "ssd": []}}
        rec = c.read_recovery(NS, 128, [(0, hashes[2:6])])
        assert rec is not None
        assert [bytes(c.verified(r)) for r in rec.pages[0]] == data[2:6]
        assert c.stats()["bytes_read"]["dram"] - before["bytes_read"]["dram"] == 4 * PAGE  # only the range
        assert c.stats()["leases"] == 1
        c.release(rec.lease)
        assert c.stats()["leases"] == 0
        with pytest.raises(UnknownLease, match=f"lease {rec.lease} is not held"):
            c.release(rec.lease)
        # An incomplete range is a miss that holds nothing.
        other = page_hashes(NS, list(range(500, 500 + 32)), 16)
        assert c.read_recovery(NS, 128, [(0, hashes[:2]), (0, [*hashes[2:3], other[0]])]) is None
        assert c.stats()["leases"] == 0


def test_a_release_sent_without_waiting_takes_effect_before_the_next_request(manager_factory, caplog):
    m = manager_factory(pool="2mb")
    hashes = page_hashes(NS, list(range(16 * 4)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, payloads(3, 4), strict=True)))
        for _ in range(3):  # replies left unread pile up in order, and are read in order
            rec = c.read_recovery(NS, 64, [(0, hashes)])
            assert rec is not None
            c.release(rec.lease, wait=False)
        # The manager answers the connection in order: the releases ran before this lookup and stats.
        assert c.lookup(NS, {0: hashes})[0]["dram"] == [0, 1, 2, 3]
        assert c.stats()["leases"] == 0
        # Released pages can be evicted: a store of the pool's size again succeeds and evicts them.
        other = page_hashes(NS, list(range(10**6, 10**6 + 16 * 32)), 16)
        assert c.store(NS, 0, list(zip(other, payloads(4, 32), strict=True))) == 32 * PAGE
        assert c.lookup(NS, {0: hashes})[0]["dram"] == []
        # A release that fails when nobody waits is one warning at the next request; the connection
        # stays in step and usable.
        caplog.clear()
        c.release(rec.lease, wait=False)
        assert c.stats()["leases"] == 0
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "release" in warnings[0] and "UnknownLease" in warnings[0], warnings
        assert f"lease {rec.lease} is not held" in warnings[0]
        assert c.lookup(NS, {0: other[:2]})[0]["dram"] == [0, 1]


def test_releases_sent_back_to_back_wait_for_no_reply_until_max_unread_are_due(manager_factory, monkeypatch):
    """A restore after a restore releases without reading the release before it: replies no caller waits
    for are read only once MAX_UNREAD are due (one each time past it), and all of them before any reply a
    caller waits for."""
    m = manager_factory(pool="2mb")
    hashes = page_hashes(NS, list(range(16 * 4)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, payloads(5, 4), strict=True)))
        count = client_module.MAX_UNREAD + 6
        leases = [c.read_recovery(NS, 64, [(0, hashes)]).lease for _ in range(count)]
        read: list[int] = []
        shipped = client_module._Exchange.receive
        monkeypatch.setattr(client_module._Exchange, "receive", lambda self: read.append(1) or shipped(self))
        for lease in leases:
            c.release(lease, wait=False)
        assert len(read) == count - client_module.MAX_UNREAD
        assert c.stats()["leases"] == 0  # every release ran before the stats, its reply read first
        assert len(read) == count + 1 and not c._unread


def _worker(endpoint: str, seed: int, rounds: int, out: mp.Queue) -> None:
    try:
        with CacheClient(endpoint, name=f"worker-{seed}") as c:
            verified = misses = 0
            for r in range(rounds):
                tokens = [seed * 100_000 + r * 1000 + i for i in range(16 * 6)]
                hashes = page_hashes(NS, tokens, 16)
                data = [bytes([(seed + r + i) % 256]) * PAGE for i in range(6)]
                c.store(NS, 0, list(zip(hashes, data, strict=True)))
                found = c.lookup(NS, {0: hashes})[0]
                rec = c.read_recovery(NS, 96, [(0, hashes)])
                if rec is None:
                    misses += 1
                    continue
                for ref, expected in zip(rec.pages[0], data, strict=True):
                    assert bytes(c.verified(ref)) == expected, "wrong bytes served"
                    verified += 1
                c.release(rec.lease)
                assert len(found["dram"]) + len(found["ssd"]) <= 6
            out.put(("ok", seed, verified, misses))
    except Exception as exc:  # reported to the parent, which fails the test
        out.put(("error", seed, repr(exc), 0))


def test_concurrent_clients_under_eviction_pressure_read_back_exact_bytes(manager_factory):
    m = manager_factory(pool="4mb", ssd=True)  # 64 pages of DRAM for 4 workers x 20 rounds x 6 pages
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(m.endpoint, seed, 20, out)) for seed in range(4)]
    for w in workers:
        w.start()
    results = [out.get(timeout=300) for _ in workers]
    for w in workers:
        w.join(60)
    assert all(r[0] == "ok" for r in results), results
    assert sum(r[2] for r in results) >= 4 * 20 * 6 * 0.9  # nearly every round recovered whole
    with CacheClient(m.endpoint) as c:
        stats = c.stats()
    assert stats["evictions"] > 0 and stats["bytes_written"]["ssd"] > 0
    assert stats["leases"] == 0 and stats["reservations"] == 0


def _hold_and_wait(endpoint: str, ready: mp.Event) -> None:
    c = CacheClient(endpoint)
    hashes = page_hashes(NS, list(range(64)), 16)
    c.store(NS, 0, [(h, b"x" * PAGE) for h in hashes])
    c.read_recovery(NS, 64, [(0, hashes)])  # a lease
    c.call("reserve", namespace=NS, group=5, pages=[[b"pending-page", PAGE]])  # an uncommitted reservation
    ready.set()
    time.sleep(600)


def test_a_client_killed_holding_leases_and_reservations_is_reclaimed(manager_factory):
    m = manager_factory()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_and_wait, args=(m.endpoint, ready))
    child.start()
    assert ready.wait(60)
    with CacheClient(m.endpoint) as c:
        held = c.stats()
        assert held["leases"] == 1 and held["reservations"] == 1
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (c.stats()["leases"] or c.stats()["reservations"]):
            time.sleep(0.05)
        after = c.stats()
        assert after["leases"] == 0 and after["reservations"] == 0
        assert after["free_bytes"]["dram"] == held["free_bytes"]["dram"] + PAGE  # the reserved extent came back


def test_uncommitted_reservations_expire(manager_factory):
    m = manager_factory(extra=("--reserve-ttl", "0.5"))
    with CacheClient(m.endpoint) as c:
        c.call("reserve", namespace=NS, group=0, pages=[[b"never-committed", PAGE]])
        assert c.stats()["reservations"] == 1
        time.sleep(1.6)
        assert c.stats()["reservations"] == 0


def test_a_killed_manager_gives_clean_errors_and_a_restart_serves_committed_ssd_pages(manager_factory, tmp_path):
    m = manager_factory(pool="1mb", ssd=True)  # 16 pages of DRAM: most of 40 pages go to SSD
    hashes = page_hashes(NS, list(range(16 * 40)), 16)
    data = [bytes([i]) * PAGE for i in range(40)]
    c = CacheClient(m.endpoint)
    c.store(NS, 0, list(zip(hashes, data, strict=True)))
    c.call("reserve", namespace=NS, group=0, pages=[[b"half-written", PAGE]])  # never committed
    on_ssd = c.lookup(NS, {0: hashes})[0]["ssd"]
    assert len(on_ssd) >= 20
    m.kill()
    with pytest.raises(ManagerUnavailable, match="went away"):
        c.lookup(NS, {0: hashes})
    [stale] = m.arenas()  # a killed manager cannot unlink its arena...
    old = time.time() - 60
    os.utime(stale, (old, old))
    restarted = manager_factory(pool="1mb", ssd=True)
    assert not stale.exists()  # ...the next manager removes it (no one holds its lock)
    assert restarted.arenas()  # and keeps its own
    assert restarted.ssd_path == m.ssd_path
    with CacheClient(restarted.endpoint) as fresh:
        found = fresh.lookup(NS, {0: [*hashes, b"half-written"]})[0]
        assert found["ssd"] == on_ssd and found["dram"] == []  # DRAM died with the process
        rec = fresh.read_recovery(NS, 0, [(0, [hashes[i] for i in on_ssd[:5]])])
        assert rec is not None
        assert [bytes(fresh.verified(r)) for r in rec.pages[0]] == [data[i] for i in on_ssd[:5]]
        assert fresh.stats()["bytes_read"]["ssd"] == 5 * PAGE  # exactly the selected pages came off SSD


def ssd_entries(ssd_path) -> dict[bytes, tuple[int, int]]:
    """Page hash -> (offset, length) of the pages an SSD tier's index names (header, then records)."""
    entries: dict[bytes, tuple[int, int]] = {}
    with open(f"{ssd_path}.index", "rb") as fh:
        records = msgpack.Unpacker(fh, raw=False)
        assert next(records) == ["orbitkv-ssd", 2, "mix64"]
        for record in records:
            if record[0] == "put":
                entries[bytes(record[3])] = (record[4], record[5])
            else:
                entries.pop(bytes(record[3]), None)
    return entries


def plain_sum64(data: bytes) -> int:
    """The checksum before mix64: the wrapping sum of the 64-bit words (order-blind)."""
    return sum(struct.unpack(f"<{len(data) // 8}Q", data)) % (1 << 64)


def test_ssd_pages_tampered_keeping_their_plain_sum_are_caught_counted_and_dropped(manager_factory):
    m = manager_factory(pool="1mb", ssd=True)
    hashes = page_hashes(NS, list(range(16 * 40)), 16)
    data = [os.urandom(PAGE) for _ in hashes]
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, data, strict=True)))
        on_ssd = c.lookup(NS, {0: hashes})[0]["ssd"]
    m.stop()
    entries = ssd_entries(m.ssd_path)
    victims = on_ssd[:3]
    with open(m.ssd_path, "r+b") as fh:
        for i in victims:
            offset, length = entries[hashes[i]]
            fh.seek(offset)
            page = bytearray(fh.read(length))
            page[8:16], page[800:808] = page[800:808], page[8:16]  # two words swapped: the same plain sum
            assert plain_sum64(bytes(page)) == plain_sum64(data[i]) and bytes(page) != data[i]
            fh.seek(offset)
            fh.write(page)
    restarted = manager_factory(pool="1mb", ssd=True)
    with CacheClient(restarted.endpoint) as c:
        for n, i in enumerate(victims, 1):
            assert c.read_recovery(NS, 0, [(0, [hashes[i]])]) is None
            assert c.stats()["corrupt"] == n and c.stats()["leases"] == 0
        assert c.lookup(NS, {0: [hashes[i] for i in victims]})[0] == {"dram": [], "ssd": []}  # dropped
        # An untouched neighbour is served, exact.
        good = next(i for i in on_ssd if i not in victims)
        rec = c.read_recovery(NS, 0, [(0, [hashes[good]])])
        assert rec is not None and bytes(c.verified(rec.pages[0][0])) == data[good]
        assert c.stats()["corrupt"] == len(victims)


def _raw(endpoint: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(endpoint[len("unix://") :])
    s.settimeout(10)
    return s


def _reply(s: socket.socket) -> dict | None:
    header = s.recv(4, socket.MSG_WAITALL)
    if len(header) < 4:
        return None  # the manager closed the connection
    (size,) = struct.unpack(">I", header)
    return msgpack.unpackb(s.recv(size, socket.MSG_WAITALL), raw=False, strict_map_key=False)


frames = st.one_of(
    st.binary(max_size=64),  # not msgpack, or the wrong msgpack
    st.builds(
        lambda v: msgpack.packb(v, use_bin_type=True),
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
            lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
            max_leaves=12,
        ),
    ),
    st.builds(
        lambda op, args: msgpack.packb({"id": 1, "op": op, "args": args}, use_bin_type=True),
        st.sampled_from(["lookup", "reserve", "commit", "read_recovery", "release", "abort", "nope"]),
        st.dictionaries(
            st.sampled_from(
                ["namespace", "group", "groups", "pages", "ranges", "lease", "reservation", "checksums", "boundary"]
            ),
            st.none() | st.integers(-5, 5) | st.text(max_size=5) | st.lists(st.binary(max_size=4), max_size=3),
            max_size=4,
        ),
    ),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames, greet=st.booleans())
def test_malformed_frames_get_an_error_or_a_closed_connection_and_others_keep_being_served(
    manager_factory, frame, greet
):
    m = getattr(test_malformed_frames_get_an_error_or_a_closed_connection_and_others_keep_being_served, "m", None)
    if m is None or m.proc.poll() is not None:
        m = manager_factory()
        test_malformed_frames_get_an_error_or_a_closed_connection_and_others_keep_being_served.m = m
    s = _raw(m.endpoint)
    if greet:
        s.sendall(_frame({"id": 0, "op": "hello", "args": {"version": PROTOCOL_VERSION}}))
        assert _reply(s)["ok"]
    s.sendall(struct.pack(">I", len(frame)) + frame)
    reply = _reply(s)
    if reply is not None:
        # An error reply, or (after hello) a frame that happened to be a well-formed request.
        assert reply["ok"] is False or greet, reply
        if reply["ok"] is False:
            assert reply["error"]["type"] in {"ProtocolError", "BadRequest", "UnknownLease", "PoolFull"}
    s.close()
    with CacheClient(m.endpoint) as c:  # the manager still serves everyone else
        assert m.proc.poll() is None
        assert set(c.stats()) >= {"bytes_read", "leases", "reservations"}


def _frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def test_oversized_and_out_of_protocol_frames(manager_factory):
    m = manager_factory()
    s = _raw(m.endpoint)
    s.sendall(_frame({"id": 1, "op": "stats", "args": {}}))  # before hello
    reply = _reply(s)
    assert reply["error"]["type"] == "ProtocolError" and "hello" in reply["error"]["message"]
    assert _reply(s) is None  # and the connection is closed
    s = _raw(m.endpoint)
    s.sendall(_frame({"id": 0, "op": "hello", "args": {"version": 99}}))
    assert _reply(s)["error"]["type"] == "ProtocolError"
    s = _raw(m.endpoint)
    s.sendall(_frame({"id": 0, "op": "hello", "args": {"version": PROTOCOL_VERSION}}))
    assert _reply(s)["ok"]
    s.sendall(struct.pack(">I", 1 << 30))  # a 1 GiB frame announced
    reply = _reply(s)
    assert reply["error"]["type"] == "ProtocolError" and "exceeds" in reply["error"]["message"]
    assert _reply(s) is None
    with CacheClient(m.endpoint) as c:
        with pytest.raises(Exception, match="unknown op 'drop_everything'"):
            c.call("drop_everything")
        with pytest.raises(Exception, match="namespace must be a non-empty string"):
            c.call("lookup", namespace="", groups={})
        assert c.stats()["leases"] == 0


def test_metrics_are_exported(manager_factory, tmp_path):
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    m = manager_factory(extra=("--metrics-port", str(port)))
    with CacheClient(m.endpoint) as c:
        hashes = page_hashes(NS, list(range(32)), 16)
        c.store(NS, 0, [(h, b"m" * PAGE) for h in hashes])
        rec = c.read_recovery(NS, 32, [(0, hashes)])
        c.release(rec.lease)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'orbitkv_hits_total{group="0",tier="dram"} 2.0' in text
    assert 'orbitkv_bytes_in_total{tier="dram"}' in text
    assert "orbitkv_request_seconds_bucket" in text
    assert ProtocolError.type == "ProtocolError"


def test_embedded_manager_and_the_batched_async_client(sock_dir):
    import asyncio

    from cacheon_orbitkv.client import AsyncCacheClient
    from cacheon_orbitkv.manager import EmbeddedManager

    endpoint = f"unix://{sock_dir / 'embedded.sock'}"
    with EmbeddedManager(endpoint, 8 << 20) as embedded:
        hashes = page_hashes(NS, list(range(16 * 4)), 16)
        with CacheClient(endpoint) as c:
            c.store(NS, 3, [(h, b"e" * PAGE) for h in hashes])

        async def batched():
            client = await AsyncCacheClient(endpoint).connect()
            try:
                return await client.lookup_many(NS, [{3: hashes[:k]} for k in range(1, 5)])
            finally:
                await client.close()

        results = asyncio.run(batched())
        assert [len(r[3]["dram"]) for r in results] == [1, 2, 3, 4]
        assert embedded.manager.op_stats(0, {})["pages"]["dram"] == 4


def test_unreleased_leases_expire(manager_factory):
    m = manager_factory(extra=("--lease-ttl", "0.5"))
    hashes = page_hashes(NS, list(range(32)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, [(h, b"l" * PAGE) for h in hashes])
        rec = c.read_recovery(NS, 32, [(0, hashes)])
        assert rec is not None and c.stats()["leases"] == 1
        time.sleep(1.6)
        assert c.stats()["leases"] == 0
        with pytest.raises(UnknownLease):
            c.release(rec.lease)


def test_namespaces_name_every_part_of_the_identity():
    from cacheon_orbitkv.client import make_namespace

    ns = make_namespace("0123abcd", "bfloat16", "nhd", 16, 0)
    assert ns == "0123abcd:bfloat16:nhd:p16:r0"
    assert page_hashes(ns, list(range(32)), 16) != page_hashes(
        make_namespace("0123abcd", "bfloat16", "nhd", 16, 1), list(range(32)), 16
    )
    # Equal prefixes share pages: the first page's hash does not depend on later tokens.
    assert page_hashes(ns, list(range(32)), 16)[0] == page_hashes(ns, [*range(16), *range(99, 115)], 16)[0]
    with pytest.raises(ValueError, match="dtype 'bf:16'"):
        make_namespace("0123abcd", "bf:16", "nhd", 16, 0)


def test_a_socket_path_too_long_to_bind_is_refused_before_the_pool_exists(sock_dir):
    long_path = sock_dir / ("s" * 120 + ".sock")
    out = subprocess.run(
        [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", f"unix://{long_path}", "--pool-size", "8mb"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "over the kernel limit of 107" in out.stderr and "Traceback" not in out.stderr
    assert "arena" not in out.stderr  # refused before the shared-memory pool was created
    with pytest.raises(ValueError, match="over the kernel limit"):
        CacheClient(f"unix://{long_path}")


@pytest.mark.parametrize("loop", [None, "uvloop", "asyncio"])
def test_the_manager_serves_stores_recoveries_and_an_orderly_stop_on_each_event_loop(manager_factory, loop):
    m = manager_factory(ssd=True, extra=() if loop is None else ("--event-loop", loop))
    data = payloads(5, 6)
    hashes = page_hashes(NS, list(range(6 * 16)), 16)
    with CacheClient(m.endpoint) as c:
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 6 * PAGE
        assert c.lookup(NS, {0: hashes})[0]["dram"] == list(range(6))
        rec = c.read_recovery(NS, 0, [(0, hashes)])
        assert rec is not None
        assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == data
        c.release(rec.lease)
        # SIGTERM through the loop's signal handler, DRAM pages written to SSD first, with this
        # client still connected (an engine that outlives its manager): a quiet stop, no traceback.
        assert m.stop() == 0
        with pytest.raises(ManagerUnavailable):
            c.stats()
    log = m.log.read_text()
    assert f"loop {loop or 'asyncio'}" in log  # asyncio unless asked for uvloop
    assert "wrote 6 DRAM pages to the SSD tier" in log
    assert "Traceback" not in log and " ERROR " not in log, log


def test_asking_for_uvloop_where_it_cannot_be_imported_stops_with_one_line(sock_dir, tmp_path):
    (tmp_path / "uvloop.py").write_text("raise ImportError('no uvloop on this machine')\n")  # shadows the real one
    args = ["--addr", f"unix://{sock_dir / 'u.sock'}", "--pool-size", "8mb", "--event-loop", "uvloop"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cacheon_orbitkv.manager", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "error: --event-loop uvloop: no uvloop on this machine (pip install uvloop)" in stderr
    assert "Traceback" not in stderr
    assert not list(Path("/dev/shm").glob(f"orbitkv-{proc.pid}-*"))  # refused before the pool existed


def test_the_arena_sweep_removes_only_unlocked_old_arenas(manager_factory, tmp_path):
    import fcntl

    from cacheon_orbitkv.manager import sweep_stale_arenas

    live = manager_factory()
    [live_arena] = live.arenas()
    old = time.time() - 60
    os.utime(live_arena, (old, old))
    shm = tmp_path / "shm"
    shm.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs: the creator of the dead arena
    dead = shm / f"orbitkv-{gone.pid}-dead"
    young = shm / f"orbitkv-{gone.pid}-young"
    held = shm / f"orbitkv-{gone.pid}-held"
    running = shm / f"orbitkv-{os.getpid()}-unlocked"  # a running creator that took no lock
    other = shm / "unrelated-file"
    for f in (dead, young, held, other, running):
        f.write_bytes(b"x" * 4096)
    for f in (dead, held, other, running):
        os.utime(f, (old, old))
    with open(held, "rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert sweep_stale_arenas(str(shm)) == [str(dead)]
    assert young.exists() and held.exists() and other.exists() and running.exists() and not dead.exists()
    assert str(live_arena) not in sweep_stale_arenas("/dev/shm")  # a running manager holds its lock
    assert live_arena.exists()
    with CacheClient(live.endpoint) as c:
        assert c.stats()["leases"] == 0


def test_a_hung_manager_times_a_call_out_and_the_connection_is_not_reused(manager_factory):
    m = manager_factory()
    client = CacheClient(m.endpoint, timeout=0.5)
    assert client.stats()["leases"] == 0
    assert m.proc is not None
    m.proc.send_signal(signal.SIGSTOP)  # alive, accepting nothing: a hung manager
    try:
        started = time.monotonic()
        with pytest.raises(ManagerUnavailable, match="timed out"):
            client.stats()
        assert time.monotonic() - started < 5
        # A late reply could not be told from the next one: the connection stays closed.
        with pytest.raises(ManagerUnavailable, match="is closed"):
            client.stats()
    finally:
        m.proc.send_signal(signal.SIGCONT)
    with CacheClient(m.endpoint, timeout=5) as fresh:
        assert fresh.stats()["leases"] == 0
    client.close()


def test_a_commit_with_one_bad_checksum_indexes_nothing_and_its_expiry_frees_only_its_own_extents(manager_factory):
    m = manager_factory(extra=("--reserve-ttl", "0.5"))
    hashes = page_hashes(NS, list(range(16 * 3)), 16)
    data = payloads(-1, 3)
    with CacheClient(m.endpoint) as c:
        empty = c.stats()["free_bytes"]["dram"]
        rid, offsets = c.reserve(NS, 0, [(h, PAGE) for h in hashes])
        for offset, payload in zip(offsets, data, strict=True):
            c.view[offset : offset + PAGE] = payload
        sums = [c.checksum_of(o, PAGE) for o in offsets]
        for bad, rule in (("x", "'x'"), (1.5, "1.5"), (-1, "-1"), (None, "None")):
            with pytest.raises(
                BadRequest, match=rf"checksum of page 2 must be an integer in \[0, 2\*\*64\), got {rule}"
            ):
                c.commit(rid, [*sums[:2], bad])
            assert c.lookup(NS, {0: hashes})[0] == {"dram": [], "ssd": []}  # not even the good ones
            assert c.stats()["reservations"] == 1
        time.sleep(1.6)  # the reservation expires: its extents, and only those, come back
        assert c.stats()["reservations"] == 0 and c.stats()["free_bytes"]["dram"] == empty
        assert c.lookup(NS, {0: hashes})[0] == {"dram": [], "ssd": []}
        with pytest.raises(BadRequest, match=f"reservation {rid} is not held"):
            c.commit(rid, sums)
        # A fresh reservation committed whole serves exact bytes.
        rid, offsets = c.reserve(NS, 0, [(h, PAGE) for h in hashes])
        for offset, payload in zip(offsets, data, strict=True):
            c.view[offset : offset + PAGE] = payload
        assert c.commit(rid, [c.checksum_of(o, PAGE) for o in offsets]) == 3 * PAGE
        rec = c.read_recovery(NS, 48, [(0, hashes)])
        assert rec is not None and [bytes(c.verified(r)) for r in rec.pages[0]] == data


def test_a_page_keeps_its_layout_tag_in_dram_and_across_a_restart_on_ssd(manager_factory):
    m = manager_factory(pool="1mb", ssd=True)
    hashes = page_hashes(NS, list(range(16 * 24)), 16)
    data = payloads(-1, 24)
    tag = "vllm:nhd:bf16:" + "é" * 57  # 128 UTF-8 bytes, the most a tag may have
    assert len(tag.encode()) == 128
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes[:20], data[:20], strict=True)), tag=tag)
        c.store(NS, 0, list(zip(hashes[20:], data[20:], strict=True)))  # no tag: ""
        for bad in (tag + "x", 7):
            with pytest.raises(BadRequest, match="tag must be a string of at most 128 UTF-8 bytes"):
                c.call("reserve", namespace=NS, group=0, pages=[[b"another-page", PAGE]], tag=bad)
        found = c.lookup(NS, {0: hashes})[0]
        assert found["ssd"] and found["dram"]
        rec = c.read_recovery(NS, 0, [(0, hashes[18:22])])
        assert rec is not None and [r.tag for r in rec.pages[0]] == [tag, tag, "", ""]
        c.release(rec.lease)
    m.stop()
    restarted = manager_factory(pool="1mb", ssd=True)
    with CacheClient(restarted.endpoint) as c:
        rec = c.read_recovery(NS, 0, [(0, hashes[:2])])
        assert rec is not None
        assert [(r.tag, bytes(c.verified(r))) for r in rec.pages[0]] == [(tag, data[0]), (tag, data[1])]


def _mostly_on_ssd(manager_factory):
    """A manager holding 128 pages of 1 MiB, most of them only on SSD, flushed to disk."""
    m = manager_factory(pool="48mb", ssd=True, ssd_capacity="256mb")
    hashes = page_hashes(NS, list(range(16 * 128)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, [(h, os.urandom(1 << 20)) for h in hashes])
        on_ssd = c.lookup(NS, {0: hashes})[0]["ssd"]
    assert len(on_ssd) >= 80
    time.sleep(1)  # the sweeper has flushed the SSD file: its pages can leave the page cache
    return m, hashes, on_ssd


def _drop_from_page_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # promotions now read the disk
    finally:
        os.close(fd)


def test_lookups_are_answered_while_another_connection_promotes_pages_from_ssd(manager_factory):
    import threading

    m, hashes, on_ssd = _mostly_on_ssd(manager_factory)
    witnessed = 0
    with CacheClient(m.endpoint) as reader, CacheClient(m.endpoint) as looker:
        for attempt in range(4):
            _drop_from_page_cache(m.ssd_path)
            wanted = [hashes[i] for i in on_ssd[attempt * 20 : attempt * 20 + 20]]
            done = threading.Event()
            result: list = []

            def recover(wanted=wanted, done=done, result=result) -> None:
                try:
                    result.append(reader.read_recovery(NS, 0, [(0, wanted)]))
                finally:
                    done.set()

            worker = threading.Thread(target=recover)
            worker.start()
            while not done.is_set():
                if looker.stats()["promoting"]:
                    found = looker.lookup(NS, {0: hashes[:8]})[0]
                    assert len(found["dram"]) + len(found["ssd"]) == 8
                    if looker.stats()["promoting"] and not done.is_set():
                        witnessed += 1  # a lookup answered in the middle of the promotion
            worker.join()
            [rec] = result
            assert rec is not None
            reader.release(rec.lease)
            if witnessed:
                break
    assert witnessed, "no lookup was answered while another connection read pages from SSD"


def test_one_connection_answers_lookups_while_its_own_read_recovery_promotes_from_ssd(manager_factory):
    import asyncio

    from cacheon_orbitkv.client import AsyncCacheClient

    m, hashes, on_ssd = _mostly_on_ssd(manager_factory)

    async def overlapped() -> int:
        client = await AsyncCacheClient(m.endpoint).connect()
        witnessed = 0
        try:
            for attempt in range(4):
                _drop_from_page_cache(m.ssd_path)
                wanted = [hashes[i] for i in on_ssd[attempt * 20 : attempt * 20 + 20]]
                recovery = asyncio.create_task(
                    client.call("read_recovery", namespace=NS, boundary=0, ranges=[[0, wanted]])
                )
                while not recovery.done():
                    # On a connection served one request at a time, these would wait for the
                    # recovery, and then nothing would be promoting any more.
                    if (await client.call("stats"))["promoting"]:
                        found = await client.call("lookup", namespace=NS, groups={0: hashes[:8]})
                        assert len(found[0]["dram"]) + len(found[0]["ssd"]) == 8
                        witnessed += not recovery.done()
                reply = await recovery
                assert reply["hit"]
                await client.call("release", lease=reply["lease"])
                if witnessed:
                    break
        finally:
            await client.close()
        return witnessed

    assert asyncio.run(overlapped()), "no lookup was answered while the same connection's recovery read SSD"


def test_a_reservation_larger_than_the_pool_is_refused_before_it_evicts_anything(manager_factory):
    m = manager_factory(pool="1mb")
    hashes = page_hashes(NS, list(range(16 * 16)), 16)
    data = payloads(-1, 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, data, strict=True)))  # the pool is full
        too_big = "a reservation of 1 pages needs 1052672 bytes, more than the pool of 1048576 bytes holds"
        with pytest.raises(BadRequest, match=too_big):
            c.reserve(NS, 1, [(b"too-big", (1 << 20) + 1)])
        with pytest.raises(BadRequest, match="a reservation of 17 pages needs"):
            c.reserve(NS, 1, [(bytes([i]) * 8, PAGE) for i in range(17)])
        assert c.lookup(NS, {0: hashes})[0]["dram"] == list(range(16))  # nothing was evicted for them
        assert c.stats()["evictions"] == 0 and c.stats()["reservations"] == 0
        # Pages already cached need no room: reserving them again is fine however many they are.
        rid, offsets = c.reserve(NS, 0, [(h, PAGE) for h in hashes] * 2)
        assert offsets == [None] * 32
        c.abort(rid)


def test_a_reservation_on_a_full_pool_evicts_the_oldest_but_its_own_cached_pages_then_takes_one_extent(
    manager_factory,
):
    # A full pool of 16 pages stored four at a time; a reservation of the oldest page (cached when it
    # asks) and five new ones evicts the next five oldest, which coalesce into one extent for the new
    # pages; the page it asks to keep stays (no gap), and every page still cached keeps its bytes.
    m = manager_factory(pool="1mb")  # 16 extents of PAGE
    hashes = page_hashes(NS, list(range(16 * 21)), 16)
    data = payloads(9, 21)
    with CacheClient(m.endpoint) as c:
        for i in range(0, 16, 4):
            c.store(NS, 0, list(zip(hashes[i : i + 4], data[i : i + 4], strict=True)))
        wanted = [0, *range(16, 21)]
        rid, offsets = c.reserve(NS, 0, [(hashes[i], PAGE) for i in wanted])
        assert offsets == [None] + [i * PAGE for i in range(1, 6)]  # pages 1-5's extents, one piece
        assert c.stats()["evictions"] == 5
        for offset, i in zip(offsets[1:], wanted[1:], strict=True):
            c.view[offset : offset + PAGE] = data[i]
        sums = [None] + [c.checksum_of(offset, PAGE) for offset in offsets[1:]]
        assert c.commit(rid, sums) == 5 * PAGE
        assert c.lookup(NS, {0: hashes[:6]})[0]["dram"] == [0]
        kept = [0, *range(6, 21)]
        rec = c.read_recovery(NS, 0, [(0, [hashes[i] for i in kept])])
        assert rec is not None
        assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == [data[i] for i in kept]
        c.release(rec.lease)


def test_a_reservation_that_fits_only_by_evicting_its_own_cached_pages_is_refused_before_it_evicts(
    manager_factory,
):
    # A full pool of 16 pages; keeping the cached page it names and writing 16 new ones needs 17: refused
    # before anything is evicted (evicting the named page would leave a gap, evicting the rest in vain).
    m = manager_factory(pool="1mb")
    hashes = page_hashes(NS, list(range(16 * 32)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes[:16], payloads(10, 16), strict=True)))
        besides = f"needs {16 * PAGE} bytes besides its {PAGE} bytes of pages cached"
        with pytest.raises(BadRequest, match=besides):
            c.reserve(NS, 0, [(h, PAGE) for h in [hashes[0], *hashes[16:]]])
        assert c.stats()["evictions"] == 0 and c.stats()["reservations"] == 0
        assert c.lookup(NS, {0: hashes[:16]})[0]["dram"] == list(range(16))


def test_a_reservation_takes_one_extent_when_one_is_free_else_the_holes_page_by_page(manager_factory):
    m = manager_factory(pool="1mb")  # 16 extents of PAGE
    with CacheClient(m.endpoint) as c:
        rid, offsets = c.reserve(NS, 0, [(bytes([i]) * 8, PAGE) for i in range(16)])
        assert offsets == [i * PAGE for i in range(16)]  # one extent, carved in order
        c.abort(rid)
        assert c.stats()["free_bytes"]["dram"] == 16 * PAGE
        singles = [c.reserve(NS, 0, [(bytes([i]) * 8, PAGE)]) for i in range(16)]
        for rid, _ in singles[::2]:
            c.abort(rid)  # eight holes of one page each: no two of them adjacent
        holes = sorted(offset for _, (offset,) in singles[::2])
        rid, offsets = c.reserve(NS, 0, [(bytes([100 + i]) * 8, PAGE) for i in range(8)])
        assert sorted(offsets) == holes  # page by page, into the holes, nothing evicted
        assert c.stats()["evictions"] == 0 and c.stats()["free_bytes"]["dram"] == 0
        for rid_ in [rid] + [r for r, _ in singles[1::2]]:
            c.abort(rid_)
        assert c.stats()["free_bytes"]["dram"] == 16 * PAGE and c.stats()["reservations"] == 0
        rid, offsets = c.reserve(NS, 0, [(bytes([i]) * 8, PAGE) for i in range(16)])
        assert offsets == [i * PAGE for i in range(16)]  # the pieces coalesced back into one extent
        c.abort(rid)


def _copy_failing_at(monkeypatch, page: int):
    """Make the client's copy of the ``page``-th page (counted from 1) raise; returns the shipped copy."""
    shipped = client_module.copy_with_checksum
    copies = 0

    def failing(dst, src):
        nonlocal copies
        copies += 1
        if copies == page:
            raise RuntimeError("the source went away")
        return shipped(dst, src)

    monkeypatch.setattr(client_module, "copy_with_checksum", failing)
    return shipped


def test_a_copy_failing_mid_store_aborts_its_reservation_and_the_connection_stays_in_step(manager_factory, monkeypatch):
    m = manager_factory()
    hashes = page_hashes(NS, list(range(16 * 9)), 16)
    data = payloads(4, 9)
    shipped = _copy_failing_at(monkeypatch, 4)
    with CacheClient(m.endpoint) as c:
        with pytest.raises(RuntimeError, match="the source went away"):
            c.store(NS, 0, list(zip(hashes, data, strict=True)))
        assert c.stats()["reservations"] == 0  # aborted: its extents are free again
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [], "ssd": []}}
        monkeypatch.setattr(client_module, "copy_with_checksum", shipped)
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 9 * PAGE
        rec = c.read_recovery(NS, 16 * 9, [(0, hashes)])
        assert rec is not None
        assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == data
        c.release(rec.lease)


def _sent_ops(monkeypatch) -> list[str]:
    """The ops a client sends, in order (the real send runs)."""
    sent: list[str] = []
    shipped = client_module._Exchange.send

    def spy(self, op, args, **kwargs):
        sent.append(op)
        return shipped(self, op, args, **kwargs)

    monkeypatch.setattr(client_module._Exchange, "send", spy)
    return sent


def test_a_store_pipelines_its_chunks_every_reserve_sent_before_the_first_copy(manager_factory, monkeypatch):
    # 9 pages in chunks of 2 pages: 5 reserves and 5 commits, every chunk reserved before the first is
    # copied (together far below half the pool), each commit sent before the next chunk's copy; every
    # page stored and served.
    m = manager_factory()
    monkeypatch.setattr(client_module, "STORE_CHUNK_BYTES", 2 * PAGE)
    hashes = page_hashes(NS, list(range(16 * 9)), 16)
    data = payloads(5, 9)
    sent = _sent_ops(monkeypatch)
    with CacheClient(m.endpoint) as c:
        sent.clear()
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 9 * PAGE
        assert sent == ["reserve"] * 5 + ["commit"] * 5
        assert c.stats()["reservations"] == 0
        rec = c.read_recovery(NS, 16 * 9, [(0, hashes)])
        assert rec is not None
        assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == data
        c.release(rec.lease)
        # Stored again: every page already cached, nothing written, the same pipeline.
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 0


def test_a_store_starts_with_a_small_chunk_and_doubles_it_up_to_the_chunk_size(manager_factory, monkeypatch):
    # 12 pages, the first chunk one page, the most four: reserves of 1, 2, 4, 4 and 1 pages, every one
    # sent before the first copy, then the commits in order; every page stored and served.
    m = manager_factory()
    monkeypatch.setattr(client_module, "STORE_FIRST_CHUNK_BYTES", PAGE)
    monkeypatch.setattr(client_module, "STORE_CHUNK_BYTES", 4 * PAGE)
    hashes = page_hashes(NS, list(range(16 * 12)), 16)
    data = payloads(8, 12)
    reserved: list[int] = []
    shipped = client_module._Exchange.send

    def spy(self, op, args, **kwargs):
        if op == "reserve":
            reserved.append(len(args["pages"]))
        return shipped(self, op, args, **kwargs)

    monkeypatch.setattr(client_module._Exchange, "send", spy)
    sent = _sent_ops(monkeypatch)
    with CacheClient(m.endpoint) as c:
        sent.clear()
        reserved.clear()
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 12 * PAGE
        assert reserved == [1, 2, 4, 4, 1]
        assert sent == ["reserve"] * 5 + ["commit"] * 5
        rec = c.read_recovery(NS, 16 * 12, [(0, hashes)])
        assert rec is not None
        assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == data
        c.release(rec.lease)


def test_a_store_failing_in_a_later_chunk_keeps_the_chunks_before_and_aborts_the_rest(manager_factory, monkeypatch):
    m = manager_factory()
    monkeypatch.setattr(client_module, "STORE_CHUNK_BYTES", 2 * PAGE)
    hashes = page_hashes(NS, list(range(16 * 9)), 16)
    data = payloads(6, 9)
    shipped = _copy_failing_at(monkeypatch, 6)  # in chunk 2 (pages 4 and 5), while chunk 3 is reserved
    with CacheClient(m.endpoint) as c:
        with pytest.raises(RuntimeError, match="the source went away"):
            c.store(NS, 0, list(zip(hashes, data, strict=True)))
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [0, 1, 2, 3], "ssd": []}}  # chunks 0 and 1
        assert c.stats()["reservations"] == 0  # chunks 2 and 3 aborted, their extents free again
        monkeypatch.setattr(client_module, "copy_with_checksum", shipped)
        assert c.store(NS, 0, list(zip(hashes, data, strict=True))) == 5 * PAGE  # the connection is in step
        rec = c.read_recovery(NS, 16 * 9, [(0, hashes)])
        assert rec is not None
        assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == data
        c.release(rec.lease)


def test_a_store_whose_later_reserve_is_refused_commits_what_it_copied_and_raises(manager_factory, monkeypatch):
    # Chunk 1 holds a page larger than the pool: its reserve is refused (answered while chunk 0 is
    # copied); chunk 0 is committed all the same, the refusal is raised, and nothing stays reserved.
    m = manager_factory(pool="1mb")
    monkeypatch.setattr(client_module, "STORE_CHUNK_BYTES", 2 * PAGE)
    hashes = page_hashes(NS, list(range(16 * 3)), 16)
    data = payloads(7, 2)
    pages = [(hashes[0], data[0]), (hashes[1], data[1]), (hashes[2], b"\1" * ((1 << 20) + 8))]
    with CacheClient(m.endpoint) as c:
        with pytest.raises(BadRequest, match="more than the pool"):
            c.store(NS, 0, pages)
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [0, 1], "ssd": []}}
        assert c.stats()["reservations"] == 0
        rec = c.read_recovery(NS, 32, [(0, hashes[:2])])
        assert rec is not None and [bytes(c.verified(ref)) for ref in rec.pages[0]] == data
        c.release(rec.lease)


def _exchanged(monkeypatch) -> list[str]:
    """What a client sends and reads, in order: "send OP" and "read OP" (the real calls run)."""
    events: list[str] = []
    shipped_send, shipped_receive = client_module._Exchange.send, client_module._Exchange.receive

    def send(self, op, args, **kwargs):
        events.append(f"send {op}")
        return shipped_send(self, op, args, **kwargs)

    def receive(self):
        events.append(f"read {self.due[0][1]}")
        return shipped_receive(self)

    monkeypatch.setattr(client_module._Exchange, "send", send)
    monkeypatch.setattr(client_module._Exchange, "receive", receive)
    return events


def _each(fill_one):
    """``store_parts``' fill from ``fill_one(k, slots)`` (one part's checksums): each part of a fill in
    turn; what ``fill_one`` raises stops the whole fill."""
    return lambda ks, slots: [fill_one(k, mine) for k, mine in zip(ks, slots, strict=True)]


def _one_page_saves(manager_factory, keys: str, seed: int):
    """A manager, and one part of one page per letter of ``keys`` (its save's key): the manager, the
    pages' hashes, their payloads and the parts."""
    m = manager_factory()
    hashes = page_hashes(NS, list(range(16 * len(keys))), 16)
    parts = [StorePart(NS, 0, [(h, PAGE)], key=key) for h, key in zip(hashes, keys, strict=True)]
    return m, hashes, payloads(seed, len(keys)), parts


def _parts_filled_from(c, pages):
    """``store_parts``' fill for parts whose pages are ``pages[k]`` (payloads): copy and sum each."""
    return _each(_part_filled_from(c, pages))


def _part_filled_from(c, pages):
    """One part's fill (``_each``) for parts whose pages are ``pages[k]``."""

    def fill(k, slots):
        return [
            None if slot is None else copy_with_checksum(c.view[slot[0] : slot[0] + slot[1]], payload)
            for payload, slot in zip(pages[k], slots, strict=True)
        ]

    return fill


def test_store_parts_of_several_saves_in_one_exchange_a_refused_one_skips_only_the_rest_of_its_own(
    manager_factory, monkeypatch
):
    # Saves a, b and c in one exchange: b's first part is refused (a tag the manager does not take) and
    # b's second part, reserved ahead with it, is aborted; a and c are stored. Every reserve goes out
    # before the first copy, and no commit is read before the last part is copied: one round trip for
    # the whole exchange.
    m, hashes, data, parts = _one_page_saves(manager_factory, "abbc", 8)
    parts[1] = parts[1]._replace(tag="x" * 200)
    events = _exchanged(monkeypatch)
    with CacheClient(m.endpoint) as c:
        events.clear()
        outcomes = c.store_parts(parts, _parts_filled_from(c, [[page] for page in data]))
        assert outcomes[0] == PAGE and outcomes[3] == PAGE and outcomes[2] is None
        assert isinstance(outcomes[1], BadRequest)
        assert events == [
            *["send reserve"] * 4,
            "read reserve", "send commit",  # a
            "read reserve",  # b refused
            "read reserve", "send abort",  # b's second part
            "read reserve", "send commit",  # c
            "read commit", "read abort", "read commit",
        ]  # fmt: skip
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [0, 3], "ssd": []}}
        assert c.stats()["reservations"] == 0
        rec = c.read_recovery(NS, 0, [(0, [hashes[0], hashes[3]])])
        assert rec is not None and [bytes(c.verified(ref)) for ref in rec.pages[0]] == [data[0], data[3]]
        c.release(rec.lease)


def test_store_parts_write_a_page_two_saves_share_once(manager_factory):
    # Saves a and b share their first page (requests with one prefix, saved in one step): it is reserved
    # and written once, by a; b writes only its own page. When a's part is refused, the shared page is
    # not stored at all: b's save has a gap there (a future miss), never another page's bytes.
    m = manager_factory()
    hashes = page_hashes(NS, list(range(16 * 6)), 16)
    data = payloads(11, 6)
    with CacheClient(m.endpoint) as c:
        before = c.stats()["bytes_written"]["dram"]
        parts = [StorePart(NS, 0, [(hashes[0], PAGE), (hashes[1], PAGE)], key="a"),
                 StorePart(NS, 0, [(hashes[0], PAGE), (hashes[2], PAGE)], key="b")]  # fmt: skip
        fill, written = _part_filled_from(c, [[data[0], data[1]], [data[0], data[2]]]), []

        def counted(k, slots):
            written.extend(slot for slot in slots if slot is not None)
            return fill(k, slots)

        outcomes = c.store_parts(parts, _each(counted))
        assert outcomes == [2 * PAGE, PAGE]
        assert len(written) == 3  # the shared page copied once
        assert c.stats()["bytes_written"]["dram"] - before == 3 * PAGE
        rec = c.read_recovery(NS, 0, [(0, hashes[:3])])
        assert rec is not None and [bytes(c.verified(ref)) for ref in rec.pages[0]] == data[:3]
        c.release(rec.lease)
        parts = [StorePart(NS, 0, [(hashes[3], PAGE)], "x" * 200, key="a"),
                 StorePart(NS, 0, [(hashes[3], PAGE), (hashes[4], PAGE)], key="b"),
                 StorePart(NS, 0, [(hashes[3], PAGE)], key="c")]  # fmt: skip
        outcomes = c.store_parts(parts, _parts_filled_from(c, [[data[3]], [data[3], data[4]], [data[3]]]))
        assert isinstance(outcomes[0], BadRequest) and outcomes[1:] == [PAGE, 0]
        assert c.lookup(NS, {0: hashes[3:5]}) == {0: {"dram": [1], "ssd": []}}
        assert c.stats()["reservations"] == 0


def test_store_parts_reserve_ahead_at_most_half_the_pool(manager_factory, monkeypatch):
    # A 1 MiB pool and parts of 192 KiB: at most two are reserved and not yet copied at any time (a
    # third would hold more than half the pool, and reserved extents are never evicted).
    m = manager_factory(pool="1mb")
    hashes = page_hashes(NS, list(range(16 * 15)), 16)
    data = payloads(10, 15)
    parts = [StorePart(NS, 0, [(h, PAGE) for h in hashes[i : i + 3]]) for i in range(0, 15, 3)]
    events = _exchanged(monkeypatch)
    with CacheClient(m.endpoint) as c:
        events.clear()
        outcomes = c.store_parts(parts, _parts_filled_from(c, [data[i : i + 3] for i in range(0, 15, 3)]))
        assert outcomes == [3 * PAGE] * 5
        reserved = 0
        for event in events:
            reserved += {"send reserve": 1, "send commit": -1}.get(event, 0)
            assert reserved <= 2, events
        assert events[:2] == ["send reserve", "send reserve"]
        assert c.stats()["reservations"] == 0


def test_store_parts_a_failed_copy_aborts_its_part_and_the_next_one_of_its_save_already_reserved(
    manager_factory, monkeypatch
):
    # b's first copy fails while b's second part is already reserved: both are aborted (nothing of b
    # stored, nothing left reserved), a and c are stored, and the connection stays in step.
    m, hashes, data, parts = _one_page_saves(manager_factory, "abbc", 9)
    sent = _sent_ops(monkeypatch)
    with CacheClient(m.endpoint) as c:
        fill = _part_filled_from(c, [[page] for page in data])

        def failing(k, slots):
            if k == 1:
                raise RuntimeError("the source went away")
            return fill(k, slots)

        sent.clear()
        outcomes = c.store_parts(parts, _each(failing))
        assert outcomes[0] == PAGE and outcomes[3] == PAGE and outcomes[2] is None
        assert isinstance(outcomes[1], RuntimeError)
        assert sent == ["reserve"] * 4 + ["commit", "abort", "abort", "commit"]
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [0, 3], "ssd": []}}
        assert c.stats()["reservations"] == 0


def test_store_parts_copies_in_flight_commit_after_the_next_copy_starts_and_abort_only_once_finished(
    manager_factory, monkeypatch
):
    # fill returns a wait for each copy (a device copy in flight; here the copy runs when waited for):
    # part k is committed once part k+1's copy has started. b's first copy fails when waited for, with
    # b's second copy already started: that one is waited for before its reservation is aborted (its
    # copy writes the reserved extents), and a, c are stored with their bytes.
    m, hashes, data, parts = _one_page_saves(manager_factory, "abbc", 12)
    events = _exchanged(monkeypatch)
    with CacheClient(m.endpoint) as c:
        fill = _part_filled_from(c, [[page] for page in data])

        def started(ks, slots):
            [k], [mine] = ks, slots  # one part per fill
            events.append(f"start {k}")

            def wait():
                events.append(f"wait {k}")
                if k == 1:
                    raise RuntimeError("the copy failed on the device")
                return [fill(k, mine)]

            return wait

        events.clear()
        outcomes = c.store_parts(parts, started)
        assert outcomes[0] == PAGE and outcomes[3] == PAGE and outcomes[2] is None
        assert isinstance(outcomes[1], RuntimeError)
        assert events == [
            *["send reserve"] * 4,
            "read reserve", "start 0",
            "read reserve", "start 1", "wait 0", "send commit",  # a committed while b's copy runs
            "read reserve", "start 2", "wait 1", "send abort",  # b's copy failed
            "read reserve", "start 3", "wait 2", "send abort",  # b's second part: its copy finished first
            "wait 3", "send commit",  # c
            "read commit", "read abort", "read abort", "read commit",
        ]  # fmt: skip
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [0, 3], "ssd": []}}
        assert c.stats()["reservations"] == 0
        rec = c.read_recovery(NS, 0, [(0, [hashes[0], hashes[3]])])
        assert rec is not None and [bytes(c.verified(ref)) for ref in rec.pages[0]] == [data[0], data[3]]
        c.release(rec.lease)


def test_store_parts_together_fills_the_parts_reserved_ahead_up_to_its_bytes_at_once(manager_factory, monkeypatch):
    # together 3 pages: three reserves answered, then one fill copies those three parts (left in flight),
    # then the fourth part's fill starts and the three are committed, each with its own checksums.
    m, hashes, data, parts = _one_page_saves(manager_factory, "abbc", 14)
    events = _exchanged(monkeypatch)
    with CacheClient(m.endpoint) as c:
        fill = _parts_filled_from(c, [[page] for page in data])

        def started(ks, slots):
            events.append(f"start {ks}")
            return lambda: events.append("wait") or fill(ks, slots)

        events.clear()
        assert c.store_parts(parts, started, together=3 * PAGE) == [PAGE] * 4
        assert events == [*["send reserve"] * 4, *["read reserve"] * 3, "start [0, 1, 2]",  # 3 pages at most
                          "read reserve", "start [3]", "wait", *["send commit"] * 3, "wait", "send commit",
                          *["read commit"] * 4]  # fmt: skip
        rec = c.read_recovery(NS, 0, [(0, hashes)])
        assert rec is not None and [bytes(c.verified(ref)) for ref in rec.pages[0]] == data
        c.release(rec.lease)


def test_store_parts_interrupted_finishes_the_copy_in_flight_before_aborting_its_reservation(
    manager_factory, monkeypatch
):
    # An interrupt while part 1 is copied, part 0's copy still in flight: it is waited for before any
    # reservation is aborted, nothing is stored and nothing stays reserved.
    m, hashes, data, parts = _one_page_saves(manager_factory, "abc", 13)
    events = _exchanged(monkeypatch)
    with CacheClient(m.endpoint) as c:
        fill = _parts_filled_from(c, [[page] for page in data])

        def started(ks, slots):
            if ks == [1]:
                raise KeyboardInterrupt
            return lambda: events.append(f"wait {ks[0]}") or fill(ks, slots)

        events.clear()
        with pytest.raises(KeyboardInterrupt):
            c.store_parts(parts, started)
        assert "wait 0" in events and events.index("wait 0") < events.index("send abort"), events
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [], "ssd": []}}
        assert c.stats()["reservations"] == 0


_store_plans = st.lists(
    st.tuples(
        st.sampled_from("abc"),
        st.integers(1, 3),
        st.sampled_from(["stored", "refused", "copy fails", "commit refused"]),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=_store_plans, copies=st.sampled_from(["at once", "in flight", "together"]))
@example(plan=[("a", 1, "stored"), ("a", 1, "refused")], copies="in flight")  # a's first part committed
@example(plan=[("a", 1, "stored"), ("a", 1, "copy fails")], copies="together")
def test_store_parts_outcomes_are_what_the_manager_holds(manager_factory, plan, copies):
    """Any mix of saves (keys), part sizes and failures (a reserve refused, a copy that raises, a commit
    refused) in a 1 MiB pool, where reserving ahead stops at half the pool, with copies done at once,
    left in flight (each copy runs, or fails, when waited for) or, in flight, the parts reserved ahead
    filled up to 4 pages at once (``together``): each part's outcome follows
    from its own save's parts alone (a part after a refused commit of its save may have been committed
    before the refusal came back), the manager holds exactly the pages of the parts reported stored,
    with their bytes, and nothing stays reserved."""
    test = test_store_parts_outcomes_are_what_the_manager_holds
    m = getattr(test, "m", None)
    if m is None or m.proc.poll() is not None:
        m = test.m = manager_factory(pool="1mb")  # 16 pages: at most 15 per example, none evicted
        test.run = 0
    test.run += 1
    hashes = iter(page_hashes(NS, list(range(10**6 * test.run, 10**6 * test.run + 16 * 15)), 16))
    data = iter(payloads(-1, 15))
    parts, pages, expected, failed, late = [], [], [], set(), set()
    for key, n, fate in plan:
        mine = [(next(hashes), next(data)) for _ in range(n)]
        tag = "x" * 200 if fate == "refused" else ""
        parts.append(StorePart(NS, 0, [(h, PAGE) for h, _ in mine], tag, key))
        pages.append(mine)
        if key in failed:  # not stored; or, after a refused commit only, possibly stored
            expected.append({None, n * PAGE} if fate == "stored" and key in late else {None})
        else:
            expected.append({n * PAGE if fate == "stored" else fate})
        # A refused reserve or a failed copy is known at the part's own turn: the key's later parts stop
        # there. A refused commit is known only when its reply is read: later parts may go on meanwhile.
        if fate in ("refused", "copy fails"):
            late.discard(key)
        elif fate == "commit refused" and key not in failed:
            late.add(key)
        if fate != "stored":
            failed.add(key)
    with CacheClient(m.endpoint) as c:
        fill = _part_filled_from(c, [[payload for _, payload in mine] for mine in pages])

        def filled(k, slots):
            if plan[k][2] == "copy fails":
                raise RuntimeError("the source went away")
            sums = fill(k, slots)
            refused = plan[k][2] == "commit refused"  # a checksum out of range: the manager refuses it
            return [None if v is None else -1 for v in sums] if refused else sums

        def each(ks, slots):  # a failed copy fails its own part (as a save per layout does)
            out = []
            for k, mine in zip(ks, slots, strict=True):
                try:
                    out.append(filled(k, mine))
                except RuntimeError as exc:
                    out.append(exc)
            return out

        if copies == "at once":
            outcomes = c.store_parts(parts, _each(filled))
        else:
            together = 4 * PAGE if copies == "together" else 0
            outcomes = c.store_parts(parts, lambda ks, slots: lambda: each(ks, slots), together=together)
        kinds = {RuntimeError: "copy fails"}
        seen = [
            ("refused" if "tag" in str(o) else "commit refused") if isinstance(o, BadRequest) else kinds.get(type(o), o)
            for o in outcomes
        ]
        assert all(o in want for o, want in zip(seen, expected, strict=True)), (seen, expected)
        stored = [page for mine, o in zip(pages, outcomes, strict=True) if isinstance(o, int) for page in mine]
        missing = [page for mine, o in zip(pages, outcomes, strict=True) if not isinstance(o, int) for page in mine]
        everything = [h for h, _ in stored] + [h for h, _ in missing]
        assert c.lookup(NS, {0: everything}) == {0: {"dram": list(range(len(stored))), "ssd": []}}
        assert c.stats()["reservations"] == 0
        if stored:
            rec = c.read_recovery(NS, 0, [(0, [h for h, _ in stored])])
            assert rec is not None
            assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == [payload for _, payload in stored]
            c.release(rec.lease)


def test_a_reply_to_another_request_closes_the_connection_instead_of_answering_the_call(manager_factory):
    m = manager_factory()
    hashes = page_hashes(NS, list(range(16 * 2)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, [(hashes[0], payloads(7, 1)[0])])
        # A stray request on the connection (as a call interrupted before it read its reply leaves):
        # its reply, a lookup's, arrives first and must not be taken for the next call's.
        c._sock.sendall(encode({"id": 10**6, "op": "lookup", "args": {"namespace": NS, "groups": {0: hashes}}}))
        with pytest.raises(ManagerUnavailable, match="a reply to request 1000000 where .* was due"):
            c.stats()
        with pytest.raises(ManagerUnavailable, match="is closed"):
            c.lookup(NS, {0: hashes})
    with CacheClient(m.endpoint) as c:  # the manager serves new connections as before
        assert c.lookup(NS, {0: hashes}) == {0: {"dram": [0], "ssd": []}}


class _Counting(dict):
    """A client's store of replies read before their turn, counting what it kept."""

    kept = 0

    def __setitem__(self, key, value) -> None:
        type(self).kept += 1
        super().__setitem__(key, value)


def test_read_recoveries_leases_each_request_on_its_own_in_one_exchange_answered_in_any_order(manager_factory):
    """Several leases sent before any reply is read: each granted or missed on its own, in the order
    asked, with the pages asked for. A lease that waits for the SSD is answered after the ones behind it
    (the manager runs each as a task); the client keeps those replies for their turn."""
    m, hashes, on_ssd = _mostly_on_ssd(manager_factory)
    in_dram = [hashes[i] for i in range(len(hashes)) if i not in set(on_ssd)][:6]
    absent = page_hashes(NS, list(range(10**6, 10**6 + 16 * 2)), 16)
    _Counting.kept = 0
    with CacheClient(m.endpoint) as c:
        c._early = _Counting()
        for attempt in range(4):
            _drop_from_page_cache(m.ssd_path)
            from_ssd = [hashes[i] for i in on_ssd[attempt * 20 : attempt * 20 + 20]]
            expected = {h: c.read_recovery(NS, 0, [(0, [h])]) for h in in_dram[:2]}  # leased alone, for the sums
            granted = c.read_recoveries(
                NS, [(0, [(0, from_ssd)]), (0, [(0, in_dram[:3])]), (0, [(0, absent)]), (0, [(0, in_dram[3:])])]
            )
            ssd_rec, first, missed, second = granted
            assert missed is None and None not in (ssd_rec, first, second)
            assert len({ssd_rec.lease, first.lease, second.lease, *(r.lease for r in expected.values())}) == 5
            assert [len(r.pages[0]) for r in (ssd_rec, first, second)] == [20, 3, 3]
            for h, alone in expected.items():
                assert first.pages[0][in_dram.index(h)].checksum == alone.pages[0][0].checksum
                c.release(alone.lease)
            for rec in (ssd_rec, first, second):
                assert all(bytes(c.verified(ref)) for ref in rec.pages[0])
                c.release(rec.lease)
            assert c.stats()["leases"] == 0
            if _Counting.kept:
                break
        assert _Counting.kept, "no lease waiting for the SSD was answered after the ones sent behind it"
        assert not c._early


def test_read_recoveries_raises_an_error_reply_after_giving_back_every_lease_granted(manager_factory):
    m = manager_factory(pool="8mb")
    hashes = page_hashes(NS, list(range(16 * 4)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, [(h, os.urandom(4096)) for h in hashes])
        with pytest.raises(BadRequest, match="group"):
            c.read_recoveries(NS, [(0, [(0, hashes[:2])]), (0, [(-1, hashes[2:])]), (0, [(0, hashes[2:])])])
        assert c.stats()["leases"] == 0  # the two granted were given back; the connection is in step
        rec = c.read_recovery(NS, 0, [(0, hashes)])
        assert rec is not None and len(rec.pages[0]) == 4


def _frames(data: bytes) -> int:
    """Whole frames at the start of ``data``."""
    count = at = 0
    while at + 4 <= len(data) and at + 4 + struct.unpack(">I", data[at : at + 4])[0] <= len(data):
        at += 4 + struct.unpack(">I", data[at : at + 4])[0]
        count += 1
    return count


class _CountingSocket:
    """A client's socket, its ``recv`` calls counted."""

    def __init__(self, sock) -> None:
        self.sock, self.recvs = sock, 0

    def recv(self, size: int) -> bytes:
        self.recvs += 1
        return self.sock.recv(size)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_replies_that_have_arrived_together_are_read_in_one_recv(manager_factory):
    """In an engine's process each return from ``recv`` can wait for the GIL: the client takes whatever
    has arrived, not a reply's header and then its body."""
    m = manager_factory(pool="2mb")
    hashes = page_hashes(NS, list(range(16 * 4)), 16)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, payloads(6, 4), strict=True)))
        counting = c._sock = _CountingSocket(c._sock)
        with c._exchange() as wire:
            for _ in range(8):
                wire.send("read_recovery", {"namespace": NS, "boundary": 64, "ranges": [[0, hashes]]})
            deadline = time.monotonic() + 10
            while _frames(counting.sock.recv(1 << 20, socket.MSG_PEEK)) < 8:  # until all 8 replies have arrived
                assert time.monotonic() < deadline
                time.sleep(0.02)
            leases = [wire.receive()[1]["result"]["lease"] for _ in range(8)]
        assert counting.recvs == 1
        for lease in leases:
            c.release(lease)
        assert c.stats()["leases"] == 0


def test_read_recoveries_keeps_at_most_leases_ahead_unanswered_and_gives_all_back_when_a_request_fails(
    manager_factory,
):
    """More leases than AHEAD (and than the manager runs at once per connection) in one call: each
    granted, in order, with its own page. A request that cannot be sent (a frame too large) raises after
    the replies due are read and every lease granted is given back: the connection is in step and holds
    nothing."""
    m = manager_factory(pool="8mb")
    hashes = page_hashes(NS, list(range(16 * 100)), 16)
    with CacheClient(m.endpoint, max_frame=1 << 14) as c:
        c.store(NS, 0, [(h, os.urandom(4096)) for h in hashes])
        alone = c.read_recovery(NS, 0, [(0, hashes)])
        count = 2 * client_module.AHEAD + 16
        granted = c.read_recoveries(NS, [(0, [(0, [h])]) for h in hashes[:count]])
        assert [rec.pages[0][0].offset for rec in granted] == [ref.offset for ref in alone.pages[0][:count]]
        for rec in [alone, *granted]:
            c.release(rec.lease)
        too_large = [(0, [(0, hashes * 12)])]  # 1200 hashes: a request of more than 16 KiB
        with pytest.raises(ProtocolError, match="exceeds"):
            c.read_recoveries(NS, [(0, [(0, [h])]) for h in hashes[:40]] + too_large)
        assert c.stats()["leases"] == 0
        assert c.read_recovery(NS, 0, [(0, hashes[:2])]) is not None


class _RecordingSocket:
    """A client's socket, the order of its sends and receives recorded."""

    def __init__(self, sock) -> None:
        self.sock, self.calls = sock, []

    def sendall(self, data: bytes) -> None:
        self.calls.append("send")
        self.sock.sendall(data)

    def recv(self, size: int) -> bytes:
        self.calls.append("recv")
        return self.sock.recv(size)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_lookups_of_several_namespaces_go_in_one_exchange_and_answer_as_each_lookup_alone(manager_factory):
    """An engine's tensor-parallel ranks, each its own namespace, asked about one request: every lookup is
    sent before any reply is read, and each answers as the same lookup alone, in the order asked, a
    namespace's pages never another's."""
    m = manager_factory(pool="8mb")
    namespaces = [f"{NS[:-2]}r{rank}" for rank in range(4)]
    tokens = list(range(16 * 6))
    with CacheClient(m.endpoint) as c:
        asks = []
        for rank, namespace in enumerate(namespaces):
            hashes = {g: page_hashes(namespace, tokens, 16, g) for g in (0, 1)}
            # rank r holds the first r + 1 pages of group 0 and the last r pages of group 1
            c.store(namespace, 0, list(zip(hashes[0][: rank + 1], payloads(rank, rank + 1), strict=True)))
            if rank:
                c.store(namespace, 1, list(zip(hashes[1][-rank:], payloads(rank + 8, rank), strict=True)))
            asks.append((namespace, hashes))
        alone = [c.lookup(namespace, hashes) for namespace, hashes in asks]
        assert [found[0]["dram"] for found in alone] == [list(range(r + 1)) for r in range(4)]
        assert [found[1]["dram"] for found in alone] == [list(range(6 - r, 6)) for r in range(4)]
        recording = c._sock = _RecordingSocket(c._sock)
        together = c.lookups(asks)
        assert together == alone
        assert recording.calls.index("recv") == len(asks)  # every request sent before the first receive
        crossed = c.lookups([(namespaces[0], asks[3][1]), (namespaces[3], asks[0][1])])
        assert crossed == [{0: {"dram": [], "ssd": []}, 1: {"dram": [], "ssd": []}}] * 2
        assert c.lookups([]) == []


def test_lookups_raise_an_error_reply_after_reading_every_reply_and_keep_more_than_ahead_in_order(manager_factory):
    """More lookups than AHEAD in one call, each answered in order; an error reply (a bad group id), or a
    request that cannot be sent (a frame too large), raises after the replies due are read: the
    connection stays in step."""
    m = manager_factory(pool="8mb")
    hashes = page_hashes(NS, list(range(16 * 100)), 16)
    with CacheClient(m.endpoint, max_frame=1 << 14) as c:
        c.store(NS, 0, [(h, os.urandom(4096)) for h in hashes[:50]])
        count = 2 * client_module.AHEAD + 16
        found = c.lookups([(NS, {0: [h]}) for h in hashes[:count]])
        assert [f[0]["dram"] for f in found] == [[0]] * 50 + [[]] * (count - 50)
        with pytest.raises(BadRequest):
            c.lookups([(NS, {0: hashes[:2]}), (NS, {"x": hashes[:2]}), (NS, {0: hashes[:3]})])
        with pytest.raises(ProtocolError, match="exceeds"):
            c.lookups([(NS, {0: [h]}) for h in hashes[:40]] + [(NS, {0: hashes * 12})])
        assert c.lookup(NS, {0: hashes[48:52]})[0]["dram"] == [0, 1]
        assert c.lookups([(NS, {0: hashes[:1]})]) == [{0: {"dram": [0], "ssd": []}}]


def test_a_lookup_of_several_namespaces_for_the_same_hashes_is_one_request_answering_as_each_alone(
    manager_factory,
):
    """An engine's ranks share their page hashes, each rank's pages keyed under its own namespace: one
    request asks every namespace and answers, in order, as each lookup alone. A manager whose hello does
    not offer it, or a lookup past the work it offers, goes one lookup per namespace in one exchange."""
    m = manager_factory(pool="8mb")
    namespaces = [f"{NS[:-2]}r{rank}" for rank in range(4)]
    hashes = {g: page_hashes(namespaces[0], list(range(16 * 6)), 16, g) for g in (0, 1)}
    with CacheClient(m.endpoint) as c:
        for rank, namespace in enumerate(namespaces):  # rank r: the first r + 1 pages of group 0, the last r of 1
            c.store(namespace, 0, list(zip(hashes[0][: rank + 1], payloads(rank, rank + 1), strict=True)))
            if rank:
                c.store(namespace, 1, list(zip(hashes[1][-rank:], payloads(rank + 8, rank), strict=True)))
        alone = [c.lookup(namespace, hashes) for namespace in namespaces]
        assert [found[0]["dram"] for found in alone] == [list(range(r + 1)) for r in range(4)]
        assert [found[1]["dram"] for found in alone] == [list(range(6 - r, 6)) for r in range(4)]
        work = lookup_work(4, hashes.values())  # 4 namespaces x (1 + 2 groups + 12 hashes)
        assert work == 60 and c.info["lookup_namespaces"] >= work
        recording = c._sock = _RecordingSocket(c._sock)
        assert c.lookup_namespaces(namespaces, hashes) == alone
        assert recording.calls.count("send") == 1  # one request for the four namespaces
        assert c.lookup_namespaces(namespaces[::-1], hashes) == alone[::-1]
        assert c.lookup_namespaces(namespaces[2:3], hashes) == alone[2:3]
        offered = c.info.pop("lookup_namespaces")
        recording.calls.clear()
        assert c.lookup_namespaces(namespaces, hashes) == alone  # as from a manager that does not offer it
        assert recording.calls.count("send") == 4
        c.info["lookup_namespaces"] = work - 1  # the same past the work offered
        recording.calls.clear()
        assert c.lookup_namespaces(namespaces, hashes) == alone
        assert recording.calls.count("send") == 4
        c.info["lookup_namespaces"] = offered
        with pytest.raises(BadRequest, match="namespaces"):
            c.call("lookup", namespaces=[], groups={0: hashes[0]})
        with pytest.raises(BadRequest, match="namespaces"):
            c.call("lookup", namespaces=[namespaces[0], ""], groups={0: hashes[0]})
        with pytest.raises(BadRequest, match="more than"):
            c.call("lookup", namespaces=namespaces, groups={0: hashes[0] * (offered // 24 + 1)})
        with pytest.raises(BadRequest, match="more than"):  # many namespaces and empty groups: work all the same
            c.call("lookup", namespaces=["n"] * 1000, groups={g: [] for g in range(2000)})
        assert c.lookup_namespaces(namespaces, hashes) == alone  # the connection in step after the refusals


@pytest.mark.parametrize(
    "garble",
    [
        lambda result: {g: v for g, v in result.items() if g != 1},  # a group asked for missing
        lambda result: {**result, 7: {"dram": []}},  # a group not asked for
        lambda result: {**result, 1: [0, 1]},  # a group's tiers not a map
        lambda result: {**result, 0: {"dram": 3}},  # a tier's positions not a list
        lambda result: {"zero": {"dram": []}, 1: result[1]},  # a group id not a number
        lambda result: [result],  # not a map at all
    ],
    ids=[
        "group-missing",
        "group-not-asked",
        "tiers-not-a-map",
        "positions-not-a-list",
        "group-not-a-number",
        "not-a-map",
    ],
)
def test_a_lookup_reply_that_does_not_answer_the_groups_asked_raises_a_protocol_error(
    manager_factory, monkeypatch, garble
):
    """Every lookup path (one namespace, several in one request, several in one exchange) checks the reply
    against the groups asked: a garbled one is a ProtocolError (a miss for an engine), never a KeyError or
    AttributeError in its scheduler, and the connection stays in step."""
    m = manager_factory(pool="8mb")
    namespaces = [f"{NS[:-2]}r{rank}" for rank in range(2)]
    hashes = {g: page_hashes(namespaces[0], list(range(16 * 3)), 16, g) for g in (0, 1)}
    with CacheClient(m.endpoint) as c:
        for namespace in namespaces:
            c.store(namespace, 0, list(zip(hashes[0][:2], payloads(0, 2), strict=True)))
        whole = c.lookup_namespaces(namespaces, hashes)
        assert [found[0]["dram"] for found in whole] == [[0, 1], [0, 1]] and whole[0][1] == {"dram": [], "ssd": []}
        receive = client_module._Exchange.receive

        def garbled(self):
            tag, reply = receive(self)
            if reply.get("ok") and self.client is c:
                result = reply["result"]
                reply = {**reply, "result": [garble(r) for r in result] if isinstance(result, list) else garble(result)}
            return tag, reply

        monkeypatch.setattr(client_module._Exchange, "receive", garbled)
        with pytest.raises(ProtocolError, match="lookup of groups"):
            c.lookup(namespaces[0], hashes)
        with pytest.raises(ProtocolError, match="lookup of groups"):
            c.lookup_namespaces(namespaces, hashes)
        with pytest.raises(ProtocolError, match="lookup of groups"):
            c.lookups([(namespace, hashes) for namespace in namespaces])
        monkeypatch.undo()
        assert c.lookup_namespaces(namespaces, hashes) == whole
        assert c.lookups([(namespace, hashes) for namespace in namespaces]) == whole
