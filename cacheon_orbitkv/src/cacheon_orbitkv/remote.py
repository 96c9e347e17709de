"""The remote tier: pages shared by the managers of several hosts through a Redis-protocol store
(a Valkey or Redis Cluster, or a single node), reached with valkey-glide.

One key per page (``SET`` is atomic, so a page is visible whole or not at all). The value is a
versioned header naming the page's full identity (namespace, group, hash), its length, checksum and
layout tag, optionally a keyed MAC (BLAKE2b over header and payload, ``--remote-key-file``), then the
payload. Every value read back is checked against the identity it was asked for, its length, its
checksum and (with a key) its MAC before a byte of it is leased; anything else is a miss.

The store is a cache behind the hosts' own tiers, never in an engine's path: writes are queued and
written behind (a full queue drops pages and counts them), discovery and reads are bounded by
``timeout``, and any failure is a miss. After ``BREAKER_FAILURES`` consecutive failures the tier
pauses for ``breaker_retry_s`` (lookups and recoveries skip it, writes are dropped), then tries again.

Discovery asks each node once for the existence of all its keys: a read-only Lua script, keys passed
as arguments (``allow-cross-slot-keys``: a node answers for any of its slots), routed per node by the
slot map. A store that refuses scripts gets a pipeline of ``EXISTS`` instead, still one batch.
"""

from __future__ import annotations

import asyncio
import binascii
import bisect
import collections
import hashlib
import hmac
import logging
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import msgpack
from prometheus_client import CollectorRegistry, Counter, Gauge

from .wire import checksum

if TYPE_CHECKING:
    from .pages import Page

log = logging.getLogger(__name__)

VALUE_MAGIC = b"OKVR"
VALUE_VERSION = 1
_PREFIX = struct.Struct("<4sBBI8s")  # magic, version, flags, header length, header digest
FLAG_MAC = 1
MAC_BYTES = 32
MAC_PERSON = b"orbitkv-remote"
SLOTS = 16384
BREAKER_FAILURES = 3
FETCH_CHUNK = 32  # pages per pipelined batch of GETs: each batch is verified while the next arrives
WRITE_BATCH = 32
EXISTS_SCRIPT = """#!lua flags=no-writes,allow-cross-slot-keys
local found = {}
for i, key in ipairs(ARGV) do found[i] = redis.call('EXISTS', key) end
return found
"""

Key = tuple[str, int, bytes]


