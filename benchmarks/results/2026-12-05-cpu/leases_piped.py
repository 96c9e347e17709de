"""Recover 256 pages with the lease split into N parts, each copied out as its reply is read (an
experiment; results beside it in leases_piped.txt)."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from orbitkv import NS, PAGE, fill_pool, page_aligned, page_aligned_pages, recover_into, start_manager, timed

from cacheon_orbitkv.client import CacheClient, _raise, page_hashes

tmp = Path(tempfile.mkdtemp())
proc, ep = start_manager(tmp, "1gb")
try:
    with CacheClient(ep) as c:
        n = 256
        hashes = page_hashes(NS, list(range(10**6, 10**6 + 16 * n)), 16)
        data = page_aligned_pages(n)
        fill_pool(c, data)
        c.store(NS, 0, list(zip(hashes, data, strict=True)))
        view = page_aligned(PAGE * n)

        def copy():
            for i, page in enumerate(data):
                view[i * PAGE : (i + 1) * PAGE] = page

        def piped(parts):
            step = n // parts
            chunks = [hashes[i : i + step] for i in range(0, n, step)]
            leases = []
            with c._exchange() as wire:
                for ch in chunks:
                    wire.send("read_recovery", {"namespace": NS, "boundary": 0, "ranges": [(0, list(ch))]})
                for j, ch in enumerate(chunks):
                    rec = c._recovery([(0, list(ch))], _raise(wire.receive()[1]))
                    base = j * step
                    for i, ref in enumerate(rec.pages[0]):
                        view[(base + i) * PAGE : (base + i + 1) * PAGE] = c.page(ref)
                    leases.append(rec.lease)
            for lease in leases:
                c.release(lease, wait=False)

        best = {k: 1e9 for k in ("copy", "one", "p2", "p4", "p8")}
        for _ in range(11):
            best["copy"] = min(best["copy"], *timed(copy, 1))
            best["one"] = min(best["one"], *timed(lambda: recover_into(c, hashes, view), 1))
            for p in (2, 4, 8):
                best[f"p{p}"] = min(best[f"p{p}"], *timed(lambda p=p: piped(p), 1))
        assert all(view[i * PAGE : (i + 1) * PAGE] == page for i, page in enumerate(data))
        for k, v in best.items():
            print(k, f"{v * 1e3:.2f} ms", f"{best['copy'] / v:.2f}")
finally:
    proc.terminate()
    proc.wait()
