"""Process-local receipts: positive accounting of which code ran where.

Each process appends JSON lines to its own file ``<dir>/receipts-<host>-<pid>.jsonl``. Lifecycle
events (``active``, ``load_failed``, ``failed``) are written at once; per-call events (``fired``,
``completed``, ``fallback``) are counted in memory on the hot path and flushed as one record per
(kind, slot, variant) with the count since the last flush. A call that completes is counted once,
as ``completed``, and stands for its ``fired`` too; a call that fails after selection counts
``fired`` on its own slow path. Flushes happen on ``flush()``, every
``CACHEON_RECEIPT_FLUSH_S`` seconds (default 1) from a daemon thread, and at exit. Each flush is
one ``write`` to a file opened with ``O_APPEND``, so concurrent readers never see half a batch.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from ._wire import converter

ReceiptKind = Literal[
    "active", "load_failed", "fired", "completed", "fallback", "failed", "captured", "replayed", "route"
]
LIFECYCLE: tuple[str, ...] = (
    "active",
    "load_failed",
    "fired",
    "completed",
    "fallback",
    "failed",
    "captured",
    "replayed",
    "route",
)
# captured: calls recorded into a CUDA graph (membership; the candidate did not run then);
# replayed: executions of captured calls, counted on the device by an increment captured with them;
# route: a collective slot's ranks agreed on a route for one call shape (variant: the candidate, or
# None for stock), written by every rank.
COUNTED = frozenset({"fired", "completed", "fallback", "captured", "replayed"})
DEVICE_COUNTERS = 1024
# Every host counter block registered with CUDA lives as long as the process: freed registered memory
# would stay registered, and a later block allocated at the same address could not be registered (error
# 712). 8 KiB per receipt log that counts CUDA graph replays (one per engine process).
_REGISTERED: list[Any] = []


@attrs.frozen
class Receipt:
    """One receipt line. ``count`` is the number of calls a counted record stands for."""

    kind: str
    role: str
    rank: int
    pid: int
    host: str
    time: float
    seq: int
    policy: str
    slot: str | None = None
    variant: str | None = None
    count: int = 1
    slots: tuple[str, ...] = ()
    plugin: str | None = None
    reason: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in LIFECYCLE:
            raise ValueError(f"receipt kind {self.kind!r} is not one of {LIFECYCLE}")


class ReceiptLog:
    """The receipts of this process. Without a directory, counts stay in memory only."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        role: str = "other",
        rank: int = 0,
        policy: str = "strict",
        flush_interval: float | None = None,
    ) -> None:
        self.directory = Path(directory) if directory else None
        self.role = role
        self.rank = rank
        self.policy = policy
        self._counts: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        # Hot-path counters (see tally): one-element lists, folded into the counts when they are read.
        self._tallies: dict[tuple[str, str, str], list[int]] = {}
        self._tallied: dict[tuple[str, str, str], int] = {}
        self._fold_lock = threading.Lock()
        self._flushed: dict[tuple[str, str, str], int] = {}
        # Replay counters: int64 cells in host memory that CUDA kernels captured in graphs increment.
        self._host_counters: Any = None
        self._device_counters: dict[str, Any] = {}
        self._counter_index: dict[tuple[str, str], int] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._interval = 0.0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            interval = flush_interval
            if interval is None:
                interval = float(os.environ.get("CACHEON_RECEIPT_FLUSH_S", "1"))
            self._interval = interval
            self._start_flusher()
            atexit.register(self.close)
        _LOGS.add(self)

    @property
    def path(self) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / f"receipts-{socket.gethostname()}-{os.getpid()}.jsonl"

    @property
    def counts(self) -> defaultdict[tuple[str, str, str], int]:
        """Every count so far, the tallies included: the same dict for the log's life."""
        if self._tallies:
            with self._fold_lock:
                for key, cell in list(self._tallies.items()):
                    total = cell[0]
                    done = self._tallied.get(key, 0)
                    if total != done:
                        self._counts[key] += total - done
                        self._tallied[key] = total
        return self._counts

    def count(self, kind: str, slot: str, variant: str) -> None:
        """One dictionary increment."""
        self._counts[(kind, slot, variant)] += 1

    def tally(self, kind: str, slot: str, variant: str) -> list[int]:
        """The counter of (kind, slot, variant) for the hottest paths: ``cell[0] += 1`` counts one.

        A list item increment costs a fraction of a dictionary one with a tuple key; reading
        ``counts`` folds every tally in. The same key always gets the same cell.
        """
        key = (kind, slot, variant)
        with self._fold_lock:
            cell = self._tallies.get(key)
            if cell is None:
                cell = self._tallies[key] = [0]
        return cell

    def event(
        self,
        kind: str,
        *,
        slot: str | None = None,
        variant: str | None = None,
        slots: Iterable[str] = (),
        plugin: str | None = None,
        reason: str | None = None,
    ) -> Receipt:
        """Write a lifecycle receipt now (after flushing pending counts, to keep order)."""
        with self._lock:
            records = self._pending()
            receipt = self._make(
                kind, slot=slot, variant=variant, slots=tuple(sorted(slots)), plugin=plugin, reason=reason
            )
            self._write([*records, receipt])
        return receipt

    def flush(self) -> None:
        with self._lock:
            self._write(self._pending())

    def close(self) -> None:
        self._stop.set()
        self.flush()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _start_flusher(self) -> None:
        if self._interval > 0:
            threading.Thread(
                target=self._flush_every, args=(self._interval,), daemon=True, name="cacheon-receipts"
            ).start()

    def _after_fork_in_child(self) -> None:
        # The parent's calls are the parent's to report: a forked child starts from zero, with its
        # own file, a fresh lock (the parent's may have been held at fork) and its own flusher.
        self._counts.clear()  # in place: call sites hold this very dict, and their tally cells
        for cell in self._tallies.values():
            cell[0] = 0
        self._tallied = {}
        self._fold_lock = threading.Lock()
        self._flushed = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._fd = None
        self._pid = os.getpid()
        self._stop = threading.Event()
        if self.directory is not None:
            self._start_flusher()

    def _flush_every(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.flush()

    def _make(self, kind: str, **fields: object) -> Receipt:
        self._seq += 1
        return Receipt(
            kind=kind,
            role=self.role,
            rank=self.rank,
            pid=os.getpid(),
            host=socket.gethostname(),
            time=time.time(),
            seq=self._seq,
            policy=self.policy,
            **fields,  # type: ignore[arg-type]
        )

    def replay_counter(self, slot: str, variant: str, device: Any) -> Any:
        """The CUDA view of this (slot, variant)'s replay counter, a one-element int64 tensor in
        host memory mapped for the device: a captured ``add_(1)`` on it counts each replay, and the
        flusher reads it without a CUDA call. Call outside capture (it may allocate)."""
        import torch

        with self._lock:
            if self._host_counters is None:
                self._host_counters = torch.zeros(DEVICE_COUNTERS, dtype=torch.int64)
                _register_host(self._host_counters)
                _REGISTERED.append(self._host_counters)
            key = str(device)
            if key not in self._device_counters:
                self._device_counters[key] = _device_alias(self._host_counters, device)
            index = self._counter_index.get((slot, variant))
            if index is None:
                if len(self._counter_index) >= DEVICE_COUNTERS:
                    raise RuntimeError(f"more than {DEVICE_COUNTERS} (slot, variant) replay counters in one process")
                index = self._counter_index[(slot, variant)] = len(self._counter_index)
            return self._device_counters[key][index : index + 1]

    def _pending(self) -> list[Receipt]:
        if self._counter_index:
            host = self._host_counters
            for (slot, variant), index in list(self._counter_index.items()):
                self.counts[("replayed", slot, variant)] = int(host[index])
        deltas: dict[tuple[str, str, str], int] = {}
        for key, total in list(self.counts.items()):
            delta = total - self._flushed.get(key, 0)
            if delta > 0:
                deltas[key] = delta
                self._flushed[key] = total
        fired: dict[tuple[str, str], int] = {}
        for (kind, slot, variant), delta in deltas.items():
            if kind in ("fired", "completed"):
                fired[(slot, variant)] = fired.get((slot, variant), 0) + delta
        records = [self._make("fired", slot=slot, variant=variant, count=n) for (slot, variant), n in fired.items()]
        for (kind, slot, variant), delta in deltas.items():
            if kind != "fired":
                records.append(self._make(kind, slot=slot, variant=variant, count=delta))
        return records

    def _write(self, records: list[Receipt]) -> None:
        if not records or self.directory is None:
            return
        if self._fd is None or self._pid != os.getpid():
            # A forked child writes its own file, never its parent's descriptor.
            self._pid = os.getpid()
            path = self.path
            assert path is not None
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = "".join(json.dumps(converter.unstructure(r), sort_keys=True) + "\n" for r in records)
        os.write(self._fd, data.encode())


_LOGS: weakref.WeakSet[ReceiptLog] = weakref.WeakSet()


def _register_host(host: Any) -> None:
    """Pin ``host`` and map it into every device's address space (cudaHostRegister, mapped+portable)."""
    import torch

    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 1 | 2)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the replay counters failed with error {int(err)}")


