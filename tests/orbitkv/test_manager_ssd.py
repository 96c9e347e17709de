"""The SSD tier of a real manager process: its lock, its format version, eviction when it is full,
a failed demotion, and the pages an orderly stop writes there for the next manager."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import msgpack

from cacheon_orbitkv.client import CacheClient, page_hashes
from cacheon_orbitkv.wire import InternalError

NS = "model-0123:bf16:nhd:p16:r0"
PAGE = 64 << 10


def pages(n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    hashes = page_hashes(NS, [seed * 1_000_000 + t for t in range(16 * n)], 16)
    return hashes, [os.urandom(PAGE) for _ in range(n)]


def read_back(c: CacheClient, hashes: list[bytes]) -> list[bytes]:
    rec = c.read_recovery(NS, 0, [(0, hashes)])
    assert rec is not None
    try:
        return [bytes(c.verified(ref)) for ref in rec.pages[0]]
    finally:
        c.release(rec.lease)


def test_a_second_manager_on_the_same_ssd_file_stops_at_start_with_one_clear_line(manager_factory, sock_dir):
    first = manager_factory(ssd=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cacheon_orbitkv.manager",
            "--addr",
            f"unix://{sock_dir / 'second.sock'}",
            "--pool-size",
            "8mb",
            "--ssd-cache-path",
            str(first.ssd_path),
            "--ssd-cache-capacity",
            "256mb",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: SSD tier {first.ssd_path} is locked by another running cache manager; "
        "give each manager its own --ssd-cache-path"
    )
    assert "Traceback" not in out.stderr and "ready" not in out.stdout
    with CacheClient(first.endpoint) as c:  # the first one is untouched
        assert c.stats()["pages"]["ssd"] == 0


def test_an_ssd_index_of_another_format_is_refused_and_the_tier_starts_empty(manager_factory, tmp_path):
    hashes, data = pages(40)
    ssd_path = tmp_path / "ssd.bin"
    ssd_path.write_bytes(data[0] * 4)
    with open(f"{ssd_path}.index", "wb") as fh:  # format 1: no header, 7-field records of sum64 pages
        for i in range(4):
            fh.write(msgpack.packb(["put", NS, 0, hashes[i], i * PAGE, PAGE, 12345], use_bin_type=True))
    m = manager_factory(pool="1mb", ssd=True)
    assert m.ssd_path == ssd_path
    with CacheClient(m.endpoint) as c:
        assert c.lookup(NS, {0: hashes[:4]})[0] == {"dram": [], "ssd": []}
        assert c.stats()["pages"]["ssd"] == 0 and c.stats()["free_bytes"]["ssd"] == 256 << 20
        c.store(NS, 0, list(zip(hashes, data, strict=True)))  # the data file is reused
        on_ssd = c.lookup(NS, {0: hashes})[0]["ssd"]
        assert len(on_ssd) >= 20
        assert read_back(c, [hashes[i] for i in on_ssd[:3]]) == [data[i] for i in on_ssd[:3]]
    log = m.log.read_text()
    assert (
        f"SSD tier {ssd_path}: its index {ssd_path}.index has no format header (format 1, sum64 checksums), "
        "this manager reads format 2 with checksum 'mix64': starting with the SSD tier empty" in log
    )
    m.stop()
    with open(f"{ssd_path}.index", "rb") as fh:
        assert next(msgpack.Unpacker(fh, raw=False)) == ["orbitkv-ssd", 2, "mix64"]
    # A header naming a later format is refused the same way.
    index = (tmp_path / "ssd.bin.index").read_bytes()
    header = msgpack.packb(["orbitkv-ssd", 2, "mix64"], use_bin_type=True)
    (tmp_path / "ssd.bin.index").write_bytes(msgpack.packb(["orbitkv-ssd", 3, "mix64"]) + index[len(header) :])
    later = manager_factory(pool="1mb", ssd=True)
    with CacheClient(later.endpoint) as c:
        assert c.lookup(NS, {0: hashes})[0] == {"dram": [], "ssd": []}
    assert "has format 3 with checksum 'mix64', this manager reads format 2" in later.log.read_text()


def test_a_full_ssd_tier_drops_its_least_recently_used_pages(manager_factory):
    m = manager_factory(pool="1mb", ssd=True, ssd_capacity="1mb")  # 16 pages in each tier
    hashes, data = pages(40)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes[:32], data[:32], strict=True)))
        assert c.lookup(NS, {0: hashes[:32]})[0] == {"dram": list(range(16, 32)), "ssd": list(range(16))}
        assert read_back(c, [hashes[0]]) == [data[0]]  # page 0 is used again: the tier keeps it
        c.store(NS, 0, list(zip(hashes[32:], data[32:], strict=True)))
        found = c.lookup(NS, {0: hashes})[0]
        stats = c.stats()
        assert stats["pages"]["ssd"] == 16 and stats["free_bytes"]["ssd"] == 0
        assert 0 in found["dram"] + found["ssd"]
        assert not set(found["dram"] + found["ssd"]) & set(range(1, 9))  # the oldest unused went first
        assert set(range(32, 40)) <= set(found["dram"])
        assert read_back(c, [hashes[i] for i in found["dram"]]) == [data[i] for i in found["dram"]]
        oldest = found["ssd"][0]  # promoting it makes room on SSD again: read it alone
        assert read_back(c, [hashes[oldest]]) == [data[oldest]]
        assert c.stats()["corrupt"] == 0


def test_an_orderly_stop_writes_the_hottest_dram_pages_to_ssd_for_the_next_manager(manager_factory):
    m = manager_factory(pool="4mb", ssd=True, ssd_capacity="2mb")  # 64 pages of DRAM, 32 of SSD
    hashes, data = pages(48)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, data, strict=True)))
        assert read_back(c, hashes[:4]) == data[:4]  # the hottest pages now
        assert c.lookup(NS, {0: hashes})[0]["ssd"] == []  # nothing was evicted
    assert m.stop() == 0  # SIGTERM
    assert "wrote 32 DRAM pages to the SSD tier" in m.log.read_text()
    restarted = manager_factory(pool="4mb", ssd=True, ssd_capacity="2mb")
    with CacheClient(restarted.endpoint) as c:
        # Most recently used first, as many as fit: pages 0-3, then the last stored back to page 20.
        hot = [*range(4), *range(20, 48)]
        assert c.lookup(NS, {0: hashes})[0] == {"dram": [], "ssd": hot}
        assert read_back(c, [hashes[i] for i in hot]) == [data[i] for i in hot]
        assert c.stats()["corrupt"] == 0


def test_a_failed_demotion_leaves_the_page_in_dram_and_the_connection_serving(manager_factory, tmp_path):
    (tmp_path / "ssd.bin").write_bytes(b"\0" * (4 << 20))  # full size already: no growth past the limit
    m = manager_factory(pool="1mb", ssd=True, ssd_capacity="4mb")
    # From now on its writes at or past 1 MiB fail with EFBIG (Python ignores SIGXFSZ): the first
    # 16 SSD pages fit, the 17th demotion fails in the kernel.
    resource.prlimit(m.proc.pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    hashes, data = pages(33)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes[:32], data[:32], strict=True)))
        assert c.lookup(NS, {0: hashes[:32]})[0] == {"dram": list(range(16, 32)), "ssd": list(range(16))}
        before = c.stats()
        try:
            c.store(NS, 0, [(hashes[32], data[32])])
        except InternalError as exc:
            assert "File too large" in str(exc) and "'reserve' failed inside the manager" in str(exc)
        else:
            raise AssertionError("a demotion past the file size limit succeeded")
        # Same connection, still served; the page that failed to move is in DRAM, intact.
        assert c.lookup(NS, {0: hashes})[0] == {"dram": list(range(16, 32)), "ssd": list(range(16))}
        after = c.stats()
        assert after["free_bytes"] == before["free_bytes"] and after["reservations"] == 0
        assert after["pages"] == before["pages"] == {"dram": 16, "ssd": 16}
        assert read_back(c, hashes[16:32]) == data[16:32]
        # While the disk keeps failing, evictions drop pages instead: saves go on, DRAM-only.
        c.store(NS, 0, [(hashes[32], data[32])])
        assert c.lookup(NS, {0: hashes})[0] == {"dram": list(range(17, 33)), "ssd": list(range(16))}
        assert read_back(c, hashes[17:33]) == data[17:33]
        assert c.stats()["free_bytes"]["ssd"] == before["free_bytes"]["ssd"]
    log = m.log.read_text()
    assert "the page stays in DRAM; evictions drop pages for the next 30 s: [Errno 27] File too large" in log
    assert "Traceback" in log


def test_the_shutdown_timeout_bounds_what_an_orderly_stop_writes(manager_factory):
    m = manager_factory(pool="4mb", ssd=True, extra=("--shutdown-timeout", "0"))
    hashes, data = pages(8)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, data, strict=True)))
    assert m.stop() == 0
    assert "shutdown timeout: 0 DRAM pages written to SSD, the rest are dropped" in m.log.read_text()
    restarted = manager_factory(pool="4mb", ssd=True)
    with CacheClient(restarted.endpoint) as c:
        assert c.lookup(NS, {0: hashes})[0] == {"dram": [], "ssd": []}


def test_a_dram_page_changed_after_its_commit_never_reaches_the_ssd_tier(manager_factory):
    """Bytes are verified where they cross a tier: a committed DRAM page scribbled over (by a client
    with the arena mapped) is dropped and counted when it is evicted, not demoted; the others are."""
    m = manager_factory(pool="1mb", ssd=True)  # 16 pages of DRAM
    hashes, data = pages(8)
    with CacheClient(m.endpoint) as c:
        c.store(NS, 0, list(zip(hashes, data, strict=True)))
        rec = c.read_recovery(NS, 0, [(0, hashes[:1])])
        assert rec is not None
        c.view[rec.pages[0][0].offset + 8] ^= 0x01  # one bit of the first page
        c.release(rec.lease)
        more, more_data = pages(16, seed=1)
        c.store(NS, 0, list(zip(more, more_data, strict=True)))  # evicts the first 8 pages
        stats = c.stats()
        assert stats["corrupt"] == 1
        found = c.lookup(NS, {0: hashes})[0]
        assert sorted(found["dram"] + found["ssd"]) == list(range(1, 8))  # the changed page is gone
        assert read_back(c, hashes[1:]) == data[1:]
