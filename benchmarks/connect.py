"""What connecting to a cache manager costs a client, with the arena prefaulted and without.

A real manager process with a pool of ``--pool`` bytes; ``CacheClient`` connects ``--reps`` times each
way, by turns (``prefault_arena`` True, as a copying link does, and False, as a scheduler's lookup-only
link does since ``ManagerLink(prefault=False)``). Prints the median connect time and the arena bytes
resident in this process's page tables after each kind of connect.

    python benchmarks/connect.py [--pool 1gb] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cacheon_orbitkv.arena import resident_bytes
from cacheon_orbitkv.client import CacheClient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", default="1gb", help="the manager's --pool-size (default 1gb)")
    parser.add_argument("--reps", type=int, default=5, help="connects each way (default 5)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="okv-connect-"))
    endpoint = f"unix://{tmp}/m.sock"
    manager = subprocess.Popen(
        [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", endpoint, "--pool-size", args.pool],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert manager.stdout is not None and manager.stdout.readline().startswith("ready")
        seconds: dict[bool, list[float]] = {True: [], False: []}
        resident: dict[bool, int] = {}
        for rep in range(args.reps):
            for prefault in (True, False) if rep % 2 == 0 else (False, True):
                began = time.perf_counter()
                client = CacheClient(endpoint, name="connect-bench", prefault_arena=prefault)
                seconds[prefault].append(time.perf_counter() - began)
                if client.lookup("bench:x:y:p1:r0", {0: [b"\1" * 16]})[0] != {"dram": [], "ssd": []}:
                    raise RuntimeError("a lookup in an empty manager found something")
                resident[prefault] = resident_bytes(client.info["arena"])
                client.close()
        size = client.info["arena_size"]
    finally:
        manager.terminate()
        manager.wait(30)
    print(f"| arena | connect | median of {args.reps} | arena bytes resident in the client |")
    print("|---|---|---|---|")
    for prefault in (True, False):
        what = "prefaulted (a copying link)" if prefault else "not prefaulted (a lookup-only link)"
        median = statistics.median(seconds[prefault]) * 1e3
        print(f"| {size >> 20} MiB | {what} | {median:.2f} ms | {resident[prefault] >> 20} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
