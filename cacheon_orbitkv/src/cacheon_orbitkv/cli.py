"""The ``orbitkv-cache-manager`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from prometheus_client import start_http_server

from .server import CacheManager, exposure_problem
from .ssd import SSDInUse
from .wire import parse_size, read_token_file, unix_socket_path

log = logging.getLogger("cacheon_orbitkv.manager")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orbitkv-cache-manager",
        description="The per-host OrbitKV cache manager: a shared-memory DRAM pool, an optional SSD tier, "
        "leases and metadata-only discovery, served over a unix or TCP socket.",
    )
    parser.add_argument(
        "--addr",
        required=True,
        help="unix:///path.sock (path at most 107 bytes) or HOST:PORT, e.g. 127.0.0.1:50055; a HOST other "
        "than loopback needs --auth-token-file",
    )
    parser.add_argument("--pool-size", required=True, help="DRAM pool size, e.g. 8gb (kb/mb/gb accepted)")
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
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds spent writing DRAM pages to the SSD tier (hottest first) before exiting",
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
        token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
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
        )
    except SSDInUse as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot create the pool or open the SSD tier: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_addr, registry=manager.metrics.registry)
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
    log.info(
        "orbitkv-cache-manager on %s: pool %d bytes, arena %s, ssd %s, auth %s",
        args.addr,
        pool,
        manager.arena_path,
        args.ssd_cache_path or "none",
        "token" if token is not None else "none",
    )
    try:
        loop.run_until_complete(manager.serve(args.addr, lambda: print(f"ready {args.addr}", flush=True)))
    except asyncio.CancelledError:
        pass
    finally:
        manager.shutdown(args.shutdown_timeout)
    return 0
