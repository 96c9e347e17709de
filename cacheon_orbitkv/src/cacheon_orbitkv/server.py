"""The manager's protocol: request validation, the per-connection loop, the endpoint, and the
same manager embedded on a thread of another process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import inspect
import ipaddress
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from .arena import ArenaFile
from .pages import Metrics, PageStore
from .remote import RemoteConfig, RemoteTier
from .ssd import SSDTier
from .wire import (
    DEFAULT_MAX_FRAME,
    HEADER,
    MAX_TAG_BYTES,
    PROTOCOL_VERSION,
    BadRequest,
    InternalError,
    OrbitKVError,
    ProtocolError,
    Unauthorized,
    decode,
    encode,
    lookup_work,
    unix_socket_path,
)

log = logging.getLogger(__name__)

LOOPBACK_NAMES = {"", "localhost"}


def exposure_problem(addr: str, has_token: bool) -> str | None:
    """Why ``addr`` may not be served without an auth token (it is reachable from other hosts), or None."""
    if has_token or unix_socket_path(addr) is not None:
        return None
    host = addr.rpartition(":")[0].strip("[]")
    if host in LOOPBACK_NAMES:
        return None
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return None
    return (
        f"--addr {addr} listens on {host!r}, reachable beyond this host, without --auth-token-file: anyone "
        "who reaches it could read the cache or poison every engine's KV; give --auth-token-file PATH, "
        "or listen on 127.0.0.1:PORT or a unix:// socket"
    )


MAX_LOOKUP_WORK = 1 << 20  # a lookup of several namespaces: namespaces x (1 + groups + hashes), at most
MAX_IN_FLIGHT = 64  # read_recovery requests of one connection running at once


@attrs.define(eq=False)
class _Replies:
    writer: asyncio.StreamWriter
    lock: asyncio.Lock


def _parse(body: bytes) -> tuple[Any, Any, dict[str, Any] | OrbitKVError]:
    """``(id, op, args)`` of a request frame, or ``(id, op, error)`` when it is not one."""
    try:
        request = decode(body)
    except ProtocolError as exc:
        return None, "?", exc
    if not isinstance(request, dict):
        return None, "?", ProtocolError("a request must be a map with id, op and args")
    args = request.get("args", {})
    if not isinstance(args, dict):
        return request.get("id"), request.get("op"), BadRequest("args must be a map")
    return request.get("id"), request.get("op"), args


def _hashes(value: Any, what: str) -> list[bytes]:
    if not isinstance(value, list):
        raise BadRequest(f"{what} must be a list of page hashes (bytes, 1..64 long)")
    if not value or (set(map(type, value)) == {bytes} and min(map(len, value)) > 0 and max(map(len, value)) <= 64):
        return value  # the checks below, run by map (a lease or lookup of 256 hashes: about 4x faster)
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


def _tag(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value.encode()) > MAX_TAG_BYTES:
        raise BadRequest(f"tag must be a string of at most {MAX_TAG_BYTES} UTF-8 bytes, got {value!r:.60}")
    return value


class CacheManager:
    """The manager: an arena, an optional SSD tier, the page state over them, and the protocol
    handlers; ``serve()`` runs it on an endpoint."""

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
        auth_token: str | None = None,
        remote: RemoteConfig | None = None,
    ) -> None:
        self.block = block
        self.max_frame = max_frame
        self.auth_token = auth_token
        # The SSD tier first: a tier locked by another manager stops this one before an arena exists.
        self.ssd = SSDTier(ssd_path, ssd_capacity or 0, block) if ssd_path else None
        try:
            self._arena = ArenaFile(shm_dir, pool_size)
        except BaseException:
            if self.ssd is not None:
                self.ssd.close()
            raise
        self.arena = self._arena.map
        self.arena_path = self._arena.path
        self.metrics = Metrics()
        self.remote = RemoteTier(remote, self.metrics.registry) if remote is not None else None
        self.pages = PageStore(
            self.arena,
            self.ssd,
            block=block,
            lease_ttl=lease_ttl,
            reserve_ttl=reserve_ttl,
            metrics=self.metrics,
            remote=self.remote,
        )
        self.internal_errors = 0
        self._server: asyncio.AbstractServer | None = None
        self._closed = False

    # -- handlers ----------------------------------------------------------------------------

    def op_hello(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        if args.get("version") != PROTOCOL_VERSION:
            raise ProtocolError(f"the first request must be hello with version {PROTOCOL_VERSION}")
        if self.auth_token is not None:
            token = args.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.auth_token.encode()):
                given = "no token" if token is None else "a wrong token"
                log.warning("refused client %d: its hello carried %s", client, given)
                raise Unauthorized(
                    f"this manager requires the token of its --auth-token-file in hello, and got {given}"
                )
        return {
            "version": PROTOCOL_VERSION,
            "arena": self.arena_path,
            "arena_size": len(self.arena),
            "block": self.block,
            "ssd": self.ssd is not None,
            "remote": self.remote is not None,
            "max_frame": self.max_frame,
            "client": client,
            # A lookup may name several namespaces (``namespaces``) for the same hashes, of at most this much
            # work (``wire.lookup_work``); a client that finds no such key asks one lookup per namespace.
            "lookup_namespaces": MAX_LOOKUP_WORK,
        }

    @staticmethod
    def _lookup_args(args: dict[str, Any]) -> tuple[list[str] | None, str, list[tuple[int, list[bytes]]]]:
        """``(namespaces, namespace, groups)``: ``namespaces`` None for a lookup of one ``namespace``;
        else the list asked (``namespace`` its first), each answered for the same groups."""
        groups = args.get("groups")
        if not isinstance(groups, dict):
            raise BadRequest("groups must be a map of group id -> page hashes")
        wanted = [(_int(g, "group id"), _hashes(h, f"group {g} hashes")) for g, h in groups.items()]
        many = args.get("namespaces")
        if many is None:
            return None, _str(args.get("namespace"), "namespace"), wanted
        if not isinstance(many, list) or not many:
            raise BadRequest("namespaces must be a non-empty list of namespaces")
        work = lookup_work(len(many), [h for _, h in wanted])
        if len(many) > 1 and work > MAX_LOOKUP_WORK:
            raise BadRequest(
                f"a lookup of {len(many)} namespaces is {work} namespaces x (1 + groups + hashes), "
                f"more than {MAX_LOOKUP_WORK}"
            )
        names = [_str(n, "each of namespaces") for n in many]
        return names, names[0], wanted

    def op_lookup(self, client: int, args: dict[str, Any]) -> Any:
        """One namespace's pages per group (``namespace``), or a list of those, one per namespace asked
        (``namespaces``: an engine's ranks, whose pages share their hashes), in order."""
        names, namespace, groups = self._lookup_args(args)
        if names is None:
            return self.pages.lookup(namespace, groups)
        return [self.pages.lookup(name, groups) for name in names]

    async def op_lookup_remote(self, client: int, args: dict[str, Any]) -> Any:
        """``lookup`` with a remote tier: pages neither local tier holds are asked of the store (a
        task of its own, like ``read_recovery``: the requests behind it do not wait for the store)."""
        names, namespace, groups = self._lookup_args(args)
        if names is None:
            return await self.pages.lookup_remote(namespace, groups)
        # Each namespace's misses asked of the store at once, as lookups of their own would be.
        return list(await asyncio.gather(*(self.pages.lookup_remote(name, groups) for name in names)))

    def op_reserve(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        namespace = _str(args.get("namespace"), "namespace")
        group = _int(args.get("group"), "group")
        tag = _tag(args.get("tag"))
        pages = args.get("pages")
        if not isinstance(pages, list) or not pages:
            raise BadRequest("pages must be a non-empty list of [hash, length]")
        wanted: list[tuple[bytes, int]] = []
        for item in pages:
            if type(item) is not list or len(item) != 2:
                raise BadRequest("each page must be [hash, length]")
            digest, length = item
            if type(digest) is not bytes or not 0 < len(digest) <= 64:
                _hashes([digest], "page hash")  # raises, naming the value
            if type(length) is not int or length < 1:
                _int(length, "page length", 1)  # raises, naming the value
            wanted.append((digest, length))
        res = self.pages.reserve(client, namespace, group, tag, wanted)
        return {"reservation": res.id, "slots": [None if s is None else [s[1], s[2]] for s in res.slots]}

    def op_commit(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        rid = _int(args.get("reservation"), "reservation")
        return {"committed": self.pages.commit(client, rid, args.get("checksums"))}

    def op_abort(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        rid = _int(args.get("reservation"), "reservation")
        self.pages.drop_reservation(self.pages.reservation(client, rid))
        return {}

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
        return await self.pages.read_recovery(client, namespace, wanted)

    def op_release(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        self.pages.release(client, _int(args.get("lease"), "lease"))
        return {}

    def op_stats(self, client: int, args: dict[str, Any]) -> dict[str, Any]:
        return {**self.pages.snapshot(), "internal_errors": self.internal_errors}

    # -- connections ---------------------------------------------------------------------------

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.5)
            self.pages.reclaim(now=time.monotonic())
            if self.ssd is not None:
                # fdatasync waits for the disk: in a thread, so lookups are not held behind it.
                await loop.run_in_executor(self.pages.io, self.ssd.sync)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection. Requests that only touch the page state are answered in order, at once;
        a ``read_recovery`` (which may wait for SSD reads) runs as its own task, so the requests
        behind it on the same connection (lookups) do not wait for it. Replies carry the request id."""
        client = self.pages.next_id()
        out = _Replies(writer, asyncio.Lock())
        greeted = False
        inflight: set[asyncio.Task[bool]] = set()
        handlers: dict[str, Callable[..., Any]] = {
            "lookup": self.op_lookup if self.remote is None else self.op_lookup_remote,
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
                    await self._reply(out, None, ProtocolError(f"frame of {size} bytes exceeds {self.max_frame}"))
                    return  # the stream cannot be resynchronized: close
                body = await reader.readexactly(size)
                began = time.perf_counter()
                request_id, op, args = _parse(body)
                if isinstance(args, OrbitKVError):
                    await self._reply(out, request_id, args)
                    if not greeted:
                        return
                    continue
                if not greeted:
                    hello = functools.partial(self._hello, client, op, args)
                    greeted = await self._answer(out, client, request_id, op, began, hello)
                    if not greeted:
                        return  # nothing but a good hello opens a connection
                    continue
                handler = handlers.get(op) if isinstance(op, str) else None
                if handler is None:
                    await self._reply(out, request_id, BadRequest(f"unknown op {op!r:.40}"))
                    continue
                call = functools.partial(handler, client, args)
                if not inspect.iscoroutinefunction(handler):
                    await self._answer(out, client, request_id, op, began, call)
                    continue
                while len(inflight) >= MAX_IN_FLIGHT:
                    await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                task = asyncio.create_task(self._answer(out, client, request_id, op, began, call))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            # The manager is stopping (SIGTERM) with this client still connected: the connection
            # ends here. Raised on, the cancellation would reach asyncio's stream callback, which
            # logs it as an unhandled error.
            return
        finally:
            if inflight:  # their leases must exist before the reclaim drops them
                await asyncio.gather(*inflight, return_exceptions=True)
            self.pages.reclaim(client)
            writer.close()

    def _hello(self, client: int, op: Any, args: dict[str, Any]) -> dict[str, Any]:
        if op != "hello":
            raise ProtocolError(f"the first request must be hello with version {PROTOCOL_VERSION}")
        return self.op_hello(client, args)

    async def _answer(
        self, out: _Replies, client: int, request_id: Any, op: Any, began: float, call: Callable[[], Any]
    ) -> bool:
        """Run one request and send its reply; False when it failed (an error reply was sent)."""
        try:
            result = call()
            if asyncio.iscoroutine(result):
                result = await result
        except OrbitKVError as exc:
            await self._reply(out, request_id, exc)
            return False
        except Exception as exc:
            # A handler validates before it mutates, so the state is as before: answer, keep serving.
            log.exception("%.40r request of client %d failed inside the manager", op, client)
            self.internal_errors += 1
            self.metrics.errors.inc()
            error = InternalError(f"{op!r:.40} failed inside the manager: {type(exc).__name__}: {exc}")
            await self._reply(out, request_id, error)
            return False
        sent = await self._reply(out, request_id, None, result)
        self.metrics.latency.labels(str(op)).observe(time.perf_counter() - began)
        return sent

    async def _reply(self, out: _Replies, request_id: Any, error: OrbitKVError | None, result: Any = None) -> bool:
        """Send a reply; False when the client is gone (its connection's loop sees that and ends)."""
        if error is None:
            message = {"id": request_id, "ok": True, "result": result}
        else:
            message = {"id": request_id, "ok": False, "error": {"type": error.type, "message": str(error)}}
        try:
            frame = encode(message, self.max_frame)
        except OrbitKVError as exc:  # a reply too large for a frame becomes an error reply
            frame = encode({"id": request_id, "ok": False, "error": {"type": exc.type, "message": str(exc)}})
        try:
            async with out.lock:  # one drain at a time: concurrent replies share the writer
                out.writer.write(frame)
                await out.writer.drain()
        except ConnectionError:
            return False
        return True

    async def serve(self, addr: str, ready: Callable[[], None] | None = None) -> None:
        problem = exposure_problem(addr, self.auth_token is not None)
        if problem is not None:
            raise ValueError(problem)
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
                self.handle, host.strip("[]") or "127.0.0.1", int(port), limit=self.max_frame + 16
            )
        sweeper = asyncio.create_task(self._sweep())
        if self.remote is not None:
            self.remote.start(self.pages.io, self.arena, self.pages.pin, self.pages.unpin)
        if ready is not None:
            ready()
        try:
            async with self._server:
                await self._server.serve_forever()
        finally:
            sweeper.cancel()
            if self.remote is not None:
                await asyncio.shield(self.remote.close())

    def shutdown(self, timeout: float) -> int:
        """An orderly stop (SIGTERM): write DRAM pages to the SSD tier, hottest first, for at most
        ``timeout`` seconds, then close. Returns the pages written."""
        written = 0
        if self.ssd is not None and not self._closed:
            began = time.monotonic()
            written = self.pages.persist_dram(began + timeout)
            log.info("wrote %d DRAM pages to the SSD tier in %.2f s before stopping", written, time.monotonic() - began)
        self.close()
        return written

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pages.close()
        if self.ssd is not None:
            self.ssd.close()
        self._arena.close()


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
