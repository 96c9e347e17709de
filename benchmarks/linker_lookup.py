"""SGLang linker lookup latency while the same linker restores 256 MiB promoted from the SSD tier.

One OrbitKVLinker on SGLang 0.5.23's real MHA pool (built by SGLang's registry, as the tests do),
one real cache manager with a DRAM pool and an SSD tier. Each round pushes the 256 restore pages
out to the SSD tier (fresh filler through DRAM), drops the SSD file from the page cache, then a
thread loads them (``load``: the lease promotes every page from SSD, then the copy into SGLang's
pool) while the scheduler thread looks up a 64-page tail, back to back, until the load returns.
Figures, same run: lookups with nothing in flight; lookups during the restore on the linker's own
lookup connection, split into those overlapping the lease (the manager promoting the pages) and
those during the copy; and, for comparison, the same with lookups sharing the payload connection
(one connection serves one request at a time).

    python benchmarks/linker_lookup.py [--rounds 3] [--append BENCHMARKS.md]

Needs SGLang (the ``sglang`` nox session's virtualenv).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the SGLang harness of the tests builds the pools as SGLang does

import report  # noqa: E402  benchmarks/report.py: the script's own directory is on sys.path
import torch  # noqa: E402
from orbitkv import drop_cache, start_manager  # noqa: E402  benchmarks/orbitkv.py: the manager benchmark
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from tests.sglang import sglang_cache as sc  # noqa: E402

from cacheon_orbitkv.client import CacheClient  # noqa: E402
from cacheon_sglang import linker as orbit  # noqa: E402

PAGE_TOKENS = 64
HEADS, HEAD_DIM, LAYERS = 8, 128, 4  # bf16: 128 KiB per K or V chunk, 1 MiB per page
RESTORE_PAGES = 256  # 256 MiB
LOOKUP_PAGES = 64
FILLER = "filler:bf16:x:p64:r0"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="restores per figure (default 3)")
    parser.add_argument("--idle", type=int, default=300, help="lookups with nothing in flight (default 300)")
    parser.add_argument("--append", metavar="FILE", help="append the result table to this markdown file")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="okv-bench-", dir="/tmp"))
    proc, endpoint = start_manager(tmp, "320mb", tmp / "ssd.bin", "2gb")
    try:
        size = RESTORE_PAGES * PAGE_TOKENS + PAGE_TOKENS
        fx = sc.build_mha(
            endpoint, page_size=PAGE_TOKENS, layers=LAYERS, size=size, heads=HEADS, head_dim=HEAD_DIM,
            max_context=size, extra={"model_fingerprint": "bench"},
        )  # fmt: skip
        linker: orbit.OrbitKVLinker = fx["linker"]
        page_bytes = linker.pool_layout.layouts[0].page_bytes
        ids = [int(x) for x in torch.randint(10, 30000, (RESTORE_PAGES * PAGE_TOKENS,))]
        keys = sc.storage_keys(ids, PAGE_TOKENS)
        payload = os.urandom(page_bytes)
        with CacheClient(endpoint) as client:
            client.store(
                linker.namespace, 0, [(orbit.storage_hash(k, 0), payload) for k in keys], tag=linker.pool_layout.tags[0]
            )
        probe = [PoolTransfer(name=PoolName.KV, keys=keys[:LOOKUP_PAGES])]
        slots = torch.arange(PAGE_TOKENS, PAGE_TOKENS * (RESTORE_PAGES + 1), dtype=torch.int64)
        restore = [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=slots)]

        def lookup_ms() -> tuple[float, float]:
            """(start, end) of one lookup of the probe, on the perf_counter clock."""
            start = time.perf_counter()
            found = linker.lookup("probe", probe)
            end = time.perf_counter()
            assert found and found[-1] == LOOKUP_PAGES, found
            return start, end

        leases: list[tuple[float, float]] = []
        lease = linker._lease

        def timed_lease(job: object) -> bool:  # the SSD promotion happens inside the lease
            start = time.perf_counter()
            try:
                return lease(job)  # type: ignore[arg-type]
            finally:
                leases.append((start, time.perf_counter()))

        linker._lease = timed_lease  # type: ignore[method-assign]

        def to_ssd(round_: int) -> None:
            """Fresh filler through DRAM: every restore page demoted to the SSD tier, off the page cache."""
            with CacheClient(endpoint) as client:
                filler = [(f"{round_}-{i}".encode().ljust(16, b"\0"), payload) for i in range(400)]
                client.store(FILLER, 0, filler)
                found = client.lookup(linker.namespace, {0: [orbit.storage_hash(k, 0) for k in keys]})[0]
                assert len(found["ssd"]) == RESTORE_PAGES, {t: len(v) for t, v in found.items()}
            drop_cache(tmp / "ssd.bin")

        def during_restore(round_: int) -> tuple[list[float], list[float], float]:
            """Lookup latencies (ms) overlapping the lease, those during the copy, and the restore's seconds."""
            to_ssd(round_)
            result: list[bool] = []
            loader = threading.Thread(target=lambda: result.append(linker.load(f"r{round_}", restore)))
            spans = []
            start = time.perf_counter()
            loader.start()
            while loader.is_alive():
                spans.append(lookup_ms())
            loader.join()
            seconds = time.perf_counter() - start
            assert result == [True], result
            lease_start, lease_end = leases[-1]
            in_lease = [(b - a) * 1e3 for a, b in spans if a < lease_end and b > lease_start]
            in_copy = [(b - a) * 1e3 for a, b in spans if not (a < lease_end and b > lease_start)]
            return in_lease, in_copy, seconds

        lookup_ms()  # connect both connections
        idle: list[float] = []
        figures: dict[str, list[float]] = {}
        restore_s, lease_s = [], []
        payload_link = linker.link
        for round_ in range(args.rounds):
            # Nothing in flight, measured between the restores (a shared machine drifts over a run).
            idle += [(b - a) * 1e3 for a, b in (lookup_ms() for _ in range(args.idle // args.rounds))]
            for shared in (False, True):
                if shared:  # the single-connection design, for comparison
                    lookup_link, linker.lookup_link = linker.lookup_link, payload_link
                try:
                    in_lease, in_copy, seconds = during_restore(2 * round_ + shared)
                finally:
                    if shared:
                        linker.lookup_link = lookup_link
                where = "sharing the payload connection" if shared else "own lookup connection"
                figures.setdefault(f"during the lease (SSD promotion), {where}", []).extend(in_lease)
                figures.setdefault(f"during the copy into the pool, {where}", []).extend(in_copy)
                restore_s.append(seconds)
                lease_s.append(leases[-1][1] - leases[-1][0])
        assert linker.stats["pages_restored"] == 2 * args.rounds * RESTORE_PAGES
        assert linker.stats["load_failures"] == linker.stats["load_misses"] == 0
        linker.close()
    finally:
        proc.terminate()
        proc.wait()
        for path in tmp.iterdir():
            path.unlink()
        tmp.rmdir()

    idle_median = statistics.median(idle)
    rows = [("nothing in flight", idle), *sorted(figures.items(), key=lambda item: ("copy" in item[0], item[0]))]
    lines = [
        f"| lookup of {LOOKUP_PAGES} pages | lookups | median (ms) | p99 (ms) | max (ms) | median / idle median |",
        "|---|---|---|---|---|---|",
    ]
    for name, samples in rows:
        median = statistics.median(samples)
        lines.append(
            f"| {name} | {len(samples)} | {median:.3f} | {percentile(samples, 0.99):.3f} | {max(samples):.1f} "
            f"| {median / idle_median:.2f} |"
        )
    table = "\n".join(lines)
    note = (
        f"Restore: {RESTORE_PAGES} x {page_bytes >> 20} MiB pages promoted from the SSD tier (page cache dropped) "
        f"and copied into SGLang's MHA pool on the CPU; median restore {statistics.median(restore_s):.2f} s, of "
        f"which the lease {statistics.median(lease_s):.2f} s, over {len(restore_s)} restores. A lookup counts as "
        "during the lease when it overlaps the load's read_recovery."
    )
    print(table)
    print(note)
    if args.append:
        report.append(args.append, "SGLang linker lookup during a restore", table, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