class RemoteValueError(ValueError):
    """A value that is not the page it was asked for; ``reason`` is one of ``format``, ``identity``,
    ``mac`` or ``checksum``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def remote_key(key: Key) -> bytes:
    """The store key of a page: a digest of its full identity (the value's header names it in full)."""
    namespace, group, digest = key
    ident = hashlib.blake2b(f"{namespace}\x00{group}\x00".encode() + digest, digest_size=20)
    return b"okv1:" + ident.hexdigest().encode()


def _digest(header: bytes | memoryview) -> bytes:
    """The header's own check (the checksum covers only the payload): any changed field is refused."""
    return hashlib.blake2b(header, digest_size=8).digest()


def _mac(mac_key: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    h = hashlib.blake2b(key=mac_key, digest_size=MAC_BYTES, person=MAC_PERSON)
    for part in parts:
        h.update(part)
    return h.digest()


def encode_value(key: Key, checksum_: int, tag: str, payload: bytes | memoryview, mac_key: bytes | None) -> bytes:
    """A page as stored: prefix (magic, version, flags, header length and digest), msgpack header
    [namespace, group, hash, length, checksum, tag], MAC (with a key), payload."""
    header = msgpack.packb([key[0], key[1], key[2], len(payload), checksum_, tag], use_bin_type=True)
    prefix = _PREFIX.pack(VALUE_MAGIC, VALUE_VERSION, FLAG_MAC if mac_key else 0, len(header), _digest(header))
    mac = _mac(mac_key, (prefix, header, payload)) if mac_key else b""
    return b"".join((prefix, header, mac, payload))


@attrs.frozen
class RemotePage:
    """A value read back and verified: its payload (a view of the value), checksum and layout tag."""

    payload: memoryview
    checksum: int
    tag: str


def decode_value(value: bytes, key: Key, mac_key: bytes | None) -> RemotePage:
    """Check ``value`` is page ``key`` (identity, length, MAC with ``mac_key``, checksum); raises
    ``RemoteValueError``. The checksum is computed over the payload, so this is the costly step."""
    view = memoryview(value)
    if len(view) < _PREFIX.size:
        raise RemoteValueError("format", f"a {len(view)}-byte value is too short for a page")
    magic, version, flags, header_length, header_digest = _PREFIX.unpack_from(view)
    if magic != VALUE_MAGIC or version != VALUE_VERSION or flags & ~FLAG_MAC:
        raise RemoteValueError("format", f"not an OrbitKV page value of version {VALUE_VERSION}")
    start = _PREFIX.size + header_length
    if start > len(view) or not hmac.compare_digest(_digest(view[_PREFIX.size : start]), header_digest):
        raise RemoteValueError("format", "the page header does not match its digest")
    try:
        header = msgpack.unpackb(view[_PREFIX.size : start], raw=False)
        namespace, group, digest, length, crc, tag = header
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RemoteValueError("format", f"unreadable page header: {exc}") from exc
    if (namespace, group, digest) != key:
        raise RemoteValueError("identity", "the value's header names another page")
    has_mac = bool(flags & FLAG_MAC)
    payload_start = start + (MAC_BYTES if has_mac else 0)
    payload = view[payload_start:]
    if not isinstance(length, int) or len(payload) != length or not isinstance(tag, str) or not isinstance(crc, int):
        raise RemoteValueError("format", f"the payload is {len(payload)} bytes, its header says {length!r}")
    if mac_key is not None:
        if not has_mac:
            raise RemoteValueError("mac", "the value carries no MAC and this manager requires one")
        expected = _mac(mac_key, (view[: _PREFIX.size], view[_PREFIX.size : start], payload))
        if not hmac.compare_digest(expected, view[start:payload_start]):
            raise RemoteValueError("mac", "the value's MAC does not match")
    if checksum(payload) != crc:
        raise RemoteValueError("checksum", "the payload does not match its checksum")
    return RemotePage(payload, crc, tag)


@attrs.frozen
class RemoteConfig:
    """What ``--remote`` and its companion flags say."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    write: str = "behind"  # or "off"
    ttl: int = 86400  # seconds; 0: no expiry
    timeout: float = 1.0  # seconds, every call to the store
    queue_pages: int = 1024
    mac_key: bytes | None = None
    breaker_retry_s: float = 10.0

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RemoteConfig:
        """``redis://[user:password@]HOST:PORT[,HOST:PORT...]`` (``rediss://``: TLS; ``valkey://`` and
        ``valkeys://`` too). ValueError names what is wrong."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("redis", "rediss", "valkey", "valkeys"):
            raise ValueError(f"--remote {url!r} must start with redis://, rediss://, valkey:// or valkeys://")
        userinfo, _, hosts = rest.rpartition("@")
        hosts = hosts.split("/", 1)[0]
        username = password = None
        if userinfo:
            user, has_password, secret = userinfo.partition(":")
            username = urllib.parse.unquote(user) or None
            password = urllib.parse.unquote(secret) if has_password else urllib.parse.unquote(user)
            if not has_password:
                username = None  # redis://password@host: a password alone
        nodes = []
        for item in hosts.split(","):
            host, colon, port = item.strip().rpartition(":")
            if not colon or not port.isdigit() or not host:
                raise ValueError(f"--remote {url!r}: {item!r} must be HOST:PORT")
            nodes.append((host.strip("[]"), int(port)))
        return cls(tuple(nodes), scheme in ("rediss", "valkeys"), username, password, **kwargs)


def read_mac_key(path: str) -> bytes:
    """The MAC key from ``--remote-key-file``: at least 16 bytes of secret, reduced to 64 by BLAKE2b."""
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"{path} holds {len(secret)} bytes: a remote key needs at least 16")
    return hashlib.blake2b(secret, digest_size=64, person=b"orbitkv-mac-key").digest()


def key_slot(key: bytes) -> int:
    """The cluster slot of a key without a hash tag (OrbitKV's keys have none): CRC16-XMODEM mod 16384."""
    return binascii.crc_hqx(key, 0) % SLOTS


class RemoteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits = Counter("orbitkv_remote_hits", "Pages read from the remote store and leased", registry=r)
        self.misses = Counter(
            "orbitkv_remote_misses",
            "Pages a recovery asked the remote store for and did not get (absent, rejected or a failed read)",
            registry=r,
        )
        self.bytes = Counter(
            "orbitkv_remote_bytes", "Payload bytes moved to or from the remote store", ["direction"], registry=r
        )
        self.queue = Gauge("orbitkv_remote_queue_depth", "Pages waiting to be written to the remote store", registry=r)
        self.dropped = Counter(
            "orbitkv_remote_dropped_writes",
            "Pages not written to the remote store, by reason (queue_full, paused, evicted, failed, corrupt)",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            "orbitkv_remote_rejected",
            "Values read from the remote store and refused, by reason (format, identity, mac, checksum)",
            ["reason"],
            registry=r,
        )
        self.failures = Counter(
            "orbitkv_remote_failures", "Calls to the remote store that failed or timed out", ["op"], registry=r
        )
        self.breaker = Gauge(
            "orbitkv_remote_breaker_open", "1 while the remote tier is paused after repeated failures", registry=r
        )
        self.breaker_trips = Counter(
            "orbitkv_remote_breaker_trips", "Times the remote tier paused after repeated failures", registry=r
        )
        for direction in ("read", "written"):
            self.bytes.labels(direction)
        for reason in ("queue_full", "paused", "evicted", "failed", "corrupt"):
            self.dropped.labels(reason)
        for reason in ("format", "identity", "mac", "checksum"):
            self.rejected.labels(reason)
        for op in ("lookup", "read", "write", "connect"):
            self.failures.labels(op)


Route = tuple[str, int] | None  # None: a single node; else a cluster primary's address


class RemoteTier:
    """The remote store as the manager's loop sees it. ``start()`` on the loop first."""

    def __init__(self, config: RemoteConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = RemoteMetrics(registry)
        self.client: Any = None
        self.cluster = False
        self._slots: list[tuple[int, int, tuple[str, int]]] = []  # (first, last, primary), sorted
        self._slot_starts: list[int] = []
        self._slots_loaded = 0.0
        self._rloop: asyncio.AbstractEventLoop | None = None
        self._rthread: threading.Thread | None = None
        self._scripts = True
        self._failures = 0
        self._paused_until = 0.0
        self._connecting: asyncio.Task[Any] | None = None
        self.queue: collections.deque[Page] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._pin: Callable[[Page], bool] | None = None
        self._unpin: Callable[[Page], None] | None = None
        self._io: Any = None
        self._arena: Any = None
        self.stats: dict[str, Any] = {
            "hits": 0,
            "misses": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "pages_written": 0,
            "dropped": {"queue_full": 0, "paused": 0, "evicted": 0, "failed": 0, "corrupt": 0},
            "rejected": {"format": 0, "identity": 0, "mac": 0, "checksum": 0},
            "failures": 0,
            "breaker_trips": 0,
        }
        self.metrics.queue.set_function(lambda: len(self.queue))
        self.metrics.breaker.set_function(lambda: float(self.paused()))

    # -- state ---------------------------------------------------------------------------------

    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def usable(self) -> bool:
        """Whether a call may go to the store now (connected, or a connection attempt is allowed)."""
        return not self.paused()

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.stats,
            "dropped": dict(self.stats["dropped"]),
            "rejected": dict(self.stats["rejected"]),
            "queue_depth": len(self.queue),
            "breaker_open": self.paused(),
            "connected": self.client is not None,
            "mode": "cluster" if self.cluster else "single",
            "write": self.config.write,
            "mac": self.config.mac_key is not None,
        }

    def _failed(self, op: str, exc: BaseException) -> None:
        self._failures += 1
        self.stats["failures"] += 1
        self.metrics.failures.labels(op).inc()
        if self._failures >= BREAKER_FAILURES and not self.paused():
            self._paused_until = time.monotonic() + self.config.breaker_retry_s
            self.stats["breaker_trips"] += 1
            self.metrics.breaker_trips.inc()
            log.warning(
                "remote store: %d calls in a row failed (last, %s: %s: %s); the remote tier pauses for %.0f s "
                "(lookups and recoveries miss it, writes are dropped)",
                self._failures,
                op,
                type(exc).__name__,
                exc,
                self.config.breaker_retry_s,
            )
        elif self._failures == 1:  # the first of a streak: one line, the rest wait for the breaker
            log.warning("remote store: %s failed (a miss): %s: %s", op, type(exc).__name__, exc)
        else:
            log.debug("remote store: %s failed: %s: %s", op, type(exc).__name__, exc)

    def _succeeded(self) -> None:
        if self._failures >= BREAKER_FAILURES:
            log.info("remote store: answering again; the remote tier resumes")
        self._failures = 0

    # -- connection ----------------------------------------------------------------------------

    def start(self, io: Any, arena: Any, pin: Callable[[Page], bool], unpin: Callable[[Page], None]) -> None:
        """Begin on the running loop: the writer task and a first connection attempt (in the background:
        a store that is down at start is a paused tier, not a manager that fails to start)."""
        self._io, self._arena, self._pin, self._unpin = io, arena, pin, unpin
        self._wake = asyncio.Event()
        if self.config.write == "behind":
            self._writer = asyncio.create_task(self._write_loop())
        self._connect_in_background()

    def _connect_in_background(self) -> asyncio.Task[Any]:
        """One connection attempt at a time, shared by every caller waiting for the client."""
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.create_task(self._connect_once())
            self._connecting.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        return self._connecting

    async def _connect_once(self) -> Any:
        client, cluster, slots = await asyncio.wait_for(self._run(self._connect()), max(self.config.timeout, 5.0))
        self.cluster = cluster
        self._set_slots(slots)
        self.client = client
        return client

    def _glide_thread(self) -> asyncio.AbstractEventLoop:
        """The event loop every glide call runs on, in a thread of its own: glide blocks its loop while
        it connects (for its whole connection timeout), and the manager's loop must never stall."""
        if self._rloop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="orbitkv-remote", daemon=True)
            thread.start()
            self._rloop, self._rthread = loop, thread
        return self._rloop

    async def _run(self, coro: Any) -> Any:
        """Run a coroutine that touches glide on the glide thread's loop; cancelling this cancels it."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._glide_thread()))

    async def _ensure_client(self) -> Any:
        """The client, connecting first if need be; a caller waits at most ``timeout`` for the shared
        attempt (which goes on in the background), so no call outlasts ``--remote-timeout``."""
        if self.client is not None:
            return self.client
        attempt = self._connect_in_background()
        try:
            return await asyncio.wait_for(asyncio.shield(attempt), self.config.timeout)
        except Exception as exc:
            self._failed("connect", exc)
            raise

    async def _connect(self) -> tuple[Any, bool, list[tuple[int, int, tuple[str, int]]]]:
        """(On the glide thread.) A client, whether it is a cluster's, and the cluster's slot map."""
        from glide import (
            AdvancedGlideClientConfiguration,
            AdvancedGlideClusterClientConfiguration,
            GlideClient,
            GlideClientConfiguration,
            GlideClusterClient,
            GlideClusterClientConfiguration,
            NodeAddress,
            ServerCredentials,
        )

        cfg = self.config
        addresses = [NodeAddress(host, port) for host, port in cfg.nodes]
        credentials = ServerCredentials(cfg.password, cfg.username) if cfg.password is not None else None
        timeout_ms = max(int(cfg.timeout * 1000), 1)
        single = AdvancedGlideClientConfiguration(connection_timeout=timeout_ms)
        probe = None
        cluster = False
        for address in addresses:  # the first node that answers says whether this is a cluster
            try:
                probe = await GlideClient.create(
                    GlideClientConfiguration(
                        [address],
                        use_tls=cfg.tls,
                        credentials=credentials,
                        request_timeout=timeout_ms,
                        advanced_config=single,
                    )
                )
                info = await probe.custom_command(["INFO", "cluster"])
                cluster = b"cluster_enabled:1" in (info if isinstance(info, bytes) else str(info).encode())
                break
            except Exception:
                if probe is not None:
                    await probe.close()
                    probe = None
                if address is addresses[-1]:
                    raise
        assert probe is not None
        if not cluster:
            log.info("remote store: a single node at %s:%d", *cfg.nodes[0])
            return probe, False, []
        await probe.close()
        client = await GlideClusterClient.create(
            GlideClusterClientConfiguration(
                addresses,
                use_tls=cfg.tls,
                credentials=credentials,
                request_timeout=timeout_ms,
                advanced_config=AdvancedGlideClusterClientConfiguration(connection_timeout=timeout_ms),
            )
        )
        slots = await self._read_slots(client)
        log.info("remote store: a cluster of %d primaries", len({node for _, _, node in slots}))
        return client, True, slots

    @staticmethod
    async def _read_slots(client: Any) -> list[tuple[int, int, tuple[str, int]]]:
        """(On the glide thread.) ``CLUSTER SLOTS`` as (first, last, primary address), sorted."""
        reply = await client.custom_command(["CLUSTER", "SLOTS"])
        slots = []
        for entry in reply:
            first, last, primary = entry[0], entry[1], entry[2]
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            slots.append((int(first), int(last), (host, int(primary[1]))))
        return sorted(slots)

    def _set_slots(self, slots: list[tuple[int, int, tuple[str, int]]]) -> None:
        self._slots = slots
        self._slot_starts = [s[0] for s in slots]

    def _route(self, key: bytes) -> Route:
        if not self.cluster:
            return None
        slot = key_slot(key)
        i = bisect.bisect_right(self._slot_starts, slot) - 1
        if i < 0 or self._slots[i][1] < slot:
            raise LookupError(f"no primary known for slot {slot}")
        return self._slots[i][2]

    async def _call(self, op: str, coro: Any) -> Any:
        """One bounded call; a failure is counted and re-raised."""
        try:
            result = await asyncio.wait_for(self._run(coro), self.config.timeout)
        except Exception as exc:
            self._failed(op, exc)
            raise
        self._succeeded()
        return result

    # -- discovery -----------------------------------------------------------------------------

    async def exists(self, keys: list[bytes], retry: bool = True) -> list[bool] | None:
        """Which of ``keys`` the store holds: one call per node. None when the store could not say.
        A failure reloads the slot map; when it changed (a failover), the call is made once more."""
        if not keys or not self.usable():
            return None if keys else []
        try:
            client = await self._ensure_client()
            if not self._scripts:
                return await self._exists_pipelined(client, keys)
            routes: dict[Route, list[int]] = {}
            for i, key in enumerate(keys):
                routes.setdefault(self._route(key), []).append(i)
            asks = [self._exists_script(client, route, [keys[i] for i in idx]) for route, idx in routes.items()]
            replies = await self._call("lookup", _gathered(asks))
        except _ScriptRefused as exc:
            self._scripts = False
            log.warning("remote store refuses the discovery script (%s); lookups use pipelined EXISTS", exc)
            return await self.exists(keys)
        except Exception:
            # A moved slot, a dead primary, a failover: the slot map may be stale (glide keeps its own
            # for key-routed commands; the discovery script is routed by this one).
            before = self._slots
            await self._refresh_slots()
            if retry and self._slots != before and self.usable():
                return await self.exists(keys, retry=False)
            return None
        found = [False] * len(keys)
        for idx, reply in zip(routes.values(), replies, strict=True):
            for i, flag in zip(idx, reply, strict=True):
                found[i] = bool(flag)
        return found

    async def _exists_script(self, client: Any, route: Route, keys: list[bytes]) -> list[int]:
        from glide import ByAddressRoute, RequestError, Script

        script = _script(Script)
        try:
            if route is None:
                reply = await client.invoke_script(script, args=keys)
            else:
                reply = await client.invoke_script_route(script, args=keys, route=ByAddressRoute(*route))
        except RequestError as exc:
            text = str(exc)
            if any(s in text for s in ("NOPERM", "unknown command", "Unknown command", "NOSCRIPT", "not allowed")):
                raise _ScriptRefused(text) from exc
            raise
        return list(reply)

    async def _exists_pipelined(self, client: Any, keys: list[bytes]) -> list[bool] | None:
        from glide import Batch, ClusterBatch

        batch = ClusterBatch(is_atomic=False) if self.cluster else Batch(is_atomic=False)
        for key in keys:
            batch.exists([key])
        try:
            replies = await self._call("lookup", client.exec(batch, raise_on_error=True))
        except Exception:
            return None
        return [bool(r) for r in replies]

    async def _refresh_slots(self) -> None:
        """Reload the slot map, at most once a second (a failing store is not asked again and again).
        All attempts together take at most ``timeout``: a lookup that failed and refreshed is bounded
        by two timeouts (three when the map changed and the lookup is made once more)."""
        now = time.monotonic()
        if self.client is None or not self.cluster or now < self._slots_loaded + 1.0:
            return
        self._slots_loaded = now
        deadline = now + self.config.timeout
        for _ in range(3):  # the node asked may be the one that died
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                slots = await asyncio.wait_for(self._run(self._read_slots(self.client)), left)
                self._set_slots(slots)
                return
            except Exception as exc:
                log.debug("remote store: refreshing the slot map failed: %s", exc)

    # -- reads ---------------------------------------------------------------------------------

    async def fetch(
        self, keys: list[Key], place: Callable[[int], int | None], land: Callable[[memoryview, int], None]
    ) -> list[tuple[RemotePage, int] | None]:
        """Read pages ``keys`` from the store into arena extents, verified.

        GETs go out in pipelined batches of ``FETCH_CHUNK``, all at once. As each batch arrives, an
        extent is placed (``place``, on the loop: the offset for a payload of that many bytes, None
        for no room) for each value by the length its header gives, and a worker thread verifies
        every value (identity, length, header digest, MAC, checksum) and copies the good ones into
        their extents (``land``) while later batches are still arriving or being verified. Returns,
        per key, the verified page and its extent, or None where it missed; every thread is done
        with every extent when this returns, even when it is cancelled. Extents of misses are the
        caller's to free (it placed them)."""
        out: list[tuple[RemotePage, int] | None] = [None] * len(keys)
        if not keys:
            return out
        if not self.usable():
            self._count_misses(len(keys))
            return out
        try:
            client = await self._ensure_client()
        except Exception:
            self._count_misses(len(keys))
            return out
        loop = asyncio.get_running_loop()
        chunks = [list(range(i, min(i + FETCH_CHUNK, len(keys)))) for i in range(0, len(keys), FETCH_CHUNK)]
        gets = [asyncio.ensure_future(self._get_batch(client, [remote_key(keys[i]) for i in c])) for c in chunks]
        checks: list[asyncio.Future[list[RemotePage | RemoteValueError | None]]] = []
        placed: dict[int, int] = {}  # key index -> its extent
        try:
            for chunk, get in zip(chunks, gets, strict=True):
                values = await get
                if values is None:
                    break  # a failed batch: the recovery misses; no later batch matters
                offsets = [_offset_for(value, place) for value in values]
                placed.update((i, o) for i, o in zip(chunk, offsets, strict=True) if o is not None)
                wanted = [keys[i] for i in chunk]
                mac_key = self.config.mac_key
                checks.append(loop.run_in_executor(self._io, _verify_all, values, wanted, mac_key, offsets, land))
        finally:
            for get in gets:
                get.cancel()
            # No thread may still write into an extent once this returns: the caller frees them.
            verdicts = await asyncio.shield(asyncio.gather(*checks, return_exceptions=True))
        for chunk, verdict in zip(chunks, verdicts, strict=False):
            if isinstance(verdict, BaseException):
                log.warning("remote store: verifying a batch failed: %s", verdict)
            results = [None] * len(chunk) if isinstance(verdict, BaseException) else verdict
            for i, result in zip(chunk, results, strict=True):
                if isinstance(result, RemotePage) and i in placed:
                    out[i] = (result, placed[i])
                elif isinstance(result, RemoteValueError):
                    self.stats["rejected"][result.reason] += 1
                    self.metrics.rejected.labels(result.reason).inc()
                    log.warning("remote store: a page of group %d was refused: %s", keys[i][1], result)
        got = sum(1 for o in out if o is not None)
        self._count_misses(len(keys) - got)
        return out

    def _count_misses(self, n: int) -> None:
        if n:
            self.stats["misses"] += n
            self.metrics.misses.inc(n)

    def count_hits(self, pages: int, nbytes: int) -> None:
        self.stats["hits"] += pages
        self.metrics.hits.inc(pages)
        self.stats["bytes_read"] += nbytes
        self.metrics.bytes.labels("read").inc(nbytes)

    async def _get_batch(self, client: Any, keys: list[bytes]) -> list[Any] | None:
        from glide import Batch, ClusterBatch

        batch = ClusterBatch(is_atomic=False) if self.cluster else Batch(is_atomic=False)
        for key in keys:
            batch.get(key)
        try:
            replies = await self._call("read", client.exec(batch, raise_on_error=False))
        except Exception:
            return None
        return list(replies)

    # -- writes --------------------------------------------------------------------------------

    def enqueue(self, page: Page) -> None:
        """Queue a committed page to be written behind; never waits (a full queue drops it, counted)."""
        if self.config.write != "behind" or self._wake is None:
            return
        if self.paused():
            self._drop("paused")
            return
        if len(self.queue) >= self.config.queue_pages:
            self._drop("queue_full")
            return
        self.queue.append(page)
        self._wake.set()

    def _drop(self, reason: str, n: int = 1) -> None:
        self.stats["dropped"][reason] += n
        self.metrics.dropped.labels(reason).inc(n)

    async def _write_loop(self) -> None:
        assert self._wake is not None and self._pin is not None and self._unpin is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                batch: list[Page] = []
                while self.queue and len(batch) < WRITE_BATCH:
                    page = self.queue.popleft()
                    if self._pin(page):  # held in DRAM while its bytes are copied out
                        batch.append(page)
                    else:
                        self._drop("evicted")
                if not batch:
                    continue
                if self.paused():
                    for page in batch:
                        self._unpin(page)
                    self._drop("paused", len(batch) + len(self.queue))
                    self.queue.clear()
                    break
                try:
                    values = await loop.run_in_executor(self._io, self._encode_all, batch)
                finally:
                    for page in batch:
                        self._unpin(page)
                await self._write(values)

    def _encode_all(self, pages: list[Page]) -> list[tuple[bytes, bytes, int] | None]:
        """``(store key, value, payload length)`` per page, None for one whose bytes fail its checksum."""
        out: list[tuple[bytes, bytes, int] | None] = []
        for page in pages:
            assert page.dram is not None
            payload = bytes(self._arena[page.dram : page.dram + page.length])
            if checksum(payload) != page.checksum:  # a page scribbled on after commit never leaves the host
                out.append(None)
                continue
            value = encode_value(page.key, page.checksum, page.tag, payload, self.config.mac_key)
            out.append((remote_key(page.key), value, page.length))
        return out

    async def _write(self, values: list[tuple[bytes, bytes, int] | None]) -> None:
        from glide import Batch, ClusterBatch, ExpirySet, ExpiryType

        good = [v for v in values if v is not None]
        if len(good) < len(values):
            self._drop("corrupt", len(values) - len(good))
        if not good:
            return
        try:
            client = await self._ensure_client()
        except Exception:
            self._drop("failed", len(good))
            return
        batch = ClusterBatch(is_atomic=False) if self.cluster else Batch(is_atomic=False)
        expiry = ExpirySet(ExpiryType.SEC, self.config.ttl) if self.config.ttl > 0 else None
        for key, value, _ in good:
            batch.set(key, value, expiry=expiry)
        try:
            replies = await self._call("write", client.exec(batch, raise_on_error=False))
        except Exception:
            self._drop("failed", len(good))
            return
        for (_, _, length), reply in zip(good, replies, strict=True):
            if isinstance(reply, Exception):
                self._drop("failed")
                continue
            self.stats["pages_written"] += 1
            self.stats["bytes_written"] += length
            self.metrics.bytes.labels("written").inc(length)

    async def close(self) -> None:
        for task in (self._writer, self._connecting):
            if task is not None:
                task.cancel()
        if self._connecting is not None:
            await asyncio.gather(self._connecting, return_exceptions=True)  # a client it made is closed below
        if self.queue:
            log.info("remote store: %d queued pages not written at shutdown", len(self.queue))
        if self.client is not None:
            client, self.client = self.client, None
            try:
                await asyncio.wait_for(self._run(client.close()), 5.0)
            except Exception as exc:
                log.debug("remote store: closing the client failed: %s", exc)
        if self._rloop is not None:
            self._rloop.call_soon_threadsafe(self._rloop.stop)
            if self._rthread is not None:
                self._rthread.join(5)


