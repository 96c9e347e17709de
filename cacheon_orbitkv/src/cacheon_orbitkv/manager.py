"""``orbitkv-cache-manager``: the per-host cache manager process (also runs embedded, in a thread).

State lives on one asyncio loop; SSD reads and writes run in threads and report back to it.

- Arena: one shared-memory file under /dev/shm (mode 0600) that clients map; the manager hands
  out extents of it, and clients copy page bytes straight in and out.
- Keys: ``(namespace, group, page hash)``; the client chains page hashes over token ids, so equal
  prefixes share pages and a changed namespace (model, dtype, layout, page size, rank) misses.
- Writes: ``reserve`` (extents, possibly evicting), the client writes, ``commit`` with a checksum
  per page. Uncommitted reservations are reclaimed on timeout or disconnect.
- ``lookup``: per group and tier, which positions of a hash list are present. Reads no payload,
  reserves nothing.
- ``read_recovery``: leases every page of every required range, promoting SSD pages into the arena
  (checksum verified, at most 8 reads in flight per group), or releases all it took and reports a
  miss. Leased and reserved extents are never evicted or overwritten.
- Eviction: least recently used unleased pages; with an SSD tier they are demoted there first.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import signal
import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .extents import ExtentAllocator
from .ssd import Key, SSDTier
from .wire import (
    DEFAULT_MAX_FRAME,
    HEADER,
    PROTOCOL_VERSION,
    BadRequest,
    OrbitKVError,
    PoolFull,
    ProtocolError,
    UnknownLease,
    decode,
    encode,
    parse_size,
    prefault,
    unix_socket_path,
)

log = logging.getLogger(__name__)

ARENA_PREFIX = "orbitkv-"
STALE_ARENA_AGE_S = 10.0  # younger arenas may belong to a manager between creating and locking one


def sweep_stale_arenas(shm_dir: str, min_age: float = STALE_ARENA_AGE_S) -> list[str]:
    """Unlink the arenas of managers that died without cleaning up (SIGKILL, OOM, power loss).

    A live manager holds an exclusive ``flock`` on its arena; an arena of this user that is older
    than ``min_age``, can be locked, and whose creator pid (``orbitkv-<pid>-<token>``) is not a
    running process here has no manager. The pid check also keeps the arena of a running manager
    from a release that took no lock (a rolling upgrade). Returns the paths removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(ARENA_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # another user's, gone already, or not a regular file we may touch
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode) or now - info.st_mtime < min_age:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live manager's arena
            if _pid_alive(name[len(ARENA_PREFIX) :].split("-", 1)[0]):
                continue  # its creator still runs (in this pid namespace)
            os.unlink(path)
            removed.append(path)
            log.warning("removed the arena %s left by a manager that died (%d bytes)", path, info.st_size)
        finally:
            os.close(fd)
    return removed


def _pid_alive(text: str) -> bool:
    if not text.isdigit():
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


SSD_READS_PER_GROUP = 8


@attrs.define(eq=False)
class Page:
    key: Key
    length: int
    checksum: int
    dram: int | None = None  # arena offset
    leases: int = 0
    promoting: asyncio.Future[bool] | None = None


@attrs.define(eq=False)
class Reservation:
    id: int
    client: int
    namespace: str
    group: int
    slots: list[tuple[bytes, int, int] | None]  # (hash, offset, length) per requested page
    deadline: float


@attrs.define(eq=False)
class Lease:
    id: int
    client: int
    pages: list[Page]
    deadline: float


def _runs(
    located: list[tuple[Page, tuple[int, int, int], int]], rounded: Callable[[int], int], limit: int = 8 << 20
) -> list[list[tuple[Page, tuple[int, int, int], int]]]:
    """Group pages (sorted by SSD offset) into runs contiguous on SSD: at most ``limit`` bytes, and at
    most 500 pages (each page and its padding are two of preadv's 1024 buffers)."""
    runs: list[list[tuple[Page, tuple[int, int, int], int]]] = []
    end = -1
    size = 0
    for item in located:
        offset, length, _ = item[1]
        if runs and offset == end and size + length <= limit and len(runs[-1]) < 500:
            runs[-1].append(item)
            size += rounded(length)
        else:
            runs.append([item])
            size = rounded(length)
        end = offset + rounded(length)
    return runs


