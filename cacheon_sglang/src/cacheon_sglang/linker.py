"""OrbitKVLinker: SGLang 0.5.23's unified-cache external linker over the OrbitKV cache manager.

Enable with::

    sglang serve ... --enable-unified-cache-external-linker \\
      --unified-cache-external-linker-backend dynamic \\
      --unified-cache-external-linker-config '{"linker": "OrbitKVLinker",
          "linker_module_path": "cacheon_sglang.linker",
          "linker_extra_config": {"endpoint": "unix:///tmp/orbitkv.sock"}}'

``linker_extra_config`` keys: ``endpoint`` (else ``ORBITKV_SGLANG_ENDPOINT`` or ``ORBITKV_ENDPOINT``),
``model_fingerprint`` (the cache identity; default a digest of the model path and revision) and
``prepare_timeout_s`` (with several attention ranks, where the lease is taken when loading
starts: how long a queued restore may wait for it before it is given up; default 5).

SGLang's tree components map onto the recovery contract: FULL is the prefix group (0), SWA a window
group (1) of ``sliding_window_size`` tokens, MAMBA a checkpoint group (2) whose one page is the
request state at a node's end boundary. Every group keys a page by SGLang's own per-page storage
hash (one chain for all groups), so a lookup finds each group's pages at every position of the
queried tail from the attention keys alone, without reading a payload byte.

- ``lookup``: metadata-only discovery of the tail in each group, the legal boundaries from the
  contract (SGLang intersects them across ranks and caps the tail at its match limit, N-1 tokens
  rounded down to a page).
- ``load``: checks SGLang's destinations against the contract's required ranges at the selected
  boundary (``split_demand``: copied pages exactly the compiled range, nothing outside it), then
  leases exactly those pages (``read_recovery``). A partial result is released by the manager and
  the load is refused, which SGLang turns into a recompute; with several attention ranks the lease
  is taken when loading starts instead (a refusal must be the same on every rank), and a missing
  page fails the batch, which SGLang aborts.
- ``start_layer_wise_loading``: a loader thread restores every queued request (checksums verified in
  the copy), releases the leases after the copies' fence, then completes every layer of SGLang's
  layer counter at once: the forward waits for the whole restore, not per layer.
- ``offload``: SGLang's write-through chain hands node pages (and a node's Mamba state); a saver
  thread reserves arena extents, copies and commits every group of the node, in order.

Pools: MHA or MLA token pools, SWAKVPool over MHA pools, HybridLinearKVPool over an MHA pool with a
plain MambaPool. Anything else (DSA, FP4/FP8-quantized or unified-memory pools, ReplaySSM, draft
pools, SWA rings that do not gate prefix matching, int8 state) is refused at startup with the reason.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from cacheon_orbitkv.client import CacheClient, Recovery, make_namespace
from cacheon_orbitkv.contract import ContractError, RecoveryContract
from cacheon_orbitkv.link import Connection, ManagerLink, StagedSave, stage_save
from cacheon_orbitkv.transfer import Arena, GroupLayout, PagePlan, paged_tokens, restore, segment_view
from cacheon_orbitkv.wire import ManagerUnavailable, OrbitKVError

log = logging.getLogger("sglang.cacheon.orbitkv")

DEFAULT_PREPARE_TIMEOUT_S = 5.0
CONFIG_KEYS = frozenset({"endpoint", "model_fingerprint", "prepare_timeout_s"})
KV_GROUP, SWA_GROUP, MAMBA_GROUP = 0, 1, 2
POOL_GROUPS = {PoolName.KV: KV_GROUP, PoolName.SWA: SWA_GROUP, PoolName.MAMBA: MAMBA_GROUP}


class UnsupportedPools(ValueError):
    """SGLang's pools are a combination OrbitKV does not restore; the message says which part."""


def storage_hash(key: str, group: int) -> bytes:
    """The manager's 16-byte page id of SGLang storage hash ``key`` in ``group``."""
    return hashlib.blake2b(f"{group}\x00{key}".encode(), digest_size=16).digest()


# -- pools ----------------------------------------------------------------------------------------


@dataclass
class PoolLayout:
    """What the linker moves: per contract group its kind, window, segments and SGLang pool."""

    groups: list[tuple[int, str, int]]
    layouts: dict[int, GroupLayout]
    pools: dict[PoolName, object]
    num_layers: int
    device: str
    dtype: str


def _exact(obj: object, *names: str) -> bool:
    return type(obj).__name__ in names


