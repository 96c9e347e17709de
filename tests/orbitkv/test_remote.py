"""The remote tier: two real managers standing for two hosts (own arenas and sockets) sharing a real
Redis Cluster of 3 primaries and 3 replicas (Debian's redis-server) on loopback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from cacheon_orbitkv.client import CacheClient, page_hashes
from cacheon_orbitkv.remote import RemoteConfig, RemoteValueError, decode_value, encode_value, read_mac_key, remote_key
from cacheon_orbitkv.wire import checksum
from tests.redis_cluster import RedisNodes, cli, free_ports

PAGE = 64 << 10
FAST = ("--remote-timeout", "0.5", "--remote-retry", "1")
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def cluster(redis_cluster):
    return redis_cluster


def namespace(tag: str) -> str:
    return f"model-{tag}-{time.monotonic_ns()}:bf16:nhd:p16:r0"


def make_pages(ns: str, n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    return page_hashes(ns, [seed * 1_000_000 + t for t in range(16 * n)], 16), [os.urandom(PAGE) for _ in range(n)]


def hosts(manager_factory, url: str, *extra: str):
    """Managers A and B: two hosts' managers on one store."""
    args = ("--remote", url, *FAST, *extra)
    return manager_factory(pool="32mb", extra=args), manager_factory(pool="32mb", extra=args)


