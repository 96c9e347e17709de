"""test_linker's restore into poisoned destinations, on a CUDA device (marked ``gpu``).

The same test, SGLang's same pools (on the GPU), tree, scheduler pieces and a real manager process;
the linker then runs its CUDA path: the arena registered with CUDA, restores on its load stream
through cacheon_orbitkv's Triton or copy-engine transfers, saves gated on SGLang's offload-ready
events. Run alone on the GPU host (``absent_sgl_kernel`` must be installed before SGLang imports).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from tests.sglang import absent_sgl_kernel

if torch.cuda.is_available():
    absent_sgl_kernel.install(strict=os.environ.get("ABSENT_SGL_KERNEL") != "any")

from tests.sglang import sglang_cache as sc
from tests.sglang import sglang_cuda, test_linker, test_linker_ranks

pytestmark = pytest.mark.gpu


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(sc, "DEVICE", "cuda")
    monkeypatch.setattr(sc, "Scheduler", sglang_cuda.DeviceScheduler)


@pytest.mark.parametrize("kind", ["mha", "swa", "mamba"])
def test_poisoned_cuda_destinations_are_restored_exactly_and_nothing_else_is_written(kind, manager_factory, on_cuda):
    test_linker.test_poisoned_destinations_are_restored_exactly_and_nothing_else_is_written(kind, manager_factory)


def _rank_on_cuda(conn, rank: int, init: str, endpoint: str, phases: list[str], answer: list[int] | None) -> None:
    """One TP rank in a spawned process (this module installed the hook before SGLang imported),
    its pools on the GPU."""
    sc.DEVICE = "cuda"
    sc.Scheduler = sglang_cuda.DeviceScheduler
    try:
        test_linker_ranks._rank(conn, rank, init, endpoint, phases, answer)
    finally:
        # What this rank's SGLang imports took from the absent sgl_kernel, and any use of it.
        report = Path(os.environ["ABSENT_SGL_KERNEL_REPORT"]) / f"rank{rank}-{os.getpid()}.json"
        report.write_text(json.dumps(absent_sgl_kernel.report()))


def _spawned_ranks(endpoint: str, phases: list[str], answer: list[int] | None = None) -> list[dict]:
    """test_linker_ranks._ranks with spawned ranks: SGLang initialises CUDA when it imports, and a
    forked child cannot use CUDA."""
    init = f"tcp://127.0.0.1:{test_linker_ranks._free_port()}"
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(test_linker_ranks.WORLD)]
    procs = [
        ctx.Process(target=_rank_on_cuda, args=(send, rank, init, endpoint, phases, answer), daemon=True)
        for rank, (_, send) in enumerate(pipes)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 240
    results: list[dict] = []
    try:
        for rank, (recv, _) in enumerate(pipes):
            while not recv.poll(1.0):  # a rank that died (at import, say) fails the test at once
                if procs[rank].exitcode is not None or time.monotonic() > deadline:
                    raise AssertionError(f"rank {rank} gave no result (exit code {procs[rank].exitcode})")
            status, value = recv.recv()
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
    finally:
        for proc in procs:
            proc.join(5 if len(results) == len(procs) else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return results


def test_two_cuda_ranks_lease_and_restore_when_loading_starts(manager_factory, monkeypatch, tmp_path):
    """test_linker_ranks' two-rank test with both ranks' pools on the one GPU: several attention ranks
    take the linker's other load path (lease and restore on its loader thread, on its load stream,
    when the batch's loading starts, while the forward waits on the layer counter)."""
    monkeypatch.setenv("SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS", "1")  # SGLang puts rank r on cuda:r otherwise
    # Joining SGLang's TP group imports its sampler and layers (layernorm, ...), whose CUDA branches
    # bind sgl_kernel names too: the ranks hand the absent package to any SGLang import statement
    # outside a try (recorded), not only to the known importers.
    monkeypatch.setenv("ABSENT_SGL_KERNEL", "any")
    monkeypatch.setenv("ABSENT_SGL_KERNEL_REPORT", str(tmp_path))
    monkeypatch.setattr(test_linker_ranks, "_ranks", _spawned_ranks)
    try:
        test_linker_ranks.test_two_ranks_save_their_shards_a_new_pair_restores_and_a_rank_missing_its_pages_refuses_on_both(
            manager_factory
        )
    finally:
        reports = {p.name: json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))}
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "absent_sgl_kernel_ranks.json").write_text(json.dumps(reports, indent=1))
    assert reports and all(r["calls"] == [] for r in reports.values()), reports
