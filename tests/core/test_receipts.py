"""Receipts: process-local files, lifecycle order, slot x rank coverage."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from cacheon_core import Receipt, ReceiptLog, coverage_report, read_receipts
from cacheon_core._receipts import ReceiptFormatError


def _scheduler(directory: str, rank: int, calls: int, role: str = "scheduler") -> None:
    log = ReceiptLog(directory, role=role, rank=rank, policy="strict", flush_interval=0)
    log.event("active", slots=["norm.rmsnorm"])
    for _ in range(calls):
        log.count("completed", "norm.rmsnorm", "example_torch")
    log.close()


def _run(target, *args):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(60)
    assert p.exitcode == 0


def test_each_process_writes_its_own_file_and_coverage_adds_up(tmp_path):
    for rank, calls in ((0, 5), (1, 7)):
        _run(_scheduler, str(tmp_path), rank, calls)
    files = sorted(tmp_path.glob("receipts-*.jsonl"))
    assert len(files) == 2
    receipts = read_receipts(tmp_path)
    assert [r.kind for r in receipts] == ["active", "active", "fired", "fired", "completed", "completed"]
    report = coverage_report(receipts, expect_ranks=2)
    assert report.ok, report.problems
    assert report.coverage["norm.rmsnorm"][0].fired == 5
    assert report.coverage["norm.rmsnorm"][1].completed == 7


def test_missing_and_extra_members_are_problems(tmp_path):
    _run(_scheduler, str(tmp_path), 0, 1)
    report = coverage_report(read_receipts(tmp_path), expect_ranks=2)
    assert any("missing active members" in p and "[1]" in p for p in report.problems)
    _run(_scheduler, str(tmp_path), 0, 1)  # a second process claiming rank 0
    report = coverage_report(read_receipts(tmp_path), expect_ranks=2)
    assert any("extra active members at ranks [0]" in p for p in report.problems)


def test_active_outside_a_scheduler_is_an_extra_member(tmp_path):
    _run(_scheduler, str(tmp_path), 0, 1, "other")
    report = coverage_report(read_receipts(tmp_path))
    assert any("has role other, not scheduler" in p for p in report.problems)


def test_load_failed_failed_and_strict_fallback_are_problems(tmp_path):
    log = ReceiptLog(tmp_path, role="scheduler", policy="strict", flush_interval=0)
    log.event("active", slots=["norm.rmsnorm"])
    log.event("load_failed", plugin="cacheon-broken", reason="ImportError: no module named nope")
    log.count("fallback", "norm.rmsnorm", "v")
    log.count("fired", "norm.rmsnorm", "v")
    log.event("failed", slot="norm.rmsnorm", variant="v", reason="raised RuntimeError: x")
    log.close()
    problems = "\n".join(coverage_report(read_receipts(tmp_path)).problems)
    assert "plugin cacheon-broken: ImportError" in problems
    assert "fallback under strict policy" in problems
    assert "failed: norm.rmsnorm by v" in problems


def test_lenient_fallback_is_reported_but_not_a_problem(tmp_path):
    log = ReceiptLog(tmp_path, role="scheduler", policy="lenient", flush_interval=0)
    log.event("active", slots=["norm.rmsnorm"])
    log.count("fired", "norm.rmsnorm", "v")
    log.count("fallback", "norm.rmsnorm", "v")
    log.close()
    report = coverage_report(read_receipts(tmp_path), expect_ranks=1)
    assert report.ok
    assert report.coverage["norm.rmsnorm"][0].fallback == 1


def test_calls_by_a_process_that_never_activated_are_problems(tmp_path):
    log = ReceiptLog(tmp_path, role="other", flush_interval=0)
    log.count("completed", "norm.rmsnorm", "v")
    log.close()
    assert any("never wrote active" in p for p in coverage_report(read_receipts(tmp_path)).problems)


def test_counts_flush_as_deltas_and_every_line_parses(tmp_path):
    log = ReceiptLog(tmp_path, role="scheduler", flush_interval=0)
    for _ in range(3):
        log.count("completed", "s.a", "v")
    log.flush()
    log.count("completed", "s.a", "v")
    log.flush()
    log.flush()  # nothing new: writes nothing
    log.close()
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(d["kind"], d["count"]) for d in lines] == [("fired", 3), ("completed", 3), ("fired", 1), ("completed", 1)]
    assert all(d["pid"] == os.getpid() for d in lines)


def test_background_flush_writes_without_an_explicit_flush(tmp_path):
    import time

    log = ReceiptLog(tmp_path, role="scheduler", flush_interval=0.05)
    log.count("completed", "s.a", "v")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (log.path.exists() and log.path.read_text()):
        time.sleep(0.02)
    assert '"completed"' in log.path.read_text()
    log.close()


def test_a_malformed_line_is_an_error_with_its_place(tmp_path):
    (tmp_path / "receipts-h-1.jsonl").write_text('{"kind": "active"}\n')
    with pytest.raises(ReceiptFormatError, match="receipts-h-1.jsonl:1: not a receipt"):
        read_receipts(tmp_path)
    with pytest.raises(ValueError, match="receipt kind 'bogus'"):
        Receipt(kind="bogus", role="x", rank=0, pid=1, host="h", time=0.0, seq=1, policy="strict")


def test_a_forked_child_reports_only_its_own_calls(tmp_path):
    log = ReceiptLog(tmp_path, role="scheduler", rank=0, flush_interval=0)
    log.event("active", slots=["s.a"])
    log.count("completed", "s.a", "v")  # unflushed when the child forks
    tally = log.tally("completed", "s.b", "v")  # the call sites' counter
    tally[0] += 3
    pid = os.fork()
    if pid == 0:  # the child
        try:
            log.event("active", slots=["s.a"])
            log.count("completed", "s.a", "v")
            log.count("completed", "s.a", "v")
            tally[0] += 1
            log.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    log.close()
    by_pid = {}
    for r in read_receipts(tmp_path):
        if r.kind == "completed":
            by_pid[(r.pid, r.slot)] = by_pid.get((r.pid, r.slot), 0) + r.count
    assert by_pid == {(os.getpid(), "s.a"): 1, (os.getpid(), "s.b"): 3, (pid, "s.a"): 2, (pid, "s.b"): 1}
    assert log.counts[("completed", "s.b", "v")] == 3
