"""A step's saves from a CUDA device through the real cache manager (needs a CUDA device).

``link.save_parts`` as the engine adapters call it, one part per request of a step (16 parts of 8 pages
of 32 layers x K and V, scattered engine blocks): consecutive parts reserved ahead copied in one save up
to ``SAVE_TOGETHER_BYTES`` (16 MiB), left in flight until the next save has started, against:
- every part reserved ahead in one save (no cap);
- the same parts one save each, each left in flight until the next part's save has started;
- the same parts one save each, each waited for before the next part is copied (the checksums read
  back at once, as ``save_parts`` ran before its copies were left in flight);
- every page of the step in one part (one reserve, one copy, one commit);
- the copy alone: ``transfer.save`` of the same pages into the arena, no manager (the ceiling).
The variants run by turns, fresh page hashes each call (every call stores every page); medians of
``--rounds`` wall-clock times. Before timing, every variant's pages are read back through a lease and
compared with the device's rows.

    python benchmarks/save_parts_gpu.py [--out DIR] [--page-kib 16,64] [--parts 16] [--pages 8] [--rounds 15]
        [--profile]   (then a cProfile of the shipped variant at each size, by own time)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from orbitkv import start_manager
from transfer import layout_for

from cacheon_orbitkv.client import StorePart
from cacheon_orbitkv.link import ManagerLink, SavePart, save_parts
from cacheon_orbitkv.transfer import PagePlan, Pages, save

NS = "bench:bf16:save-parts:p16:r0"


def capped(together: int):
    """``save_parts`` with ``together`` bytes at most in one save (0: one save per part)."""

    def run(client, arena, parts: list[SavePart]) -> list:
        shipped = client.store_parts
        client.store_parts = lambda wanted, fill, **_: shipped(wanted, fill, together)
        try:
            return save_parts(client, arena, parts)
        finally:
            del client.store_parts

    return run


per_part, all_together = capped(0), capped(1 << 62)


def waited(client, arena, parts: list[SavePart]) -> list:
    """``save_parts`` with each part's copy waited for before the next part is copied."""

    def fill(ks, slots):
        [k], [mine] = ks, slots
        part = parts[k]
        kept = [(row, slot[0]) for row, slot in zip(part.rows, mine, strict=True) if slot is not None]
        sums = iter(save(arena, part.layout, Pages.of(*zip(*kept, strict=True))).checksums())
        return [[None if slot is None else next(sums) for slot in mine]]

    wanted = [
        StorePart(p.namespace, p.group, [(h, p.layout.page_bytes) for h in p.hashes], p.tag, p.key) for p in parts
    ]
    return client.store_parts(wanted, fill)


def step_parts(layout, n_parts: int, per_part: int, seed: int) -> list[SavePart]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(layout.segments[0].shape[0], generator=g)[: n_parts * per_part].tolist()
    return [
        SavePart(
            NS, 0, layout, [os.urandom(16) for _ in range(per_part)], blocks[i * per_part : (i + 1) * per_part], "", i
        )
        for i in range(n_parts)
    ]


def one_part(parts: list[SavePart]) -> list[SavePart]:
    return [parts[0]._replace(hashes=[h for p in parts for h in p.hashes], rows=[r for p in parts for r in p.rows])]


def check(client, layout, parts: list[SavePart]) -> None:
    """The manager holds every page of ``parts`` with the device rows' bytes."""
    hashes = [h for p in parts for h in p.hashes]
    rows = [r for p in parts for r in p.rows]
    recovery = client.read_recovery(NS, 0, [(0, hashes)])
    assert recovery is not None, "a saved page is missing"
    try:
        for ref, row in zip(recovery.pages[0], rows, strict=True):
            want = torch.cat([seg[row].reshape(-1) for seg in layout.segments]).cpu().numpy().tobytes()
            assert bytes(client.verified(ref)) == want, "a saved page's bytes differ from its engine row"
    finally:
        client.release(recovery.lease)


def one_size(client, arena, kib: int, args: argparse.Namespace) -> dict:
    """Every variant at per-layer pages of ``kib`` KiB, checked, then timed by turns."""
    layout = layout_for(kib << 10, layers=32, blocks=512)
    seed = iter(range(10**6))
    count = args.parts * args.pages

    def step() -> list[SavePart]:
        return step_parts(layout, args.parts, args.pages, next(seed))

    # The copy alone writes extents reserved for it (never a page the manager holds).
    reservation, offsets = client.reserve(NS, 1, [(os.urandom(16), layout.page_bytes) for _ in range(count)])
    probe = save(arena, layout, [PagePlan(0, offsets[0])])
    probe.checksums()
    checked = {"shipped": save_parts, "all": all_together, "per part": per_part, "waited": waited}
    for name, fn in checked.items():  # correct before timed
        for shaped in (step(), one_part(step())):
            assert all(isinstance(o, int) and o > 0 for o in fn(client, arena, shaped)), name
            check(client, layout, shaped)

    def copy_alone() -> None:
        save(arena, layout, Pages.of([r for p in step() for r in p.rows], offsets)).checksums()

    variants = {
        "shipped": lambda: save_parts(client, arena, step()),
        "all": lambda: all_together(client, arena, step()),
        "per part": lambda: per_part(client, arena, step()),
        "waited": lambda: waited(client, arena, step()),
        "one part": lambda: save_parts(client, arena, one_part(step())),
        "copy": copy_alone,
    }
    timed: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            began = time.perf_counter()
            outcomes = fn()
            timed[name].append(time.perf_counter() - began)
            assert outcomes is None or all(isinstance(o, int) for o in outcomes), (name, outcomes)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.rounds):
            variants["shipped"]()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(f"profile of {args.rounds} shipped calls, {kib} KiB pages:\n{text.getvalue()}", flush=True)
    client.abort(reservation)
    med = {name: float(np.median(ts)) for name, ts in timed.items()}
    print(
        f"| {kib} KiB | {layout.page_bytes >> 10} KiB | {probe.path} | {med['shipped'] * 1e3:.2f} ms"
        f" | {med['all'] * 1e3:.2f} ms | {med['per part'] * 1e3:.2f} ms | {med['waited'] * 1e3:.2f} ms"
        f" | {med['one part'] * 1e3:.2f} ms"
        f" | {med['copy'] * 1e3:.2f} ms | {med['copy'] / med['shipped']:.3f} |",
        flush=True,
    )
    return {"bytes": count * layout.page_bytes, "path": probe.path, "median_s": med, "all_s": timed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="directory for save_parts_gpu.json")
    parser.add_argument("--page-kib", default="16,64", help="per-layer page sizes (KiB), comma list")
    parser.add_argument("--parts", type=int, default=16, help="parts (requests) per step")
    parser.add_argument("--pages", type=int, default=8, help="pages per part")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the shipped variant")
    args = parser.parse_args()
    results: dict = {"parts": args.parts, "pages": args.pages, "rounds": args.rounds, "sizes": {}}
    print(
        "| page (per layer) | page extent | path | up to 16 MiB a save (shipped) | all in one save"
        " | a save per part, in flight"
        " | a save per part, each waited | one part | copy alone | copy alone / shipped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        proc, endpoint = start_manager(Path(tmp), "4gb")
        link = ManagerLink(endpoint, "bench", device="cuda:0")
        try:
            with link.session() as connection:
                assert connection is not None and connection[1].cuda is not None
                for kib in map(int, args.page_kib.split(",")):
                    results["sizes"][kib] = one_size(*connection, kib, args)
        finally:
            link.close()
            proc.terminate()
            proc.wait()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "save_parts_gpu.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