def _device_alias(host: Any, device: Any) -> Any:
    """A CUDA tensor over the same (registered) host memory: kernels write the host cells directly."""
    import torch

    class _Alias:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "shape": tuple(host.shape),
                "typestr": "<i8",
                "data": (host.data_ptr(), False),
                "version": 3,
            }

    with torch.cuda.device(device):
        return torch.as_tensor(_Alias(), device=device)


def _reset_after_fork() -> None:
    for log in list(_LOGS):
        log._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_after_fork)


class ReceiptFormatError(ValueError):
    """A receipt file holds a line that is not a receipt."""


def read_receipts(directory: str | os.PathLike[str]) -> list[Receipt]:
    """Every receipt under ``directory``, in lifecycle order (kind, then host, pid, sequence)."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"receipt directory {str(root)!r} does not exist")
    receipts = []
    for path in sorted(root.glob("receipts-*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                receipts.append(converter.structure(json.loads(line), Receipt))
            except Exception as exc:  # any malformed line is reported with its place, never skipped
                raise ReceiptFormatError(f"{path}:{number}: not a receipt ({exc})") from exc
    receipts.sort(key=lambda r: (LIFECYCLE.index(r.kind), r.host, r.pid, r.seq))
    return receipts


@attrs.frozen
class Member:
    """A process that wrote ``active``: it loaded candidates and enabled its registry."""

    host: str
    pid: int
    rank: int
    role: str
    slots: tuple[str, ...]


@attrs.frozen
class SlotCoverage:
    fired: int = 0
    completed: int = 0
    fallback: int = 0
    failed: int = 0
    captured: int = 0
    replayed: int = 0

    @property
    def ran(self) -> int:
        """How many times candidates really ran: eager completions plus graph replays."""
        return self.completed + self.replayed


@attrs.frozen
class CoverageReport:
    """Slot x rank coverage of a receipt directory, and every problem found in it."""

    members: tuple[Member, ...]
    coverage: Mapping[str, Mapping[int, SlotCoverage]]
    problems: tuple[str, ...]
    # collective slots: per slot and rank, the routes agreed, in order ("stock" or the variant)
    routes: Mapping[str, Mapping[int, tuple[str, ...]]] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def coverage_report(receipts: Iterable[Receipt], expect_ranks: int | None = None) -> CoverageReport:
    receipts = list(receipts)
    members = [Member(r.host, r.pid, r.rank, r.role, r.slots) for r in receipts if r.kind == "active"]
    active_procs = {(m.host, m.pid) for m in members}
    problems: list[str] = []
    table: dict[str, dict[int, dict[str, int]]] = {}
    for m in members:
        for slot in m.slots:
            table.setdefault(slot, {}).setdefault(m.rank, {})
    routes: dict[str, dict[int, list[str]]] = {}
    for r in receipts:
        where = f"rank {r.rank} (host {r.host}, pid {r.pid}, role {r.role})"
        if r.kind == "route":
            routes.setdefault(r.slot or "?", {}).setdefault(r.rank, []).append(r.variant or "stock")
        elif r.kind == "load_failed":
            problems.append(f"load_failed on {where}: plugin {r.plugin or '?'}: {r.reason}")
        elif r.kind in COUNTED or r.kind == "failed":
            cell = table.setdefault(r.slot or "?", {}).setdefault(r.rank, {})
            cell[r.kind] = cell.get(r.kind, 0) + r.count
            if (r.host, r.pid) not in active_procs:
                problems.append(f"{r.kind} for {r.slot} by {r.variant} on {where}, which never wrote active")
            if r.kind == "failed":
                problems.append(f"failed: {r.slot} by {r.variant} on {where}: {r.reason}")
            if r.kind == "fallback" and r.policy == "strict":
                problems.append(f"fallback under strict policy: {r.slot} by {r.variant} on {where}")
    for m in members:
        if m.role != "scheduler":
            problems.append(f"extra active member: pid {m.pid} on {m.host} has role {m.role}, not scheduler")
    if expect_ranks is not None:
        ranks = [m.rank for m in members if m.role == "scheduler"]
        missing = sorted(set(range(expect_ranks)) - set(ranks))
        if missing:
            problems.append(f"missing active members: expected ranks 0..{expect_ranks - 1}, none from ranks {missing}")
        extra = sorted(r for r in set(ranks) if r >= expect_ranks or ranks.count(r) > 1)
        if extra:
            problems.append(
                f"extra active members at ranks {extra}: expected exactly one per rank 0..{expect_ranks - 1}"
            )
        for slot, by_rank in sorted(routes.items()):
            silent = sorted(set(range(expect_ranks)) - set(by_rank))
            if silent:
                problems.append(f"collective {slot}: ranks {silent} reported no route while others did")
            seen = {tuple(v) for v in by_rank.values()}
            if len(seen) > 1:
                told = "; ".join(f"rank {k}: {', '.join(v)}" for k, v in sorted(by_rank.items()))
                problems.append(f"collective {slot}: the ranks report different routes ({told})")
    coverage = {
        slot: {rank: SlotCoverage(**cell) for rank, cell in sorted(by_rank.items())}
        for slot, by_rank in sorted(table.items())
    }
    agreed = {slot: {rank: tuple(v) for rank, v in sorted(by.items())} for slot, by in sorted(routes.items())}
    return CoverageReport(tuple(members), coverage, tuple(problems), agreed)
