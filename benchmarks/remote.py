"""OrbitKV's remote tier on a real Redis Cluster (3 primaries, 3 replicas, loopback), each figure
against its baseline in the same run:

1. recovery of 256 pages of 256 KiB from the cluster into a manager's arena (``read_recovery`` on a
   manager that never saw them: fetched, header/checksum verified, copied, leased) versus valkey-glide's
   plain pipelined GET of the same values (the ceiling of what the client moves); also with the MAC on;
2. discovery of 4096 page hashes through the cluster (a manager's ``lookup``: one existence script per
   node) versus one MGET of the same keys on a single node;
3. the client pick: valkey-glide's pipelined GET versus redis-py's asyncio cluster pipeline.

Correctness first: every recovered page is compared with what was stored before any timing.

    python benchmarks/remote.py [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report  # benchmarks/report.py: the script's own directory is on sys.path
from orbitkv import start_manager  # benchmarks/orbitkv.py: the manager benchmark

from cacheon_orbitkv.client import CacheClient, page_hashes
from cacheon_orbitkv.remote import remote_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.redis_cluster import RedisNodes

PAGE = 256 << 10
SMALL = 4 << 10


def manager(tmp: Path, url: str, pool: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """A cache manager whose remote tier is the cluster at ``url``."""
    return start_manager(
        tmp, pool, extra=("--remote", url, "--remote-timeout", "10", "--remote-queue", "100000", *extra)
    )


def wait_written(endpoint: str, pages: int) -> None:
    with CacheClient(endpoint) as c:
        deadline = time.monotonic() + 300
        while c.stats()["remote"]["pages_written"] < pages:
            assert time.monotonic() < deadline, c.stats()["remote"]
            time.sleep(0.05)


def store_sets(endpoint: str, ns: str, sets: int, pages: int, size: int) -> list[tuple[list[bytes], list[bytes]]]:
    """``sets`` distinct sets of ``pages`` random pages, stored through a writer manager and written
    behind to the cluster."""
    out = []
    with CacheClient(endpoint) as c:
        for s in range(sets):
            hashes = page_hashes(ns, [s * 10_000_000 + t for t in range(16 * pages)], 16)
            payloads = [os.urandom(size) for _ in range(pages)]
            c.store(ns, 0, list(zip(hashes, payloads, strict=True)))
            wait_written(endpoint, (s + 1) * pages)
            out.append((hashes, payloads))
    return out


async def glide_gets(cluster: RedisNodes, keys: list[bytes], reps: int) -> tuple[list[float], list[bytes]]:
    from glide import ClusterBatch, GlideClusterClient, GlideClusterClientConfiguration, NodeAddress

    config = GlideClusterClientConfiguration(
        [NodeAddress("127.0.0.1", p) for p in cluster.ports], request_timeout=10000
    )
    client = await GlideClusterClient.create(config)
    times, values = [], []
    for _ in range(reps):
        start = time.perf_counter()
        batch = ClusterBatch(is_atomic=False)
        for key in keys:
            batch.get(key)
        values = await client.exec(batch, raise_on_error=True)
        times.append(time.perf_counter() - start)
    await client.close()
    return times, values


async def redis_py_gets(cluster: RedisNodes, keys: list[bytes], reps: int) -> tuple[list[float], list[bytes]]:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])
    await client.initialize()
    times, values = [], []
    for _ in range(reps):
        start = time.perf_counter()
        pipe = client.pipeline()
        for key in keys:
            pipe.get(key)
        values = await pipe.execute()
        times.append(time.perf_counter() - start)
    await client.aclose()
    return times, values


def recovery(tmp: Path, cluster: RedisNodes, pages: int, reps: int, mac: bool) -> list[str]:
    extra: tuple[str, ...] = ()
    if mac:
        key_file = tmp / "remote.key"
        key_file.write_bytes(os.urandom(32).hex().encode())
        extra = ("--remote-key-file", str(key_file))
    ns = f"bench-{'mac' if mac else 'plain'}:bf16:nhd:p16:r0"
    pool = f"{2 * pages * PAGE // (1 << 20) + 64}mb"
    writer, w_end = manager(tmp, cluster.url, pool, *extra)
    # one set per timed recovery, plus one for the check: a reader holds what it recovered
    sets = store_sets(w_end, ns, reps + 1, pages, PAGE)
    writer.terminate()
    writer.wait(30)
    reader, r_end = manager(tmp, cluster.url, f"{(reps + 1) * pages * PAGE // (1 << 20) + 64}mb", *extra)
    ours, theirs = [], []
    try:
        with CacheClient(r_end) as c:
            for i, (hashes, payloads) in enumerate(sets):
                start = time.perf_counter()
                rec = c.read_recovery(ns, 0, [(0, hashes)])
                took = time.perf_counter() - start
                assert rec is not None, "a stored set missed"
                if i == 0:  # correctness before timing: every byte as stored
                    assert [bytes(c.verified(ref)) for ref in rec.pages[0]] == payloads
                c.release(rec.lease)
                # the baseline, interleaved: the same values fetched by the client alone
                keys = [remote_key((ns, 0, h)) for h in hashes]
                [get], values = asyncio.run(glide_gets(cluster, keys, 1))
                assert len(values) == pages and all(len(v) > PAGE for v in values)
                if i:
                    ours.append(took)
                    theirs.append(get)
            stats = c.stats()["remote"]
            assert stats["hits"] == (reps + 1) * pages and stats["misses"] == 0, stats
    finally:
        reader.terminate()
        reader.wait(30)
    mb = pages * PAGE / 1e6
    o, t = statistics.median(ours), statistics.median(theirs)
    label = "with MAC (BLAKE2b)" if mac else "checksum only"
    return [
        f"| recovery of {pages} x 256 KiB from the cluster into the arena, {label} | {o * 1e3:.1f} ms "
        f"({mb / o:.0f} MB/s) | glide pipelined GET of the same values: {t * 1e3:.1f} ms ({mb / t:.0f} MB/s) "
        f"| {t / o:.2f} |"
    ]


def discovery(tmp: Path, cluster: RedisNodes, hashes_n: int, reps: int) -> list[str]:
    import redis

    ns = "bench-discovery:bf16:nhd:p16:r0"
    writer, w_end = manager(tmp, cluster.url, "128mb")
    [(hashes, payloads)] = store_sets(w_end, ns, 1, hashes_n, SMALL)
    writer.terminate()
    writer.wait(30)
    reader, r_end = manager(tmp, cluster.url, "64mb")
    try:
        with CacheClient(r_end) as c:
            found = c.lookup(ns, {0: hashes})[0]
            assert found["remote"] == list(range(hashes_n)) and not found["dram"], "discovery is wrong"
            ours = []
            for _ in range(reps):
                start = time.perf_counter()
                c.lookup(ns, {0: hashes})
                ours.append(time.perf_counter() - start)
    finally:
        reader.terminate()
        reader.wait(30)
    single = RedisNodes(tmp / "single", primaries=1, replicas=0, cluster=False).start()
    try:
        r = redis.Redis(port=single.ports[0])
        keys = [remote_key((ns, 0, h)) for h in hashes]
        r.mset(dict(zip(keys, payloads, strict=True)))
        assert r.mget(keys) == payloads
        theirs = []
        for _ in range(reps):
            start = time.perf_counter()
            r.mget(keys)
            theirs.append(time.perf_counter() - start)
    finally:
        single.stop()
    o, t = statistics.median(ours), statistics.median(theirs)
    return [
        f"| discovery of {hashes_n} hashes through the cluster (manager lookup, 3 primaries) | {o * 1e3:.2f} ms | "
        f"one MGET of the same {hashes_n} keys (4 KiB values) on a single node, redis-py: {t * 1e3:.2f} ms | "
        f"{o / t:.2f} |"
    ]


def client_pick(cluster: RedisNodes, pages: int, reps: int) -> list[str]:
    async def run() -> tuple[list[float], list[float]]:
        from glide import ClusterBatch, GlideClusterClient, GlideClusterClientConfiguration, NodeAddress

        keys = [f"bench:pick:{i}".encode() for i in range(pages)]
        values = [os.urandom(PAGE) for _ in range(pages)]
        config = GlideClusterClientConfiguration([NodeAddress("127.0.0.1", p) for p in cluster.ports])
        client = await GlideClusterClient.create(config)
        batch = ClusterBatch(is_atomic=False)
        for key, value in zip(keys, values, strict=True):
            batch.set(key, value)
        await client.exec(batch, raise_on_error=True)
        await client.close()
        glide_t, glide_v = await glide_gets(cluster, keys, reps)
        redis_t, redis_v = await redis_py_gets(cluster, keys, reps)
        assert glide_v == values and redis_v == values
        return glide_t, redis_t

    g, r = asyncio.run(run())
    mb = pages * PAGE / 1e6
    g, r = statistics.median(g), statistics.median(r)
    return [
        f"| client pick: pipelined GET of {pages} x 256 KiB, valkey-glide | {g * 1e3:.1f} ms ({mb / g:.0f} MB/s) | "
        f"redis-py asyncio RedisCluster pipeline: {r * 1e3:.1f} ms ({mb / r:.0f} MB/s) | {r / g:.2f} |"
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=256, help="256 KiB pages per recovery (default 256)")
    parser.add_argument("--hashes", type=int, default=4096, help="hashes per discovery (default 4096)")
    parser.add_argument("--reps", type=int, default=5, help="timed recoveries per side (default 5)")
    parser.add_argument("--append", metavar="FILE", help="append the result table to this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("ORBITKV_BENCH_DIR")) as tmpdir:
        tmp = Path(tmpdir)
        cluster = RedisNodes(tmp / "cluster").start()
        try:
            rows = ["| figure | OrbitKV | baseline, same run | ratio |", "|---|---|---|---|"]
            rows += recovery(tmp, cluster, args.pages, args.reps, mac=False)
            rows += recovery(tmp, cluster, args.pages, args.reps, mac=True)
            rows += discovery(tmp, cluster, args.hashes, max(args.reps * 4, 20))
            rows += client_pick(cluster, args.pages, args.reps)
        finally:
            cluster.stop()
    table = "\n".join(rows)
    print(table)
    if args.append:
        report.append(
            args.append,
            "OrbitKV remote tier on a Redis Cluster",
            table,
            "Medians. Ratios: recovery rows are baseline time / OrbitKV time (higher is better, goal >= 0.8); "
            "discovery is OrbitKV / MGET (lower is better, goal <= 2); the client row is redis-py / glide "
            "(above 1: glide is faster).",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
