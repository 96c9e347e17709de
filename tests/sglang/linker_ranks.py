"""One attention-TP rank of an SGLang scheduler with OrbitKVLinker, for test_linker_ranks.py.

``run_rank`` (in a process of its own) joins SGLang's tensor-parallel group over gloo, then runs
each phase (``save``, ``restore`` of a saved ``answer``, ``refuse``, ``intersect``) on a new set of pools, tree and
linker (a new engine's cache on this rank, sharing nothing with the last one but the manager) through
SGLang's scheduler pieces (sglang_cache.py), and returns what each phase saw.
Each rank holds one of two heads and its forward writes values salted by its rank, so a rank that
restored another rank's shard would read values its own cold forward never writes.
"""

from __future__ import annotations

import torch

from cacheon_orbitkv.client import CacheClient
from cacheon_sglang import linker as orbit
from tests.sglang import sglang_cache as sc

PAGE = 4
PROMPT = list(range(600, 618))  # 18 tokens: SGLang looks up 16, four pages
ANSWER_TOKENS = 6  # 18 + 5 tokens with KV at the finish: five full pages saved per rank


def _engine(endpoint: str, rank: int, world: int) -> tuple[dict, sc.Scheduler]:
    fx = sc.build_mha(endpoint, page_size=PAGE, heads=1, tp=(rank, world))
    return fx, sc.Scheduler(fx, salt=100 * rank)


def _stats(linker: orbit.OrbitKVLinker) -> dict:
    return {k: linker.stats[k] for k in ("loads", "load_misses", "load_failures", "pages_restored", "offloads")}


def save(endpoint: str, rank: int, world: int) -> dict:
    fx, sched = _engine(endpoint, rank, world)
    out = sched.generate("first", PROMPT, max_new_tokens=ANSWER_TOKENS)
    linker = fx["linker"]
    result = {
        "host_loaded": out["host_loaded"],
        "answer": out["output_ids"],
        "lease_at_queue": linker.lease_at_queue,
        "namespace": linker.namespace,
        "stats": _stats(linker),
    }
    linker.close()
    return result


def restore(endpoint: str, rank: int, world: int, answer: list[int]) -> dict:
    """A new engine serves the next turn: prompt, answer and one more token."""
    fx, sched = _engine(endpoint, rank, world)
    kv = fx["kvcache"]
    for t in [*kv.k_buffer, *kv.v_buffer]:
        t.fill_(3.5)  # never written by the fake forward: whatever the forward reads was restored
    at_admit: dict = {}

    def admitted(req: object) -> None:
        torch.distributed.barrier()  # every rank has queued its load
        with CacheClient(endpoint) as client:
            at_admit["leases"] = client.stats()["leases"]
        at_admit["queued_unleased"] = [job.recovery is None for job in fx["linker"]._queued.values()]
        torch.distributed.barrier()

    out = sched.generate("next", [*PROMPT, *answer, 5], max_new_tokens=2, after_admit=admitted)
    linker = fx["linker"]
    result = {"host_loaded": out["host_loaded"], "checks": sorted(out["checks"].values()), "at_admit": at_admit}
    result["failed"] = [r.rid for r in out["failed"]]
    result["stats"] = _stats(linker)
    linker.close()
    return result


def intersect(endpoint: str, rank: int, world: int) -> dict:
    """Both ranks save a prompt, rank 1's pages go, then a new engine looks the prompt up: rank 0
    finds every page, rank 1 none, and SGLang's intersection (a MIN all-reduce) makes it a miss on
    both, so both compute the prompt in full and load nothing."""
    prompt = list(range(700, 718))
    fx, sched = _engine(endpoint, rank, world)
    sched.generate("seed", prompt, max_new_tokens=1)
    namespace = fx["linker"].namespace
    fx["linker"].close()
    pinned = _evict_rank_one(endpoint, rank, namespace, prompt)

    fx, sched = _engine(endpoint, rank, world)
    linker: orbit.OrbitKVLinker = fx["linker"]
    found: list[list[int]] = []
    own_lookup = linker.lookup

    def lookup(rid: str, transfers: list) -> list[int]:
        found.append(own_lookup(rid, transfers))
        return found[-1]

    linker.lookup = lookup  # type: ignore[method-assign]  # records this rank's own answer
    out = sched.generate("late", prompt, max_new_tokens=1)
    result = {"pinned": pinned, "found": found, "host_loaded": out["host_loaded"], "prefix_len": out["prefix_len"]}
    result["stats"] = _stats(linker)
    linker.close()
    return result


def _evict_rank_one(endpoint: str, rank: int, namespace: str, prompt: list[int]) -> bool:
    """Evict rank 1's pages of ``prompt``'s first four pages, not rank 0's: rank 0 pins its own with a
    lease meanwhile and rank 1 pushes filler through the 64 KiB pool. Rank 0 says whether it pinned."""
    pinned = False
    with CacheClient(endpoint) as client:
        pin = None
        if rank == 0:
            hashes = [orbit.storage_hash(k, 0) for k in sc.storage_keys(prompt[:16], PAGE)]
            pin = client.read_recovery(namespace, 16, [(0, hashes)])
            pinned = pin is not None
        torch.distributed.barrier()
        if rank == 1:  # every page not leased is evicted
            for i in range(40):
                client.store("filler:bf16:x:p4:r1", 0, [(bytes([i]) * 16, b"\0" * 4096)])
        torch.distributed.barrier()
        if pin is not None:
            client.release(pin.lease)
    torch.distributed.barrier()
    return pinned


def refuse(endpoint: str, rank: int, world: int) -> dict:
    """Rank 1's pages are evicted between the lookup (both ranks hit) and the load's lease."""
    fx, sched = _engine(endpoint, rank, world)
    linker: orbit.OrbitKVLinker = fx["linker"]
    hit: dict = {}

    def evict_rank_one(req: object) -> None:
        hit["host_hit"] = req.host_hit_length  # type: ignore[attr-defined]
        hit["pinned"] = _evict_rank_one(endpoint, rank, linker.namespace, PROMPT)

    req = sched.new_req("gone", PROMPT)
    batch = sched.schedule(req, after_match=evict_rank_one)
    failed = [r.rid for r in sched.cache.finish_external_linker_loads(batch.reqs)]
    result = {**hit, "host_loaded": req.host_loaded_length, "failed": failed, "stats": _stats(linker)}
    linker.close()
    torch.distributed.barrier()  # both linkers closed: nothing of theirs is leased any more
    with CacheClient(endpoint) as client:
        stats = client.stats()
    result["leases"], result["reservations"] = stats["leases"], stats["reservations"]
    return result


def run_rank(
    rank: int, world: int, init_method: str, endpoint: str, phases: list[str], answer: list[int] | None = None
) -> dict:
    r, w = rank, world
    sc.join_tensor_parallel(endpoint, PAGE, r, w, init_method)
    results: dict = {"rank": r}
    for phase in phases:
        if phase == "save":
            results["save"] = save(endpoint, r, w)
        elif phase == "restore":
            results["restore"] = restore(endpoint, r, w, answer or results["save"]["answer"])
        elif phase == "refuse":
            results["refuse"] = refuse(endpoint, r, w)
        elif phase == "intersect":
            results["intersect"] = intersect(endpoint, r, w)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    torch.distributed.destroy_process_group()
    return results
