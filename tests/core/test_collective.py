"""Collective slots: route agreement across ranks, the rank-wide abort, and verify on its own group.

Each test forks two ranks joined over gloo on the loopback interface (real torch.distributed).
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import socket
import time

import torch
import torch.distributed as dist

from cacheon_core import Dispatcher, ReceiptLog, Registry, Topology, Variant, coverage_report, read_receipts
from cacheon_core._catalog import ALL_REDUCE
from cacheon_core._dispatch import COLLECTIVE_ABORT_EXIT
from cacheon_core._verify import verify_variant

WORLD = 2
DEADLINE_S = 60.0


def summed(*, x, out, group):
    out.copy_(x)
    dist.all_reduce(out, group=group)


def only_rank_zero(descriptor):
    return descriptor.topology.tp_rank == 0


def fails_on_rank_one(*, x, out, group):
    if dist.get_rank(group) == 1:
        raise RuntimeError("rank-local fault")
    out.copy_(x)
    dist.all_reduce(out, group=group)  # rank 0 is inside the communication when its peer fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(body, rank, port, receipts_dir, send):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=30),
    )
    receipts = ReceiptLog(receipts_dir, role="scheduler", rank=rank)
    try:
        send.send(("ok", body(rank, receipts)))
    except BaseException as exc:  # reported to the parent, which fails the test
        send.send(("error", f"{type(exc).__name__}: {exc}"))
    receipts.flush()


def run_ranks(body, receipts_dir):
    """Fork WORLD ranks running ``body(rank, receipts)``; each rank's (exit status, report)."""
    ctx = multiprocessing.get_context("fork")
    # Garbage this process still holds (earlier tests' objects) would be collected in each child, running
    # destructors of native objects whose threads live only here: one such child aborted in a GC run.
    gc.collect()
    port = _free_port()
    pipes, procs = [], []
    for rank in range(WORLD):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(body, rank, port, str(receipts_dir), send))
        proc.start()
        send.close()
        pipes.append(receive)
        procs.append(proc)
    deadline = time.monotonic() + DEADLINE_S
    reports = []
    for pipe, proc in zip(pipes, procs, strict=True):
        report = None
        if pipe.poll(max(deadline - time.monotonic(), 0)):
            try:
                report = pipe.recv()
            except EOFError:
                report = None
        proc.join(max(deadline - time.monotonic(), 0))
        if proc.is_alive():
            proc.kill()
            proc.join()
            report = ("hung", None)
        reports.append((proc.exitcode, report))
    return reports


def dispatcher_for(rank, receipts, *variants):
    registry = Registry()
    for v in variants:
        registry.add_variant(v)
    registry.enable()
    receipts.event("active", slots=[ALL_REDUCE.id])
    return Dispatcher(registry, receipts=receipts, topology=Topology(tp_rank=rank, tp_size=WORLD))


def _agreed_body(rank, receipts):
    d = dispatcher_for(rank, receipts, Variant(slot=ALL_REDUCE.id, name="summed", impl=summed))
    site = d.site(ALL_REDUCE.id)
    results = []
    for t in (3, 3, 5):  # two call shapes: two agreements, the second call of t=3 reuses the first
        x = torch.full((t, 8), float(rank + 1))
        out = site(group=dist.group.WORLD, x=x)
        results.append(None if out is None else out.tolist())
    return results, dict(receipts.counts)


def test_ranks_that_agree_route_to_the_candidate_and_each_reports_its_route(tmp_path):
    reports = run_ranks(_agreed_body, tmp_path)
    for rank, (code, report) in enumerate(reports):
        assert code == 0 and report[0] == "ok", (rank, code, report)
        results, counts = report[1]
        assert [r is not None for r in results] == [True, True, True]
        assert all(v == 3.0 for r in results for row in r for v in row)  # 1 + 2 summed over the ranks
        assert counts[("completed", ALL_REDUCE.id, "summed")] == 3
    report = coverage_report(read_receipts(tmp_path), expect_ranks=WORLD)
    assert report.ok, report.problems
    assert report.routes == {ALL_REDUCE.id: {0: ("summed", "summed"), 1: ("summed", "summed")}}
    # one rank's receipts missing: the check names it
    short = coverage_report([r for r in read_receipts(tmp_path) if r.rank == 0], expect_ranks=WORLD)
    assert any("none from ranks [1]" in p for p in short.problems), short.problems


def _disagree_body(rank, receipts):
    d = dispatcher_for(rank, receipts, Variant(slot=ALL_REDUCE.id, name="half", impl=summed, supports=only_rank_zero))
    out = d.site(ALL_REDUCE.id)(group=dist.group.WORLD, x=torch.ones(2, 8))
    return out is None, dict(receipts.counts)


def test_ranks_that_disagree_route_stock_on_every_rank(tmp_path):
    reports = run_ranks(_disagree_body, tmp_path)
    for code, report in reports:
        assert code == 0 and report[0] == "ok", report
        stock, counts = report[1]
        assert stock and not any(k[0] == "completed" for k in counts)
    receipts = read_receipts(tmp_path)
    routes = [r for r in receipts if r.kind == "route"]
    assert sorted(r.rank for r in routes) == [0, 1] and all(r.variant is None for r in routes)
    assert all("rank 0: half, rank 1: stock" in (r.reason or "") for r in routes)
    assert coverage_report(receipts, expect_ranks=WORLD).routes[ALL_REDUCE.id] == {0: ("stock",), 1: ("stock",)}


