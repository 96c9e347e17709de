"""The manager's page state against a dictionary oracle: whatever sequence of reserves, writes,
commits (good, bad, or with a checksum that does not match the bytes), aborts, lookups, recoveries,
releases, evictions, expiries, disconnects and restarts on the same SSD file, no read returns bytes
the oracle does not hold for that key, no extent is owned twice, and the counts add up."""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import tempfile
import time
from pathlib import Path

import attrs
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cacheon_orbitkv.client import LeasedPages
from cacheon_orbitkv.extents import ExtentAllocator
from cacheon_orbitkv.manager import CacheManager
from cacheon_orbitkv.wire import BadRequest, PoolFull, UnknownLease, checksum

BLOCK = 4096
POOL = 16 * BLOCK
SSD_CAPACITY = 12 * BLOCK
NAMESPACES = ("ns-a", "ns-b")
HASHES = [bytes([i]) * 16 for i in range(6)]
LENGTHS = (BLOCK, 2 * BLOCK, 3 * BLOCK - 40)  # the last one ragged: a tail short of a block
CLIENTS = (1, 2)

Key = tuple[str, int, bytes]


@attrs.define
class Held:
    """A reservation as its writer sees it."""

    client: int
    namespace: str
    group: int
    tag: str
    slots: list[tuple[bytes, int, int] | None]
    payloads: list[bytes | None] | None = None


