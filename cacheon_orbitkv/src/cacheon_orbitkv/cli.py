"""The ``orbitkv-cache-manager`` command line: run a manager, or (``stats``) report a running one's figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from prometheus_client import start_http_server

from .client import _connect, _hello_args, _raise, _token
from .remote import BREAKER_FAILURES, RemoteConfig, read_mac_key
from .server import CacheManager, exposure_problem
from .ssd import SSDInUse
from .wire import (
    AUTH_TOKEN_ENV,
    DEFAULT_MAX_FRAME,
    HEADER,
    ManagerUnavailable,
    OrbitKVError,
    ProtocolError,
    compiled_checksum,
    decode,
    encode,
    parse_size,
    read_token_file,
    unix_socket_path,
)

log = logging.getLogger("cacheon_orbitkv.manager")

STATS_TIMEOUT_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orbitkv-cache-manager",
        description="The per-host OrbitKV cache manager: a shared-memory DRAM pool, an optional SSD tier, "
        "leases and metadata-only discovery, served over a unix or TCP socket.",
        epilog="'orbitkv-cache-manager stats --addr ADDR [--json]' prints a running manager's pages and bytes "
        "per tier and its counters (see 'orbitkv-cache-manager stats --help').",
    )
    parser.add_argument(
        "--addr",
        required=True,
        help="unix:///path.sock (path at most 107 bytes) or HOST:PORT, e.g. 127.0.0.1:50055; a HOST other "
        "than loopback needs --auth-token-file",
    )
    parser.add_argument("--pool-size", required=True, help="DRAM pool size, e.g. 8gb (kb/mb/gb/tb accepted)")
    parser.add_argument("--ssd-cache-path", help="SSD tier data file; omit for DRAM-only caching")
    parser.add_argument("--ssd-cache-capacity", help="SSD tier size, e.g. 100gb (required with --ssd-cache-path)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument(
        "--metrics-addr", default="127.0.0.1", help="address the metrics server binds (default 127.0.0.1)"
    )
    parser.add_argument("--lease-ttl", type=float, default=60.0, help="seconds before an unreleased lease expires")
    parser.add_argument(
        "--reserve-ttl", type=float, default=30.0, help="seconds before an uncommitted reservation is reclaimed"
    )
    parser.add_argument(
        "--auth-token-file",
        help="a file holding the token every client's hello must carry (clients read it from the file named "
        "by ORBITKV_AUTH_TOKEN_FILE); required to listen on a non-loopback TCP address",
    )
    remote = parser.add_argument_group(
        "remote tier",
        "pages shared with the managers of other hosts through a Redis-protocol store (a Valkey or Redis "
        "Cluster, or one node); needs the valkey-glide package (pip install 'cacheon-orbitkv[remote]')",
    )
    remote.add_argument(
        "--remote",
        metavar="URL",
        help="redis://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...] (rediss:// for TLS): the store's nodes; a cluster "
        "is recognised by its first node that answers",
    )
    remote.add_argument(
        "--remote-write",
        choices=("behind", "off"),
        default="behind",
        help="behind: committed pages are queued and written to the store behind the engines' backs (a full "
        "queue drops pages, counted); off: read the store, never write it (default behind)",
    )
    remote.add_argument(
        "--remote-ttl", type=int, default=86400, help="seconds a page lives in the store; 0: no expiry (default 86400)"
    )
    remote.add_argument(
        "--remote-key-file",
        help="a file holding a secret shared by every host (at least 16 bytes): each value carries a keyed MAC "
        "(BLAKE2b over header and payload), checked before a page is leased; without it the store is trusted "
        "like the hosts themselves",
    )
    remote.add_argument(
        "--remote-timeout", type=float, default=1.0, help="seconds any one call to the store may take (default 1)"
    )
    remote.add_argument(
        "--remote-queue", type=int, default=1024, help="pages the write-behind queue holds (default 1024)"
    )
    remote.add_argument(
        "--remote-retry",
        type=float,
        default=10.0,
        help=f"seconds the remote tier pauses after {BREAKER_FAILURES} failed calls in a row (default 10)",
    )
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the loop that serves requests: asyncio (default, the standard library's) or uvloop (pip install "
        "uvloop; faster on one test host, slower on another: BENCHMARKS.md, 2026-12-03)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds spent writing DRAM pages to the SSD tier (hottest first) before exiting",
    )
    return parser


def build_stats_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orbitkv-cache-manager stats",
        description="Print a running manager's pages and bytes per tier (DRAM, SSD), hits and misses, leases, "
        "reservations, evictions, corrupt pages and internal errors: the figures of its Prometheus metrics. "
        "Exit 1 with one line when the manager cannot be reached or refuses the connection, 2 for a malformed --addr "
        "or an unreadable --auth-token-file.",
    )
    parser.add_argument("--addr", required=True, help="the manager's --addr: unix:///path.sock or HOST:PORT")
    parser.add_argument("--json", action="store_true", help="print the manager's stats reply as JSON")
    parser.add_argument(
        "--auth-token-file",
        help=f"the file holding the manager's auth token (TCP managers started with --auth-token-file); "
        f"default: the file named by {AUTH_TOKEN_ENV}, if set",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=STATS_TIMEOUT_S,
        help=f"seconds to wait for the manager (default {STATS_TIMEOUT_S:g})",
    )
    return parser


def fetch_stats(addr: str, token: str | None, timeout: float) -> dict[str, Any]:
    """The manager's ``stats`` reply, over a connection of its own. Unlike ``CacheClient`` it maps no
    arena, so it works from another host or user. Raises ``ManagerUnavailable`` (or ``Unauthorized``)."""
    try:
        sock = _connect(addr)
    except OSError as exc:
        raise ManagerUnavailable(f"cannot reach the cache manager at {addr}: {exc}") from exc
    with sock:
        sock.settimeout(timeout)
        try:
            replies = []
            for request_id, op, args in ((1, "hello", _hello_args("stats", token)), (2, "stats", {})):
                sock.sendall(encode({"id": request_id, "op": op, "args": args}))
                replies.append(_raise(decode(_receive(sock))))
        except (OSError, EOFError) as exc:
            raise ManagerUnavailable(
                f"the cache manager at {addr} did not answer: {exc or type(exc).__name__}"
            ) from exc
    return dict(replies[1])


def _receive(sock: Any) -> bytes:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise EOFError("connection closed")
            data += chunk
        return data

    (size,) = HEADER.unpack(exactly(HEADER.size))
    if size > DEFAULT_MAX_FRAME:
        raise ProtocolError(f"a reply of {size} bytes is over {DEFAULT_MAX_FRAME}: is this an OrbitKV manager?")
    return exactly(size)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_stats(addr: str, stats: dict[str, Any]) -> str:
    """The human-readable report of ``stats``."""
    lines = [f"orbitkv-cache-manager at {addr}"]
    for tier, name in (("dram", "DRAM"), ("ssd", "SSD")):
        capacity = stats["capacity_bytes"][tier]
        if tier == "ssd" and capacity == 0:
            lines.append(f"  {name:<4} none (DRAM-only caching)")
            continue
        lines.append(
            f"  {name:<4} {stats['pages'][tier]} pages, {human_bytes(stats['stored_bytes'][tier])} stored, "
            f"{human_bytes(stats['free_bytes'][tier])} free of {human_bytes(capacity)}"
        )
    hits = stats["hits"]
    rows = [
        ("hits", f"{hits['dram'] + hits['ssd']} pages leased ({hits['dram']} from DRAM, {hits['ssd']} from SSD)"),
        ("misses", f"{stats['misses']} read_recovery requests"),
        ("leases", str(stats["leases"])),
        ("reservations", str(stats["reservations"])),
        ("promoting", f"{stats.get('promoting', 0)} pages being read from SSD"),
        ("evictions", f"{stats['evictions']} pages left DRAM"),
        ("corrupt", f"{stats['corrupt']} pages failed their checksum"),
        ("internal errors", str(stats.get("internal_errors", 0))),
        (
            "bytes read",
            f"DRAM {human_bytes(stats['bytes_read']['dram'])}, SSD {human_bytes(stats['bytes_read']['ssd'])}",
        ),
        (
            "bytes written",
            f"DRAM {human_bytes(stats['bytes_written']['dram'])}, SSD {human_bytes(stats['bytes_written']['ssd'])}",
        ),
    ]
    remote = stats.get("remote")
    if remote is not None:
        rows[0] = ("hits", rows[0][1][:-1] + f", {hits['remote']} from the remote store)")
        dropped = ", ".join(f"{n} {why}" for why, n in remote["dropped"].items() if n) or "none"
        rejected = ", ".join(f"{n} {why}" for why, n in remote["rejected"].items() if n) or "none"
        rows += [
            (
                "remote",
                f"{remote['mode']}, write {remote['write']}, {'MAC on' if remote['mac'] else 'no MAC'}, "
                f"{'PAUSED after failures' if remote['breaker_open'] else 'active'}",
            ),
            (
                "  read",
                f"{remote['hits']} pages ({human_bytes(remote['bytes_read'])}), {remote['misses']} missed, "
                f"rejected: {rejected}",
            ),
            (
                "  written",
                f"{remote['pages_written']} pages ({human_bytes(remote['bytes_written'])}), queue "
                f"{remote['queue_depth']}, dropped: {dropped}",
            ),
            ("  failures", f"{remote['failures']} calls, breaker tripped {remote['breaker_trips']} times"),
        ]
    lines += [f"  {label:<16}{value}" for label, value in rows]
    return "\n".join(lines)


def stats_main(argv: list[str]) -> int:
    args = build_stats_parser().parse_args(argv)
    try:
        unix_socket_path(args.addr)
        if unix_socket_path(args.addr) is None and not args.addr.rpartition(":")[2].isdigit():
            raise ValueError(f"--addr {args.addr!r} must be unix:///path.sock or HOST:PORT")
        token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        stats = fetch_stats(args.addr, _token(token), args.timeout)
    except OrbitKVError as exc:  # ManagerUnavailable, Unauthorized, a protocol mismatch
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_stats(args.addr, stats))
    return 0


def _remote_config(args: argparse.Namespace) -> RemoteConfig | None:
    """The remote tier's settings, or None without --remote; ValueError/OSError for bad ones."""
    if not args.remote:
        if args.remote_key_file:
            raise ValueError("--remote-key-file needs --remote")
        return None
    if args.remote_ttl < 0 or args.remote_timeout <= 0 or args.remote_queue < 1 or args.remote_retry <= 0:
        raise ValueError("--remote-ttl must be >= 0, --remote-timeout and --remote-retry > 0, --remote-queue >= 1")
    try:
        import glide  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--remote needs valkey-glide: pip install 'cacheon-orbitkv[remote]' ({exc})") from exc
    return RemoteConfig.from_url(
        args.remote,
        write=args.remote_write,
        ttl=args.remote_ttl,
        timeout=args.remote_timeout,
        queue_pages=args.remote_queue,
        mac_key=read_mac_key(args.remote_key_file) if args.remote_key_file else None,
        breaker_retry_s=args.remote_retry,
    )


