"""A lease of 256 pages in the manager, step by step, in one process (no socket): medians of 300, us."""

import asyncio
import statistics
import time
from collections import deque

import numpy as np

from cacheon_orbitkv import pages as page_store
from cacheon_orbitkv import wire
from cacheon_orbitkv.client import page_hashes
from cacheon_orbitkv.server import CacheManager, _hashes

NS = "bench:bf16:nhd:p16:r0"
PAGE = 256 << 10
m = CacheManager(1 << 30)
hashes = page_hashes(NS, list(range(10**6, 10**6 + 16 * 256)), 16)
res = m.op_reserve(1, {"namespace": NS, "group": 0, "pages": [[h, PAGE] for h in hashes]})
sums = [wire.checksum(m.arena[offset : offset + length]) for offset, length in res["slots"]]
m.op_commit(1, {"reservation": res["reservation"], "checksums": sums})
st = m.pages
table = st.index.table(NS, 0)
DRAM, LENGTH, CHECKSUM, TAG, KEY = (page_store._DRAM, page_store._LENGTH, page_store._CHECKSUM, page_store._TAG,
                                    page_store._KEY)  # fmt: skip


def med(f, n=300):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e6, 1)


pages = list(map(table.get, hashes))
print("get", med(lambda: list(map(table.get, hashes))))
print("count None", med(lambda: pages.count(None)))


def inc():
    for p in pages:
        p.leases += 1
    for p in pages:
        p.leases -= 1


print("leases +=1 and -=1", med(inc))
print("dram count", med(lambda: list(map(DRAM, pages)).count(None)))
print("metrics labels inc", med(lambda: st.metrics.hits.labels("0", "dram").inc(256)))
print(
    "pack_leased",
    med(lambda: wire.pack_leased(0, map(DRAM, pages), map(LENGTH, pages), map(CHECKSUM, pages), list(map(TAG, pages)))),
)
print("fromiter one", med(lambda: np.fromiter(map(DRAM, pages), wire.LEASED_INTS, 256).tobytes()))
print("array q one", med(lambda: __import__("array").array("q", map(DRAM, pages)).tobytes()))
print("keys", med(lambda: list(map(KEY, pages))))
keys = list(map(KEY, pages))
print("lru move", med(lambda: deque(map(st.lru.move_to_end, keys), maxlen=0)))
print("sum length", med(lambda: sum(map(LENGTH, pages))))
print("hashes check", med(lambda: _hashes(hashes, "x")))


async def full():
    r = await st.read_recovery(1, NS, [(0, hashes)])
    st.release(1, r["lease"])


loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
print("full lease+release", med(lambda: loop.run_until_complete(full())))