class _ScriptRefused(Exception):
    pass


async def _gathered(coros: list[Any]) -> list[Any]:
    """(On the glide thread.) The calls to every node at once."""
    return list(await asyncio.gather(*coros))


_SCRIPT: list[Any] = []


def _script(script_class: Any) -> Any:
    if not _SCRIPT:
        _SCRIPT.append(script_class(EXISTS_SCRIPT))
    return _SCRIPT[0]


def _offset_for(value: Any, place: Callable[[int], int | None]) -> int | None:
    """An extent for ``value``'s payload, by the length its header gives (None: no value, an
    unreadable header, or no room). The header is verified in full later, with the payload."""
    if not isinstance(value, bytes) or len(value) < _PREFIX.size:
        return None
    try:
        header_length = _PREFIX.unpack_from(value)[3]
        header = msgpack.unpackb(value[_PREFIX.size : _PREFIX.size + header_length], raw=False)
        length = header[3]
    except (ValueError, TypeError, IndexError, msgpack.UnpackException):
        return None
    if not isinstance(length, int) or not 0 < length <= len(value):
        return None
    return place(length)


def _verify_all(
    values: list[Any],
    keys: list[Key],
    mac_key: bytes | None,
    offsets: list[int | None],
    land: Callable[[memoryview, int], None],
) -> list[RemotePage | RemoteValueError | None]:
    """Each value verified and, when good, copied into its extent (a worker thread: the checksum,
    the MAC and the copy release the GIL)."""
    out: list[RemotePage | RemoteValueError | None] = []
    for value, key, offset in zip(values, keys, offsets, strict=True):
        if not isinstance(value, bytes):
            out.append(None)  # absent (None) or an error reply
            continue
        try:
            page = decode_value(value, key, mac_key)
        except RemoteValueError as exc:
            out.append(exc)
            continue
        if offset is None:
            out.append(None)
            continue
        land(page.payload, offset)
        out.append(page)
    return out
