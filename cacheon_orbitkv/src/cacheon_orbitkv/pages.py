"""The manager's page state: the index, reservations, leases, DRAM and SSD extents, eviction,
demotion and promotion. Everything here runs on the manager's asyncio loop; only SSD reads and remote-store
pages run in threads, into arena extents nothing else can see until they are verified.

Every operation validates its whole input before it changes anything, and changes state in an
order that leaves it consistent when a step raises (an SSD write that fails leaves its page in
DRAM, indexed as before).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import mmap
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .extents import ExtentAllocator
from .remote import remote_key
from .ssd import Key, SSDEntry, SSDTier
from .wire import BadRequest, OrbitKVError, PoolFull, UnknownLease, checksum, pack_leased

if TYPE_CHECKING:
    from .remote import RemoteTier

log = logging.getLogger(__name__)

SSD_READS_PER_GROUP = 8
SSD_RETRY_S = 30.0  # after a failed demotion, evictions drop pages for this long instead of writing
U64 = 1 << 64
# A lease's columns, and the fields its per-page steps read (through map, not a Python loop: a lease of 256 pages)
_DRAM, _LENGTH, _CHECKSUM, _TAG, _KEY = map(operator.attrgetter, ("dram", "length", "checksum", "tag", "key"))


@attrs.define(eq=False)
class Page:
    key: Key
    length: int
    checksum: int
    tag: str = ""
    dram: int | None = None  # arena offset
    leases: int = 0
    promoting: asyncio.Future[bool] | None = None
    remote: bool = False  # read from the remote store: never written back to it


@attrs.define(eq=False)
class Reservation:
    id: int
    client: int
    namespace: str
    group: int
    tag: str
    slots: list[tuple[bytes, int, int] | None]  # (hash, offset, length) per requested page
    deadline: float


@attrs.define(eq=False)
class Lease:
    id: int
    client: int
    pages: list[Page]
    deadline: float


Located = tuple[Page, SSDEntry, int]  # a page, its SSD entry, the arena extent it is read into


def _runs(located: list[Located], rounded: Callable[[int], int], limit: int = 8 << 20) -> list[list[Located]]:
    """Group pages (sorted by SSD offset) into runs contiguous on SSD: at most ``limit`` bytes, and at
    most 500 pages (each page and its padding are two of preadv's 1024 buffers)."""
    runs: list[list[Located]] = []
    end = -1
    size = 0
    for item in located:
        offset, length = item[1].offset, item[1].length
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

    def writable(self, namespace: str, group: int) -> dict[bytes, Page]:
        """The table of ``(namespace, group)`` to add pages to (made if missing; ``drop_if_empty``
        after, in case nothing was added)."""
        return self._tables.setdefault((namespace, group), {})

    def drop_if_empty(self, namespace: str, group: int) -> None:
        if not self._tables.get((namespace, group), True):
            del self._tables[(namespace, group)]

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


TIERS = ("dram", "ssd")


class Metrics:
    """The manager's Prometheus metrics: counters updated as things happen, gauges read from the
    page state when scraped (``watch``), so both agree with the ``stats`` op at any moment."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter(
            "orbitkv_hits",
            "Pages leased by read_recovery, per group and the tier they were in",
            ["group", "tier"],
            registry=r,
        )
        self.misses = Counter(
            "orbitkv_misses",
            "read_recovery requests that missed (a page not cached, or failing its checksum on SSD), per group",
            ["group"],
            registry=r,
        )
        self.bytes_in = Counter("orbitkv_bytes_in", "Payload bytes written, per tier", ["tier"], registry=r)
        self.bytes_out = Counter(
            "orbitkv_bytes_out",
            "Payload bytes read (leased to clients, or read to demote), per tier",
            ["tier"],
            registry=r,
        )
        self.leases = Gauge("orbitkv_leases_held", "Leases currently held", registry=r)
        self.reservations = Gauge("orbitkv_reservations_held", "Reservations not yet committed or aborted", registry=r)
        self.pages = Gauge("orbitkv_pages", "Pages held, per tier", ["tier"], registry=r)
        self.stored_bytes = Gauge(
            "orbitkv_stored_bytes", "Payload bytes of the pages held, per tier", ["tier"], registry=r
        )
        self.free_bytes = Gauge(
            "orbitkv_free_bytes", "Bytes free for new pages, per tier (0 without an SSD tier)", ["tier"], registry=r
        )
        self.capacity_bytes = Gauge(
            "orbitkv_capacity_bytes", "Size of each tier in bytes (0 without an SSD tier)", ["tier"], registry=r
        )
        self.evictions = Counter(
            "orbitkv_evictions", "Pages evicted from DRAM, by where they went (ssd, dropped)", ["to"], registry=r
        )
        self.corrupt = Counter(
            "orbitkv_corrupt",
            "Pages whose bytes failed their checksum (on SSD, or in DRAM on their way to SSD)",
            registry=r,
        )
        self.errors = Counter("orbitkv_internal_errors", "Requests that failed inside the manager", registry=r)
        self.latency = Histogram(
            "orbitkv_request_seconds",
            "Request latency",
            ["op"],
            registry=r,
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0),
        )

        for tier in TIERS:  # zero from the start, not absent until the first page moves
            self.bytes_in.labels(tier)
            self.bytes_out.labels(tier)
        # Per page evicted, the counter of where it went, looked up once (``labels`` takes a lock and a dict).
        self.evicted = {to: self.evictions.labels(to) for to in ("ssd", "dropped")}

    def watch(self, store: PageStore) -> None:
        """Read the gauges from ``store`` at scrape time. The scrape runs on the metrics server's
        thread, so each reads one attribute or length, never iterating state the loop changes."""
        ssd = store.ssd
        self.leases.set_function(lambda: len(store.leases))
        self.reservations.set_function(lambda: len(store.reservations))
        self.pages.labels("dram").set_function(lambda: len(store.lru))
        self.pages.labels("ssd").set_function(lambda: len(ssd.entries) if ssd is not None else 0)
        self.stored_bytes.labels("dram").set_function(lambda: store.stored_bytes["dram"])
        self.stored_bytes.labels("ssd").set_function(lambda: store.stored_bytes["ssd"])
        self.free_bytes.labels("dram").set_function(lambda: store.allocator.free_bytes)
        self.free_bytes.labels("ssd").set_function(lambda: ssd.allocator.free_bytes if ssd is not None else 0)
        self.capacity_bytes.labels("dram").set(store.allocator.capacity)
        self.capacity_bytes.labels("ssd").set(ssd.allocator.capacity if ssd is not None else 0)


class PageStore:
    """Pages, reservations and leases over one arena and an optional SSD tier."""

    def __init__(
        self,
        arena: mmap.mmap,
        ssd: SSDTier | None,
        *,
        block: int = 4096,
        lease_ttl: float = 60.0,
        reserve_ttl: float = 30.0,
        metrics: Metrics | None = None,
        remote: RemoteTier | None = None,
    ) -> None:
        self.arena = arena
        self.ssd = ssd
        self.remote = remote
        self.lease_ttl = lease_ttl
        self.reserve_ttl = reserve_ttl
        self.metrics = metrics or Metrics()
        self.allocator = ExtentAllocator(len(arena), block)
        self.index = PageIndex()
        # Pages with a DRAM copy, least recent first, by identity: moving a leased page to the end reads
        # no key (a lease of 256 pages after an engine's copy has evicted the caches: fewer misses).
        self.lru: OrderedDict[Page, None] = OrderedDict()
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self._ids = 0
        self.stats: dict[str, Any] = {
            "bytes_read": {"dram": 0, "ssd": 0},
            "bytes_written": {"dram": 0, "ssd": 0},
            "hits": {"dram": 0, "ssd": 0},
            "misses": 0,
            "evictions": 0,
            "corrupt": 0,
        }
        if remote is not None:
            self.stats["hits"]["remote"] = 0
        # Payload bytes of the pages in each tier, kept as pages come and go (the gauges read them).
        self.stored_bytes = {"dram": 0, "ssd": 0}
        if ssd is not None:
            for key, entry in ssd.entries.items():
                self.index[key] = Page(key, entry.length, entry.checksum, entry.tag)
                self.stored_bytes["ssd"] += entry.length
        self._group_reads: dict[tuple[int, int], asyncio.Semaphore] = {}
        self._ssd_failed_until = 0.0
        # Enough threads for 8 SSD reads in flight per group across several concurrent recoveries.
        self.io = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="orbitkv-ssd")
        self.metrics.watch(self)

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    # -- space -------------------------------------------------------------------------------

    def allocate_dram(self, length: int) -> int:
        offset = self.allocator.allocate(length)
        while offset is None:
            if not self.evict_one():
                raise PoolFull(f"no {length}-byte extent free: every DRAM page is leased or reserved")
            offset = self.allocator.allocate(length)
        return offset

    def evict_one(self) -> bool:
        """Make room: demote (or, without room on SSD, drop) the least recently used DRAM page that
        nobody leases. False when every DRAM page is leased.

        Demotion writes synchronously on the loop, so nothing can lease a page while it moves; the
        loop blocks for one page's ``pwrite`` (into the page cache, flushed later by the sweeper).
        An OSError from the write propagates with the page still in DRAM; for ``SSD_RETRY_S`` after
        it, evictions drop pages instead of writing to a failing disk (a full one, say).
        """
        for page in self.lru:
            if page.leases or page.promoting is not None:
                continue
            self._evict(page)
            return True
        return False

    def _evict_until(self, free: int) -> None:
        """Evict least recently used pages that nobody holds until ``free`` bytes are free, or none is left:
        the pages ``evict_one`` would take one call after another, chosen in one walk of the LRU (pages
        held at its head are passed once, not once per page evicted)."""
        short = free - self.allocator.free_bytes
        rounded = self.allocator.rounded
        victims: list[Page] = []
        for page in self.lru:
            if short <= 0:
                break
            if page.leases or page.promoting is not None:
                continue
            victims.append(page)
            short -= rounded(page.length)
        for page in victims:
            self._evict(page)

    def _evict(self, page: Page) -> None:
        key = page.key
        if self.ssd is not None and key not in self.ssd.entries and time.monotonic() >= self._ssd_failed_until:
            self._demote(page, set())
        self._drop_dram(page, "ssd" if self.ssd is not None and key in self.ssd.entries else "dropped")

    def _demote(self, page: Page, keep: set[Key]) -> bool:
        """Copy a DRAM page to the SSD tier, making room by dropping least recently used SSD pages
        (not those in ``keep``). False when it cannot fit; an OSError leaves everything as it was."""
        assert self.ssd is not None and page.dram is not None
        ssd = self.ssd
        if ssd.allocator.rounded(page.length) > ssd.allocator.capacity:
            return False  # it could never fit: emptying the tier for it would only lose pages
        # Bytes are verified wherever they cross a tier: a DRAM page that no longer matches the
        # checksum its writer committed (a client scribbling on a committed extent) never reaches SSD.
        view = memoryview(self.arena)[page.dram : page.dram + page.length]
        try:
            intact = checksum(view) == page.checksum
        finally:
            view.release()
        if not intact:
            self.stats["corrupt"] += 1
            self.metrics.corrupt.inc()
            log.warning("a %d-byte DRAM page failed its checksum on its way to %s: dropped", page.length, ssd.path)
            return False
        ssd_offset = ssd.allocate(page.length)
        while ssd_offset is None and self.drop_ssd_lru(keep):
            ssd_offset = ssd.allocate(page.length)
        if ssd_offset is None:
            return False
        entry = SSDEntry(ssd_offset, page.length, page.checksum, page.tag)
        payload = memoryview(self.arena)[page.dram : page.dram + page.length]
        try:
            written = ssd.write([(page.key, entry, payload)])
        except OSError as exc:
            ssd.allocator.free(ssd_offset, page.length)
            self._ssd_failed_until = time.monotonic() + SSD_RETRY_S
            log.warning(
                "demoting a %d-byte page to %s failed, the page stays in DRAM; evictions drop pages for the "
                "next %.0f s: %s",
                page.length,
                ssd.path,
                SSD_RETRY_S,
                exc,
            )
            raise
        finally:
            payload.release()
        self.stored_bytes["ssd"] += page.length
        self.stats["bytes_read"]["dram"] += page.length
        self.metrics.bytes_out.labels("dram").inc(page.length)
        self.stats["bytes_written"]["ssd"] += written
        self.metrics.bytes_in.labels("ssd").inc(written)
        return True

    def _drop_dram(self, page: Page, to: str) -> None:
        assert page.dram is not None
        self.allocator.free(page.dram, page.length)  # first: it raises before anything changed
        del self.lru[page]
        page.dram = None
        self.stored_bytes["dram"] -= page.length
        if self.ssd is None or page.key not in self.ssd.entries:
            del self.index[page.key]
        self.stats["evictions"] += 1
        self.metrics.evicted[to].inc()

    def drop_ssd_lru(self, keep: set[Key] | None = None) -> bool:
        """Drop the least recently used SSD page that no request is reading; False when none can go."""
        assert self.ssd is not None
        for key in self.ssd.entries:
            if keep and key in keep:
                continue
            page = self.index.get(key)
            if page is not None and (page.leases or page.promoting is not None):
                continue
            self._delete_ssd(key)
            if page is not None and page.dram is None:
                del self.index[key]
            return True
        return False

    def _delete_ssd(self, key: Key) -> None:
        assert self.ssd is not None
        entry = self.ssd.entries.get(key)
        self.ssd.delete(key)
        if entry is not None:
            self.stored_bytes["ssd"] -= entry.length

    # -- writes ------------------------------------------------------------------------------

    def reserve(
        self, client: int, namespace: str, group: int, tag: str, pages: Iterable[tuple[bytes, int]]
    ) -> Reservation:
        pages = list(pages)
        cached = self.index.table(namespace, group)
        rounded = self.allocator.rounded
        need = 0
        held: dict[int, Page] = {}  # the request's pages already cached, by identity
        new: list[bool] = []  # per page, whether it gets an extent: what ``need`` counts, nothing else
        for digest, n in pages:
            page = cached.get(digest)
            new.append(page is None)
            if page is None:
                need += rounded(n)
            else:
                held[id(page)] = page
        # Its cached pages in DRAM stay there while it evicts (held below): they count against the pool too.
        kept = sum(rounded(page.length) for page in held.values() if page.dram is not None) if need else 0
        if need + kept > self.allocator.capacity:  # refused before it evicts anything
            with_kept = f" besides its {kept} bytes of pages cached" if kept else ""
            raise BadRequest(
                f"a reservation of {len(pages)} pages needs {need} bytes{with_kept}, more than the pool of "
                f"{self.allocator.capacity} bytes holds"
            )
        slots: list[tuple[bytes, int, int] | None] = []
        # One free extent for every new page when there is one (carved in order, each piece freed on
        # its own later). On a full pool, the least recently used pages go until the free bytes cover
        # the new pages, which then mostly fit one extent (pages stored together were carved from one,
        # and their extents coalesce as they go); else page by page, evicting as each needs. The
        # request's cached pages are held meanwhile, as a lease holds them: its own evictions never make
        # a gap in what it asks to keep, and which pages it writes does not change as it evicts.
        base = self.allocator.allocate(need) if need else None
        for page in held.values():
            page.leases += 1
        try:
            if base is None and need and self.allocator.free_bytes < need:
                self._evict_until(need)
                base = self.allocator.allocate(need)
            start = base
            for (digest, length), writes in zip(pages, new, strict=True):
                if not writes:
                    slots.append(None)  # already cached: nothing to write
                elif start is not None:
                    slots.append((digest, start, length))
                    start += rounded(length)
                else:
                    slots.append((digest, self.allocate_dram(length), length))
        except BaseException:
            for slot in slots:
                if slot is not None:
                    self.allocator.free(slot[1], slot[2])
            if base is not None:  # the extent's rest, past the pieces carved into slots
                carved = sum(rounded(slot[2]) for slot in slots if slot is not None)
                if carved < need:
                    self.allocator.free(base + carved, need - carved)
            raise
        finally:
            for page in held.values():
                page.leases -= 1
        res = Reservation(self.next_id(), client, namespace, group, tag, slots, time.monotonic() + self.reserve_ttl)
        self.reservations[res.id] = res
        return res

    def reservation(self, client: int, rid: int) -> Reservation:
        res = self.reservations.get(rid)
        if res is None or res.client != client:
            raise BadRequest(f"reservation {rid} is not held by this client (expired or never made)")
        return res

    def commit(self, client: int, rid: int, checksums: Any) -> int:
        """Index a reservation's pages; every checksum is checked first, so a bad one changes nothing
        (the reservation stays, to be committed again or aborted)."""
        res = self.reservation(client, rid)
        if not isinstance(checksums, list) or len(checksums) != len(res.slots):
            raise BadRequest(f"checksums must list one value per reserved page ({len(res.slots)})")
        for position, (slot, crc) in enumerate(zip(res.slots, checksums, strict=True)):
            if slot is not None and (type(crc) is not int or not 0 <= crc < U64):
                raise BadRequest(f"checksum of page {position} must be an integer in [0, 2**64), got {crc!r:.40}")
        committed = 0
        table = self.index.writable(res.namespace, res.group)
        namespace, group, tag, lru, remote = res.namespace, res.group, res.tag, self.lru, self.remote
        for slot, crc in zip(res.slots, checksums, strict=True):
            if slot is None:
                continue
            digest, offset, length = slot
            if digest in table:  # another client committed it meanwhile: keep one copy
                self.allocator.free(offset, length)
                continue
            key = (namespace, group, digest)
            page = Page(key, length, crc, tag, dram=offset)
            table[digest] = page
            lru[page] = None
            committed += length
            if remote is not None:
                remote.enqueue(page)
        self.index.drop_if_empty(namespace, group)
        self.stored_bytes["dram"] += committed
        del self.reservations[res.id]
        self.stats["bytes_written"]["dram"] += committed
        self.metrics.bytes_in.labels("dram").inc(committed)
        return committed

    def drop_reservation(self, res: Reservation) -> None:
        for slot in res.slots:
            if slot is not None:
                self.allocator.free(slot[1], slot[2])
        self.reservations.pop(res.id, None)

    # -- reads -------------------------------------------------------------------------------

    def lookup(self, namespace: str, groups: list[tuple[int, list[bytes]]]) -> dict[int, dict[str, list[int]]]:
        result: dict[int, dict[str, list[int]]] = {}
        for group, hashes in groups:
            dram: list[int] = []
            ssd: list[int] = []
            table = self.index.table(namespace, group)
            for position, digest in enumerate(hashes):
                page = table.get(digest)
                if page is not None:
                    (dram if page.dram is not None else ssd).append(position)
            result[group] = {"dram": dram, "ssd": ssd}
        return result

    async def lookup_remote(
        self, namespace: str, groups: list[tuple[int, list[bytes]]]
    ) -> dict[int, dict[str, list[int]]]:
        """``lookup``, then the pages neither tier holds asked of the remote store in one call per
        node: those it holds are reported as a third tier, ``remote`` (a failed call reports none)."""
        result = self.lookup(namespace, groups)
        asks: list[tuple[int, int, bytes]] = []
        for group, hashes in groups:
            found = result[group]
            found["remote"] = []
            have = set(found["dram"]) | set(found["ssd"])
            asks += [(group, i, remote_key((namespace, group, d))) for i, d in enumerate(hashes) if i not in have]
        if self.remote is not None and asks:
            flags = await self.remote.exists([key for _, _, key in asks])
            for (group, position, _), flag in zip(asks, flags or (), strict=False):
                if flag:
                    result[group]["remote"].append(position)
        return result

    async def read_recovery(self, client: int, namespace: str, wanted: list[tuple[int, list[bytes]]]) -> dict[str, Any]:
        taken: list[Page] = []
        reply: list[list[Any]] = []

        def give_back() -> None:
            for page in taken:
                page.leases -= 1

        def missed(group: int, reason: str) -> dict[str, Any]:
            give_back()
            self.stats["misses"] += 1
            self.metrics.misses.labels(str(group)).inc()
            return {"hit": False, "reason": f"group {group}: {reason}"}

        try:
            for group, hashes in wanted:
                table = self.index.table(namespace, group)
                pages: list[Page | None] = list(map(table.get, hashes))
                missing = pages.count(None)
                local = [p for p in pages if p is not None] if missing else cast("list[Page]", pages)
                for page in local:
                    page.leases += 1  # held from here: no eviction while the others load
                taken += local
                if missing:
                    if self.remote is None:
                        return missed(group, f"{missing} of {len(hashes)} pages not cached")
                    if not await self._from_remote(namespace, group, hashes, pages, taken):
                        return missed(group, f"{missing} of {len(hashes)} pages neither cached nor in the remote store")
                hits = len(local) - list(map(_DRAM, local)).count(None)
                self.stats["hits"]["dram"] += hits
                self.metrics.hits.labels(str(group), "dram").inc(hits)
                held = cast("list[Page]", pages)  # every gap is filled now
                if hits < len(held):  # a page another request brought may be on SSD
                    cold = list({id(p): p for p in held if p.dram is None}.values())  # a hash may repeat
                    if cold and not await self._promote(group, cold):
                        return missed(group, "a page failed its checksum on SSD")
                reply.append(
                    pack_leased(
                        group, map(_DRAM, held), map(_LENGTH, held), map(_CHECKSUM, held), list(map(_TAG, held))
                    )
                )
        except BaseException:
            give_back()
            raise
        deque(map(self.lru.move_to_end, taken), maxlen=0)  # each page the most recently used
        if self.ssd is not None:
            deque(map(self.ssd.touch, map(_KEY, taken)), maxlen=0)
        lease = Lease(self.next_id(), client, taken, time.monotonic() + self.lease_ttl)
        self.leases[lease.id] = lease
        leased = sum(map(_LENGTH, taken))
        self.stats["bytes_read"]["dram"] += leased
        self.metrics.bytes_out.labels("dram").inc(leased)
        return {"hit": True, "lease": lease.id, "pages": reply}

    async def _from_remote(
        self, namespace: str, group: int, hashes: list[bytes], pages: list[Page | None], taken: list[Page]
    ) -> bool:
        """Fill the gaps of ``pages`` from the remote store: each page read, verified, copied into an
        arena extent nothing else can see, then indexed and leased (appended to ``taken``). All of
        them or none: False (and nothing indexed) when any page could not be had."""
        assert self.remote is not None
        wanted: dict[bytes, list[int]] = {}
        for position, (digest, page) in enumerate(zip(hashes, pages, strict=True)):
            if page is None:
                wanted.setdefault(digest, []).append(position)
        keys = [(namespace, group, digest) for digest in wanted]
        extents: list[tuple[int, int]] = []

        def place(length: int) -> int | None:
            try:
                offset = self.allocate_dram(length)
            except PoolFull:
                return None
            extents.append((offset, length))
            return offset

        def land(payload: memoryview, offset: int) -> None:  # a worker thread, into an extent only it sees
            self.arena[offset : offset + len(payload)] = payload

        try:
            fetched = await self.remote.fetch(keys, place, land)
        except BaseException:
            for offset, length in extents:
                self.allocator.free(offset, length)
            raise
        if any(item is None for item in fetched):
            for offset, length in extents:
                self.allocator.free(offset, length)
            return False
        new, nbytes = 0, 0
        for (key, positions), item in zip(zip(keys, wanted.values(), strict=True), fetched, strict=True):
            assert item is not None
            data, offset = item
            page = self.index.get(key)
            if page is None:
                page = Page(key, len(data.payload), data.checksum, data.tag, dram=offset, remote=True)
                self.index[key] = page
                self.lru[page] = None
                self.stored_bytes["dram"] += page.length
                self.stats["hits"]["remote"] += 1
                new += 1
                nbytes += page.length
            else:  # another request brought it meanwhile: keep one copy
                self.allocator.free(offset, len(data.payload))
            page.leases += 1
            taken.append(page)
            for position in positions:
                pages[position] = page
        self.remote.count_hits(new, nbytes)
        return True

    def pin(self, page: Page) -> bool:
        """Hold a DRAM page in place (the remote writer copying it out); False if it left DRAM."""
        if page.dram is None or self.index.get(page.key) is not page:
            return False
        page.leases += 1
        return True

    @staticmethod
    def unpin(page: Page) -> None:
        page.leases -= 1

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
            located: list[Located] = []
            try:
                for page in mine:
                    entry = ssd.entries.get(page.key)
                    if entry is None:
                        raise OrbitKVError(f"page of group {group} lost its SSD copy")
                    located.append((page, entry, self.allocate_dram(page.length)))
            except BaseException:
                for page, _, offset in located:
                    self.allocator.free(offset, page.length)
                raise
            runs = _runs(sorted(located, key=lambda item: item[1].offset), ssd.allocator.rounded)
            sem = self._group_reads.setdefault((id(loop), group), asyncio.Semaphore(SSD_READS_PER_GROUP))

            async def read(run: list[Located]) -> list[bool]:
                async with sem:
                    return await loop.run_in_executor(self.io, ssd.read_run, [(e, o) for _, e, o in run], self.arena)

            # Every read finishes before any extent is handed back: a thread still writing into a
            # freed extent would scribble over its next owner.
            outcomes = await asyncio.gather(*(read(run) for run in runs), return_exceptions=True)
            failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failure is not None:
                for page, _, offset in located:
                    self.allocator.free(offset, page.length)
                raise failure
            results = [o for o in outcomes if not isinstance(o, BaseException)]
            good_all = True
            for run, verdicts in zip(runs, results, strict=True):
                for (page, _, offset), good in zip(run, verdicts, strict=True):
                    self.stats["bytes_read"]["ssd"] += page.length
                    self.metrics.bytes_out.labels("ssd").inc(page.length)
                    if good:
                        page.dram = offset
                        self.lru[page] = None
                        self.stored_bytes["dram"] += page.length
                        self.stats["hits"]["ssd"] += 1
                        self.metrics.hits.labels(str(group), "ssd").inc()
                    else:
                        good_all = False
                        self.allocator.free(offset, page.length)
                        self._delete_ssd(page.key)
                        self.index.pop(page.key, None)
                        self.stats["corrupt"] += 1
                        self.metrics.corrupt.inc()
                        log.warning("a page of group %d failed its checksum on %s: dropped", group, ssd.path)
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

    def release(self, client: int, lid: int) -> None:
        lease = self.leases.get(lid)
        if lease is None or lease.client != client:
            raise UnknownLease(f"lease {lid} is not held by this client (released, expired or never granted)")
        self.drop_lease(lease)

    def drop_lease(self, lease: Lease) -> None:
        for page in lease.pages:
            page.leases -= 1
        self.leases.pop(lease.id, None)

    def reclaim(self, client: int | None = None, now: float | None = None) -> None:
        """Drop the reservations and leases of a client that went away, or past their deadline at ``now``."""
        for res in list(self.reservations.values()):
            if res.client == client or (now is not None and res.deadline < now):
                self.drop_reservation(res)
        for lease in list(self.leases.values()):
            if lease.client == client or (now is not None and lease.deadline < now):
                self.drop_lease(lease)

    def snapshot(self) -> dict[str, Any]:
        """The ``stats`` op: counters since start, and pages and bytes per tier counted from the
        index itself (not from the running totals the gauges read, so a test can hold one to the other)."""
        pages = self.index.values()
        in_dram = [p for p in pages if p.dram is not None]
        ssd = self.ssd
        return {
            **self.stats,
            "pages": {"dram": len(in_dram), "ssd": len(ssd.entries) if ssd else 0},
            "stored_bytes": {
                "dram": sum(p.length for p in in_dram),
                "ssd": sum(e.length for e in ssd.entries.values()) if ssd else 0,
            },
            "promoting": sum(p.promoting is not None for p in pages),
            "leases": len(self.leases),
            "reservations": len(self.reservations),
            "free_bytes": {"dram": self.allocator.free_bytes, "ssd": ssd.allocator.free_bytes if ssd else 0},
            "capacity_bytes": {"dram": self.allocator.capacity, "ssd": ssd.allocator.capacity if ssd else 0},
            **({"remote": self.remote.snapshot()} if self.remote is not None else {}),
        }

    # -- shutdown ----------------------------------------------------------------------------

    def persist_dram(self, deadline: float) -> int:
        """Write DRAM pages not yet on SSD to the SSD tier, most recently used first, until they are all
        there, the tier holds nothing older to drop, or ``deadline`` (monotonic) passes; returns how
        many were written. For an orderly stop: a restart then keeps the hottest pages."""
        if self.ssd is None:
            return 0
        kept: set[Key] = set()
        written = 0
        for page in reversed(self.lru):
            key = page.key
            if time.monotonic() > deadline:
                log.warning("shutdown timeout: %d DRAM pages written to SSD, the rest are dropped", written)
                break
            kept.add(key)
            if key in self.ssd.entries:
                continue
            try:
                if not self._demote(page, kept):
                    break  # the tier is full of pages hotter than this one
            except OSError:
                break  # logged by _demote
            written += 1
        return written

    def close(self) -> None:
        self.io.shutdown(wait=True)