def _failing_body(rank, receipts):
    d = dispatcher_for(rank, receipts, Variant(slot=ALL_REDUCE.id, name="fragile", impl=fails_on_rank_one))
    d.site(ALL_REDUCE.id)(group=dist.group.WORLD, x=torch.ones(2, 8))
    return "returned"  # never reached: the failure aborts every rank


def test_a_rank_local_failure_after_agreement_ends_every_rank_in_bounded_time(tmp_path):
    began = time.monotonic()
    reports = run_ranks(_failing_body, tmp_path)
    took = time.monotonic() - began
    assert [code for code, _ in reports] == [COLLECTIVE_ABORT_EXIT] * WORLD, reports
    assert all(report is None for _, report in reports)  # neither rank went on
    assert took < 30, took  # the peer learns at its communication, not at a timeout
    receipts = read_receipts(tmp_path)
    failed = {r.rank: r.reason for r in receipts if r.kind == "failed"}
    assert set(failed) == {0, 1}, failed
    assert "rank-local fault" in failed[1] and "collective abort" in failed[0]
    assert not any(r.kind == "fallback" for r in receipts)  # never a fallback
    assert not coverage_report(receipts, expect_ranks=WORLD).ok


def test_verify_runs_a_collective_variant_on_two_ranks_of_its_own():
    good = verify_variant(ALL_REDUCE, Variant(slot=ALL_REDUCE.id, name="summed", impl=summed))
    assert good.status == "passed", good.reason
    assert "2 gloo ranks" in good.device

    def local_only(*, x, out, group):
        out.copy_(x)  # right on one rank, wrong on two

    bad = verify_variant(ALL_REDUCE, Variant(slot=ALL_REDUCE.id, name="local", impl=local_only))
    assert bad.status == "rejected" and "differ from the reference" in (bad.reason or ""), bad.reason


def test_verify_rejects_a_collective_variant_that_ignores_its_group():
    def whole_world(*, x, out, group):
        out.copy_(x)
        dist.all_reduce(out)  # the default group, not the one it was handed

    began = time.monotonic()
    result = verify_variant(ALL_REDUCE, Variant(slot=ALL_REDUCE.id, name="world", impl=whole_world))
    assert result.status == "rejected", result
    assert "rank 0" in (result.reason or "") and "rank 1" in (result.reason or ""), result.reason
    assert time.monotonic() - began < 60


def _one_rank_without_candidates_body(rank, receipts):
    variants = [Variant(slot=ALL_REDUCE.id, name="summed", impl=summed)] if rank == 0 else []
    registry = Registry()
    for v in variants:
        registry.add_variant(v)
    if variants:  # as the runtime does: a rank whose plugins all failed never enables its registry
        registry.enable()
    d = Dispatcher(registry, receipts=receipts, topology=Topology(tp_rank=rank, tp_size=WORLD))
    out = d.site(ALL_REDUCE.id)(group=dist.group.WORLD, x=torch.ones(2, 8))
    return out is None


def test_a_rank_without_candidates_still_answers_the_agreement_and_both_route_stock(tmp_path):
    reports = run_ranks(_one_rank_without_candidates_body, tmp_path)
    assert [(code, report) for code, report in reports] == [(0, ("ok", True))] * WORLD


def _changed_after_agreement_body(rank, receipts):
    d = dispatcher_for(rank, receipts, Variant(slot=ALL_REDUCE.id, name="summed", impl=summed))
    site = d.site(ALL_REDUCE.id)
    site(group=dist.group.WORLD, x=torch.ones(2, 8))  # agreed on "summed"
    if rank == 1:  # this rank alone now resolves another variant for the same call shape
        d.registry.add_variant(Variant(slot=ALL_REDUCE.id, name="other", impl=summed, priority=5))
    site(group=dist.group.WORLD, x=torch.ones(2, 8))
    return "went on"


def test_a_rank_whose_registry_changed_after_agreement_aborts_and_so_does_its_peer(tmp_path):
    reports = run_ranks(_changed_after_agreement_body, tmp_path)
    assert [code for code, _ in reports] == [COLLECTIVE_ABORT_EXIT] * WORLD, reports
    failed = {r.rank: r.reason for r in read_receipts(tmp_path) if r.kind == "failed"}
    assert "agreed on summed but this rank now resolves other" in failed[1], failed


def _inference_body(rank, receipts):
    d = dispatcher_for(rank, receipts, Variant(slot=ALL_REDUCE.id, name="summed", impl=summed))
    site = d.site(ALL_REDUCE.id)
    first = site(group=dist.group.WORLD, x=torch.ones(2, 8))
    with torch.inference_mode():  # the same call shape, now an inference tensor (no version counter)
        second = site(group=dist.group.WORLD, x=torch.ones(2, 8))
    return first.sum().item(), second.sum().item()


def test_inference_tensors_of_an_agreed_call_shape_are_served(tmp_path):
    reports = run_ranks(_inference_body, tmp_path)
    assert [(code, report) for code, report in reports] == [(0, ("ok", (32.0, 32.0)))] * WORLD
