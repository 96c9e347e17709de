"""OrbitKV cache manager figures, each against its baseline in the same run:

1. batched discovery of 4096 page hashes (one ``lookup`` frame) versus Redis ``MGET`` of 4096 keys
   through redis-py, both on unix sockets;
2. store and recover throughput through the shared arena (256 KiB pages) versus a plain copy of the
   same bytes between two private buffers, and versus the ceiling of the mapping itself: the same
   page-by-page copies into and out of the very arena extents the stored pages occupy (populated,
   no protocol), measured in the same run, versus its two required steps one after the other
   (that copy, then the mix64 checksum of each page, timed alone), and versus the one pass the store
   makes of them (``wire.copy_with_checksum`` into the stored extents, no protocol), and versus the
   same store in one chunk (no pipelining) and in chunks of STORE_CHUNK_BYTES from the first (the shipped
   store's first chunks are smaller; the plain copy and the three stores run by turns, the stores' order
   rotating; with them, by turns, the store as an engine's CPU save runs it: ``link.save_parts`` of the
   same pages from a buffer of engine blocks, in parts of ENGINE_PART_PAGES, its best run split into its
   ``transfer.save_rows`` calls, sends and waits), and the
   recover (its lease's release sent without waiting for the reply) versus the same recover waiting for
   it, by turns; the recover as an engine's CPU restore runs it (the lease, ``transfer.restore`` of every
   page with its checksum verified, the release) versus the plain copy and, by turns, versus the same
   ``transfer.restore`` of pages leased beforehand (no request: its ceiling); the store's best
   run is also split into its copy pass, the time it sent requests and
   the time it waited for the manager's replies (the store pipelines its chunks: a reply is mostly
   ready when it is read); the recover's lease alone, and a request with no work (a lookup of no hashes), each back to
   back and straight after a copy out of the extents (the manager idle for the copy's length), by turns;
   a lease of all the pages without the socket (a manager in this process), taken apart into its steps;
   and the store and the recover against their floors: the one pass (the store) or the copy out of the
   extents (the recover) plus the one round trip each must wait for after or before it, timed as a
   request with no work straight after a copy at its quickest.
   Every buffer these figures copy from or into starts on a page boundary, as the arena's extents do
   (``page_aligned``); a copy out of the extents into a destination 16 bytes past one is timed apart.
   Then the same copies into and out of a fresh /dev/shm-like memfd mapping and, where the host has
   huge pages reserved, a ``MFD_HUGETLB`` memfd mapping, to say whether huge pages would lift the
   shared mapping's ceiling (the table says which ran);
3. SSD-tier recovery into an empty DRAM pool (a restarted manager) versus a plain sequential read of
   a file of the same size on the same file system, both with the page cache dropped first;
4. the manager on uvloop (``--event-loop uvloop``) against the same manager on the standard asyncio
   loop (the default): lookup latency after an idle spell and straight after,
   store and recover times, by turns;
5. a request's lookup on 2, 4 and 8 tensor-parallel ranks (each rank its own namespace, every rank the
   same hashes, as the vLLM connector's scheduler asks): every rank in one request
   (``CacheClient.lookup_namespaces``) against one call per rank, against one lookup per rank in one
   exchange (``CacheClient.lookups``), by turns, and against one rank's lookup alone (the floor of one
   round trip).

Where this process may run on two CPUs or more, it runs on the first and every manager it starts on the second
(``--no-pin``: both left to the scheduler); the appended note says which.

    python benchmarks/orbitkv.py [--pages 256] [--sections discovery,throughput,ssd,loops,ranks]
        [--append BENCHMARKS.md] [--no-pin]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import report  # benchmarks/report.py: the script's own directory is on sys.path

from cacheon_orbitkv import client as client_module
from cacheon_orbitkv.client import CacheClient, page_hashes
from cacheon_orbitkv.wire import checksum, compiled_checksum, copy_with_checksum, parse_size

NS = "bench:bf16:nhd:p16:r0"
PAGE = 256 << 10
POOL = "1gb"  # the throughput figures' manager
# The CPUs of the managers the figures start, set by main (--pin): on a host of few CPUs a manager that shares
# its CPU with the client runs its replies inside the client's sends (the scheduler moves a woken process
# onto its waker's CPU), which on the 2-core machine added about 1 ms to a 64 MiB save in some processes
# and not in others.
MANAGER_CPUS: set[int] | None = None
ROUTES = {"compiled": "the compiled route", "torch": "torch copies"}  # a CPU fence's path, as the table names it
ENGINE_PART_PAGES = 32  # the engine's save: parts of 32 pages (8 MiB, a store's chunk), as a step's requests


def start_manager(
    tmp: Path, pool: str, ssd: Path | None = None, ssd_capacity: str = "1gb", extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], str]:
    """A cache manager process on a unix socket in ``tmp``, with ``extra`` options (benchmarks/
    linker_lookup.py and benchmarks/remote.py use it too)."""
    sock = tmp / f"m{time.monotonic_ns()}.sock"
    args = [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", f"unix://{sock}", "--pool-size", pool]
    if ssd is not None:
        args += ["--ssd-cache-path", str(ssd), "--ssd-cache-capacity", ssd_capacity]
    args += extra
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("ready")
    if MANAGER_CPUS is not None:  # every thread it has by now; the threads it starts later inherit it
        for thread in os.listdir(f"/proc/{proc.pid}/task"):
            os.sched_setaffinity(int(thread), MANAGER_CPUS)
    return proc, f"unix://{sock}"


def page_aligned(nbytes: int) -> memoryview:
    """A private buffer that starts on a page boundary (anonymous memory, faulted in). Every buffer the
    throughput figures copy from or into is one, as the arena's page extents are: on some CPUs glibc's
    memcpy (``rep movsb`` from a few KiB) runs several times slower when the destination starts 8-24 bytes
    past the source modulo 4096, which a large ``bytearray`` (16 bytes past a page boundary) is against the
    arena. Aligned alike, no figure is that artifact; the table measures it apart."""
    import mmap

    region = mmap.mmap(-1, nbytes)
    region.write(bytes(nbytes))
    return memoryview(region)


def page_aligned_pages(pages: int) -> list[memoryview]:
    """``pages`` random pages of PAGE bytes, each on a page boundary (``page_aligned``)."""
    source = page_aligned(PAGE * pages)
    data = [source[i * PAGE : (i + 1) * PAGE] for i in range(pages)]
    for page in data:
        page[:] = os.urandom(PAGE)
    return data


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fresh_pages(run: int, data: list[memoryview]) -> list[tuple[bytes, memoryview]]:
    """``data`` under hashes of a run of its own (``run`` >= 1): a store of them commits new pages."""
    hashes = page_hashes(NS, list(range(10**7 * run, 10**7 * run + 16 * len(data))), 16)
    return list(zip(hashes, data, strict=True))


def fill_pool(c: CacheClient, data: list[memoryview]) -> int:
    """Store the pool's size once over (untimed), so that each later store evicts the oldest pages and
    writes extents written before, as a cache under load does (on these VMs, memory first written since
    the arena was mapped is written several times slower); returns the last run number it used."""
    run = 0
    for _ in range(parse_size(POOL) // (PAGE * len(data)) + 1):
        run += 1
        c.store(NS, 0, fresh_pages(run, data))
    return run


def recover_into(
    c: CacheClient, hashes: list[bytes], view: memoryview, verify: bool = False, wait: bool = False
) -> None:
    """Lease the pages, copy each out into ``view`` in order (checked against its checksum first with
    ``verify``), release the lease; without ``wait``, as the vLLM connector does, not waiting for the
    release's reply (read before the next request's)."""
    rec = c.read_recovery(NS, 0, [(0, hashes)])
    assert rec is not None
    for i, ref in enumerate(rec.pages[0]):
        view[i * PAGE : (i + 1) * PAGE] = c.verified(ref) if verify else c.page(ref)
    c.release(rec.lease, wait=wait)


def restored(c: CacheClient, hashes: list[bytes], view: memoryview, data: list[memoryview]) -> tuple[float, float, str]:
    """The recover as an engine's CPU restore runs it: the lease, ``transfer.restore`` of every page into a
    buffer of ``len(hashes)`` blocks (the checksums verified; the compiled route where numba compiled it),
    the release; and, by turns with it, the same ``transfer.restore`` of pages leased once beforehand (no
    request: the restore's own pass, the engine's recover's ceiling). Checked before it is timed: every
    block holds its page. Best of 7 each, and the route."""
    import torch

    from cacheon_orbitkv.link import leased_pages
    from cacheon_orbitkv.transfer import Arena, GroupLayout, restore

    arena = Arena(c.arena)
    blocks = torch.frombuffer(view, dtype=torch.uint8).view(len(hashes), PAGE)
    layout = GroupLayout([blocks])
    order = list(range(len(hashes)))
    route = ""

    def once() -> None:
        nonlocal route
        rec = c.read_recovery(NS, 0, [(0, hashes)])
        assert rec is not None
        fence = restore(arena, layout, leased_pages(order, rec.pages[0]))
        route = fence.path
        assert all(fence.wait())
        c.release(rec.lease, wait=False)

    held = c.read_recovery(NS, 0, [(0, hashes)])
    assert held is not None
    pages = leased_pages(order, held.pages[0])

    def alone() -> None:
        assert all(restore(arena, layout, pages).wait())

    try:
        for run in (once, alone):
            view[:] = bytes(len(view))
            run()
            assert all(view[i * PAGE : (i + 1) * PAGE] == page for i, page in enumerate(data))
        best = best_alone = 1e9
        for _ in range(7):
            best = min(best, *timed(once, 1))
            best_alone = min(best_alone, *timed(alone, 1))
    finally:
        c.release(held.lease)
    return best, best_alone, ROUTES.get(route, route)


def save_calls(link: Any) -> dict[str, Callable[..., Any]]:
    """The transfer calls ``link.save_parts`` makes, by name: ``save``, and ``save_rows`` where the library has
    it (a run against an older library for comparison has not)."""
    return {name: getattr(link, name) for name in ("save", "save_rows") if hasattr(link, name)}


def engine_saver(c: CacheClient, data: list[memoryview], part_pages: int) -> tuple[Callable[[list[bytes]], None], str]:
    """The store as an engine's CPU save runs it: ``link.save_parts`` of the pages from a buffer of
    ``len(data)`` blocks (each holding its page) in parts of ``part_pages`` blocks, as a step's requests
    are, their pages reserved, copied and summed by ``transfer.save_rows`` (the compiled route where numba
    compiled it) and committed. Checked before it is timed: the stored extents hold the pages and their
    checksums. Returns a save of the pages under fresh hashes (``save(hashes)``) and the route."""
    import torch

    from cacheon_orbitkv import link
    from cacheon_orbitkv.link import SavePart, save_parts
    from cacheon_orbitkv.transfer import Arena, GroupLayout

    arena = Arena(c.arena)
    engine = page_aligned(PAGE * len(data))
    for i, page in enumerate(data):
        engine[i * PAGE : (i + 1) * PAGE] = page
    layout = GroupLayout([torch.frombuffer(engine, dtype=torch.uint8).view(len(data), PAGE)])

    def saved(hashes: list[bytes]) -> None:
        parts = [
            SavePart(NS, 0, layout, hashes[k : k + part_pages], list(range(k, min(k + part_pages, len(data)))))
            for k in range(0, len(data), part_pages)
        ]
        outcomes = save_parts(c, arena, parts)
        assert all(isinstance(o, int) for o in outcomes), outcomes

    # The first save, checked, with the route of each of its fills noted (link's calls of transfer.save and
    # transfer.save_rows, where the library has it).
    shipped, routes = save_calls(link), set()

    def noting(call: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            fence = call(*args, **kwargs)
            routes.add(fence.path)
            return fence

        return noted

    hashes = page_hashes(NS, list(range(10**9, 10**9 + 16 * len(data))), 16)
    for name, call in shipped.items():
        setattr(link, name, noting(call))
    try:
        saved(hashes)
    finally:
        for name, call in shipped.items():
            setattr(link, name, call)
    rec = c.read_recovery(NS, 0, [(0, hashes)])
    assert rec is not None and len(rec.pages[0]) == len(data)
    for ref, page in zip(rec.pages[0], data, strict=True):
        assert c.page(ref) == page and checksum(page) == ref.checksum
    c.release(rec.lease)
    return saved, " and ".join(ROUTES.get(route, route) for route in sorted(routes))


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def discovery(tmp: Path, reps: int) -> list[str]:
    proc, endpoint = start_manager(tmp, "64mb")
    rows = []
    try:
        with CacheClient(endpoint) as c:
            hashes = page_hashes(NS, list(range(16 * 4096)), 16)
            c.store(NS, 0, [(h, b"k" * 4096) for h in hashes])  # 4096 small pages, all present
            ours = statistics.median(timed(lambda: c.lookup(NS, {0: hashes}), reps)) * 1e3
    finally:
        proc.terminate()
        proc.wait()
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        rows.append(f"| discovery of 4096 page hashes | {ours:.2f} ms | Redis MGET: redis-server not installed | - |")
        return rows
    import redis

    rsock = tmp / "redis.sock"
    server = subprocess.Popen(
        [redis_server, "--port", "0", "--unixsocket", str(rsock), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            if rsock.exists():
                break
            time.sleep(0.05)
        r = redis.Redis(unix_socket_path=str(rsock))
        r.mset({h: b"\x01" * 16 for h in hashes})
        theirs = statistics.median(timed(lambda: r.mget(hashes), reps)) * 1e3
        r.close()
    finally:
        server.terminate()
        server.wait()
    rows.append(
        f"| discovery of 4096 page hashes (median) | {ours:.2f} ms | Redis MGET of 4096 keys: {theirs:.2f} ms "
        f"| {ours / theirs:.2f} |"
    )
    return rows


def throughput(tmp: Path, pages: int, rounds: int = 9) -> list[str]:
    proc, endpoint = start_manager(tmp, POOL)
    # The client's checksum (store, verify): compiled where numba is installed, said in the table.
    which = "compiled (numba)" if compiled_checksum() else "numpy (numba not installed)"
    rows = []
    try:
        with CacheClient(endpoint) as c:
            hashes = page_hashes(NS, list(range(10**6, 10**6 + 16 * pages)), 16)
            data = page_aligned_pages(pages)
            total = PAGE * pages
            view = page_aligned(total)

            def copy() -> None:
                for i, page in enumerate(data):
                    view[i * PAGE : (i + 1) * PAGE] = page

            copy_s = min(timed(copy, 5))
            arena = c.view[:total]

            def arena_ceiling() -> None:
                # The same page-by-page copies, out of the shared arena with no protocol at all.
                for i in range(pages):
                    view[i * PAGE : (i + 1) * PAGE] = arena[i * PAGE : (i + 1) * PAGE]

            first_touch_s = min(timed(arena_ceiling, 5))
            arena.release()
            store_s, split = 1e9, {}
            parts: dict[str, float] = {}
            exchange = client_module._Exchange
            shipped_send, shipped_receive = exchange.send, exchange.receive
            shipped_copy = client_module.copy_with_checksum

            def timing(name: str, step):  # the store's requests and its waits for replies, from the client
                def timed_step(*args, **kwargs):
                    began = time.perf_counter()
                    try:
                        return step(*args, **kwargs)
                    finally:
                        parts[name] = parts.get(name, 0.0) + time.perf_counter() - began

                return timed_step

            def copy_pass(dst, src):  # the store's one pass over each page: copy and checksum
                began = time.perf_counter()
                try:
                    return shipped_copy(dst, src)
                finally:
                    parts["copy"] = parts.get("copy", 0.0) + time.perf_counter() - began

            # Timed in the steady state of a full pool (fill_pool). The recovered pages are stored first
            # and their extents leased once for the mapping's own ceiling: the same page-by-page copies
            # out of and into those very extents (written back with the bytes they hold, so nothing
            # stored changes), no protocol. Then, by turns in each round, every figure and its ceiling:
            # the plain copy; the store as shipped (chunks pipelined, the first ones smaller), in chunks of
            # STORE_CHUNK_BYTES from the first, and in one chunk; the copies into
            # the extents, plain and with the checksum (the store's one pass); the recover as the vLLM
            # connector runs it (its release not waited for), the same waiting for the release, and the
            # copy out of the extents. Each figure is its best round.
            run = fill_pool(c, data)
            assert c.stats()["evictions"] > 0
            c.store(NS, 0, list(zip(hashes, data, strict=True)))
            rec = c.read_recovery(NS, 0, [(0, hashes)])
            assert rec is not None
            extents = [c.page(ref) for ref in rec.pages[0]]

            def out_of_arena(into: memoryview = view) -> None:
                for i, extent in enumerate(extents):
                    into[i * PAGE : (i + 1) * PAGE] = extent

            # The same copies into a destination 16 bytes past a page boundary, as a 64 MiB bytearray's buffer
            # is (malloc's header), by turns with the aligned copy out (page_aligned says why).
            shifted = page_aligned(total + 4096)[16 : 16 + total]
            shifted_s = 1e9

            def into_arena() -> None:
                for extent, page in zip(extents, data, strict=True):
                    extent[:] = page

            def fused_into_arena() -> None:
                for extent, page in zip(extents, data, strict=True):
                    copy_with_checksum(extent, page)

            chunk, first, one_chunk_s, flat_s = (
                client_module.STORE_CHUNK_BYTES,
                client_module.STORE_FIRST_CHUNK_BYTES,
                1e9,
                1e9,
            )
            out_s = in_s = fused_s = recover_s = waited_s = engine_s = 1e9
            engine_save, engine_route = engine_saver(c, data, ENGINE_PART_PAGES)
            from cacheon_orbitkv import link as link_module

            shipped_saves, engine_split = save_calls(link_module), {}
            try:
                stores = ["shipped", "flat", "one chunk", "engine"]
                for _ in range(rounds):
                    copy_s = min(copy_s, *timed(copy, 1))
                    exchange.send, exchange.receive = timing("send", shipped_send), timing("wait", shipped_receive)  # type: ignore[method-assign]
                    client_module.copy_with_checksum = copy_pass
                    stores.append(stores.pop(0))  # each store first after the plain copy in a third of the rounds
                    for how in stores:
                        client_module.STORE_CHUNK_BYTES = 1 << 62 if how == "one chunk" else chunk
                        client_module.STORE_FIRST_CHUNK_BYTES = first if how == "shipped" else 1 << 62
                        run += 1  # fresh hashes each time: every store commits new pages
                        fresh = fresh_pages(run, data)
                        parts.clear()
                        if how == "engine":
                            hashes_now = [digest for digest, _ in fresh]
                            for name, call in shipped_saves.items():
                                setattr(link_module, name, timing("save", call))
                            start = time.perf_counter()
                            try:
                                engine_save(hashes_now)
                            finally:
                                took = time.perf_counter() - start
                                for name, call in shipped_saves.items():
                                    setattr(link_module, name, call)
                            if took < engine_s:
                                engine_s, engine_split = took, dict(parts)
                            continue
                        start = time.perf_counter()
                        c.store(NS, 0, fresh)
                        took = time.perf_counter() - start
                        if how == "one chunk":
                            one_chunk_s = min(one_chunk_s, took)
                        elif how == "flat":
                            flat_s = min(flat_s, took)
                        elif took < store_s:
                            store_s, split = took, dict(parts)
                    exchange.send, exchange.receive = shipped_send, shipped_receive  # type: ignore[method-assign]
                    client_module.copy_with_checksum = shipped_copy
                    client_module.STORE_CHUNK_BYTES, client_module.STORE_FIRST_CHUNK_BYTES = chunk, first
                    in_s = min(in_s, *timed(into_arena, 1))
                    fused_s = min(fused_s, *timed(fused_into_arena, 1))
                    recover_s = min(recover_s, *timed(lambda: recover_into(c, hashes, view), 1))
                    waited_s = min(waited_s, *timed(lambda: recover_into(c, hashes, view, wait=True), 1))
                    out_s = min(out_s, *timed(out_of_arena, 1))
                    shifted_s = min(shifted_s, *timed(lambda: out_of_arena(shifted), 1))
            finally:
                exchange.send, exchange.receive = shipped_send, shipped_receive  # type: ignore[method-assign]
                client_module.copy_with_checksum = shipped_copy
                client_module.STORE_CHUNK_BYTES, client_module.STORE_FIRST_CHUNK_BYTES = chunk, first
            verify_s = min(timed(lambda: recover_into(c, hashes, view, verify=True), 5))
            restore_s, restore_alone_s, route = restored(c, hashes, view, data)
            # The recover's lease alone (read_recovery's round trip, the release waited for apart): back
            # to back; straight after a copy out of the extents, as in the recover, where the manager has
            # sat idle for the copy's length while the copy went through the caches; and after a sleep of
            # the copy's length (idle, the caches left alone). The same for a request with no work (a
            # lookup of no hashes): the round trip's own floor. By turns, medians of 15.
            pause = out_s

            def before(kind: str) -> None:
                if kind == "copy":
                    out_of_arena()
                elif kind == "sleep":
                    time.sleep(pause)

            leases: dict[str, list[float]] = {"none": [], "copy": [], "sleep": []}
            empty: dict[str, list[float]] = {"none": [], "copy": [], "sleep": []}
            for _ in range(15):
                for kind, took in leases.items():
                    before(kind)
                    began = time.perf_counter()
                    held = c.read_recovery(NS, 0, [(0, hashes)])
                    took.append(time.perf_counter() - began)
                    assert held is not None
                    c.release(held.lease)
                for kind, took in empty.items():
                    before(kind)
                    began = time.perf_counter()
                    c.lookup(NS, {})
                    took.append(time.perf_counter() - began)
            # The store's other required step on its own: the mix64 checksum of every page.
            checksum_s = min(timed(lambda: [checksum(page) for page in data], 5))
            assert all(bytes(extent) == page for extent, page in zip(extents, data, strict=True))
            for extent in extents:
                extent.release()
            c.release(rec.lease)
    finally:
        proc.terminate()
        proc.wait()
    gbs = lambda s: total / s / 1e9  # noqa: E731
    rows.append(
        f"| store {pages} x 256 KiB pages (copy + mix64 checksum + commit; checksum {which}) "
        f"| {gbs(store_s):.2f} GB/s | "
        f"plain copy: {gbs(copy_s):.2f} GB/s | {copy_s / store_s:.2f} |"
    )
    rows.append(
        f"| recover {pages} x 256 KiB pages (lease, copy out, release) | {gbs(recover_s):.2f} GB/s | "
        f"plain copy: {gbs(copy_s):.2f} GB/s | {copy_s / recover_s:.2f} |"
    )
    rows.append(
        f"| recover, its release not waited for, against the same recover waiting for the release (by turns) "
        f"| {gbs(recover_s):.2f} GB/s | waiting: {gbs(waited_s):.2f} GB/s | {waited_s / recover_s:.2f} |"
    )
    rows.append(
        f"| recover + verify checksums (each page checked, then copied, in Python) | {gbs(verify_s):.2f} GB/s | "
        f"plain copy: {gbs(copy_s):.2f} GB/s | {copy_s / verify_s:.2f} |"
    )
    rows.append(
        f"| recover + verify checksums as an engine's CPU restore runs it (lease, `transfer.restore` into a "
        f"{pages}-block buffer, {route}, release) | {gbs(restore_s):.2f} GB/s | plain copy: {gbs(copy_s):.2f} GB/s | "
        f"{copy_s / restore_s:.2f} |"
    )
    rows.append(
        f"| `transfer.restore` alone of the same pages, leased beforehand (no request; the engine's recover's "
        f"ceiling), against the plain copy | {gbs(restore_alone_s):.2f} GB/s | plain copy: {gbs(copy_s):.2f} GB/s | "
        f"{copy_s / restore_alone_s:.2f} |"
    )
    rows.append(
        f"| recover + verify as an engine's CPU restore runs it, against its `transfer.restore` alone (by turns; "
        f"the lease's round trip and the release the difference) | {gbs(restore_s):.2f} GB/s | "
        f"{gbs(restore_alone_s):.2f} GB/s | {restore_alone_s / restore_s:.2f} |"
    )
    rows.append(
        f"| store as an engine's CPU save runs it (`link.save_parts` of {pages // ENGINE_PART_PAGES} parts of "
        f"{ENGINE_PART_PAGES} blocks of a {pages}-block buffer, {engine_route}; by turns with the stores) | "
        f"{gbs(engine_s):.2f} GB/s | plain copy: {gbs(copy_s):.2f} GB/s | {copy_s / engine_s:.2f} |"
    )
    rows.append(
        f"| the engine's save's best run, split | {engine_s * 1e3:.1f} ms | `transfer.save_rows` calls (copy and "
        f"checksum, one per part) {engine_split.get('save', 0) * 1e3:.1f} ms, sending requests "
        f"{engine_split.get('send', 0) * 1e3:.1f} ms, waiting for replies "
        f"{engine_split.get('wait', 0) * 1e3:.1f} ms | |"
    )
    rows.append(
        f"| store as an engine's CPU save runs it, against its floor (the store's: one pass and one request with "
        f"no work straight after a copy; best rounds) | {gbs(engine_s):.2f} GB/s | "
        f"{gbs(fused_s + min(empty['copy'])):.2f} GB/s | {(fused_s + min(empty['copy'])) / engine_s:.2f} |"
    )
    rows.append(
        f"| store against the mapping's ceiling | {gbs(store_s):.2f} GB/s | plain copy into the stored "
        f"extents: {gbs(in_s):.2f} GB/s | {in_s / store_s:.2f} |"
    )
    rows.append(
        f"| store against its two required steps, one after the other | {gbs(store_s):.2f} GB/s | copy into "
        f"the stored extents then mix64 of each page ({gbs(checksum_s):.2f} GB/s alone): "
        f"{gbs(in_s + checksum_s):.2f} GB/s | {(in_s + checksum_s) / store_s:.2f} |"
    )
    rows.append(
        f"| store against its one pass (copy and mix64 together) | {gbs(store_s):.2f} GB/s | "
        f"wire.copy_with_checksum into the stored extents, no protocol: {gbs(fused_s):.2f} GB/s | "
        f"{fused_s / store_s:.2f} |"
    )
    rows.append(
        f"| store with its chunks pipelined, against the same store in one chunk (by turns) | {gbs(store_s):.2f} GB/s "
        f"| one chunk: {gbs(one_chunk_s):.2f} GB/s | {one_chunk_s / store_s:.2f} |"
    )
    rows.append(
        f"| store with its first chunks smaller ({first >> 20} MiB, doubling up to {chunk >> 20} MiB), against the "
        f"same store in chunks of {chunk >> 20} MiB from the first (by turns) | {gbs(store_s):.2f} GB/s | "
        f"{chunk >> 20} MiB chunks: {gbs(flat_s):.2f} GB/s | {flat_s / store_s:.2f} |"
    )
    rows.append(
        f"| the store's best run, split | {store_s * 1e3:.1f} ms | copy pass {split.get('copy', 0) * 1e3:.1f} ms, "
        f"sending requests {split.get('send', 0) * 1e3:.1f} ms, "
        f"waiting for replies {split.get('wait', 0) * 1e3:.1f} ms | |"
    )
    rows.append(
        f"| recover against the mapping's ceiling | {gbs(recover_s):.2f} GB/s | plain copy out of the stored "
        f"extents: {gbs(out_s):.2f} GB/s | {out_s / recover_s:.2f} |"
    )
    for what, times in (
        (f"lease of {pages} pages (read_recovery's round trip)", leases),
        ("a request with no work (a lookup of no hashes)", empty),
    ):
        after_copy, slept, busy = (statistics.median(times[k]) * 1e6 for k in ("copy", "sleep", "none"))
        rows.append(
            f"| {what} straight after a copy out of the extents, as in the recover (median of 15, by turns) | "
            f"{after_copy:.0f} us | back to back: {busy:.0f} us | {busy / after_copy:.2f} |"
        )
        rows.append(
            f"| {what} after a sleep as long as that copy (idle, the caches left alone; same turns) | {slept:.0f} us | "
            f"back to back: {busy:.0f} us | {busy / slept:.2f} |"
        )
    # Each must wait for one round trip to a manager that sat idle through its copy (the store for its
    # last commit's reply, the recover for its lease before it copies): its floor is its copy and that
    # round trip at its quickest, a request with no work straight after a copy (the best of 15).
    trip = min(empty["copy"])
    rows.append(
        f"| store against its floor: its one pass and one request with no work straight after a copy (the "
        f"commit's round trip; best rounds) | {gbs(store_s):.2f} GB/s | one pass {fused_s * 1e6:.0f} us + "
        f"{trip * 1e6:.0f} us: {gbs(fused_s + trip):.2f} GB/s | {(fused_s + trip) / store_s:.2f} |"
    )
    rows.append(
        f"| recover against its floor: the copy out of the stored extents and one request with no work straight "
        f"after a copy (the lease's round trip; best rounds) | {gbs(recover_s):.2f} GB/s | copy {out_s * 1e6:.0f} us "
        f"+ {trip * 1e6:.0f} us: {gbs(out_s + trip):.2f} GB/s | {(out_s + trip) / recover_s:.2f} |"
    )
    rows.append(
        f"| the recover's time over the copy out of the stored extents (best rounds) | "
        f"{(recover_s - out_s) * 1e6:.0f} us | copy out of the stored extents: {out_s * 1e6:.0f} us | |"
    )
    rows.append(
        f"| copy out of never-written arena memory (first touch; not a ceiling) | {gbs(first_touch_s):.2f} GB/s | "
        f"plain copy: {gbs(copy_s):.2f} GB/s | {copy_s / first_touch_s:.2f} |"
    )
    rows.append(
        f"| copy out of the stored extents into a destination 16 bytes past a page boundary (as a 64 MiB bytearray "
        f"is), by turns with the aligned copy | {gbs(shifted_s):.2f} GB/s | into a page-aligned destination: "
        f"{gbs(out_s):.2f} GB/s | {out_s / shifted_s:.2f} |"
    )
    rows += mappings(data)
    rows += lease_split(pages)
    return rows


def lease_split(pages: int, reps: int = 300) -> list[str]:
    """Where a lease's time goes without the socket and the other process: a ``CacheManager`` in this process
    (its arena in /dev/shm, as the manager's) holding ``pages`` pages of 256 KiB, one ``read_recovery`` of all
    of them taken apart into the steps a lease over the socket makes, each timed on its own, back to back
    (medians of ``reps``):
    the client encoding its request, the manager decoding it, the manager's handler, the manager encoding its
    reply, the client decoding it, unpacking the group's columns (``LeasedPages.unpack``, as the engines'
    restores read them) and building the ``PageRef`` of every page (as the Python recover reads them), and the
    release's handler. The round trip over the socket is the rest of the lease's time in the rows above."""
    import asyncio

    from cacheon_orbitkv.client import LeasedPages
    from cacheon_orbitkv.server import CacheManager
    from cacheon_orbitkv.wire import decode, encode

    manager = CacheManager(2 * PAGE * pages)
    try:
        hashes = page_hashes(NS, list(range(16 * pages)), 16)
        res = manager.op_reserve(1, {"namespace": NS, "group": 0, "pages": [[h, PAGE] for h in hashes], "tag": ""})
        sums = [checksum(manager.arena[o : o + n]) for o, n in res["slots"]]
        assert manager.op_commit(1, {"reservation": res["reservation"], "checksums": sums})["committed"] == PAGE * pages
        args = {"namespace": NS, "boundary": 0, "ranges": [(0, hashes)]}
        request = {"id": 7, "op": "read_recovery", "args": args}
        steps = ["request encoded", "request decoded", "handler", "reply encoded", "reply decoded", "columns"]
        steps += ["PageRefs", "release"]
        took: dict[str, list[float]] = {step: [] for step in steps}

        async def leases() -> None:
            for _ in range(reps):
                marks = [time.perf_counter()]
                frame = encode(request)
                marks.append(time.perf_counter())
                asked = decode(frame[4:])["args"]
                marks.append(time.perf_counter())
                result = await manager.op_read_recovery(1, asked)
                marks.append(time.perf_counter())
                reply = encode({"id": 7, "ok": True, "result": result})
                marks.append(time.perf_counter())
                got = decode(reply[4:])["result"]
                marks.append(time.perf_counter())
                leased = LeasedPages.unpack(got["pages"][0][1:], pages)
                marks.append(time.perf_counter())
                refs = list(leased)
                marks.append(time.perf_counter())
                manager.op_release(1, {"lease": got["lease"]})
                marks.append(time.perf_counter())
                assert [ref.checksum for ref in refs] == sums
                for step, (began, ended) in zip(steps, itertools.pairwise(marks), strict=True):
                    took[step].append(ended - began)

        asyncio.run(leases())
    finally:
        manager.close()
    medians = {step: statistics.median(times) * 1e6 for step, times in took.items()}
    split = ", ".join(f"{step} {us:.0f} us" for step, us in medians.items())
    return [
        f"| a lease of {pages} pages without the socket (a manager in this process; medians of {reps}, back to back) "
        f"| {sum(medians.values()):.0f} us | {split} | |"
    ]


def ranks(tmp: Path, rounds: int = 300) -> list[str]:
    """A 4096-token prompt's lookup (256 page hashes, the first 128 cached) on 1, 2, 4 and 8 ranks, each
    rank its own namespace and every rank the same hashes (the vLLM connector's one chain): in one
    request (``lookup_namespaces``, as the connector asks), in one exchange of one lookup per rank
    (``lookups``) and one call per rank (``lookup``), by turns in each round (the order rotating),
    medians of ``rounds``. Checked first: the three give the same answer for every rank."""
    proc, endpoint = start_manager(tmp, "64mb")
    hashes = page_hashes(f"{NS[:-2]}r0", list(range(16 * 256)), 16)
    namespaces = [f"{NS[:-2]}r{rank}" for rank in range(8)]
    kinds = ["request", "exchange", "each"]
    rows = []
    try:
        with CacheClient(endpoint) as c:
            for namespace in namespaces:
                c.store(namespace, 0, [(h, b"k" * 4096) for h in hashes[:128]])
            groups = {0: hashes}

            def ask(kind: str, n: int) -> list[dict[int, dict[str, list[int]]]]:
                if kind == "request":
                    return c.lookup_namespaces(namespaces[:n], groups)
                if kind == "exchange":
                    return c.lookups([(namespace, groups) for namespace in namespaces[:n]])
                return [c.lookup(namespace, groups) for namespace in namespaces[:n]]

            for n in (1, 2, 4, 8):
                answers = [ask(kind, n) for kind in kinds]
                assert answers[0] == answers[1] == answers[2]
                assert all(found[0]["dram"] == list(range(128)) for found in answers[0])
            got: dict[tuple[str, int], list[float]] = {}
            for r in range(rounds):
                order = kinds[r % 3 :] + kinds[: r % 3]
                for n in (1, 2, 4, 8):
                    for kind in order:
                        began = time.perf_counter()
                        ask(kind, n)
                        got.setdefault((kind, n), []).append(time.perf_counter() - began)
    finally:
        proc.terminate()
        proc.wait()
    med = {key: statistics.median(values) * 1e6 for key, values in got.items()}
    what = "a request's lookup on {n} ranks (256 page hashes, 128 cached, the same hashes on every rank)"
    for n in (2, 4, 8):
        rows.append(
            f"| {what.format(n=n)} in one request, against one call per rank (median of {rounds}, by turns) "
            f"| {med[('request', n)]:.0f} us | one call each: {med[('each', n)]:.0f} us "
            f"| {med[('each', n)] / med[('request', n)]:.2f} |"
        )
    for n in (2, 4, 8):
        rows.append(
            f"| the same in one request on {n} ranks, against one lookup per rank in one exchange (same turns) "
            f"| {med[('request', n)]:.0f} us | one exchange: {med[('exchange', n)]:.0f} us "
            f"| {med[('exchange', n)] / med[('request', n)]:.2f} |"
        )
    for n in (2, 4, 8):
        rows.append(
            f"| the same in one request on {n} ranks, against one rank's lookup alone (the floor of one round "
            f"trip; same turns) | {med[('request', n)]:.0f} us | one rank: {med[('request', 1)]:.0f} us "
            f"| {med[('request', 1)] / med[('request', n)]:.2f} |"
        )
    return rows


def event_loops(tmp: Path, pages: int, rounds: int = 15) -> list[str]:
    """The manager on uvloop against the same manager on the standard asyncio loop: two manager
    processes at once, taken by turns in each round (drift hits both alike), medians. A lookup of 64
    hashes after the manager sat idle 4 ms, the same lookup straight after, a store and a recover
    (lease, copy out, release) of ``pages`` 256 KiB pages."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return ["| manager on uvloop against asyncio | not run: uvloop is not installed | | |"]
    clients, procs = {}, []
    data = page_aligned_pages(pages)
    view = page_aligned(PAGE * pages)
    hashes = page_hashes(NS, list(range(10**6, 10**6 + 16 * pages)), 16)
    timings: dict[str, dict[str, list[float]]] = {}
    run = 0
    try:
        for loop in ("asyncio", "uvloop"):
            proc, endpoint = start_manager(tmp, POOL, extra=("--event-loop", loop))
            procs.append(proc)
            clients[loop] = CacheClient(endpoint)
            timings[loop] = {"idle": [], "hot": [], "store": [], "recover": []}
            run = max(run, fill_pool(clients[loop], data))  # the pool full, as for the figures above
            clients[loop].store(NS, 0, list(zip(hashes, data, strict=True)))
        for _ in range(rounds):
            for loop, c in clients.items():
                got = timings[loop]
                time.sleep(0.004)
                began = time.perf_counter()
                assert c.lookup(NS, {0: hashes[:64]})[0]["dram"] == list(range(64))
                got["idle"].append(time.perf_counter() - began)
                began = time.perf_counter()
                c.lookup(NS, {0: hashes[:64]})
                got["hot"].append(time.perf_counter() - began)
                run += 1
                fresh = fresh_pages(run, data)
                began = time.perf_counter()
                c.store(NS, 0, fresh)
                got["store"].append(time.perf_counter() - began)
                began = time.perf_counter()
                recover_into(c, hashes, view)
                got["recover"].append(time.perf_counter() - began)
        assert bytes(view[:PAGE]) == data[0] and bytes(view[-PAGE:]) == data[-1]
    finally:
        for c in clients.values():
            c.close()
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    names = {
        "idle": "lookup of 64 hashes after 4 ms idle",
        "hot": "the same lookup straight after",
        "store": f"store {pages} x 256 KiB pages",
        "recover": f"recover {pages} x 256 KiB pages (lease, copy out, release)",
    }
    rows = []
    for key, name in names.items():
        uv, std = (statistics.median(timings[loop][key]) for loop in ("uvloop", "asyncio"))
        rows.append(
            f"| {name}, manager on uvloop against asyncio (median of {rounds}, by turns) | {uv * 1e6:.0f} us "
            f"| asyncio: {std * 1e6:.0f} us | {uv / std:.2f} |"
        )
    return rows


def mappings(data: list[memoryview]) -> list[str]:
    """The same page-by-page copies into and out of a private buffer, a shared memfd mapping (what
    /dev/shm is) and a MFD_HUGETLB memfd mapping, each populated first; the hugetlb row says when the
    host has no huge pages reserved (vm.nr_hugepages)."""
    import mmap

    total = PAGE * len(data)
    sink = page_aligned(total)
    kinds: list[tuple[str, int | None]] = [("private memory", None), ("shared memfd (as /dev/shm)", 0)]
    kinds.append(("shared memfd, MFD_HUGETLB (2 MiB pages)", os.MFD_HUGETLB))
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    setting = thp.read_text().strip() if thp.exists() else "absent"
    rows, base = [], None
    for name, flags in kinds:
        try:
            if flags is None:
                region = page_aligned(total)
            else:
                fd = os.memfd_create("orbitkv-bench", flags)
                try:
                    os.ftruncate(fd, total)
                    region = memoryview(mmap.mmap(fd, total))
                finally:
                    os.close(fd)

            def write(region: memoryview = region) -> None:
                for i, page in enumerate(data):
                    region[i * PAGE : (i + 1) * PAGE] = page

            def read(region: memoryview = region) -> None:
                for i in range(len(data)):
                    sink[i * PAGE : (i + 1) * PAGE] = region[i * PAGE : (i + 1) * PAGE]

            write()  # populate: every figure below copies into and out of faulted-in memory
            w_s, r_s = min(timed(write, 5)), min(timed(read, 5))
            region.release()
        except OSError as exc:  # no huge pages reserved, or none free
            rows.append(f"| copy into / out of a {name} mapping | not run: {exc.strerror} | | |")
            continue
        if base is None:
            base = (w_s, r_s)
        rows.append(
            f"| copy into / out of a {name} mapping | {total / w_s / 1e9:.2f} / {total / r_s / 1e9:.2f} GB/s | "
            f"private memory: {total / base[0] / 1e9:.2f} / {total / base[1] / 1e9:.2f} GB/s | "
            f"{base[0] / w_s:.2f} / {base[1] / r_s:.2f} |"
        )
    rows.append(f"| shmem transparent huge pages on this host | {setting} | | |")
    return rows


def ssd(tmp: Path, pages: int, rounds: int = 5) -> list[str]:
    ssd_file = tmp / "ssd.bin"
    proc, endpoint = start_manager(tmp, "32mb", ssd_file)
    hashes = page_hashes(NS, list(range(2 * 10**6, 2 * 10**6 + 16 * pages * 2)), 16)
    try:
        with CacheClient(endpoint) as c:
            c.store(NS, 0, [(h, os.urandom(PAGE)) for h in hashes])  # twice the pool: the early ones demote
            on_ssd = [hashes[i] for i in c.lookup(NS, {0: hashes})[0]["ssd"]][:pages]
    finally:
        proc.terminate()
        proc.wait()
    plain = tmp / "plain.bin"
    with open(plain, "wb") as fh:
        for _ in range(len(on_ssd)):
            fh.write(os.urandom(PAGE))
    ours, theirs = [], []
    read = 0
    for _ in range(rounds):  # alternate the two, each from a dropped page cache
        drop_cache(ssd_file)
        proc, endpoint = start_manager(tmp, "512mb", ssd_file)  # an empty DRAM pool over the same SSD file
        try:
            with CacheClient(endpoint) as c:
                start = time.perf_counter()
                rec = c.read_recovery(NS, 0, [(0, on_ssd)])
                ours.append(time.perf_counter() - start)
                assert rec is not None
                read = c.stats()["bytes_read"]["ssd"]
        finally:
            proc.terminate()
            proc.wait()
        drop_cache(plain)
        start = time.perf_counter()
        with open(plain, "rb", buffering=0) as fh:
            buf = bytearray(1 << 20)
            while fh.readinto(buf):
                pass
        theirs.append(time.perf_counter() - start)
    ssd_s, plain_s = statistics.median(ours), statistics.median(theirs)
    return [
        f"| SSD recovery of {len(on_ssd)} x 256 KiB pages into an empty pool ({read} bytes read; "
        f"median of {rounds}) | {read / ssd_s / 1e9:.2f} GB/s | sequential read: {read / plain_s / 1e9:.2f} GB/s "
        f"| {plain_s / ssd_s:.2f} |"
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="timed discoveries per side (default 200)")
    parser.add_argument("--pages", type=int, default=256, help="256 KiB pages per throughput figure (default 256)")
    parser.add_argument(
        "--rounds", type=int, default=9, help="throughput rounds; each figure is its best round (default 9)"
    )
    parser.add_argument("--append", metavar="FILE", help="append the result table to this markdown file")
    parser.add_argument(
        "--sections",
        default="discovery,throughput,ssd,loops,ranks",
        help="a comma list of the figures to run (default all): discovery (needs redis-server), throughput "
        "(with the mappings), ssd, loops (uvloop against asyncio), ranks (a request's lookup on several "
        "tensor-parallel ranks)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run this process on its first CPU and the managers on its second (default on, where it has two "
        "or more; --no-pin leaves both to the scheduler)",
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"discovery", "throughput", "ssd", "loops", "ranks"}
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    global MANAGER_CPUS
    allowed = sorted(os.sched_getaffinity(0))
    placed = "the client and the managers left to the scheduler"
    if args.pin and len(allowed) >= 2:
        os.sched_setaffinity(0, {allowed[0]})
        MANAGER_CPUS = {allowed[1]}
        placed = f"the client on CPU {allowed[0]}, each manager on CPU {allowed[1]}"
    print(f"placement: {placed}", flush=True)
    with tempfile.TemporaryDirectory(dir=os.environ.get("ORBITKV_BENCH_DIR")) as tmpdir:
        tmp = Path(tmpdir)
        rows = ["| figure | OrbitKV | baseline, same run | ratio |", "|---|---|---|---|"]
        if "discovery" in sections:
            rows += discovery(tmp, args.reps)
        if "throughput" in sections:
            rows += throughput(tmp, args.pages, args.rounds)
        if "ssd" in sections:
            rows += ssd(tmp, args.pages)
        if "loops" in sections:
            rows += event_loops(tmp, args.pages)
        if "ranks" in sections:
            rows += ranks(tmp)
    table = "\n".join(rows)
    print(table)
    if args.append:
        report.append(
            args.append,
            "OrbitKV cache manager",
            table,
            "Ratios: discovery is OrbitKV / Redis (lower is better); throughput rows are "
            "OrbitKV / baseline (higher is better); event-loop rows are uvloop / asyncio times (lower is better); "
            "rank rows are the baseline's time / OrbitKV's (higher is better). Placement: "
            f"{placed}.",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
