"""OrbitKVLinker with two attention-TP ranks: two real processes in SGLang's own parallel state over
gloo (``init_distributed_environment`` + ``initialize_model_parallel``), SGLang's cache groups and
its cross-rank reductions (the lookup intersection's MIN all-reduce, the load verdict's), one real
manager. Each rank is a process running tests/sglang/linker_ranks.py.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
import traceback
from multiprocessing.connection import Connection

import torch

from tests.sglang import linker_ranks

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(conn: Connection, rank: int, init: str, endpoint: str, phases: list[str], answer: list[int] | None) -> None:
    try:
        torch.set_num_threads(1)  # no OpenMP team inherited from the parent's pool: ATen runs inline
        conn.send(("ok", linker_ranks.run_rank(rank, WORLD, init, endpoint, phases, answer)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _ranks(endpoint: str, phases: list[str], answer: list[int] | None = None, timeout: float = 60.0) -> list[dict]:
    """Both ranks' results. The ranks are forked from this process, which has imported SGLang
    already (a fresh interpreter spends most of a minute importing it on a busy two-core runner);
    a rank that fails or hangs fails the test, and both are killed."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(WORLD)]
    procs = [
        ctx.Process(target=_rank, args=(send, rank, init, endpoint, phases, answer), daemon=True)
        for rank, (_, send) in enumerate(pipes)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    results: list[dict] = []
    try:
        for rank, (recv, _) in enumerate(pipes):
            if not recv.poll(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"rank {rank} gave no result within {timeout} s")
            status, value = recv.recv()
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
    finally:
        for proc in procs:
            # Both answered: they exit at once. Otherwise the other rank may wait in a collective forever.
            proc.join(5 if len(results) == WORLD else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return results


def test_two_ranks_save_their_shards_a_new_pair_restores_and_a_rank_missing_its_pages_refuses_on_both(
    manager_factory,
):
    m = manager_factory(pool="64kb")
    saved = [r["save"] for r in _ranks(m.endpoint, ["save"])]
    assert [s["lease_at_queue"] for s in saved] == [False, False]  # several ranks: lease at loading start
    assert saved[0]["namespace"] != saved[1]["namespace"]  # each rank its own shard
    assert saved[0]["answer"] == saved[1]["answer"] and len(saved[0]["answer"]) == linker_ranks.ANSWER_TOKENS
    # Five full pages per rank (four of the prompt, one with generated tokens), each saved by its rank.
    assert [s["stats"]["offloads"] for s in saved] == [2, 2]  # the prompt's node, then the answer's

    # A new pair of processes: new pools, trees and linkers; only the manager is shared.
    results = _ranks(m.endpoint, ["restore", "refuse", "intersect"], answer=saved[0]["answer"])
    restored, refused, intersected = ([r[phase] for r in results] for phase in ("restore", "refuse", "intersect"))

    for rank, out in enumerate(restored):
        # Queued without a lease on either rank; leased and restored when the batch's loading started.
        assert out["at_admit"] == {"leases": 0, "queued_unleased": [True]}, rank
        assert out["host_loaded"] == 20 and out["failed"] == [], (rank, out)
        # Every layer read its own rank's cold values at every restored position.
        assert out["checks"] == [True, True], rank
        assert out["stats"] == {"loads": 1, "load_misses": 0, "load_failures": 0, "pages_restored": 5, "offloads": 1}
    for rank, out in enumerate(refused):
        assert out["host_hit"] == 16 and out["host_loaded"] == 16, (rank, out)  # both ranks found every page
        assert out["failed"] == ["gone"], (rank, out)  # the same verdict on both ranks: SGLang aborts it
        assert out["leases"] == 0 and out["reservations"] == 0
    assert refused[0]["pinned"] is True
    assert refused[0]["stats"]["pages_restored"] == 4 and refused[0]["stats"]["load_misses"] == 0  # rank 0 landed
    assert refused[1]["stats"]["load_misses"] == 1 and refused[1]["stats"]["pages_restored"] == 0  # rank 1 missed

    # Rank 1's pages gone before the lookup: SGLang's intersection of the ranks' lookups is a miss.
    assert intersected[0]["pinned"] is True
    assert [out["found"] for out in intersected] == [[[1, 2, 3, 4]], [[]]]
    for rank, out in enumerate(intersected):
        assert out["host_loaded"] == 0 and out["prefix_len"] == 0, (rank, out)
        assert out["stats"]["loads"] == 0 and out["stats"]["load_misses"] == 0 and out["stats"]["pages_restored"] == 0
