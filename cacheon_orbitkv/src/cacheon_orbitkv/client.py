"""The client engine adapters use: sync calls over one socket, a batched asyncio path, and the mapped arena.

Page bytes are copied between the caller's buffers and the shared arena by the caller's process;
the socket carries only hashes, offsets, lengths and checksums. Any failure to reach the manager
raises ``ManagerUnavailable``, which engines treat as a miss (``Unauthorized``, a refused token, is one).

A manager started with ``--auth-token-file`` requires its token in the hello: pass ``token``, or
leave it None and name the token file in ``ORBITKV_AUTH_TOKEN_FILE`` (engine adapters do nothing).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
import logging
import mmap
import os
import socket
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import attrs
import numpy as np

from .wire import (
    AUTH_TOKEN_ENV,
    DEFAULT_MAX_FRAME,
    ERRORS,
    HEADER,
    LEASED_INTS,
    LEASED_SUMS,
    LEASED_TAGS,
    PROTOCOL_VERSION,
    ManagerUnavailable,
    OrbitKVError,
    ProtocolError,
    checksum,
    copy_with_checksum,
    decode,
    encode,
    lookup_work,
    prefault,
    read_token_file,
    unix_socket_path,
)

HASH_BYTES = 16

log = logging.getLogger(__name__)


def make_namespace(fingerprint: str, dtype: str, layout: str, page_size: int, rank: int) -> str:
    """A namespace from these five parts, for a client outside the engines (a tool, a test): a change in
    any part always misses. The engine integrations do not use it: their namespaces come from
    ``identity.CacheIdentity``, which also states a format version and each group's geometry."""
    for name, part in (("fingerprint", fingerprint), ("dtype", dtype), ("layout", layout)):
        if not part or ":" in part:
            raise ValueError(f"namespace {name} {part!r} must be non-empty and contain no ':'")
    if page_size <= 0 or rank < 0:
        raise ValueError(f"page size {page_size} must be positive and rank {rank} non-negative")
    return f"{fingerprint}:{dtype}:{layout}:p{page_size}:r{rank}"


def page_hashes(
    namespace: str, tokens: Sequence[int], page_size: int, group: int = 0, after: bytes | None = None
) -> list[bytes]:
    """Chained hashes of full pages: each page's hash covers the namespace, group and every token before it.

    ``after``: the hash of the page before ``tokens`` (a sequence that grows, hashed page by page as
    its pages fill); ``tokens`` then continue that chain."""
    out = []
    previous = after or hashlib.blake2b(f"{namespace}\x00{group}".encode(), digest_size=HASH_BYTES).digest()
    full = len(tokens) - len(tokens) % page_size
    # Each token as 8 little-endian bytes, two's complement, all encoded at once (a token outside int64
    # raises OverflowError, as int.to_bytes does): 1.2 ms for 32k tokens on a 2-core host, where one
    # to_bytes per token took 4.1 ms on the scheduler's path (BENCHMARKS.md).
    data = memoryview(np.asarray(tokens[:full], dtype=np.int64).astype("<i8", copy=False).tobytes())
    step = 8 * page_size
    for start in range(0, len(data), step):
        h = hashlib.blake2b(previous, digest_size=HASH_BYTES)
        h.update(data[start : start + step])
        previous = h.digest()
        out.append(previous)
    return out


def cached_positions(found: dict[str, list[int]]) -> list[int]:
    """The positions of one group's ``lookup`` reply held in any tier (DRAM, SSD, and the remote store
    when the manager has one), sorted: a restore treats them all alike."""
    return sorted({i for tier in found.values() for i in tier})


class PageRef(NamedTuple):
    """A leased page: its arena extent, committed checksum and layout tag (the writer's name for
    the physical layout of its bytes; a restore refuses a page whose tag is not its own). A named
    tuple: a lease of 256 pages builds 256 of them, twice as fast as a frozen attrs class."""

    offset: int
    length: int
    checksum: int
    tag: str = ""