def _token_segments(pool: Any, page: int, what: str) -> tuple[str, list[Any]]:
    """The prefix kind and per-layer page segments of a plain MHA or MLA token pool."""
    if _exact(pool, "MHATokenToKVPool"):
        segments = []
        for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True):
            # NHD [slots, heads, dim] by default; HND (SGLANG_USE_HND_KVCACHE) is [pages, heads, page, dim].
            segments += (
                [segment_view(k), segment_view(v)] if k.dim() == 4 else [paged_tokens(k, page), paged_tokens(v, page)]
            )
        return "attention", segments
    if _exact(pool, "MLATokenToKVPool"):
        return "mla", [paged_tokens(buf, page) for buf in pool.kv_buffer]
    raise UnsupportedPools(
        f"{what} is {type(pool).__name__}; OrbitKV restores plain MHATokenToKVPool and MLATokenToKVPool "
        "buffers (DSA, quantized, page-major and unified-memory pools are not supported)"
    )


def _state_segments(mamba_pool: Any) -> list[Any]:
    """Per Mamba layer, each conv tensor's and the temporal tensor's ``[slots, bytes]`` rows."""
    if not _exact(mamba_pool, "MambaPool"):
        raise UnsupportedPools(f"the Mamba pool is {type(mamba_pool).__name__}; only a plain MambaPool is supported")
    if getattr(mamba_pool, "replayssm_write_pos", None) is not None:
        raise UnsupportedPools("ReplaySSM state (a replay cursor per slot) is not supported")
    cache = mamba_pool.mamba_cache
    if type(cache).__name__ != "State":
        raise UnsupportedPools(f"Mamba state {type(cache).__name__} (speculative state) is not supported")
    temporal = cache.temporal
    if temporal.dtype in (torch.int8, torch.uint8):
        raise UnsupportedPools("int8 checkpoint storage is not supported")
    segments = []
    for layer in range(temporal.shape[0]):
        for conv in cache.conv:
            segments.append(segment_view(conv[layer]))
        if temporal[layer].numel():  # a convolution-only checkpoint registers no zero-byte buffer
            segments.append(segment_view(temporal[layer]))
    return segments


def describe_pools(params: Any, components: set[ComponentType]) -> PoolLayout:
    """Validate SGLang's pools against the supported combinations and build the group layouts."""
    page = int(params.page_size)
    unknown = set(components) - {ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA}
    if unknown or ComponentType.FULL not in components:
        names = ", ".join(sorted(str(c) for c in components))
        raise UnsupportedPools(f"tree components [{names}]: OrbitKV needs FULL, optionally with SWA and MAMBA")
    for name in ("mtp_draft_device_pools", "sidecar_draft_device_pools", "mtp_draft_mamba_pools"):
        if getattr(params, name, ()):
            raise UnsupportedPools(f"draft state ({name}) is not supported")
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    mamba_pool = None
    if ComponentType.MAMBA in components:
        if getattr(params.req_to_token_pool, "mamba_ckpt_pool", None) is not None:
            raise UnsupportedPools("int8 checkpoint storage (--enable-int8-mamba-checkpoint) is not supported")
        if not _exact(kvcache, "HybridLinearKVPool"):
            raise UnsupportedPools(f"a Mamba model's KV pool is {type(kvcache).__name__}, not HybridLinearKVPool")
        mamba_pool = kvcache.mamba_pool
        kvcache = kvcache.full_kv_pool
    groups: list[tuple[int, str, int]] = []
    layouts: dict[int, GroupLayout] = {}
    pools: dict[PoolName, object] = {}
    if ComponentType.SWA in components:
        if not _exact(kvcache, "SWAKVPool"):
            raise UnsupportedPools(f"a sliding-window model's KV pool is {type(kvcache).__name__}, not SWAKVPool")
        if not getattr(params, "swa_gates_prefix_match", True):
            raise UnsupportedPools("the SWA state is a per-request ring that tree nodes do not own")
        window = params.sliding_window_size
        if not window:
            raise UnsupportedPools("SWA component without a sliding_window_size")
        kind, full_segments = _token_segments(kvcache.full_kv_pool, page, "the full-attention pool")
        _, swa_segments = _token_segments(kvcache.swa_kv_pool, page, "the sliding-window pool")
        groups += [(KV_GROUP, kind, 0), (SWA_GROUP, "window", int(window))]
        layouts[KV_GROUP], layouts[SWA_GROUP] = GroupLayout(full_segments), GroupLayout(swa_segments)
        pools[PoolName.KV], pools[PoolName.SWA] = kvcache.full_kv_pool, kvcache.swa_kv_pool
        num_layers = len(kvcache.layers_mapping)
        device, dtype = kvcache.full_kv_pool.device, kvcache.full_kv_pool.dtype
    else:
        kind, full_segments = _token_segments(kvcache, page, "the KV pool")
        groups.append((KV_GROUP, kind, 0))
        layouts[KV_GROUP] = GroupLayout(full_segments)
        pools[PoolName.KV] = kvcache
        num_layers = int(kvcache.layer_num)
        device, dtype = kvcache.device, kvcache.dtype
    if mamba_pool is not None:
        groups.append((MAMBA_GROUP, "recurrent", 0))
        layouts[MAMBA_GROUP] = GroupLayout(_state_segments(mamba_pool))
        pools[PoolName.MAMBA] = mamba_pool
    for group, layout in layouts.items():  # checksums sum 64-bit words: every chunk a whole number of them
        if any(chunk % 8 for chunk in layout.chunks):
            raise UnsupportedPools(f"group {group}: page chunks {layout.chunks} are not multiples of 8 bytes")
    # The counter is waited on with model layer ids relative to this stage's first layer.
    outer = params.token_to_kv_pool_allocator.get_kvcache()
    for mapping in (
        getattr(outer, "layers_mapping", None),
        getattr(outer, "full_attention_layer_id_mapping", None),
        getattr(params.req_to_token_pool, "mamba_map", None) if mamba_pool is not None else None,
    ):
        if mapping:
            start = int(getattr(outer, "start_layer", 0) or 0)
            num_layers = max(num_layers, max(mapping) - start + 1)
    return PoolLayout(groups, layouts, pools, num_layers, str(device), str(dtype).removeprefix("torch."))


