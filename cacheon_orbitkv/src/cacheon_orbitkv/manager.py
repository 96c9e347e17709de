"""``orbitkv-cache-manager``: the per-host cache manager process (also runs embedded, in a thread).

State lives on one asyncio loop; SSD reads run in threads and report back to it.

- Arena (``arena``): one shared-memory file under /dev/shm (mode 0600) that clients map; the manager
  hands out extents of it, and clients copy page bytes straight in and out.
- Keys: ``(namespace, group, page hash)``; the client chains page hashes over token ids, so equal
  prefixes share pages and a changed namespace (model, dtype, layout, page size, rank) misses.
- Pages (``pages``): ``reserve`` (extents, possibly evicting, with a layout tag), the client writes,
  ``commit`` with a checksum per page, all validated before anything is indexed. Uncommitted
  reservations are reclaimed on timeout or disconnect. ``lookup`` reads no payload and reserves
  nothing; ``read_recovery`` leases every page of every required range, promoting SSD pages into
  the arena (checksum verified), or releases all it took and reports a miss. Eviction demotes the
  least recently used unleased pages to SSD (or drops them), a page leaving DRAM only once its
  SSD copy is written; an orderly stop writes DRAM pages to SSD, hottest first.
- Server (``server``): the protocol, optional token auth, typed errors for every failure.
- Command line (``cli``).
"""

from __future__ import annotations

import sys

from .arena import ARENA_PREFIX, STALE_ARENA_AGE_S, sweep_stale_arenas
from .cli import build_parser, main
from .pages import SSD_READS_PER_GROUP, Lease, Metrics, Page, PageIndex, PageStore, Reservation
from .server import CacheManager, EmbeddedManager, exposure_problem

__all__ = [
    "ARENA_PREFIX",
    "SSD_READS_PER_GROUP",
    "STALE_ARENA_AGE_S",
    "CacheManager",
    "EmbeddedManager",
    "Lease",
    "Metrics",
    "Page",
    "PageIndex",
    "PageStore",
    "Reservation",
    "build_parser",
    "exposure_problem",
    "main",
    "sweep_stale_arenas",
]

if __name__ == "__main__":
    sys.exit(main())