@attrs.frozen(eq=False)
class LeasedPages(Sequence[PageRef]):
    """One group's leased pages, in request order, as the reply carries them (``wire.pack_leased``): read-only
    columns of arena offsets, lengths and committed checksums, and each page's layout tag. A sequence of
    ``PageRef`` too (built per item asked for); ``link.leased_pages`` and ``link.lease_mismatch`` read the
    columns whole."""

    offsets: np.ndarray  # int64
    lengths: np.ndarray  # int64
    checksums: np.ndarray  # uint64
    names: tuple[str, ...]  # the distinct layout tags
    which: np.ndarray | None  # each page's index into ``names``; None: every page has names[0]

    @classmethod
    def unpack(cls, entry: Any, count: int) -> LeasedPages:
        """A reply's group entry (after its group id) for ``count`` pages; ``ProtocolError`` for anything else."""
        try:
            raw_offsets, raw_lengths, raw_sums, names, raw_which = entry
            offsets = np.frombuffer(raw_offsets, LEASED_INTS).astype(np.int64)
            lengths = np.frombuffer(raw_lengths, LEASED_INTS).astype(np.int64)
            checksums = np.frombuffer(raw_sums, LEASED_SUMS).astype(np.uint64)
            which = np.frombuffer(raw_which, LEASED_TAGS).astype(np.int64) if raw_which else None
            names = tuple(names)
            ok = len(offsets) == len(lengths) == len(checksums) == count and all(isinstance(t, str) for t in names)
            if which is None:
                ok = ok and (len(names) == 1 or not count)
            else:
                ok = ok and len(which) == count and bool(count) and int(which.max()) < len(names)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"a leased group's pages are malformed: {exc}") from exc
        if not ok:
            raise ProtocolError(f"a leased group's columns do not describe the {count} pages asked for")
        for column in (offsets, lengths, checksums) + (() if which is None else (which,)):
            column.flags.writeable = False
        return cls(offsets, lengths, checksums, names, which)

    @property
    def tags(self) -> list[str]:
        """Each page's layout tag."""
        if self.which is None:
            return [self.names[0]] * len(self.offsets) if self.names else []
        return [self.names[i] for i in self.which.tolist()]

    def tagged(self, tag: str) -> np.ndarray:
        """Whether each page's layout tag is ``tag``."""
        if self.which is None:
            return np.full(len(self), bool(self.names) and self.names[0] == tag)
        return np.isin(self.which, [i for i, name in enumerate(self.names) if name == tag])

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> PageRef: ...
    @overload
    def __getitem__(self, i: slice) -> list[PageRef]: ...
    def __getitem__(self, i: int | slice) -> PageRef | list[PageRef]:
        if isinstance(i, slice):
            return list(self)[i]
        tag = self.names[0 if self.which is None else int(self.which[i])]
        return PageRef(int(self.offsets[i]), int(self.lengths[i]), int(self.checksums[i]), tag)

    def __iter__(self) -> Iterator[PageRef]:
        columns = (self.offsets.tolist(), self.lengths.tolist(), self.checksums.tolist(), self.tags)
        return map(PageRef._make, zip(*columns, strict=True))


Slots = list[tuple[int, int] | None]
Filled = Sequence[Sequence[int | None] | Exception]
Fill = Callable[[list[int], list[Slots]], Filled | Callable[[], Filled]]
"""``store_parts``'s ``fill(ks, slots)``: for parts ``ks``, each with its slots, each part's checksums or the
exception that stopped its copy; or a callable that waits for copies still in flight and returns them."""


class StorePart(NamedTuple):
    """One reserve, fill and commit of ``CacheClient.store_parts``: ``(hash, length)`` pages of one
    namespace and group, with layout ``tag``. Parts with the same ``key`` are one store's, in order:
    a part after a failed one of its key is not stored (a cached prefix has no gap)."""

    namespace: str
    group: int
    pages: list[tuple[bytes, int]]
    tag: str = ""
    key: Any = None


@attrs.frozen
class Recovery:
    """A granted ``read_recovery``: per group, the leased pages' arena extents, in request order."""

    lease: int
    pages: dict[int, LeasedPages]


def _token(token: str | None) -> str | None:
    """The token to send: the given one, else the content of ``$ORBITKV_AUTH_TOKEN_FILE`` if set."""
    if token is not None:
        return token
    path = os.environ.get(AUTH_TOKEN_ENV)
    if not path:
        return None
    try:
        return read_token_file(path)
    except (OSError, ValueError) as exc:
        raise ManagerUnavailable(f"cannot read the auth token named by {AUTH_TOKEN_ENV}: {exc}") from exc


def _hello_args(name: str, token: str | None) -> dict[str, Any]:
    args: dict[str, Any] = {"version": PROTOCOL_VERSION, "name": name}
    if token is not None:
        args["token"] = token
    return args


def _connect(endpoint: str) -> socket.socket:
    path = unix_socket_path(endpoint)
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
    else:
        host, _, port = endpoint.rpartition(":")
        sock = socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _found(result: Any, groups: Collection[int]) -> dict[int, dict[str, list[int]]]:
    """A ``lookup`` result checked against the groups asked: ``{group: {tier: [position, ...]}}`` with
    every group asked and no other, else a ``ProtocolError`` (a garbled or foreign reply is a miss for
    the caller, never a ``KeyError`` in an engine's scheduler)."""
    try:
        found = {int(group): tiers for group, tiers in result.items()}
        whole = found.keys() == set(groups) and all(
            type(tiers) is dict and all(type(positions) is list for positions in tiers.values())
            for tiers in found.values()
        )
    except (AttributeError, TypeError, ValueError):
        whole = False
    if not whole:
        raise ProtocolError(f"a lookup of groups {sorted(groups)} was answered with {result!r:.80}")
    return found


def _raise(reply: dict[str, Any]) -> Any:
    if reply.get("ok"):
        return reply.get("result")
    error = reply.get("error") or {}
    raise ERRORS.get(error.get("type", ""), OrbitKVError)(error.get("message", "unknown error"))