class PageIndex:
    """Committed pages by key, stored per ``(namespace, group)`` so discovery does one lookup per hash."""

    def __init__(self) -> None:
        self._tables: dict[tuple[str, int], dict[bytes, Page]] = {}
        self._empty: dict[bytes, Page] = {}

    def table(self, namespace: str, group: int) -> dict[bytes, Page]:
        return self._tables.get((namespace, group), self._empty)

    def get(self, key: Key) -> Page | None:
        return self._tables.get((key[0], key[1]), self._empty).get(key[2])

    def __contains__(self, key: Key) -> bool:
        return key[2] in self._tables.get((key[0], key[1]), self._empty)

    def __getitem__(self, key: Key) -> Page:
        return self._tables[(key[0], key[1])][key[2]]

    def __setitem__(self, key: Key, page: Page) -> None:
        self._tables.setdefault((key[0], key[1]), {})[key[2]] = page

    def pop(self, key: Key, default: Page | None = None) -> Page | None:
        table = self._tables.get((key[0], key[1]))
        if table is None:
            return default
        page = table.pop(key[2], default)
        if not table:
            del self._tables[(key[0], key[1])]
        return page

    def __delitem__(self, key: Key) -> None:
        if self.pop(key) is None:
            raise KeyError(key)

    def values(self) -> list[Page]:
        return [page for table in self._tables.values() for page in table.values()]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter("orbitkv_hits", "Pages found, per group and tier", ["group", "tier"], registry=r)
        self.misses = Counter("orbitkv_misses", "Pages not found, per group", ["group"], registry=r)
        self.bytes_in = Counter("orbitkv_bytes_in", "Payload bytes written, per tier", ["tier"], registry=r)
        self.bytes_out = Counter("orbitkv_bytes_out", "Payload bytes read or leased, per tier", ["tier"], registry=r)
        self.leases = Gauge("orbitkv_leases_held", "Leases currently held", registry=r)
        self.evictions = Counter("orbitkv_evictions", "Pages evicted from DRAM", ["to"], registry=r)
        self.latency = Histogram(
            "orbitkv_request_seconds",
            "Request latency",
            ["op"],
            registry=r,
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0),
        )


def _hashes(value: Any, what: str) -> list[bytes]:
    if not isinstance(value, list):
        raise BadRequest(f"{what} must be a list of page hashes (bytes, 1..64 long)")
    for h in value:
        if type(h) is not bytes or not 0 < len(h) <= 64:
            raise BadRequest(f"{what} must be a list of page hashes (bytes, 1..64 long), got {h!r:.40}")
    return value


