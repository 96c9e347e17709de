"""An engine process's connection to its cache manager: made on first use, re-made after it is lost.

Engine adapters (the vLLM connector, the SGLang linker) never fail a request because the manager
is away: while ``session()`` yields None a lookup is a miss and a save is skipped. A call that
raises ``ManagerUnavailable`` (the manager died, or a call outlived ``timeout``: a hung manager)
retires the connection; the next session at least ``retry_s`` later connects again, so a restarted
manager is found without restarting the engine. A new connection maps the new manager's arena
(registered with CUDA when ``device`` is a CUDA device).

A retired connection is closed (its arena unregistered and unmapped) only when the last session
using it ends: a copy running on another thread never loses the memory it reads or writes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .client import CacheClient, Filled, LeasedPages, PageRef, Slots, StorePart
from .transfer import Arena, Fence, GroupLayout, Pages, save, save_rows
from .wire import ManagerUnavailable, OrbitKVError

# Per endpoint, the cause of trouble last warned about in this process, until a connection succeeds.
_REPORTED: dict[str, str] = {}
_REPORTED_LOCK = threading.Lock()

RETRY_S = 5.0  # at most one connection attempt per this many seconds while the manager is away
CALL_TIMEOUT_S = 30.0  # a hung manager stalls one call this long
LOAD_SWITCH_INTERVAL_S = 200e-6  # the interpreter's thread switch interval while loads run (LoadHandoff)


class Connection:
    """One connection to a manager: its client and mapped arena. ``retired`` once it was lost (its
    leases and reservations died with it); closed when the last holder releases it."""

    def __init__(self, client: CacheClient, arena: Arena) -> None:
        self.client = client
        self.arena = arena
        self.users = 0
        self.retired = False

    def close(self) -> None:
        self.arena.close()
        self.client.close()


class ManagerLink:
    def __init__(
        self,
        endpoint: str,
        name: str,
        device: str = "cpu",
        timeout: float | None = CALL_TIMEOUT_S,
        retry_s: float | None = None,
        log: logging.Logger | None = None,
        prefault: bool = True,
    ) -> None:
        """``prefault``: map every arena page into this process on connecting (copies then pay no page
        faults). False for a link that only looks pages up (a scheduler's): its arena mapping is left
        untouched, so connecting costs no time or page tables however large the manager's pool."""
        self.endpoint = endpoint
        self.name = name
        self.device = device
        self.prefault = prefault
        self.timeout = timeout
        self.retry_s = RETRY_S if retry_s is None else retry_s
        self.log = log or logging.getLogger("cacheon.orbitkv")
        self._lock = threading.Lock()
        self._current: Connection | None = None
        self._next_attempt = 0.0
        self.attempts = 0
        self.connects = 0

    def _connect(self) -> Connection | None:
        if self._current is not None:
            return self._current
        if time.monotonic() < self._next_attempt:
            return None
        self.attempts += 1
        client: CacheClient | None = None
        try:
            client = CacheClient(self.endpoint, name=self.name, timeout=self.timeout, prefault_arena=self.prefault)
            arena = Arena(client.arena, device=self.device)
        except Exception as exc:  # whatever stops the cache, the engine serves on
            # No socket, a manager of another user or version, garbage replies, an arena this process
            # may not map (/dev/shm not shared, another user), a failed cudaHostRegister: no cache.
            if client is not None:
                client.close()
            self._next_attempt = time.monotonic() + self.retry_s
            self._trouble(f"{type(exc).__name__}: {exc}")
            return None
        self._current = Connection(client, arena)
        self.connects += 1
        with _REPORTED_LOCK:
            recovered = _REPORTED.pop(self.endpoint, None) is not None
        if recovered:
            self.log.warning("orbitkv: cache manager at %s reachable again", self.endpoint)
        return self._current

    def _trouble(self, cause: str) -> None:
        """One warning per distinct cause while the manager stays unusable, however many links of this
        process (a vLLM scheduler and worker in one process) retry; repeats go to debug."""
        with _REPORTED_LOCK:
            repeat = _REPORTED.get(self.endpoint) == cause
            _REPORTED[self.endpoint] = cause
        if repeat:
            self.log.debug("orbitkv: cache manager still unusable: %s", cause)
            return
        self.log.warning(
            "orbitkv: cache manager at %s unusable, serving without it (misses; retried every %.0f s): %s",
            self.endpoint,
            self.retry_s,
            cause,
        )

    def acquire(self) -> Connection | None:
        """Hold the current connection (connecting if needed) until ``release``; None while the
        manager is unreachable. Hold it for as long as anything it returned is in use: a lease, an
        arena extent being copied."""
        with self._lock:
            connection = self._connect()
            if connection is not None:
                connection.users += 1
            return connection

    def release(self, connection: Connection) -> None:
        with self._lock:
            connection.users -= 1
            close = connection.retired and connection.users == 0
        if close:
            connection.close()

    @contextlib.contextmanager
    def session(self) -> Iterator[tuple[CacheClient, Arena] | None]:
        """``acquire`` / ``release`` around one piece of work: the client and arena, or None."""
        connection = self.acquire()
        if connection is None:
            yield None
            return
        try:
            yield connection.client, connection.arena
        finally:
            self.release(connection)

    def connect(self) -> bool:
        """Connect now (map, and on CUDA register, the arena before the first request needs it)."""
        with self.session() as connection:
            return connection is not None

    def failed(self, exc: OrbitKVError, client: CacheClient | None = None) -> None:
        """Log a failed manager call; a lost connection is retired and re-made later.

        ``client`` names the connection the call went through: a failure on an already retired one
        does not retire its successor.
        """
        if not isinstance(exc, ManagerUnavailable):
            self.log.warning("orbitkv: %s", exc)
            return
        with self._lock:
            current = self._current
            if current is None or (client is not None and current.client is not client):
                return
            self.log.warning("orbitkv: lost the cache manager (%s); reconnecting later", exc)
            self._next_attempt = time.monotonic() + self.retry_s
            idle = self._retire()
        if idle is not None:
            idle.close()

    def close(self) -> None:
        """Retire the connection; it closes once the sessions still using it end."""
        with self._lock:
            idle = self._retire()
        if idle is not None:
            idle.close()

    def _retire(self) -> Connection | None:
        """With the lock held: retire the current connection; returned when nobody holds it (the
        caller closes it outside the lock), else its last holder's ``release`` closes it."""
        current, self._current = self._current, None
        if current is None:
            return None
        current.retired = True
        return current if current.users == 0 else None


class LoadHandoff:
    """The interpreter's thread switch interval, lowered while an engine's loads run on its loader thread.

    A thread coming back from a call that let go of the GIL (a socket's reply, a CUDA event's wait, most
    torch operations, a Triton launch) waits for the GIL up to ``sys.getswitchinterval()`` (5 ms unless
    set) while another thread runs Python without pause, as vLLM's engine loop does while a request
    waits for its KV: each such return of the loader then costs up to 5 ms. From the first ``enter``
    to the matching last ``exit`` the interval is ``interval`` seconds (only ever lowered); then it is
    set back, unless something else changed it meanwhile. ``interval`` None or 0 leaves it alone.
    Thread-safe.
    """

    def __init__(self, interval: float | None = LOAD_SWITCH_INTERVAL_S) -> None:
        if interval is not None and not interval >= 0:
            raise ValueError(f"a switch interval of {interval!r} seconds: give one >= 0, or None")
        self.interval = interval or None
        self._lock = threading.Lock()
        self._running = 0
        self._saved: float | None = None  # the interval to set back; None while it was left alone
        self._set = 0.0  # the interval as set here (as the interpreter rounds it)

    def enter(self) -> None:
        with self._lock:
            self._running += 1
            if self._running == 1 and self.interval is not None and sys.getswitchinterval() > self.interval:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(self.interval)
                self._set = sys.getswitchinterval()

    def exit(self) -> None:
        with self._lock:
            self._running = max(self._running - 1, 0)
            if self._running == 0 and self._saved is not None:
                if sys.getswitchinterval() == self._set:
                    sys.setswitchinterval(self._saved)
                self._saved = None


class SavePart(NamedTuple):
    """Engine rows to save as pages (``save_parts``): ``rows[i]`` of ``layout`` under ``hashes[i]``, in
    ``namespace`` and ``group``, with layout ``tag`` (the physical layout of the pages' bytes; a restore
    refuses pages of another tag). Parts with the same ``key`` are one save's: after a failed one, the
    rest of its key is not stored."""

    namespace: str
    group: int
    layout: GroupLayout
    hashes: Sequence[bytes]
    rows: Sequence[int]
    tag: str = ""
    key: Any = None


# On a device, the most bytes of consecutive parts one save copies (``save_parts``): several small parts in
# one save spare the host a save call each; a part of this size or more goes alone, its copy overlapping
# the exchange of the parts around it. Measured in benchmarks/save_parts_gpu.py.
SAVE_TOGETHER_BYTES = 16 << 20


def save_parts(client: CacheClient, arena: Arena, parts: Sequence[SavePart]) -> list[int | Exception | None]:
    """Reserve an extent per page not stored yet, gather its engine row into it and commit it with the
    copy's checksums, for every part in one pipelined exchange (``CacheClient.store_parts``: the reserves
    of the parts ahead, up to half the pool, and the commits before part k are answered while part k is
    copied). On a device, consecutive parts reserved ahead are copied together up to ``SAVE_TOGETHER_BYTES``,
    one save per layout (the host's work per save call costs more than a small part's copy), and
    committed once the next copy has started; on the CPU, one part per save, done when it returns.
    The save path both engine adapters take. Per part: the bytes newly stored, the exception that
    stopped it (its reservation aborted), or None (an earlier part of its key failed). Raises
    ``ManagerUnavailable`` for a lost connection."""

    def saved(chosen: list[tuple[int, Slots]]) -> Fence:
        """One save of the rows of ``(part, slots)`` pairs of one layout that have an extent to fill."""
        if len(chosen) == 1 and None not in chosen[0][1]:  # one part, every page new: no per-page pairs
            k, mine = chosen[0]
            if len(mine) != len(parts[k].rows):
                raise ValueError(f"{len(mine)} slots for a part of {len(parts[k].rows)} rows")
            return save_rows(arena, parts[k].layout, parts[k].rows, [slot[0] for slot in mine if slot is not None])
        kept = [
            (row, slot[0])
            for k, mine in chosen
            for row, slot in zip(parts[k].rows, mine, strict=True)
            if slot is not None
        ]
        if not kept:
            return Fence(sums=[])
        return save(arena, parts[chosen[0][0]].layout, Pages.of(*zip(*kept, strict=True)))

    def fill_at_once(ks: list[int], slots: list[Slots]) -> Filled:
        # The CPU's fill: one part, its save done when it returns, without the bookkeeping of parts
        # copied together and left in flight (a few microseconds a part: BENCHMARKS.md, 2026-12-05).
        [k], [mine] = ks, slots
        sums = saved([(k, mine)]).checksums()
        if len(sums) == len(mine):  # every page new
            return [sums]
        found = iter(sums)
        return [[None if slot is None else next(found) for slot in mine]]

    def fill_together(ks: list[int], slots: list[Slots]) -> Filled | Callable[[], Filled]:
        mine = dict(zip(ks, slots, strict=True))

        by_layout: dict[int, list[int]] = {}
        for k in ks:
            by_layout.setdefault(id(parts[k].layout), []).append(k)
        # One save per layout of the parts filled together; where it cannot start, each part on its own,
        # so that a part the copy refuses fails alone.
        jobs: list[tuple[list[int], Fence | Exception]] = []
        for members in by_layout.values():
            try:
                jobs.append((members, saved([(k, mine[k]) for k in members])))
            except Exception as exc:
                if len(members) == 1:
                    jobs.append((members, exc))
                    continue
                for k in members:
                    try:
                        jobs.append(([k], saved([(k, mine[k])])))
                    except Exception as alone:
                        jobs.append(([k], alone))

        def checksums() -> Filled:
            got: dict[int, list[int | None] | Exception] = {}
            for members, fence in jobs:
                try:
                    sums = fence if isinstance(fence, Exception) else iter(fence.checksums())
                except Exception as exc:
                    sums = exc
                for k in members:
                    if isinstance(sums, Exception):
                        got[k] = sums
                    else:
                        got[k] = [None if slot is None else next(sums) for slot in mine[k]]
            return [got[k] for k in ks]

        in_flight = any(not isinstance(fence, Exception) and fence.event is not None for _, fence in jobs)
        return checksums if in_flight else checksums()

    wanted = [
        StorePart(
            part.namespace,
            part.group,
            list(zip(part.hashes, itertools.repeat(part.layout.page_bytes, len(part.hashes)), strict=True)),
            part.tag,
            part.key,
        )
        for part in parts
    ]
    if arena.cuda is None:
        return client.store_parts(wanted, fill_at_once)
    return client.store_parts(wanted, fill_together, together=SAVE_TOGETHER_BYTES)


def leased_pages(rows: Sequence[int], refs: Sequence[PageRef]) -> Pages:
    """The restore of leased pages into engine rows ``rows`` (one per page, in order)."""
    if isinstance(refs, LeasedPages):
        return Pages.of(rows, refs.offsets, refs.checksums)
    return Pages.of(rows, [r.offset for r in refs], [r.checksum for r in refs])


def lease_mismatch(refs: Sequence[PageRef], layout: GroupLayout, tag: str) -> str | None:
    """Why leased pages cannot be copied into ``layout`` (the restore path both engine adapters
    take): a page of another length or layout tag is a miss, never a copy. None when all fit."""
    if isinstance(refs, LeasedPages):  # the columns whole; the first page that does not fit named
        bad = np.flatnonzero((refs.lengths != layout.page_bytes) | ~refs.tagged(tag))
        if not len(bad):
            return None
        refs = [refs[int(bad[0])]]
    for ref in refs:
        if ref.length != layout.page_bytes:
            return f"a leased page is {ref.length} bytes, this layout's pages are {layout.page_bytes}"
        if ref.tag != tag:
            return f"a leased page has layout tag {ref.tag!r}, this engine's is {tag!r}"
    return None