# The most bytes of pages per reserve and commit of a store, pipelined (CacheClient._store_batch); the
# first chunk holds STORE_FIRST_CHUNK_BYTES, each after it twice the one before: the first reserve's round
# trip, which nothing overlaps, is answered after the manager reserved a few pages, and the copy starts sooner.
STORE_CHUNK_BYTES = 8 << 20
STORE_FIRST_CHUNK_BYTES = 1 << 20


RECV_BYTES = 1 << 16  # the least each recv asks for (_recv)
AHEAD = 32  # requests of one pipelined exchange sent and not yet answered, at most (the manager runs 64 at once)
MAX_UNREAD = 64  # requests sent without waiting for their replies, before the client reads those replies


class _Exchange:
    """Requests sent and replies read on a client's connection, its lock held (``CacheClient._exchange``).
    Replies are read in the order the requests went out; each must carry its request's id. The manager
    runs a lease as a task of its own, so one that waits for the SSD can be answered after a later request:
    a reply to a later request still due is kept until its turn."""

    def __init__(self, client: CacheClient) -> None:
        self.client = client
        self.due: collections.deque[tuple[int, str, Any]] = collections.deque()  # (id, op, tag) per request

    @property
    def broken(self) -> bool:
        return self.client._broken is not None

    def send(self, op: str, args: dict[str, Any], tag: Any = None) -> None:
        """Send a request; ``tag`` (the caller's) comes back with its reply."""
        request_id = next(self.client._ids)
        frame = encode({"id": request_id, "op": op, "args": args}, self.client.max_frame)  # may refuse it
        self._guard(op, lambda: self.client._sock.sendall(frame))
        self.due.append((request_id, op, tag))

    def pipeline(self, op: str, requests: Iterable[dict[str, Any]], replies: list[dict[str, Any]]) -> None:
        """Send each of ``requests`` (an ``op``'s args) before reading the replies, appending each reply to
        ``replies`` in order; at most AHEAD unanswered (fewer than the manager runs at once per connection):
        the manager never stops reading this connection's requests while its replies wait. Raises as
        ``send`` and ``receive`` do, once the replies due are read into ``replies`` (``drain``): a request
        that could not be sent leaves the connection in step."""
        try:
            for args in requests:
                self.send(op, args)
                while len(self.due) >= AHEAD:
                    replies.append(self.receive()[1])
            while self.due:
                replies.append(self.receive()[1])
        except BaseException:
            self.drain(replies)
            raise

    def drain(self, replies: list[dict[str, Any]] | None = None) -> None:
        """Read every reply still due (appended to ``replies`` where given), so the connection stays in
        step; a connection that breaks meanwhile, or is broken, has nothing left to read (no error)."""
        with contextlib.suppress(OrbitKVError):
            while self.due and not self.broken:
                reply = self.receive()[1]
                if replies is not None:
                    replies.append(reply)

    def receive(self) -> tuple[Any, dict[str, Any]]:
        """``(tag, reply)`` for the oldest request not yet answered (an error reply included)."""
        request_id, op, tag = self.due.popleft()
        early = self.client._early.pop(request_id, None)
        if early is not None:
            return tag, early

        def read() -> dict[str, Any]:
            while True:
                (size,) = HEADER.unpack(self.client._recv(HEADER.size))
                reply: dict[str, Any] = decode(self.client._recv(size))
                # The reply must answer this request or a later one still due (kept for its turn):
                # any other (a connection out of step) closes the connection rather than answer the
                # wrong call. An error the manager could not tie to an id (a frame it could not parse)
                # answers the request at hand.
                answered = reply.get("id")
                if answered == request_id or (answered is None and not reply.get("ok")):
                    return reply
                if answered is None or answered in self.client._early or all(d[0] != answered for d in self.due):
                    raise EOFError(f"a reply to request {answered!r:.20} where {request_id} was due")
                self.client._early[answered] = reply

        reply: dict[str, Any] = self._guard(op, read)
        return tag, reply

    def _guard(self, op: str, step: Callable[[], Any]) -> Any:
        client = self.client
        if client._broken is not None:
            raise ManagerUnavailable(f"connection to {client.endpoint} is closed: {client._broken}")
        try:
            return step()
        except (OSError, EOFError) as exc:
            client._broken = f"{op} failed: {exc or type(exc).__name__}"
            with contextlib.suppress(OSError):
                client._sock.close()
            raise ManagerUnavailable(f"cache manager at {client.endpoint} went away during {op}: {exc}") from exc