def _int(value: Any, what: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise BadRequest(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{what} must be a non-empty string, got {value!r}")
    return value


class CacheManager:
    """The manager's state and protocol handlers; ``serve()`` runs it on an endpoint."""

    def __init__(
        self,
        pool_size: int,
        *,
        ssd_path: str | None = None,
        ssd_capacity: int | None = None,
        block: int = 4096,
        max_frame: int = DEFAULT_MAX_FRAME,
        lease_ttl: float = 60.0,
        reserve_ttl: float = 30.0,
        shm_dir: str = "/dev/shm",
    ) -> None:
        self.block = block
        self.max_frame = max_frame
        self.lease_ttl = lease_ttl
        self.reserve_ttl = reserve_ttl
        sweep_stale_arenas(shm_dir)
        self.arena_path = os.path.join(shm_dir, f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.arena_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Held for the manager's life: the lock is how a later manager knows this arena is in use
            # (pids say nothing across pid namespaces sharing one /dev/shm).
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, pool_size)
            self.arena = mmap.mmap(fd, pool_size)
        except BaseException:
            os.close(fd)
            os.unlink(self.arena_path)
            raise
        self._arena_lock = fd
        prefault(self.arena)
        self.allocator = ExtentAllocator(pool_size, block)
        self.ssd = SSDTier(ssd_path, ssd_capacity or 0, block) if ssd_path else None
        self.index = PageIndex()
        self.lru: OrderedDict[Key, None] = OrderedDict()  # pages with a DRAM copy, least recent first
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self._ids = 0
        self.metrics = Metrics()
        self.stats: dict[str, Any] = {
            "bytes_read": {"dram": 0, "ssd": 0},
            "bytes_written": {"dram": 0, "ssd": 0},
            "hits": {"dram": 0, "ssd": 0},
            "misses": 0,
            "evictions": 0,
            "corrupt": 0,
        }
        if self.ssd is not None:
            for key, (_, length, crc) in self.ssd.entries.items():
                self.index[key] = Page(key, length, crc)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._group_reads: dict[tuple[int, int], asyncio.Semaphore] = {}
        # Enough threads for 8 SSD reads in flight per group across several concurrent recoveries.
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="orbitkv-ssd")

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    # -- space -------------------------------------------------------------------------------

    def _allocate_dram(self, length: int) -> int:
        offset = self.allocator.allocate(length)
        while offset is None:
            if not self._evict_one():
                raise PoolFull(f"no {length}-byte extent free: every DRAM page is leased or reserved")
            offset = self.allocator.allocate(length)
        return offset

    def _evict_one(self) -> bool:
        # Demotion writes synchronously on the loop: no request can lease a page while it moves.
        for key in self.lru:
            page = self.index[key]
            if page.leases or page.promoting is not None:
                continue
            assert page.dram is not None
            offset = page.dram
            del self.lru[key]
            if self.ssd is not None and key not in self.ssd.entries:
                ssd_offset = self.ssd.allocate(page.length)
                while ssd_offset is None and self._drop_ssd_lru():
                    ssd_offset = self.ssd.allocate(page.length)
                if ssd_offset is not None:
                    payload = memoryview(self.arena)[offset : offset + page.length]
                    self.stats["bytes_read"]["dram"] += page.length
                    try:
                        written = self.ssd.write([(key, ssd_offset, payload, page.checksum)])
                    finally:
                        payload.release()
                    self.stats["bytes_written"]["ssd"] += written
                    self.metrics.bytes_in.labels("ssd").inc(written)
                    self.metrics.evictions.labels("ssd").inc()
                    page.dram = None
                    self.allocator.free(offset, page.length)
                    self.stats["evictions"] += 1
                    return True
            page.dram = None
            self.allocator.free(offset, page.length)
            if self.ssd is None or key not in self.ssd.entries:
                del self.index[key]
            self.stats["evictions"] += 1
            self.metrics.evictions.labels("dropped" if key not in self.index else "ssd").inc()
            return True
        return False

    def _drop_ssd_lru(self) -> bool:
        assert self.ssd is not None
        for key in list(self.ssd.entries):
            page = self.index.get(key)
            if page is not None and (page.leases or page.promoting is not None):
                continue
            self.ssd.delete(key)
            if page is not None and page.dram is None:
                del self.index[key]
            return True
        return False

    # -- handlers ----------------------------------------------------------------------------

    def op_hello(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "arena": self.arena_path,
            "arena_size": len(self.arena),
            "block": self.block,
            "ssd": self.ssd is not None,
            "max_frame": self.max_frame,
            "client": client,
        }

    def op_lookup(self, client: int, args: dict[str, Any]) -> dict[int, dict[str, list[int]]]:
        namespace = _str(args.get("namespace"), "namespace")
        groups = args.get("groups")
        if not isinstance(groups, dict):
            raise BadRequest("groups must be a map of group id -> page hashes")
        result: dict[int, dict[str, list[int]]] = {}
        for key, hashes in groups.items():
            group = _int(key, "group id")
            dram: list[int] = []
            ssd: list[int] = []
            table = self.index.table(namespace, group)
            for position, digest in enumerate(_hashes(hashes, f"group {group} hashes")):
                page = table.get(digest)
                if page is not None:
                    (dram if page.dram is not None else ssd).append(position)
            result[group] = {"dram": dram, "ssd": ssd}
        return result

    async def op_reserve(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        namespace = _str(args.get("namespace"), "namespace")
        group = _int(args.get("group"), "group")
        pages = args.get("pages")
        if not isinstance(pages, list) or not pages:
            raise BadRequest("pages must be a non-empty list of [hash, length]")
        slots: list[tuple[bytes, int, int] | None] = []
        try:
            for item in pages:
                if not isinstance(item, list) or len(item) != 2:
                    raise BadRequest("each page must be [hash, length]")
                digest = _hashes([item[0]], "page hash")[0]
                length = _int(item[1], "page length", 1)
                if (namespace, group, digest) in self.index:
                    slots.append(None)  # already cached: nothing to write
                    continue
                slots.append((digest, self._allocate_dram(length), length))
        except Exception:
            for slot in slots:
                if slot is not None:
                    self.allocator.free(slot[1], slot[2])
            raise
        res = Reservation(self._next_id(), client, namespace, group, slots, time.monotonic() + self.reserve_ttl)
        self.reservations[res.id] = res
        return {"reservation": res.id, "slots": [None if s is None else [s[1], s[2]] for s in slots]}

    def op_commit(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        res = self._reservation(client, args)
        checksums = args.get("checksums")
        if not isinstance(checksums, list) or len(checksums) != len(res.slots):
            raise BadRequest(f"checksums must list one value per reserved page ({len(res.slots)})")
        committed = 0
        for slot, crc in zip(res.slots, checksums, strict=True):
            if slot is None:
                continue
            digest, offset, length = slot
            key = (res.namespace, res.group, digest)
            if key in self.index:  # another client committed it meanwhile: keep one copy
                self.allocator.free(offset, length)
                continue
            page = Page(key, length, _int(crc, "checksum"), dram=offset)
            self.index[key] = page
            self.lru[key] = None
            committed += length
        del self.reservations[res.id]
        self.stats["bytes_written"]["dram"] += committed
        self.metrics.bytes_in.labels("dram").inc(committed)
        return {"committed": committed}

    def op_abort(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        self._drop_reservation(self._reservation(client, args))
        return {}

    def _reservation(self, client: int, args: dict[str, Any]) -> Reservation:
        rid = _int(args.get("reservation"), "reservation")
        res = self.reservations.get(rid)
        if res is None or res.client != client:
            raise BadRequest(f"reservation {rid} is not held by this client (expired or never made)")
        return res

    def _drop_reservation(self, res: Reservation) -> None:
        for slot in res.slots:
            if slot is not None:
                self.allocator.free(slot[1], slot[2])
        self.reservations.pop(res.id, None)

    async def op_read_recovery(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        namespace = _str(args.get("namespace"), "namespace")
        _int(args.get("boundary"), "boundary")
        ranges = args.get("ranges")
        if not isinstance(ranges, list):
            raise BadRequest("ranges must be a list of [group, [page hashes]]")
        wanted: list[tuple[int, list[bytes]]] = []
        for item in ranges:
            if not isinstance(item, list) or len(item) != 2:
                raise BadRequest("each range must be [group, [page hashes]]")
            wanted.append((_int(item[0], "group"), _hashes(item[1], "range hashes")))
        taken: list[Page] = []
        reply: list[list[Any]] = []

        def give_back() -> None:
            for page in taken:
                page.leases -= 1

        try:
            for group, hashes in wanted:
                table = self.index.table(namespace, group)
                pages = [table.get(digest) for digest in hashes]
                if any(p is None for p in pages):
                    self.stats["misses"] += 1
                    self.metrics.misses.labels(str(group)).inc()
                    give_back()
                    missing = sum(p is None for p in pages)
                    return {"hit": False, "reason": f"group {group}: {missing} of {len(hashes)} pages not cached"}
                for page in pages:
                    assert page is not None
                    page.leases += 1  # held from here: no eviction while the others load
                    taken.append(page)
                in_dram = [p for p in pages if p is not None and p.dram is not None]
                self.stats["hits"]["dram"] += len(in_dram)
                self.metrics.hits.labels(str(group), "dram").inc(len(in_dram))
                cold = [p for p in pages if p is not None and p.dram is None]
                if cold and not await self._promote(group, cold):
                    give_back()
                    self.stats["misses"] += 1
                    return {"hit": False, "reason": f"group {group}: a page failed its checksum on SSD"}
                reply.append([group, [[p.dram, p.length, p.checksum] for p in pages if p is not None]])
        except BaseException:
            give_back()
            raise
        for page in taken:
            self.lru.move_to_end(page.key)
        lease = Lease(self._next_id(), client, taken, time.monotonic() + self.lease_ttl)
        self.leases[lease.id] = lease
        leased = sum(p.length for p in taken)
        self.stats["bytes_read"]["dram"] += leased
        self.metrics.bytes_out.labels("dram").inc(leased)
        self.metrics.leases.set(len(self.leases))
        return {"hit": True, "lease": lease.id, "pages": reply}

    async def _promote(self, group: int, pages: list[Page]) -> bool:
        """Bring SSD pages into the arena, verified; False when any page's bytes are bad.

        Pages adjacent on SSD are read as one run (one ``preadv`` scattering into their arena
        extents), at most ``SSD_READS_PER_GROUP`` runs of a group in flight. A page another request
        is already promoting is awaited, not read twice.
        """
        loop = asyncio.get_running_loop()
        waiting = [p.promoting for p in pages if p.promoting is not None]
        mine = [p for p in pages if p.promoting is None and p.dram is None]
        for page in mine:
            page.promoting = loop.create_future()
        try:
            assert self.ssd is not None
            ssd = self.ssd
            located: list[tuple[Page, tuple[int, int, int], int]] = []
            try:
                for page in mine:
                    entry = ssd.entries.get(page.key)
                    if entry is None:
                        raise OrbitKVError(f"page of group {group} lost its SSD copy")
                    located.append((page, entry, self._allocate_dram(page.length)))
            except BaseException:
                for page, _, offset in located:
                    self.allocator.free(offset, page.length)
                raise
            runs = _runs(sorted(located, key=lambda item: item[1][0]), ssd.allocator.rounded)
            sem = self._group_reads.setdefault((id(loop), group), asyncio.Semaphore(SSD_READS_PER_GROUP))

            async def read(run: list[tuple[Page, tuple[int, int, int], int]]) -> list[bool]:
                async with sem:
                    return await loop.run_in_executor(self._io, ssd.read_run, [(e, o) for _, e, o in run], self.arena)

            results = await asyncio.gather(*(read(run) for run in runs))
            good_all = True
            for run, verdicts in zip(runs, results, strict=True):
                for (page, _, offset), good in zip(run, verdicts, strict=True):
                    self.stats["bytes_read"]["ssd"] += page.length
                    self.metrics.bytes_out.labels("ssd").inc(page.length)
                    if good:
                        page.dram = offset
                        self.lru[page.key] = None
                        self.stats["hits"]["ssd"] += 1
                        self.metrics.hits.labels(str(group), "ssd").inc()
                    else:
                        good_all = False
                        self.allocator.free(offset, page.length)
                        ssd.delete(page.key)
                        self.index.pop(page.key, None)
                        self.stats["corrupt"] += 1
                    assert page.promoting is not None
                    page.promoting.set_result(good)
            for future in waiting:
                good_all = await asyncio.shield(future) and good_all
            return good_all
        except BaseException as exc:
            for page in mine:
                if page.promoting is not None and not page.promoting.done():
                    page.promoting.set_exception(exc)
                    page.promoting.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            for page in mine:
                page.promoting = None

    def op_release(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        lid = _int(args.get("lease"), "lease")
        lease = self.leases.get(lid)
        if lease is None or lease.client != client:
            raise UnknownLease(f"lease {lid} is not held by this client (released, expired or never granted)")
        self._drop_lease(lease)
        return {}

    def _drop_lease(self, lease: Lease) -> None:
        for page in lease.pages:
            page.leases -= 1
        self.leases.pop(lease.id, None)
        self.metrics.leases.set(len(self.leases))

    def op_stats(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        return {
            **self.stats,
            "pages": {
                "dram": sum(p.dram is not None for p in self.index.values()),
                "ssd": len(self.ssd.entries) if self.ssd else 0,
            },
            "leases": len(self.leases),
            "reservations": len(self.reservations),
            "free_bytes": {"dram": self.allocator.free_bytes, "ssd": self.ssd.allocator.free_bytes if self.ssd else 0},
        }

    # -- connections ---------------------------------------------------------------------------

    def _reclaim(self, client: int | None = None, now: float | None = None) -> None:
        for res in list(self.reservations.values()):
            if res.client == client or (now is not None and res.deadline < now):
                self._drop_reservation(res)
        for lease in list(self.leases.values()):
            if lease.client == client or (now is not None and lease.deadline < now):
                self._drop_lease(lease)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self._reclaim(now=time.monotonic())
            if self.ssd is not None:
                self.ssd.sync()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = self._next_id()
        greeted = False
        handlers: dict[str, Callable[..., Any]] = {
            "lookup": self.op_lookup,
            "reserve": self.op_reserve,
            "commit": self.op_commit,
            "abort": self.op_abort,
            "read_recovery": self.op_read_recovery,
            "release": self.op_release,
            "stats": self.op_stats,
        }
        try:
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError:
                    return
                (size,) = HEADER.unpack(header)
                if size > self.max_frame:
                    await self._reply(writer, None, ProtocolError(f"frame of {size} bytes exceeds {self.max_frame}"))
                    return  # the stream cannot be resynchronized: close
                body = await reader.readexactly(size)
                request_id = None
                began = time.perf_counter()
                op: Any = "?"
                try:
                    request = decode(body)
                    if not isinstance(request, dict):
                        raise ProtocolError("a request must be a map with id, op and args")
                    request_id = request.get("id")
                    op = request.get("op")
                    args = request.get("args", {})
                    if not isinstance(args, dict):
                        raise BadRequest("args must be a map")
                    if not greeted:
                        if op != "hello" or args.get("version") != PROTOCOL_VERSION:
                            raise ProtocolError(f"the first request must be hello with version {PROTOCOL_VERSION}")
                        greeted = True
                        result = self.op_hello(client, args)
                    elif op not in handlers:
                        raise BadRequest(f"unknown op {op!r}")
                    else:
                        result = handlers[op](client, args)
                        if asyncio.iscoroutine(result):
                            result = await result
                    await self._reply(writer, request_id, None, result)
                    self.metrics.latency.labels(str(op)).observe(time.perf_counter() - began)
                except ProtocolError as exc:
                    await self._reply(writer, request_id, exc)
                    if not greeted:
                        return
                except OrbitKVError as exc:
                    await self._reply(writer, request_id, exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._reclaim(client)
            writer.close()

    async def _reply(
        self, writer: asyncio.StreamWriter, request_id: Any, error: OrbitKVError | None, result: Any = None
    ) -> None:
        if error is None:
            message = {"id": request_id, "ok": True, "result": result}
        else:
            message = {"id": request_id, "ok": False, "error": {"type": error.type, "message": str(error)}}
        try:
            writer.write(encode(message, self.max_frame))
        except OrbitKVError as exc:  # a reply too large for a frame becomes an error reply
            writer.write(encode({"id": request_id, "ok": False, "error": {"type": exc.type, "message": str(exc)}}))
        await writer.drain()

    async def serve(self, addr: str, ready: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        path = unix_socket_path(addr)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.stat(path).st_mode):
                    os.unlink(path)
            old = os.umask(0o177)  # the socket is created mode 0600
            try:
                self._server = await asyncio.start_unix_server(self.handle, path, limit=self.max_frame + 16)
            finally:
                os.umask(old)
        else:
            host, _, port = addr.rpartition(":")
            self._server = await asyncio.start_server(
                self.handle, host or "127.0.0.1", int(port), limit=self.max_frame + 16
            )
        sweeper = asyncio.create_task(self._sweep())
        if ready is not None:
            ready()
        try:
            async with self._server:
                await self._server.serve_forever()
        finally:
            sweeper.cancel()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self.ssd is not None:
            self.ssd.close()
        with contextlib.suppress(BufferError):
            self.arena.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.arena_path)
        os.close(self._arena_lock)


class EmbeddedManager:
    """The same manager on a background thread of this process (tests, the demo)."""

    def __init__(self, addr: str, pool_size: int, **kwargs: Any) -> None:
        self.addr = addr
        self.manager = CacheManager(pool_size, **kwargs)
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="orbitkv-manager", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self.manager.serve(self.addr, self._ready.set))

    def __enter__(self) -> EmbeddedManager:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"the embedded manager did not start on {self.addr}")
        return self

    def __exit__(self, *exc: object) -> None:
        def stop() -> None:
            for task in asyncio.all_tasks(self._loop):
                task.cancel()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)
        self.manager.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orbitkv-cache-manager",
        description="The per-host OrbitKV cache manager: a shared-memory DRAM pool, an optional SSD tier, "
        "leases and metadata-only discovery, served over a unix or TCP socket.",
    )
    parser.add_argument(
        "--addr", required=True, help="unix:///path.sock (path at most 107 bytes) or HOST:PORT, e.g. 127.0.0.1:50055"
    )
    parser.add_argument("--pool-size", required=True, help="DRAM pool size, e.g. 8gb (kb/mb/gb accepted)")
    parser.add_argument("--ssd-cache-path", help="SSD tier data file; omit for DRAM-only caching")
    parser.add_argument("--ssd-cache-capacity", help="SSD tier size, e.g. 100gb (required with --ssd-cache-path)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--lease-ttl", type=float, default=60.0, help="seconds before an unreleased lease expires")
    parser.add_argument(
        "--reserve-ttl", type=float, default=30.0, help="seconds before an uncommitted reservation is reclaimed"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if bool(args.ssd_cache_path) != bool(args.ssd_cache_capacity):
        print("error: --ssd-cache-path and --ssd-cache-capacity go together", file=sys.stderr)
        return 2
    try:
        pool = parse_size(args.pool_size)
        ssd_capacity = parse_size(args.ssd_cache_capacity) if args.ssd_cache_capacity else None
        unix_socket_path(args.addr)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    manager = CacheManager(
        pool,
        ssd_path=args.ssd_cache_path,
        ssd_capacity=ssd_capacity,
        lease_ttl=args.lease_ttl,
        reserve_ttl=args.reserve_ttl,
    )
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=manager.metrics.registry)
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
    log.info(
        "orbitkv-cache-manager on %s: pool %d bytes, arena %s, ssd %s",
        args.addr,
        pool,
        manager.arena_path,
        args.ssd_cache_path or "none",
    )
    try:
        loop.run_until_complete(manager.serve(args.addr, lambda: print(f"ready {args.addr}", flush=True)))
    except asyncio.CancelledError:
        pass
    finally:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