def assert_partition(allocator: ExtentAllocator, owned: list[tuple[int, int]], where: str) -> None:
    spans = sorted([*((o, allocator.rounded(n)) for o, n in owned), *allocator.free_extents()])
    position = 0
    for start, size in spans:
        assert start == position, f"{where}: extent at {start} overlaps or leaves a gap before it ({position})"
        position += size
    assert position == allocator.capacity, f"{where}: extents cover {position} of {allocator.capacity} bytes"


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="okv-sm-"))
        self.loop = asyncio.new_event_loop()
        self.manager = self._start()
        self.oracle: dict[Key, tuple[bytes, str]] = {}  # bytes and tag of the commit that indexed the key
        self.held: dict[int, Held] = {}
        self.leases: dict[int, tuple[int, int]] = {}  # lease -> (client, pages)
        self.version = 0
        self.healthy_fd: int | None = None  # the SSD file's writable descriptor while the disk "fails"

    def _start(self) -> CacheManager:
        return CacheManager(
            POOL,
            ssd_path=str(self.dir / "ssd.bin"),
            ssd_capacity=SSD_CAPACITY,
            block=BLOCK,
            lease_ttl=1e6,
            reserve_ttl=1e6,
        )

    def teardown(self) -> None:
        self.disk_recovers()
        self.manager.close()
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- writes ------------------------------------------------------------------------------

    @rule(
        client=st.sampled_from(CLIENTS),
        namespace=st.sampled_from(NAMESPACES),
        group=st.integers(0, 1),
        pages=st.lists(st.tuples(st.sampled_from(HASHES), st.sampled_from(LENGTHS)), min_size=1, max_size=4),
        tag=st.sampled_from(("", "nhd", "hnd")),
    )
    def reserve(self, client: int, namespace: str, group: int, pages: list[tuple[bytes, int]], tag: str) -> None:
        args = {"namespace": namespace, "group": group, "pages": [list(p) for p in pages], "tag": tag}
        try:
            reply = self.manager.op_reserve(client, args)
        except (PoolFull, OSError):  # OSError: a failed demotion, answered InternalError by the server
            return
        slots = [None if s is None else (digest, s[0], s[1]) for (digest, _), s in zip(pages, reply["slots"])]
        self.held[reply["reservation"]] = Held(client, namespace, group, tag, slots)

    @rule(
        client=st.sampled_from(CLIENTS),
        namespace=st.sampled_from(NAMESPACES),
        group=st.integers(0, 1),
        pages=st.lists(st.tuples(st.sampled_from(HASHES), st.sampled_from(LENGTHS)), min_size=1, max_size=4),
        tag=st.sampled_from(("", "nhd")),
    )
    def store(self, client: int, namespace: str, group: int, pages: list[tuple[bytes, int]], tag: str) -> None:
        """Reserve, write and commit in one step, the way a save usually goes."""
        before = set(self.held)
        self.reserve(client, namespace, group, pages, tag)
        for rid in set(self.held) - before:
            self._write(rid)
            self._commit(rid, bad=False, honest=True)

    @precondition(lambda self: any(h.payloads is None for h in self.held.values()))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        self._write(data.draw(st.sampled_from(sorted(r for r, h in self.held.items() if h.payloads is None))))

    def _write(self, rid: int) -> None:
        held = self.held[rid]
        held.payloads = []
        for slot in held.slots:
            if slot is None:
                held.payloads.append(None)
                continue
            self.version += 1
            _, offset, length = slot
            payload = (self.version.to_bytes(8, "little") + bytes(range(offset % 200, offset % 200 + 8))) * length
            payload = payload[:length]
            self.manager.arena[offset : offset + length] = payload
            held.payloads.append(payload)

    @precondition(lambda self: any(h.payloads is not None for h in self.held.values()))
    @rule(data=st.data(), bad=st.booleans(), honest=st.booleans())
    def commit(self, data: st.DataObject, bad: bool, honest: bool) -> None:
        self._commit(
            data.draw(st.sampled_from(sorted(r for r, h in self.held.items() if h.payloads is not None))), bad, honest
        )

    def _commit(self, rid: int, bad: bool, honest: bool) -> None:
        held = self.held[rid]
        assert held.payloads is not None
        # A writer whose checksum does not match its bytes (a torn copy) commits a page no tier
        # verification will pass; what the oracle holds is still what was written.
        sums = [None if p is None else checksum(p) ^ (0 if honest else 1) for p in held.payloads]
        if bad and any(s is not None for s in sums):
            last = max(i for i, s in enumerate(sums) if s is not None)
            before = self._index_keys()
            try:
                self.manager.op_commit(
                    held.client, {"reservation": rid, "checksums": [*sums[:last], "x", *sums[last + 1 :]]}
                )
            except BadRequest:
                pass
            else:
                raise AssertionError("a commit with a checksum that is not an integer was accepted")
            assert self._index_keys() == before
            return
        present = self._index_keys()
        for slot, payload in zip(held.slots, held.payloads):
            if slot is not None and payload is not None:
                key = (held.namespace, held.group, slot[0])
                if key not in present:
                    present.add(key)
                    self.oracle[key] = (payload, held.tag)
        self.manager.op_commit(held.client, {"reservation": rid, "checksums": sums})
        del self.held[rid]

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.held)))
        self.manager.op_abort(self.held.pop(rid).client, {"reservation": rid})

    # -- reads -------------------------------------------------------------------------------

    @rule(namespace=st.sampled_from(NAMESPACES), group=st.integers(0, 1), hashes=st.lists(st.sampled_from(HASHES)))
    def lookup(self, namespace: str, group: int, hashes: list[bytes]) -> None:
        found = self.manager.op_lookup(0, {"namespace": namespace, "groups": {group: hashes}})[group]
        for position in found["dram"] + found["ssd"]:
            assert (namespace, group, hashes[position]) in self.oracle, "lookup found a page never committed"

    @rule(
        client=st.sampled_from(CLIENTS),
        namespace=st.sampled_from(NAMESPACES),
        ranges=st.lists(
            st.tuples(st.integers(0, 1), st.lists(st.sampled_from(HASHES), min_size=1, max_size=3)),
            min_size=1,
            max_size=2,
        ),
    )
    def read_recovery(self, client: int, namespace: str, ranges: list[tuple[int, list[bytes]]]) -> None:
        args = {"namespace": namespace, "boundary": 0, "ranges": [[g, h] for g, h in ranges]}
        before = copy.deepcopy(self.manager.op_stats(0, {}))
        try:
            reply = self.loop.run_until_complete(self.manager.op_read_recovery(client, args))
        except (PoolFull, OSError):
            event("recovery: pool full or a failed demotion")
            return
        after = self.manager.op_stats(0, {})
        if after["corrupt"] > before["corrupt"]:
            event("recovery: a page failed its checksum on SSD")
        if not reply["hit"]:
            event("recovery: miss")
            return
        event("recovery: hit, promoted from SSD" if after["hits"]["ssd"] > before["hits"]["ssd"] else "recovery: hit")
        assert [entry[0] for entry in reply["pages"]] == [g for g, _ in ranges]
        count = 0
        for (group, hashes), entry in zip(ranges, reply["pages"]):
            refs = LeasedPages.unpack(entry[1:], len(hashes))  # ProtocolError unless one per hash
            for digest, (offset, length, _crc, tag) in zip(hashes, refs, strict=True):
                key = (namespace, group, digest)
                assert key in self.oracle, "a recovery leased a page never committed"
                payload, committed_tag = self.oracle[key]
                assert bytes(self.manager.arena[offset : offset + length]) == payload, "wrong bytes served"
                assert tag == committed_tag
                count += 1
        self.leases[reply["lease"]] = (client, count)

    @precondition(lambda self: bool(self.oracle))
    @rule(data=st.data(), client=st.sampled_from(CLIENTS))
    def recover_committed(self, data: st.DataObject, client: int) -> None:
        """A recovery of pages once committed (they may have been forgotten since)."""
        namespace, group, first = data.draw(st.sampled_from(sorted(self.oracle)))
        more = sorted(k[2] for k in self.oracle if k[:2] == (namespace, group))
        hashes = [first, *data.draw(st.lists(st.sampled_from(more), max_size=3))]
        self.read_recovery(client, namespace, [(group, hashes)])

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data(), wrong_client=st.booleans())
    def release(self, data: st.DataObject, wrong_client: bool) -> None:
        lease = data.draw(st.sampled_from(sorted(self.leases)))
        client = self.leases[lease][0]
        if wrong_client:
            try:
                self.manager.op_release(3 - client, {"lease": lease})
            except UnknownLease:
                return
            raise AssertionError("a client released another client's lease")
        self.manager.op_release(client, {"lease": lease})
        del self.leases[lease]

    # -- pressure, time, failures ------------------------------------------------------------

    @rule(times=st.integers(1, 6))
    def evict(self, times: int) -> None:
        for _ in range(times):
            try:
                self.manager.pages.evict_one()
            except OSError:
                event("eviction: demotion failed")
                return

    @rule(client=st.sampled_from(CLIENTS))
    def pressure(self, client: int) -> None:
        """A large reservation evicts what it must, then goes away."""
        try:
            reply = self.manager.op_reserve(client, {"namespace": "filler", "group": 0, "pages": [[b"big", POOL // 2]]})
        except (PoolFull, OSError):
            return
        self.manager.op_abort(client, {"reservation": reply["reservation"]})

    @rule()
    def expire(self) -> None:
        self.manager.pages.reclaim(now=time.monotonic() + 2e6)
        self.held.clear()
        self.leases.clear()

    @rule(client=st.sampled_from(CLIENTS))
    def disconnect(self, client: int) -> None:
        self.manager.pages.reclaim(client)
        self.held = {r: h for r, h in self.held.items() if h.client != client}
        self.leases = {lease: v for lease, v in self.leases.items() if v[0] != client}

    @rule(orderly=st.booleans())
    def restart(self, orderly: bool) -> None:
        self.disk_recovers()  # the new manager must be able to lock the file
        event(f"restart ({'orderly' if orderly else 'close'}) with {len(self.manager.pages.lru)} DRAM pages")
        if orderly:
            self.manager.shutdown(5.0)  # DRAM pages go to the SSD tier first
        else:
            self.manager.close()
        self.manager = self._start()
        self.held.clear()
        self.leases.clear()

    @rule()
    def disk_fails(self) -> None:
        """Writes to the SSD file fail from now on (EBADF: its descriptor is swapped for a read-only
        one); reads still work."""
        ssd = self.manager.ssd
        assert ssd is not None
        if self.healthy_fd is None:
            self.healthy_fd = os.dup(ssd._fd)
            read_only = os.open(ssd.path, os.O_RDONLY)
            os.dup2(read_only, ssd._fd)
            os.close(read_only)

    @rule()
    def disk_recovers(self) -> None:
        if self.healthy_fd is not None:
            assert self.manager.ssd is not None
            os.dup2(self.healthy_fd, self.manager.ssd._fd)
            os.close(self.healthy_fd)
            self.healthy_fd = None
            self.manager.pages._ssd_failed_until = 0.0  # the next eviction writes again

    # -- invariants --------------------------------------------------------------------------

    def _index_keys(self) -> set[Key]:
        return {page.key for page in self.manager.pages.index.values()}

    @invariant()
    def no_extent_is_owned_twice(self) -> None:
        store = self.manager.pages
        pages = store.index.values()
        dram = [(p.dram, p.length) for p in pages if p.dram is not None]
        dram += [(s[1], s[2]) for res in store.reservations.values() for s in res.slots if s is not None]
        assert_partition(store.allocator, dram, "DRAM")
        assert store.ssd is not None
        assert_partition(store.ssd.allocator, [(e.offset, e.length) for e in store.ssd.entries.values()], "SSD")
        assert set(store.lru) == {p for p in pages if p.dram is not None}  # the indexed objects themselves
        for page in pages:  # every indexed page has its bytes somewhere
            assert page.dram is not None or page.key in store.ssd.entries
        for key, entry in store.ssd.entries.items():
            page = store.index.get(key)
            assert page is not None and (page.length, page.checksum, page.tag) == (
                entry.length,
                entry.checksum,
                entry.tag,
            )

    @invariant()
    def counts_match(self) -> None:
        stats = self.manager.op_stats(0, {})
        assert stats["leases"] == len(self.leases)
        assert stats["reservations"] == len(self.held)
        assert stats["promoting"] == 0
        assert sum(p.leases for p in self.manager.pages.index.values()) == sum(n for _, n in self.leases.values())
        assert stats["pages"]["dram"] + stats["pages"]["ssd"] >= len(self._index_keys())


ManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_manager_page_state_against_an_oracle = ManagerMachine.TestCase