class CacheClient:
    """A blocking client. Thread-safe: one request at a time on its connection."""

    def __init__(
        self,
        endpoint: str,
        name: str = "client",
        max_frame: int = DEFAULT_MAX_FRAME,
        prefault_arena: bool = True,
        timeout: float | None = None,
        token: str | None = None,
    ) -> None:
        """``timeout``: seconds one call may take; past it (a hung manager) the call raises
        ``ManagerUnavailable`` and the connection is closed (a late reply could not be matched).
        ``token``: the manager's auth token (None: read ``$ORBITKV_AUTH_TOKEN_FILE`` if set)."""
        self.endpoint = endpoint
        self.max_frame = max_frame
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._broken: str | None = None
        # Requests whose replies no caller waits for (``release(lease, wait=False)``): read, in order,
        # before the next request's reply, on the same connection.
        self._unread: collections.deque[tuple[int, str, Any]] = collections.deque()
        self._early: dict[int, dict[str, Any]] = {}  # replies read before their turn (``_Exchange.receive``)
        self._inbox = bytearray()  # bytes received and not yet taken (``_recv``)
        hello_args = _hello_args(name, _token(token))
        try:
            self._sock = _connect(endpoint)
            self._sock.settimeout(timeout)
        except OSError as exc:
            raise ManagerUnavailable(f"cannot reach the cache manager at {endpoint}: {exc}") from exc
        try:
            hello = self.call("hello", **hello_args)
        except BaseException:
            self._sock.close()
            raise
        self.info = hello
        fd = os.open(hello["arena"], os.O_RDWR)
        try:
            self.arena = mmap.mmap(fd, hello["arena_size"])
        finally:
            os.close(fd)
        if prefault_arena:
            prefault(self.arena)
        self.view = memoryview(self.arena)

    def call(self, op: str, **args: Any) -> Any:
        with self._exchange() as wire:
            wire.send(op, args)
            _, reply = wire.receive()
        return _raise(reply)

    @contextlib.contextmanager
    def _exchange(self, drain: bool = True) -> Iterator[_Exchange]:
        """The connection, held for a run of requests: replies are read in the order their requests
        were sent. A broken connection (closed, or a reply out of step) is closed for good. Replies no
        caller waits for are read first; with ``drain`` False (a request sent without waiting for its
        reply) only once MAX_UNREAD of them are due."""
        with self._lock:
            if self._broken is not None:
                raise ManagerUnavailable(f"connection to {self.endpoint} is closed: {self._broken}")
            wire = _Exchange(self)
            while self._unread and (drain or len(self._unread) >= MAX_UNREAD):  # due before any new request's
                request = self._unread.popleft()
                wire.due.append(request)
                _, reply = wire.receive()
                if not reply.get("ok"):
                    error = reply.get("error") or {}
                    log.warning(
                        "orbitkv: %s (sent without waiting for its reply) failed: %s: %s",
                        request[1],
                        error.get("type", "OrbitKVError"),
                        error.get("message", "unknown error"),
                    )
            yield wire

    def _recv(self, size: int) -> bytes:
        """``size`` bytes of the stream, read through the client's inbox: each ``recv`` takes whatever has
        arrived (at least RECV_BYTES asked for), so a reply's header and body, or the replies to several
        requests sent together, usually come in one system call. In an engine's process each return from
        ``recv`` may wait for the GIL (up to the switch interval): one call instead of two per reply."""
        inbox = self._inbox
        while len(inbox) < size:
            chunk = self._sock.recv(max(size - len(inbox), RECV_BYTES))
            if not chunk:
                raise EOFError("connection closed")
            inbox += chunk
        data = bytes(inbox[:size])
        del inbox[:size]
        return data

    # -- the protocol ------------------------------------------------------------------------

    def lookup(self, namespace: str, groups: dict[int, list[bytes]]) -> dict[int, dict[str, list[int]]]:
        return _found(self.call("lookup", namespace=namespace, groups=groups), groups)

    def lookup_namespaces(
        self, namespaces: Sequence[str], groups: dict[int, list[bytes]]
    ) -> list[dict[int, dict[str, list[int]]]]:
        """``lookup`` of the same hashes in each of ``namespaces`` (an engine's tensor-parallel ranks,
        whose pages share their hashes and are keyed under each rank's namespace): one request where
        the manager takes several namespaces in one (its hello bounds their work, ``wire.lookup_work``)
        and they fit, else one lookup per namespace in one exchange (``lookups``). In the order asked."""
        budget = self.info.get("lookup_namespaces")
        if len(namespaces) < 2 or type(budget) is not int or lookup_work(len(namespaces), groups.values()) > budget:
            return self.lookups([(namespace, groups) for namespace in namespaces])
        result = self.call("lookup", namespaces=list(namespaces), groups=groups)
        if not isinstance(result, list) or len(result) != len(namespaces):
            raise ProtocolError(f"a lookup of {len(namespaces)} namespaces was answered with {result!r:.60}")
        return [_found(found, groups) for found in result]

    def lookups(self, requests: Sequence[tuple[str, dict[int, list[bytes]]]]) -> list[dict[int, dict[str, list[int]]]]:
        """Several ``lookup`` calls, each ``(namespace, groups)``, in one exchange: every request is sent
        before any reply is read (at most AHEAD unanswered), so the caller waits for one round trip
        instead of one each (an engine's tensor-parallel ranks, each its own namespace, asked about one
        request). The results in the order asked. An error reply raises once every reply has been read
        (a lookup holds nothing: there is nothing to give back)."""
        replies: list[dict[str, Any]] = []
        with self._exchange() as wire:
            wire.pipeline("lookup", ({"namespace": n, "groups": groups} for n, groups in requests), replies)
        results = [_raise(reply) for reply in replies]
        return [_found(result, groups) for result, (_, groups) in zip(results, requests, strict=True)]

    def store(
        self, namespace: str, group: int, pages: Sequence[tuple[bytes, bytes | memoryview]], tag: str = ""
    ) -> int:
        """Reserve, write and commit ``(hash, payload)`` pages with layout ``tag``; returns the bytes
        newly committed.

        Pages go in batches of at most a quarter of the arena, so that a large store can evict
        (reserved extents never are) instead of failing with PoolFull; each batch in chunks of at
        most STORE_CHUNK_BYTES (the first ones smaller), pipelined (``_store_batch``). A failure
        raises once the chunks copied before it are committed and the rest aborted: what was
        committed stays cached.
        """
        budget = max(self.info["arena_size"] // 4, 1)
        total, size = 0, 0
        batch: list[tuple[bytes, bytes | memoryview]] = []
        for page in pages:
            if batch and size + len(page[1]) > budget:
                total += self._store_batch(namespace, group, batch, tag)
                batch, size = [], 0
            batch.append(page)
            size += len(page[1])
        if batch:
            total += self._store_batch(namespace, group, batch, tag)
        return total

    def reserve(
        self, namespace: str, group: int, pages: Sequence[tuple[bytes, int]], tag: str = ""
    ) -> tuple[int, list[Any]]:
        """Reserve arena extents for ``(hash, length)`` pages: ``(reservation, [offset or None per page])``.

        None marks a page already cached (nothing to write). The caller fills the extents (an engine's
        save kernel), then calls ``commit`` with the checksums, or ``abort``. ``tag`` (at most 128
        UTF-8 bytes) names the physical layout of the pages' bytes; it comes back in every ``PageRef``.
        """
        reply = self.call("reserve", namespace=namespace, group=group, pages=[[h, n] for h, n in pages], tag=tag)
        return int(reply["reservation"]), [None if s is None else int(s[0]) for s in reply["slots"]]

    def commit(self, reservation: int, checksums: Sequence[int | None]) -> int:
        return int(self.call("commit", reservation=reservation, checksums=list(checksums))["committed"])

    def abort(self, reservation: int) -> None:
        self.call("abort", reservation=reservation)

    def _store_batch(
        self, namespace: str, group: int, pages: Sequence[tuple[bytes, bytes | memoryview]], tag: str
    ) -> int:
        """Reserve, copy and commit ``pages`` in chunks, pipelined on the connection (``store_parts``):
        the first of at most STORE_FIRST_CHUNK_BYTES, each next one of at most twice the last one's
        limit, up to STORE_CHUNK_BYTES (a chunk holds one page at least). A chunk is committed only
        once all of it is copied; a failure commits the chunks before it, aborts the rest and raises."""
        chunks: list[list[tuple[bytes, bytes | memoryview]]] = [[]]
        size = 0
        limit = min(STORE_FIRST_CHUNK_BYTES, STORE_CHUNK_BYTES)
        for page in pages:
            if chunks[-1] and size + len(page[1]) > limit:
                chunks.append([])
                size = 0
                limit = min(2 * limit, STORE_CHUNK_BYTES)
            chunks[-1].append(page)
            size += len(page[1])

        def fill(ks: list[int], slots: list[Slots]) -> Filled:
            # One pass over each payload: each block is summed as it is copied into the arena.
            return [
                [
                    None if slot is None else copy_with_checksum(self.view[slot[0] : slot[0] + slot[1]], payload)
                    for (_, payload), slot in zip(chunks[k], mine, strict=True)
                ]
                for k, mine in zip(ks, slots, strict=True)
            ]

        parts = [StorePart(namespace, group, [(digest, len(payload)) for digest, payload in c], tag) for c in chunks]
        outcomes = self.store_parts(parts, fill)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return sum(o for o in outcomes if isinstance(o, int))

    def store_parts(self, parts: Sequence[StorePart], fill: Fill, together: int = 0) -> list[int | Exception | None]:
        """Reserve, fill and commit each part in one exchange, pipelined: the reserves of the parts after
        part k are sent before part k is filled (as many as hold at most half the pool, reserved extents
        being never evicted) and no commit is waited for before the next part, so the manager answers
        them while the caller copies. ``fill(ks, slots)`` writes the reserved extents of parts ``ks``
        (per part, ``(offset, length)`` per page, None for a page already cached or written by an earlier
        part of the exchange: nothing to write) and returns per part its pages' checksums (None where the
        slot is None) or the exception that stopped its copy; or a callable that waits for copies still
        in flight and returns those: the parts are then committed after the next fill started (a device
        copy runs while the host waits for the one before), and a reservation whose copy is in flight is
        aborted only once that copy has finished. One part per fill; with ``together`` (bytes), the
        parts reserved ahead, in order, in one fill while it holds at most that many bytes (their reserves
        answered first): fewer device copies where the host's work per copy costs more than a small
        part's copy, and copies still small enough to overlap the exchange.

        Returns, per part: the bytes newly committed; the exception that stopped it (an error reply to
        its reserve or commit, or what ``fill`` raised or returned for it: its reservation aborted); or
        None, not stored because an earlier part of its ``key`` failed (a later one already reserved is
        aborted; one committed before a refused commit's reply arrived stays stored, and reports its
        bytes). Raises only when the connection is lost (``ManagerUnavailable``: nothing stays
        reserved), when a request cannot be sent, or on an exception that is not an ``Exception``: every
        reply due read first, every reservation not committed aborted, every copy in flight finished."""
        outcomes: list[int | Exception | None] = [None] * len(parts)
        failed: dict[Any, int] = {}  # the key of each save that failed: its first part that failed

        def fail(k: int) -> None:
            failed[parts[k].key] = min(failed.get(parts[k].key, k), k)

        granted: dict[int, Any] = {}  # part index: its reservation's result, until committed or aborted
        # A page in several parts (requests sharing a prefix, saved in one step) is reserved and written
        # once, by the first part that has it; were that part to fail, the later one lacks the page (a
        # future miss, never a wrong byte).
        seen: dict[tuple[str, int], set[bytes]] = {}  # per namespace and group, the hashes of the parts so far
        sent: list[Sequence[int]] = []  # per part, the indexes of its pages in its reserve
        for part in parts:
            known = seen.setdefault((part.namespace, part.group), set())
            digests = [page[0] for page in part.pages]
            fresh = set(digests)
            if len(fresh) == len(digests) and known.isdisjoint(fresh):
                known |= fresh
                sent.append(range(len(digests)))
                continue
            mine: list[int] = []
            for i, digest in enumerate(digests):
                if digest not in known:
                    known.add(digest)
                    mine.append(i)
            sent.append(mine)

        def whole(k: int) -> bool:  # every page of part k in its reserve (the common case, without a page loop)
            return len(sent[k]) == len(parts[k].pages)

        sizes = [
            sum(page[1] for page in parts[k].pages) if whole(k) else sum(parts[k].pages[i][1] for i in sent[k])
            for k in range(len(parts))
        ]
        budget = max(int(self.info["arena_size"]) // 2, 1)
        upcoming = collections.deque(range(len(parts)))
        ahead: collections.deque[int] = collections.deque()  # reserves sent, their parts not yet filled
        held = 0  # the bytes of those parts
        with self._exchange() as wire:

            def send(op: str, args: dict[str, Any], tag: tuple[str, int, int]) -> None:
                while len(wire.due) >= AHEAD:  # the manager never stops reading while its replies wait
                    answer()
                wire.send(op, args, tag=tag)

            def abort(k: int) -> None:
                reservation = granted.pop(k)["reservation"]
                send("abort", {"reservation": reservation}, ("abort", k, reservation))

            def answer() -> None:
                (op, k, reservation), reply = wire.receive()
                try:
                    result = _raise(reply)
                except OrbitKVError as exc:
                    if op != "abort":
                        outcomes[k] = outcomes[k] if isinstance(outcomes[k], Exception) else exc
                        fail(k)
                    if op == "commit":  # a refused commit leaves its reservation in place
                        send("abort", {"reservation": reservation}, ("abort", k, reservation))
                    return
                if op == "reserve":
                    granted[k] = result
                elif op == "commit":
                    outcomes[k] = int(result["committed"])

            def reserve_ahead() -> None:
                """Send the reserves of the next parts (not of a failed key) while the parts reserved
                and not yet filled hold at most half the pool, or none is."""
                nonlocal held
                while upcoming and (not ahead or held + sizes[upcoming[0]] <= budget):
                    k = upcoming.popleft()
                    part = parts[k]
                    if part.key in failed:
                        continue
                    if not sent[k]:  # every page of it is another part's to write
                        outcomes[k] = 0
                        continue
                    pages = part.pages if whole(k) else [part.pages[i] for i in sent[k]]  # tuples go as arrays
                    args = {"namespace": part.namespace, "group": part.group, "pages": pages, "tag": part.tag}
                    send("reserve", args, ("reserve", k, 0))
                    ahead.append(k)
                    held += sizes[k]

            def settle(ks: list[int], filled: Filled | Callable[[], Filled]) -> None:
                """Commit parts ``ks`` with their copies' checksums (waited for if in flight), or abort
                each whose copy failed or an earlier part of whose store failed meanwhile."""
                try:
                    results: list[Sequence[int | None] | Exception] = list(filled() if callable(filled) else filled)
                except Exception as exc:
                    results = [exc] * len(ks)
                for k, got in zip(ks, results, strict=True):
                    if isinstance(got, Exception):
                        outcomes[k] = got
                        fail(k)
                    if isinstance(got, Exception) or failed.get(parts[k].key, k) < k:
                        abort(k)  # a later part's failure is not its own
                    else:
                        reservation = granted.pop(k)["reservation"]
                        sums = list(got) if whole(k) else [got[i] for i in sent[k]]
                        args = {"reservation": reservation, "checksums": sums}
                        send("commit", args, ("commit", k, reservation))

            copying: collections.deque[tuple[list[int], Callable[[], Filled]]] = collections.deque()
            try:
                reserve_ahead()
                while ahead:
                    turn, size = [ahead[0]], sizes[ahead[0]]
                    for k in itertools.islice(ahead, 1, None):
                        if size + sizes[k] > together:
                            break
                        turn.append(k)
                        size += sizes[k]
                    ready: list[int] = []
                    for k in turn:
                        while k not in granted and wire.due and not isinstance(outcomes[k], Exception):
                            answer()
                        if k not in granted:
                            continue
                        if failed.get(parts[k].key, k) < k:  # an earlier part of its store failed meanwhile
                            abort(k)
                        else:
                            ready.append(k)
                    if ready:
                        slots: list[Slots] = []
                        for k in ready:
                            given = granted[k]["slots"]
                            if len(given) != len(sent[k]):
                                raise ProtocolError(f"{len(given)} slots granted for a reserve of {len(sent[k])} pages")
                            if whole(k):
                                slots.append([None if slot is None else (int(slot[0]), int(slot[1])) for slot in given])
                                continue
                            slots.append([None] * len(parts[k].pages))
                            for i, slot in zip(sent[k], given, strict=True):
                                slots[-1][i] = None if slot is None else (int(slot[0]), int(slot[1]))
                        try:
                            filled = fill(ready, slots)
                        except Exception as exc:
                            filled = [exc] * len(ready)
                        if callable(filled):  # in flight: settled once the next fill started
                            copying.append((ready, filled))
                        else:
                            settle(ready, filled)
                    while len(copying) > (1 if ready and copying and copying[-1][0] is ready else 0):
                        settle(*copying.popleft())
                    for k in turn:
                        ahead.popleft()
                        held -= sizes[k]
                    reserve_ahead()
                while copying:
                    settle(*copying.popleft())
                while wire.due:
                    answer()
            except BaseException:
                # The replies still due are read (the connection stays in step) and every reservation
                # not committed is aborted, a copy still in flight finished first (it writes the
                # reserved extents); a lost connection holds nothing.
                for _, wait in copying:
                    with contextlib.suppress(Exception):
                        wait()
                with contextlib.suppress(OrbitKVError):
                    while wire.due and not wire.broken:
                        answer()
                for result in granted.values():
                    if wire.broken:
                        break
                    with contextlib.suppress(OrbitKVError):
                        wire.send("abort", {"reservation": result["reservation"]})
                        wire.receive()
                raise
        # A part after a failed one of its key is not stored, whatever its own reply said (its reserve,
        # sent ahead, may have been refused too): the outcome does not depend on how far ahead it went.
        stopped: set[Any] = set()
        for k, outcome in enumerate(outcomes):
            if parts[k].key in stopped and not isinstance(outcome, int):
                outcomes[k] = None
            elif isinstance(outcome, Exception):
                stopped.add(parts[k].key)
        return outcomes

    def read_recovery(
        self, namespace: str, boundary: int, ranges: Iterable[tuple[int, list[bytes]]]
    ) -> Recovery | None:
        """Lease every page of every range, or None (a miss) when any range is incomplete."""
        wanted = [(group, list(hashes)) for group, hashes in ranges]  # msgpack sends tuples as arrays
        return self._recovery(wanted, self.call("read_recovery", namespace=namespace, boundary=boundary, ranges=wanted))

    def read_recoveries(
        self, namespace: str, requests: Sequence[tuple[int, Iterable[tuple[int, list[bytes]]]]]
    ) -> list[Recovery | None]:
        """Several ``read_recovery`` calls, each ``(boundary, ranges)``, in one exchange: every request is
        sent before any reply is read, so the manager answers them back to back and the caller waits for
        one round trip instead of one each. Each is a lease of its own, granted or missed (None) on its own,
        in the order asked. An error reply, or a malformed one, raises after every reply has been read and
        every lease granted has been released (not waited for)."""
        wanted = [[(group, list(hashes)) for group, hashes in ranges] for _, ranges in requests]
        replies: list[dict[str, Any]] = []
        with self._exchange() as wire:
            try:
                asks = (
                    {"namespace": namespace, "boundary": boundary, "ranges": ranges}
                    for (boundary, _), ranges in zip(requests, wanted, strict=True)
                )
                wire.pipeline("read_recovery", asks, replies)
            except BaseException:
                # A request that could not be sent (the replies due are read by then): every lease granted is
                # given back, so the connection stays in step and holds nothing (a broken one holds nothing).
                with contextlib.suppress(OrbitKVError):
                    for reply in replies:
                        result = reply.get("result")
                        if reply.get("ok") and isinstance(result, dict) and isinstance(result.get("lease"), int):
                            wire.send("release", {"lease": result["lease"]})
                wire.drain()
                raise
        granted: list[Recovery | None] = []
        failure: Exception | None = None
        for ranges, reply in zip(wanted, replies, strict=True):
            try:
                granted.append(self._recovery(ranges, _raise(reply)))
            except OrbitKVError as exc:
                failure = failure or exc
                granted.append(None)
        if failure is not None:
            for recovery in granted:
                if recovery is not None:
                    with contextlib.suppress(OrbitKVError):  # a connection gone takes its leases with it
                        self.release(recovery.lease, wait=False)
            raise failure
        return granted

    def _recovery(self, wanted: list[tuple[int, list[bytes]]], reply: Any) -> Recovery | None:
        """A ``read_recovery`` result for the ranges asked: None for a miss, a ``ProtocolError`` (the lease
        released, not waited for) for a reply that does not describe the pages asked for."""
        if not reply["hit"]:
            return None
        try:
            groups = reply["pages"]
            if not isinstance(groups, list) or [entry[0] for entry in groups] != [group for group, _ in wanted]:
                raise ProtocolError("a lease's groups are not the ranges asked for")
            pages = {
                group: LeasedPages.unpack(entry[1:], len(hashes))
                for (group, hashes), entry in zip(wanted, groups, strict=True)
            }
        except (ProtocolError, TypeError, IndexError, KeyError) as exc:
            if isinstance(reply.get("lease"), int):
                self.release(reply["lease"], wait=False)  # nothing will read these pages
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"a lease's reply is malformed: {exc}") from exc
        return Recovery(reply["lease"], pages)

    def page(self, ref: PageRef) -> memoryview:
        return self.view[ref.offset : ref.offset + ref.length]

    def verified(self, ref: PageRef) -> memoryview:
        """The page's bytes after checking them against the committed checksum."""
        data = self.page(ref)
        if checksum(data) != ref.checksum:
            raise OrbitKVError(f"page at arena offset {ref.offset} failed its checksum")
        return data

    def checksum_of(self, offset: int, length: int) -> int:
        """The checksum (mix64) of an arena extent, as the manager and the transfer kernels compute it."""
        view = self.view[offset : offset + length]
        try:
            return checksum(view)
        finally:
            view.release()

    def release(self, lease: int, wait: bool = True) -> None:
        """Give a lease back. ``wait=False`` sends the request and returns without waiting for the
        manager's reply, which is read (and, were it an error, logged as a warning) before the reply to
        this client's next request: the manager answers one connection's requests in order, so the
        release still takes effect before anything this client asks next. It saves a restore the round
        trip to a manager that had sat idle while the pages were copied (BENCHMARKS.md)."""
        if wait:
            self.call("release", lease=lease)
            return
        with self._exchange(drain=False) as wire:  # releases back to back: none waits for the one before
            wire.send("release", {"lease": lease})
            self._unread.extend(wire.due)

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def close(self) -> None:
        self._sock.close()
        # A tensor still viewing the arena keeps the mapping alive until it goes (the close refuses).
        with contextlib.suppress(BufferError):
            self.view.release()
            self.arena.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncCacheClient:
    """The batched asyncio path: many requests in flight on one connection, matched by id."""

    def __init__(self, endpoint: str, max_frame: int = DEFAULT_MAX_FRAME, token: str | None = None) -> None:
        self.endpoint = endpoint
        self.max_frame = max_frame
        self.token = token
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}

    async def connect(self) -> AsyncCacheClient:
        hello_args = _hello_args("async-client", _token(self.token))
        try:
            path = unix_socket_path(self.endpoint)
            if path is not None:
                self._reader, self._writer = await asyncio.open_unix_connection(path)
            else:
                host, _, port = self.endpoint.rpartition(":")
                self._reader, self._writer = await asyncio.open_connection(host.strip("[]") or "127.0.0.1", int(port))
        except OSError as exc:
            raise ManagerUnavailable(f"cannot reach the cache manager at {self.endpoint}: {exc}") from exc
        self._reading = asyncio.create_task(self._read_replies())
        try:
            self.info = await self.call("hello", **hello_args)
        except BaseException:
            await self.close()
            raise
        return self

    async def _read_replies(self) -> None:
        try:
            while True:
                (size,) = HEADER.unpack(await self._reader.readexactly(HEADER.size))
                reply = decode(await self._reader.readexactly(size))
                future = self._pending.pop(reply.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ManagerUnavailable(f"cache manager at {self.endpoint} went away: {exc}"))
            self._pending.clear()

    async def call(self, op: str, **args: Any) -> Any:
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._writer.write(encode({"id": request_id, "op": op, "args": args}, self.max_frame))
        await self._writer.drain()
        return _raise(await future)

    async def lookup_many(self, namespace: str, batches: Iterable[dict[int, list[bytes]]]) -> list[Any]:
        """Several lookups in flight at once (one per request of an engine's waiting queue)."""
        return list(await asyncio.gather(*(self.call("lookup", namespace=namespace, groups=b) for b in batches)))

    async def close(self) -> None:
        self._writer.close()
        self._reading.cancel()