def event_loop_factory(kind: str = "asyncio") -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes the manager's event loop: the standard ``asyncio`` one, or ``uvloop`` (ImportError
    where it is not installed). Measured by turns (BENCHMARKS.md, the cache manager's tables of
    2026-12-03), uvloop answered lookups 3-16% sooner on a 2-core AMD host in nine of ten
    measurements and 5-6% later on the H200's Intel host; stores and recovers took the same time
    within noise on the first and 4-8% longer on the second: not the default."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stats"]:
        return stats_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if bool(args.ssd_cache_path) != bool(args.ssd_cache_capacity):
        print("error: --ssd-cache-path and --ssd-cache-capacity go together", file=sys.stderr)
        return 2
    try:
        pool = parse_size(args.pool_size)
        ssd_capacity = parse_size(args.ssd_cache_capacity) if args.ssd_cache_capacity else None
        unix_socket_path(args.addr)
        token = read_token_file(args.auth_token_file) if args.auth_token_file else None
        remote = _remote_config(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        new_event_loop = event_loop_factory(args.event_loop)  # before the pool exists: a refusal leaves none
    except ImportError as exc:
        print(f"error: --event-loop uvloop: {exc} (pip install uvloop)", file=sys.stderr)
        return 2
    if args.auth_token_file and os.stat(args.auth_token_file).st_mode & 0o077:
        log.warning("auth token file %s is readable by other users: chmod 600 it", args.auth_token_file)
    problem = exposure_problem(args.addr, token is not None)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        manager = CacheManager(
            pool,
            ssd_path=args.ssd_cache_path,
            ssd_capacity=ssd_capacity,
            lease_ttl=args.lease_ttl,
            reserve_ttl=args.reserve_ttl,
            auth_token=token,
            remote=remote,
        )
    except SSDInUse as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot create the pool or open the SSD tier: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_addr, registry=manager.metrics.registry)
    # The page checksum compiled now, in the background (numpy until then); not the CPU page copies, which
    # only a client runs: the compile shares the interpreter with the manager's loop while it runs.
    compiled_checksum(wait=False, page_copies=False)
    loop = new_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
    log.info(
        "orbitkv-cache-manager on %s: pool %d bytes, arena %s, ssd %s, auth %s, loop %s",
        args.addr,
        pool,
        manager.arena_path,
        args.ssd_cache_path or "none",
        "token" if token is not None else "none",
        type(loop).__module__.split(".")[0],
    )
    if remote is not None:
        log.info(
            "remote tier: %d node(s)%s, write %s, ttl %d s, %s",
            len(remote.nodes),
            " over TLS" if remote.tls else "",
            remote.write,
            remote.ttl,
            "values MAC-checked" if remote.mac_key else "no MAC: the store is trusted like the hosts",
        )
    try:
        loop.run_until_complete(manager.serve(args.addr, lambda: print(f"ready {args.addr}", flush=True)))
    except asyncio.CancelledError:
        pass
    finally:
        manager.shutdown(args.shutdown_timeout)
        # Closed here, in the main thread: left to the garbage collector, the loop would remove its
        # signal handlers from whichever thread collects it (the checksum compiler's, at exit).
        loop.close()
    return 0