# -- jobs -----------------------------------------------------------------------------------------


@dataclass
class _Load:
    rid: str
    boundary: int  # tokens from the tail's origin (SGLang's device prefix)
    ranges: list[tuple[int, list[bytes]]]  # per group the page ids to lease, in range order
    rows: dict[int, list[int]]  # per group the destination rows, same order
    deadline: float
    recovery: Recovery | None = None  # the lease, once taken
    connection: Connection | None = None  # the manager connection the lease lives on, held until released


@dataclass
class _Save:
    ranges: list[tuple[int, list[bytes], list[int]]]  # (group, page ids, source rows)
    events: list[Any] = field(default_factory=list)


class OrbitKVLinker(UnifiedCacheLinker):
    """OrbitKV as SGLang's ``UnifiedCacheLinker`` (see the module docstring)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: set[ComponentType],
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        config = dict(extra_config or {})
        unknown = set(config) - CONFIG_KEYS
        if unknown:
            raise ValueError(
                f"OrbitKVLinker: unknown linker_extra_config keys {sorted(unknown)}; known {sorted(CONFIG_KEYS)}"
            )
        env = os.environ
        endpoint = config.get("endpoint") or env.get("ORBITKV_SGLANG_ENDPOINT") or env.get("ORBITKV_ENDPOINT")
        if not endpoint:
            raise ValueError("OrbitKVLinker needs linker_extra_config.endpoint (or ORBITKV_SGLANG_ENDPOINT)")
        self.endpoint = str(endpoint)
        timeout = config.get("prepare_timeout_s", DEFAULT_PREPARE_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"OrbitKVLinker: prepare_timeout_s must be a number of seconds >= 0, got {timeout!r}")
        self.prepare_timeout = float(timeout)
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        self.pool_layout = describe_pools(params, components)
        self.pools = self.pool_layout.pools
        self.groups = self.pool_layout.groups
        tp_group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
        tp_size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        tp_rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
        pp_size, pp_rank = int(getattr(params, "pp_size", 1)), int(getattr(params, "pp_rank", 0))
        cp_size, cp_rank = int(getattr(params, "attn_cp_size", 1)), int(getattr(params, "attn_cp_rank", 0))
        # A refusal in load() must be the same on every rank, which a per-rank lease cannot promise.
        self.lease_at_queue = tp_size * cp_size == 1
        fingerprint = config.get("model_fingerprint") or _model_fingerprint(server_args)
        # The pools' geometry is part of the identity: pages of another layout miss, never mis-restore.
        geometry = hashlib.sha256(
            repr([(g, kind, window, self.pool_layout.layouts[g].chunks) for g, kind, window in self.groups]).encode()
        ).hexdigest()[:12]
        layout = f"sglang-tp{tp_size}-cp{cp_size}-pp{pp_size}-{geometry}"
        rank = (pp_rank * cp_size + cp_rank) * tp_size + tp_rank
        self.namespace = make_namespace(fingerprint, self.pool_layout.dtype, layout, self.page_size, rank)
        self.contract = RecoveryContract.compile(self.namespace, self.page_size, self.groups)
        self.layer_done_counter = LayerWiseLoadCounter(self.pool_layout.num_layers)
        if PoolName.MAMBA in self.pools:
            # SGLang registers the counter with the KV pool only; Mamba layers wait through the
            # request pool, which must not read a state the restore has not written yet.
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.device = self.pool_layout.device
        name = f"sglang-{os.getpid()}-{self.namespace.rsplit(':', 1)[1]}"
        self.link = ManagerLink(self.endpoint, name, device=self.device, log=log)
        self._queued: dict[str, _Load] = {}
        self._started: dict[int, Future[bool]] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitkv-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitkv-save")
        self._offloads: collections.deque[Future[bool]] = collections.deque()
        self._load_stream = torch.cuda.Stream() if self.device.startswith("cuda") else None  # type: ignore[no-untyped-call]
        self.stats = {
            "lookups": 0,
            "loads": 0,
            "load_failures": 0,
            "loaded_bytes": 0,
            "offloads": 0,
            "saved_bytes": 0,
        }
        log.info(
            "orbitkv linker: namespace %s, groups %s, page bytes %s, %d layers, transfers on %s",
            self.namespace,
            self.groups,
            {g: lay.page_bytes for g, lay in self.pool_layout.layouts.items()},
            self.pool_layout.num_layers,
            self.device,
        )

    # -- lookup and load -------------------------------------------------------------------------

    def _tail_keys(self, transfers: list[PoolTransfer]) -> tuple[list[str], dict[PoolName, PoolTransfer]]:
        by_name = {t.name: t for t in transfers}
        extra = set(by_name) - set(self.pools)
        if extra:
            raise OrbitKVError(f"transfers for pools {sorted(str(n) for n in extra)} this linker does not hold")
        kv = by_name.get(PoolName.KV)
        return (list(kv.keys or []) if kv is not None else []), by_name

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        try:
            keys, _ = self._tail_keys(transfers)
        except OrbitKVError as exc:  # a lookup never fails a request: it is a miss
            log.warning("orbitkv lookup of %s: %s", rid, exc)
            return []
        if not keys:
            return []
        ids = {g: [storage_hash(k, g) for k in keys] for g, _, _ in self.groups}
        with self.link.session() as connection:
            if connection is None:
                return []
            self.stats["lookups"] += 1
            try:
                found = connection[0].lookup(self.namespace, ids)
            except OrbitKVError as exc:
                self.link.failed(exc, connection[0])
                return []
        page = self.page_size
        evidence = {g: [(i + 1) * page for i in sorted(found[g]["dram"] + found[g]["ssd"])] for g in ids}
        boundaries = self.contract.restorable_boundaries(self.namespace, 0, len(keys) * page, evidence)
        return [b // page for b in boundaries]

    def _rows(self, name: PoolName, transfer: PoolTransfer) -> list[int]:
        """Destination rows of a transfer: pages of a token pool, slots of a state pool."""
        indices = transfer.device_indices
        if indices is None:
            raise OrbitKVError(f"{name} transfer carries no device indices")
        flat = indices.reshape(-1).to("cpu", torch.int64)
        if name == PoolName.MAMBA:
            return flat.tolist()  # type: ignore[no-any-return]  # a plain MambaPool's slot ids are its rows
        page = self.page_size
        if flat.numel() % page:
            raise OrbitKVError(f"{name} transfer has {flat.numel()} slots, not whole pages of {page}")
        pages = flat.view(-1, page)
        firsts = pages[:, 0]
        if bool((firsts % page).any()) or not bool((pages == firsts[:, None] + torch.arange(page)).all()):
            raise OrbitKVError(f"{name} transfer slots are not whole, aligned pages")
        return (firsts // page).tolist()  # type: ignore[no-any-return]

    def _plan(self, rid: str, transfers: list[PoolTransfer]) -> _Load:
        """The leases and destinations a load needs, checked against the contract at its boundary."""
        keys, by_name = self._tail_keys(transfers)
        if not keys:
            raise OrbitKVError("a load without attention pages")
        page = self.page_size
        end = len(keys) * page
        position = {k: (i + 1) * page for i, k in enumerate(keys)}
        moved: dict[int, list[int]] = {}
        rows: dict[int, list[int]] = {}
        for name, transfer in by_name.items():
            group = POOL_GROUPS[name]  # a pool this linker holds: _tail_keys checked
            tkeys = list(transfer.keys or [])
            if any(k not in position for k in tkeys):
                raise OrbitKVError(f"{name} transfer names pages outside the attention tail")
            moved[group] = [position[k] for k in tkeys]
            rows[group] = self._rows(name, transfer)
            if len(rows[group]) != len(tkeys):
                raise OrbitKVError(f"{name} transfer has {len(rows[group])} destinations for {len(tkeys)} pages")
        # SGLang loads a tail into private slots: it retains none of the range's pages.
        self.contract.split_demand(self.namespace, 0, end, moved)
        ranges = []
        ordered_rows = {}
        for group, _, _ in self.groups:
            group_ends = moved.get(group, [])
            order = sorted(range(len(group_ends)), key=group_ends.__getitem__)
            ends = [group_ends[i] for i in order]
            ranges.append((group, [storage_hash(keys[e // page - 1], group) for e in ends]))
            ordered_rows[group] = [rows[group][i] for i in order]
        return _Load(rid, end, ranges, ordered_rows, time.monotonic() + self.prepare_timeout)

    def _lease(self, job: _Load) -> bool:
        """Lease the job's ranges, holding the connection (its arena holds the leased pages) until
        ``_release``."""
        connection = self.link.acquire()
        if connection is None:
            return False
        job.connection = connection
        try:
            job.recovery = connection.client.read_recovery(
                self.namespace, job.boundary, [r for r in job.ranges if r[1]]
            )
        except OrbitKVError as exc:
            self.link.failed(exc, connection.client)
        if job.recovery is None:
            log.warning("orbitkv load of %s: no lease (pages gone since lookup, or no manager)", job.rid)
            self._release(job)
            return False
        return True

    def _release(self, job: _Load) -> None:
        recovery, job.recovery = job.recovery, None
        connection, job.connection = job.connection, None
        if connection is None:
            return
        try:
            if recovery is not None and not connection.retired:  # a lost connection took its leases along
                connection.client.release(recovery.lease)
        except OrbitKVError as exc:
            self.link.failed(exc, connection.client)
        finally:
            self.link.release(connection)

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        try:
            job = self._plan(rid, transfers)
        except (OrbitKVError, ContractError) as exc:
            log.warning("orbitkv load of %s refused: %s", rid, exc)
            return False
        if self.lease_at_queue and not self._lease(job):
            return False
        self._queued[rid] = job
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._queued:
            return -1  # every prefill batch starts loading; one without loads waits on nothing
        index = self.layer_done_counter.update_producer()
        jobs = list(self._queued.values())
        self._queued.clear()
        self._started[index] = self._loader.submit(self._run_loads, index, jobs)
        return int(index)

    def _run_loads(self, index: int, jobs: list[_Load]) -> bool:
        counter = self.layer_done_counter
        try:
            landed = all([self._restore(job) for job in jobs])  # every job runs (and releases) even after a failure
        except BaseException as exc:  # a bug must fail the batch, not hang the forward waiting on it
            log.exception("orbitkv restore raised")
            counter.fail(index, exc)
            raise
        if landed:
            for layer in range(counter.num_layers):
                counter.complete(index, layer)
        else:
            counter.fail(index, OrbitKVError("an OrbitKV restore did not land; SGLang aborts its requests"))
        return landed

    def _restore(self, job: _Load) -> bool:
        """Copy one request's leased pages into its destinations; the leases go after the fence."""
        try:
            if job.recovery is None:  # several ranks: leased now, within the preparation limit
                if time.monotonic() > job.deadline:
                    log.warning("orbitkv load of %s passed its preparation limit", job.rid)
                    return False
                if not self._lease(job):
                    return False
            assert job.recovery is not None and job.connection is not None
            if job.connection.retired:  # the manager went away since the lease: its pages with it
                return False
            arena = job.connection.arena
            moved = 0
            stream = torch.cuda.stream(self._load_stream) if self._load_stream is not None else contextlib.nullcontext()
            with stream:
                fences = []
                for group, hashes in job.ranges:
                    if not hashes:
                        continue
                    layout = self.pool_layout.layouts[group]
                    refs = job.recovery.pages[group]
                    if any(r.length != layout.page_bytes for r in refs):
                        log.warning("orbitkv load of %s: group %d pages have another length", job.rid, group)
                        return False
                    plans = [PagePlan(row, r.offset, r.checksum) for row, r in zip(job.rows[group], refs, strict=True)]
                    fences.append(restore(arena, layout, plans))
                    moved += len(plans) * layout.page_bytes
                verdicts = [ok for fence in fences for ok in fence.wait()]
            if not all(verdicts):
                log.warning("orbitkv load of %s: %d page(s) failed their checksums", job.rid, verdicts.count(False))
                return False
            self.stats["loaded_bytes"] += moved
            return True
        finally:
            self.stats["loads"] += 1
            self._release(job)

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        future = self._started.pop(counter_index, None)
        landed = bool(self.layer_done_counter.finish(counter_index))
        if future is not None:
            try:
                landed = future.result() and landed
            except Exception:
                landed = False
        if not landed:
            self.stats["load_failures"] += 1
        return landed

    def cancel_queued_load(self, rid: str) -> bool:
        job = self._queued.pop(rid, None)
        if job is None:
            return False  # started (SGLang finishes it before freeing the slots) or never queued
        self._release(job)
        return True

    # -- offload ---------------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        ranges = []
        try:
            for transfer in transfers:
                if transfer.name not in self.pools:
                    raise OrbitKVError(f"an offload of pool {transfer.name} this linker does not hold")
                group = POOL_GROUPS[transfer.name]
                keys = list(transfer.keys or [])
                rows = self._rows(transfer.name, transfer)
                if len(rows) != len(keys):
                    raise OrbitKVError(f"{transfer.name} offload has {len(rows)} sources for {len(keys)} pages")
                ranges.append((group, [storage_hash(k, group) for k in keys], rows))
        except OrbitKVError as exc:
            log.warning("orbitkv offload refused: %s", exc)
            return False
        job = _Save(ranges, self.record_offload_ready() if self.device.startswith("cuda") else [])
        self._offloads.append(self._saver.submit(self._persist, job))
        return True

    def _persist(self, job: _Save) -> bool:
        """Reserve, copy and commit every group of one node; False (nothing claimed) on any failure."""
        for event in job.events:
            event.synchronize()
        with self.link.session() as connection:
            if connection is None:
                return False
            return self._persist_on(job, *connection)

    def _persist_on(self, job: _Save, client: CacheClient, arena: Arena) -> bool:
        staged: list[StagedSave] = []
        try:
            for group, hashes, rows in job.ranges:
                layout = self.pool_layout.layouts[group]
                staged.append(stage_save(client, arena, self.namespace, group, layout, hashes, rows))
            while staged:
                self.stats["saved_bytes"] += staged[0].commit(client)
                staged.pop(0)
        except OrbitKVError as exc:
            self.link.failed(exc, client)
            if not isinstance(exc, ManagerUnavailable):
                for pending in staged:
                    client.abort(pending.reservation)
            return False
        self.stats["offloads"] += 1
        return True

    def num_completed_offloads(self) -> int:
        done = 0
        for future in self._offloads:
            if not future.done():
                break
            done += 1
        return done

    def pop_completed_offload(self) -> bool:
        future = self._offloads.popleft()
        try:
            return bool(future.result())
        except Exception:
            log.exception("orbitkv offload raised")
            return False

    # -- lifecycle -------------------------------------------------------------------------------

    def _quiesce(self) -> None:
        for future in list(self._started.values()):
            with contextlib.suppress(Exception):
                future.result()
        for future in list(self._offloads):
            with contextlib.suppress(Exception):
                future.result()
        for job in self._queued.values():
            self._release(job)
        self._queued.clear()
        self._started.clear()
        self._offloads.clear()

    def reset(self) -> None:
        self._quiesce()
        self.layer_done_counter.reset()

    def close(self) -> None:
        self._quiesce()
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        log.info("orbitkv linker stats: %s", self.stats)
        self.link.close()


def _model_fingerprint(server_args: Any) -> str:
    model = getattr(server_args, "model_path", None)
    if not model:
        raise ValueError("OrbitKVLinker: no model path in server_args; set linker_extra_config.model_fingerprint")
    revision = getattr(server_args, "revision", None)
    return hashlib.sha256(f"{model}@{revision}".encode()).hexdigest()[:32]