def wait_for(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def written(manager, n: int) -> dict:
    return wait_for(lambda: (s := manager.stats())["remote"]["pages_written"] >= n and s, f"{n} pages written")


def save(manager, ns: str, hashes: list[bytes], payloads: list[bytes]) -> None:
    with CacheClient(manager.endpoint) as c:
        assert c.store(ns, 0, list(zip(hashes, payloads, strict=True))) == len(payloads) * PAGE
    written(manager, len(payloads))


def restore(manager, ns: str, hashes: list[bytes]) -> list[bytes] | None:
    with CacheClient(manager.endpoint) as c:
        rec = c.read_recovery(ns, 0, [(0, hashes)])
        if rec is None:
            return None
        try:
            return [bytes(c.verified(ref)) for ref in rec.pages[0]]
        finally:
            c.release(rec.lease)


def evalsha_calls(cluster: RedisNodes) -> dict[int, int]:
    """EVALSHA calls each primary has served."""
    calls = {}
    for port in cluster.primaries():
        found = re.search(r"cmdstat_evalsha:calls=(\d+)", cli(port, "INFO", "commandstats"))
        calls[port] = int(found.group(1)) if found else 0
    return calls


def metrics(port: int) -> dict[str, float]:
    """The manager's Prometheus samples, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_a_page_saved_on_one_host_is_restored_on_another_from_the_cluster(cluster, manager_factory):
    a_port, b_port = free_ports(2, bus=False)
    a = manager_factory(pool="32mb", extra=("--remote", cluster.url, *FAST, "--metrics-port", str(a_port)))
    b = manager_factory(pool="32mb", extra=("--remote", cluster.url, *FAST, "--metrics-port", str(b_port)))
    ns = namespace("two-hosts")
    hashes, payloads = make_pages(ns, 12)
    save(a, ns, hashes, payloads)
    assert a.stats()["remote"]["bytes_written"] == 12 * PAGE
    with CacheClient(b.endpoint) as c:
        c.lookup(ns, {0: [os.urandom(16) for _ in range(64)]})  # each node has loaded the script (NOSCRIPT once)
        before = evalsha_calls(cluster)
        found = c.lookup(ns, {0: [*hashes, b"\x01" * 16]})[0]
        # one discovery call per node, whatever the number of hashes
        after = evalsha_calls(cluster)
        assert all(0 <= after[p] - before.get(p, 0) <= 1 for p in after), (before, after)
    assert found == {"dram": [], "ssd": [], "remote": list(range(12))}
    with CacheClient(b.endpoint) as c:  # several namespaces in one lookup: the store asked for each
        both = c.lookup_namespaces([namespace("nobody-saved"), ns], {0: [*hashes, b"\x01" * 16]})
    assert both == [{0: {"dram": [], "ssd": [], "remote": []}}, {0: found}]
    assert restore(b, ns, hashes) == payloads
    stats = b.stats()
    assert stats["remote"]["hits"] == 12 and stats["remote"]["bytes_read"] == 12 * PAGE
    assert stats["hits"] == {"dram": 0, "ssd": 0, "remote": 12}
    assert stats["leases"] == 0 and stats["remote"]["pages_written"] == 0  # read pages are never written back
    # now held by B itself: found in its DRAM, not read again
    assert restore(b, ns, hashes[:4]) == payloads[:4]
    assert b.stats()["remote"]["hits"] == 12 and b.stats()["hits"]["dram"] == 4
    with CacheClient(b.endpoint) as c:
        assert c.lookup(ns, {0: hashes})[0] == {"dram": list(range(12)), "ssd": [], "remote": []}
    # the same figures for Prometheus
    seen_a, seen_b = metrics(a_port), metrics(b_port)
    assert seen_a["orbitkv_remote_bytes_total{direction=written}"] == 12 * PAGE
    assert seen_b["orbitkv_remote_hits_total"] == 12 and seen_b["orbitkv_remote_misses_total"] == 0
    assert seen_b["orbitkv_remote_bytes_total{direction=read}"] == 12 * PAGE
    assert seen_b["orbitkv_remote_queue_depth"] == 0 and seen_b["orbitkv_remote_breaker_open"] == 0
    assert seen_b["orbitkv_remote_failures_total{op=lookup}"] == 0
    assert seen_b["orbitkv_hits_total{group=0,tier=dram}"] == 4


def test_a_single_node_with_a_password_serves_two_hosts_and_a_wrong_password_is_a_paused_tier(
    manager_factory, tmp_path
):
    node = RedisNodes(tmp_path / "single", primaries=1, replicas=0, cluster=False, password="s3cret:/@").start()
    try:
        url = f"redis://default:s3cret%3A%2F%40@127.0.0.1:{node.ports[0]}"  # user and password, URL-quoted
        a, b = hosts(manager_factory, url)
        ns = namespace("single")
        hashes, payloads = make_pages(ns, 3)
        save(a, ns, hashes, payloads)
        assert a.stats()["remote"]["mode"] == "single"
        assert restore(b, ns, hashes) == payloads
        assert b.stats()["remote"]["hits"] == 3
        wrong = manager_factory(pool="16mb", extra=("--remote", f"redis://wrong@127.0.0.1:{node.ports[0]}", *FAST))
        with CacheClient(wrong.endpoint) as c:
            assert c.lookup(ns, {0: hashes})[0]["remote"] == []
            assert c.read_recovery(ns, 0, [(0, hashes)]) is None
        remote = wrong.stats()["remote"]
        assert not remote["connected"] and remote["failures"] >= 1
    finally:
        node.stop()


def test_a_restore_needing_a_page_nobody_has_is_a_miss_and_leases_nothing(cluster, manager_factory):
    a, b = hosts(manager_factory, cluster.url)
    ns = namespace("partial")
    hashes, payloads = make_pages(ns, 4)
    save(a, ns, hashes[:3], payloads[:3])
    assert restore(b, ns, hashes) is None  # all ranges or nothing
    stats = b.stats()
    assert stats["leases"] == 0 and stats["pages"]["dram"] == 0 and stats["misses"] == 1
    assert stats["free_bytes"]["dram"] == stats["capacity_bytes"]["dram"]  # every extent handed back


def test_tampered_and_misnamed_values_are_counted_misses_never_restored(cluster, manager_factory):
    a, b = hosts(manager_factory, cluster.url)
    ns = namespace("tamper")
    hashes, payloads = make_pages(ns, 4)
    save(a, ns, hashes, payloads)
    tampered = remote_key((ns, 0, hashes[2]))
    node = redis.Redis(port=cluster.primary_of(tampered))
    # one byte inside the payload flipped (a fixed "X" left the 1 in 256 pages already holding one intact)
    node.setrange(tampered, PAGE, bytes([node.getrange(tampered, PAGE, PAGE)[0] ^ 0xFF]))
    # page 1's value stored under page 3's key: a valid header and checksum, naming another page
    _copy_value(cluster, remote_key((ns, 0, hashes[1])), remote_key((ns, 0, hashes[3])))
    assert restore(b, ns, hashes[2:3]) is None
    assert restore(b, ns, hashes[3:4]) is None
    remote = b.stats()["remote"]
    assert remote["rejected"]["checksum"] == 1 and remote["rejected"]["identity"] == 1
    assert remote["hits"] == 0 and b.stats()["pages"]["dram"] == 0
    assert restore(b, ns, hashes[:2]) == payloads[:2]  # the intact pages still restore


def _copy_value(cluster: RedisNodes, source: bytes, target: bytes) -> None:
    """Copy a value between keys (on whichever primaries serve them)."""
    value = redis.Redis(port=cluster.primary_of(source)).get(source)
    assert value
    _put(cluster, target, value)


def _put(cluster: RedisNodes, key: bytes, value: bytes) -> None:
    redis.Redis(port=cluster.primary_of(key)).set(key, value)


def test_with_a_key_file_values_under_another_key_or_without_the_mac_are_refused(cluster, manager_factory, tmp_path):
    key_file = tmp_path / "remote.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    a, b = hosts(manager_factory, cluster.url, "--remote-key-file", str(key_file))
    ns = namespace("mac")
    hashes, payloads = make_pages(ns, 4)
    save(a, ns, hashes, payloads)
    _copy_value(cluster, remote_key((ns, 0, hashes[0])), remote_key((ns, 0, hashes[1])))
    # a forger who can write the store but lacks the key: a well-formed page, right checksum, no MAC
    forged = os.urandom(PAGE)
    for i, mac_key in ((2, None), (3, read_mac_key_bytes(tmp_path, os.urandom(32)))):  # no MAC; another key's MAC
        page = (ns, 0, hashes[i])
        _put(cluster, remote_key(page), encode_value(page, checksum(forged), "", forged, mac_key))
    for i in (1, 2, 3):
        assert restore(b, ns, hashes[i : i + 1]) is None
    remote = b.stats()["remote"]
    assert remote["rejected"] == {"format": 0, "identity": 1, "mac": 2, "checksum": 0}
    assert restore(b, ns, hashes[:1]) == payloads[:1]  # the genuine one


def read_mac_key_bytes(folder: Path, secret: bytes) -> bytes:
    path = folder / "other.key"
    path.write_bytes(secret)
    return read_mac_key(str(path))


def test_without_a_key_file_the_store_is_trusted_as_the_readme_says(cluster, manager_factory):
    _, b = hosts(manager_factory, cluster.url)
    ns = namespace("trusted")
    hashes, _ = make_pages(ns, 1)
    forged = os.urandom(PAGE)
    page = (ns, 0, hashes[0])
    _put(cluster, remote_key(page), encode_value(page, checksum(forged), "", forged, None))
    assert restore(b, ns, hashes) == [forged]  # whoever can write the store writes pages every host restores
    text = " ".join(README.read_text().split())
    assert "Without --remote-key-file the store is trusted like the hosts themselves" in text


def test_a_paused_store_never_holds_up_saves_or_lookups_and_drops_are_counted(cluster, manager_factory):
    a = manager_factory(pool="32mb", extra=("--remote", cluster.url, *FAST, "--remote-queue", "4"))
    ns = namespace("paused")
    hashes, payloads = make_pages(ns, 48)
    with CacheClient(a.endpoint) as c:
        assert c.lookup(ns, {0: hashes[:1]})[0]["remote"] == []  # connected and answering
    pause_ms = 15000
    primaries = cluster.primaries()  # CLUSTER NODES itself waits while paused
    began = time.monotonic()
    for port in primaries:
        cli(port, "CLIENT", "PAUSE", str(pause_ms), "WRITE")
    try:
        slowest = 0.0
        with CacheClient(a.endpoint) as c:
            for i in range(0, 48, 4):
                t = time.monotonic()
                c.store(ns, 0, list(zip(hashes[i : i + 4], payloads[i : i + 4], strict=True)))
                c.lookup(ns, {0: [os.urandom(16) for _ in range(8)]})  # misses everywhere: asks the store
                slowest = max(slowest, time.monotonic() - t)
            stats = c.stats()
        elapsed = time.monotonic() - began
        assert elapsed < pause_ms / 1000 - 3, elapsed  # all of it while the store was still paused
        assert slowest < 2.0, slowest  # a lookup: its call plus a slot-map refresh, each within --remote-timeout
        remote = stats["remote"]
        dropped = sum(remote["dropped"].values())
        assert dropped > 0 and remote["pages_written"] == 0, remote
        assert remote["queue_depth"] + dropped + remote["pages_written"] <= 48
        assert remote["breaker_trips"] >= 1 and remote["failures"] >= 3
    finally:
        for port in primaries:
            cli(port, "CLIENT", "UNPAUSE")
    # the store answers again: after the breaker's pause, new pages are written
    late, late_payloads = make_pages(ns, 2, seed=7)
    time.sleep(1.2)
    with CacheClient(a.endpoint) as c:
        c.store(ns, 0, list(zip(late, late_payloads, strict=True)))
    wait_for(lambda: a.stats()["remote"]["pages_written"] >= 2, "writes after the pause")


def test_a_primary_killed_during_restores_never_yields_a_wrong_page_and_failover_restores_again(
    manager_factory, tmp_path
):
    cluster = RedisNodes(tmp_path / "redis").start()
    try:
        a, b = hosts(manager_factory, cluster.url)
        ns = namespace("failover")
        sets = []
        for seed in range(10):
            hashes, payloads = make_pages(ns, 3, seed=seed)
            sets.append((hashes, payloads))
        with CacheClient(a.endpoint) as c:
            for hashes, payloads in sets:
                c.store(ns, 0, list(zip(hashes, payloads, strict=True)))
        written(a, 30)
        wait_for(lambda: _replicated(cluster), "replicas caught up")
        assert restore(b, ns, sets[0][0]) == sets[0][1]
        cluster.kill(cluster.primaries()[0])
        outcomes = []
        for hashes, payloads in sets[1:6]:
            got = restore(b, ns, hashes)
            assert got is None or got == payloads  # restored correctly, or a miss (recompute)
            outcomes.append(got is not None)
        cluster.wait_ok(timeout=30)  # a replica took over
        # every set not yet held by B restores again, from the store, once the breaker lets it
        for hashes, payloads in sets[1:]:
            wait_for(lambda h=hashes, p=payloads: restore(b, ns, h) == p, "a restore after failover", 20)
        remote = b.stats()["remote"]
        assert remote["hits"] == 30 and remote["bytes_read"] == 30 * PAGE
        assert sum(remote["rejected"].values()) == 0
    finally:
        cluster.stop()


def _replicated(cluster: RedisNodes) -> bool:
    keys = {p: int(cli(p, "DBSIZE").strip()) for p in cluster.alive()}
    primaries = cluster.primaries()
    return sum(keys[p] for p in primaries) == sum(n for p, n in keys.items() if p not in primaries) > 0


# -- the value format ------------------------------------------------------------------------


@given(
    payload=st.binary(min_size=1, max_size=512),
    position=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
    tag=st.text(max_size=12),
)
def test_any_changed_byte_of_a_mac_carrying_value_is_refused(payload, position, flip, tag):
    mac_key = bytes(range(64))
    key = ("model:bf16:nhd:p16:r0", 1, b"\x07" * 16)
    value = bytearray(encode_value(key, checksum(payload), tag, payload, mac_key))
    page = decode_value(bytes(value), key, mac_key)
    assert bytes(page.payload) == payload and page.checksum == checksum(payload) and page.tag == tag
    value[position % len(value)] ^= flip
    with pytest.raises(RemoteValueError):
        decode_value(bytes(value), key, mac_key)


@given(payload=st.binary(min_size=1, max_size=256), position=st.integers(min_value=0))
def test_without_a_mac_a_changed_header_or_payload_byte_is_still_refused(payload, position):
    key = ("model:bf16:nhd:p16:r0", 0, b"\x01" * 16)
    value = bytearray(encode_value(key, checksum(payload), "t", payload, None))
    value[position % len(value)] ^= 0x5A
    with pytest.raises(RemoteValueError):
        decode_value(bytes(value), key, None)


def test_a_value_is_refused_for_any_other_identity():
    payload = os.urandom(64)
    key = ("ns:a", 0, b"\x01" * 16)
    value = encode_value(key, checksum(payload), "", payload, None)
    for other in (("ns:b", 0, b"\x01" * 16), ("ns:a", 1, b"\x01" * 16), ("ns:a", 0, b"\x02" * 16)):
        with pytest.raises(RemoteValueError) as err:
            decode_value(value, other, None)
        assert err.value.reason == "identity"
    assert len({remote_key(k) for k in (key, ("ns:b", 0, b"\x01" * 16), ("ns:a", 1, b"\x01" * 16))}) == 3


def test_remote_urls():
    c = RemoteConfig.from_url("redis://10.0.0.1:6379,10.0.0.2:6380")
    assert c.nodes == (("10.0.0.1", 6379), ("10.0.0.2", 6380)) and not c.tls and c.password is None
    c = RemoteConfig.from_url("rediss://cache:p%40ss@[::1]:7000")
    assert c.nodes == (("::1", 7000),) and c.tls and c.username == "cache" and c.password == "p@ss"
    c = RemoteConfig.from_url("redis://secret@host:1")
    assert c.username is None and c.password == "secret"
    for bad in ("http://h:1", "redis://h", "redis://h:x", "redis://:1", "h:1"):
        with pytest.raises(ValueError):
            RemoteConfig.from_url(bad)


# -- the command line, and a store that is not there -----------------------------------------


def test_bad_remote_flags_stop_the_manager_at_start_with_one_line(tmp_path, sock_dir):
    short = tmp_path / "short.key"
    short.write_text("too short")
    addr = f"unix://{sock_dir / 'm.sock'}"
    cases = [
        (("--remote", "http://127.0.0.1:6379"), "must start with redis://"),
        (("--remote", "redis://127.0.0.1"), "must be HOST:PORT"),
        (("--remote-key-file", str(short)), "--remote-key-file needs --remote"),
        (("--remote", "redis://127.0.0.1:6379", "--remote-key-file", str(short)), "needs at least 16"),
        (("--remote", "redis://127.0.0.1:6379", "--remote-timeout", "0"), "--remote-timeout"),
    ]
    for flags, message in cases:
        out = subprocess.run(
            [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", addr, "--pool-size", "8mb", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (flags, out.stderr)
        assert out.stderr.startswith("error: ") and message in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_store_that_is_down_is_a_paused_tier_not_a_failed_manager(manager_factory):
    dead = free_ports(1, bus=False)[0]  # nothing listens there
    m = manager_factory(pool="16mb", extra=("--remote", f"redis://127.0.0.1:{dead}", *FAST))
    ns = namespace("down")
    hashes, payloads = make_pages(ns, 4)
    with CacheClient(m.endpoint) as c:
        t = time.monotonic()
        assert c.store(ns, 0, list(zip(hashes, payloads, strict=True))) == 4 * PAGE
        for _ in range(4):
            assert c.lookup(ns, {0: [*hashes, os.urandom(16)]})[0] == {"dram": [0, 1, 2, 3], "ssd": [], "remote": []}
        assert c.read_recovery(ns, 0, [(0, [os.urandom(16)])]) is None  # a plain miss
        assert [bytes(b) for b in (restore(m, ns, hashes) or [])] == payloads
        assert time.monotonic() - t < 10
        remote = c.stats()["remote"]
    assert not remote["connected"] and remote["failures"] >= 3 and remote["breaker_trips"] >= 1
    out = subprocess.run(
        [sys.executable, "-m", "cacheon_orbitkv.manager", "stats", "--addr", m.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split("  ")[1].strip(): line for line in out.stdout.splitlines()[1:] if line.startswith("  ")}
    assert "remote" in rows and ("PAUSED" in rows["remote"] or "active" in rows["remote"]), out.stdout
    assert "failures" in out.stdout and "from the remote store" in out.stdout


def test_a_store_that_accepts_and_never_answers_holds_no_call_past_the_timeout(manager_factory):
    with socket.socket() as silent:  # the kernel completes connections; nothing ever replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        m = manager_factory(pool="16mb", extra=("--remote", f"redis://127.0.0.1:{port}", *FAST))
        ns = namespace("silent")
        hashes, payloads = make_pages(ns, 2)
        with CacheClient(m.endpoint) as c:
            slowest = 0.0
            for _ in range(3):
                t = time.monotonic()
                assert c.lookup(ns, {0: hashes})[0]["remote"] == []
                assert c.read_recovery(ns, 0, [(0, hashes)]) is None
                slowest = max(slowest, time.monotonic() - t)
            t = time.monotonic()
            assert c.store(ns, 0, list(zip(hashes, payloads, strict=True))) == 2 * PAGE
            assert time.monotonic() - t < 0.5  # a save never waits for the store
            remote = c.stats()["remote"]
    assert slowest < 1.6, slowest  # a lookup and a recovery, each at most --remote-timeout (0.5 s)
    assert not remote["connected"] and remote["breaker_trips"] >= 1
