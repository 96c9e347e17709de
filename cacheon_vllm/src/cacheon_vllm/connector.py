"""OrbitKVConnector: vLLM's KV connector API over the OrbitKV cache manager.

Enable with ``--kv-transfer-config '{"kv_connector": "OrbitKVConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"endpoint": "unix:///tmp/orbitkv.sock"}}'`` once ``cacheon-vllm`` is
installed (its ``vllm.general_plugins`` entry point registers the name). ``kv_role`` ``kv_consumer``
only restores, ``kv_producer`` only saves. Other ``kv_connector_extra_config`` keys:
``model_fingerprint`` (the model part of the cache identity; default a digest of the model's
config and weight files, see ``cacheon_orbitkv.identity``), ``prepare_timeout_s`` (the
preparation limit of one restore, default 5 seconds), ``save_decode`` (also save each page of generated
tokens as it fills, default true) and ``load_switch_interval_us`` (Python's thread
switch interval while restores run, default 200; 0 leaves it alone: see below). The namespace of every page states the
model, the KV cache dtype, the engine's layout, each group's geometry, the parallel sizes and
rank; each page carries the worker's layout tag, and a restore refuses a page of another tag or
length.

It implements ``SupportsHMA``, so vLLM keeps its hybrid allocator on: every full-attention KV cache
group is a prefix group of the recovery contract (storage groups 0..), every sliding-window group a
window of W-1 past tokens (vLLM counts the next query token in its window), rounded up to pages.
Mamba groups in vLLM's ``align`` mode (prefix caching on) are checkpoint groups: the state at a
page boundary is one page, saved when vLLM offers it (its exact boundary-state hand-off) and
restored into the block that holds the state at the restored boundary; Mamba groups in any other
mode are rejected at startup.

- Scheduler side: a metadata-only ``lookup`` of the full pages of the request's tokens (a resumed
  request's generated tokens included), the legal boundaries from
  the recovery contract, the largest clamped so the final prompt token is always computed. The
  request then waits in ``WAITING_FOR_REMOTE_KVS`` while the worker loads its blocks. Saves: the
  pages of a prompt are saved in the step that completes its prefill, and (``save_decode``) each page
  of generated tokens in the step that fills it (chunked prefills and preemption are followed through
  the scheduler's block tables).
- Worker side: a loader thread leases the pages (``read_recovery``; the leases of a step's loads in
  one exchange, ``read_recoveries``), restores them into the request's blocks through the transfer
  module with checksums verified in the copy, and releases each lease. While any load runs (from its
  submission until it is done), the worker process's thread switch interval is lowered to
  ``load_switch_interval_us`` (``cacheon_orbitkv.link.LoadHandoff``)
  and then set back: vLLM's engine loop runs Python without pause while a request waits for its KV,
  and at Python's default of 5 ms every return of the loader from a socket, a CUDA wait or a torch
  operation would wait that long for the GIL. A load that finds any page missing or corrupt, or passes
  the preparation limit, is reported through vLLM's ``failed_recving`` path: vLLM recomputes the
  request, nothing raises.
  Every load is reported finished, cancelled requests included, so vLLM frees their blocks only
  after the loader has stopped writing them. Saves reserve arena extents, gather the blocks into
  them and commit with the copy's checksums, before the step returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from cacheon_orbitkv.client import CacheClient, Recovery, cached_positions, page_hashes
from cacheon_orbitkv.contract import CHECKPOINT_KINDS, RecoveryContract
from cacheon_orbitkv.identity import CacheIdentity, model_fingerprint
from cacheon_orbitkv.link import (
    LOAD_SWITCH_INTERVAL_S,
    LoadHandoff,
    ManagerLink,
    SavePart,
    lease_mismatch,
    leased_pages,
    save_parts,
)
from cacheon_orbitkv.transfer import (
    Arena,
    GroupLayout,
    LayoutError,
    block_runs,
    coalesce,
    restore,
)
from cacheon_orbitkv.wire import OrbitKVError, compiled_checksum

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree, so its handlers and VLLM_LOGGING_LEVEL apply to what the connector logs.
log = logging.getLogger("vllm.cacheon.orbitkv")

DEFAULT_PREPARE_TIMEOUT_S = 5.0
CONFIG_KEYS = frozenset(
    {"endpoint", "model_fingerprint", "prepare_timeout_s", "save_decode", "load_switch_interval_us"}
)
NULL_BLOCK = 0  # vLLM's placeholder for blocks a sliding window has released


_ON_ITS_OWN = object()  # a load whose lease was not taken ahead with its step's others (_lease_ahead)


@dataclass
class LoadJob:
    req_id: str
    boundary: int
    # per rank, per vLLM KV cache group: the page hashes to lease; per group the blocks they restore into
    hashes: list[list[list[bytes]]]
    block_ids: list[list[int]]
    deadline: float  # time.time() past which the load gives up (the preparation limit)
    refused: str = ""  # set when the scheduler cannot honour the allocation: the worker reports a failure


@dataclass
class SaveJob:
    req_id: str
    hashes: list[list[list[bytes]]]  # [rank][group]
    block_ids: list[list[int]]  # [group]


@dataclass
class OrbitKVMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)  # after this step's forward


@dataclass
class _Match:
    """A lookup's answer, kept until vLLM allocates (or drops) the request."""

    start: int
    boundaries: frozenset[int]
    hashes: list[list[list[bytes]]]  # [rank][group]


@dataclass
class _Tracked:
    """A scheduled request whose pages the connector saves: its prompt, the live request (whose
    token ids grow as it decodes), its blocks per group, and where its unsaved pages start."""

    tokens: list[int]  # the prompt
    save_from: int
    block_ids: list[list[int]]
    request: Request | None = None
    prompt_saved: bool = False
    hashes: list[list[list[bytes]]] | None = None  # [rank][group] of its full pages so far, extended as they fill


def kv_cache_dtype(vllm_config: VllmConfig) -> str:
    """The KV cache's element type as stored: the model's dtype for ``auto``, else the cache dtype
    (``fp8`` is vLLM's name for ``fp8_e4m3``)."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype


def engine_layout(vllm_config: VllmConfig) -> str:
    """What decides how this engine lays a page out, as the scheduler and every worker see it alike:
    the device type and the attention backend (configured, or chosen by vLLM for the platform)."""
    device = str(getattr(vllm_config.device_config, "device_type", "") or "auto")
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    name = getattr(backend, "name", None) or (str(backend) if backend else "auto")
    return f"vllm-{device}-{name}".lower().replace(":", "-")


def cache_identity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, groups: list[tuple[int, str, int]], rank: int = 0
) -> CacheIdentity:
    """The cache identity of one rank's pages (see ``cacheon_orbitkv.identity``): the model's files
    (or ``model_fingerprint``), the KV cache dtype, the engine's layout, each group's page geometry
    (layers, KV heads, head size and page bytes of its spec), the parallel sizes and the rank."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
    fingerprint = str(extra.get("model_fingerprint") or model_fingerprint(model.model, model.revision))
    geometry = []
    for (sid, kind, window), group in zip(groups, kv_cache_config.kv_cache_groups, strict=True):
        spec = group.kv_cache_spec
        shape = "/".join(
            str(getattr(spec, name, "-")) for name in ("num_kv_heads", "head_size", "dtype", "block_size")
        ).replace(":", "-")
        per_layer = int(getattr(spec, "page_size_bytes", 0) or 0) or 1
        geometry.append((sid, f"{kind}/{type(spec).__name__}/{shape}", window, (per_layer,) * len(group.layer_names)))
    sizes = [
        ("tp", parallel.tensor_parallel_size),
        ("pp", parallel.pipeline_parallel_size),
        ("dcp", int(getattr(parallel, "decode_context_parallel_size", 1) or 1)),
    ]
    return CacheIdentity(
        model=fingerprint,
        kv_dtype=kv_cache_dtype(vllm_config),
        layout=engine_layout(vllm_config),
        page_size=vllm_config.cache_config.block_size,
        geometry=geometry,
        parallel=sizes,
        rank=rank,
    )


def storage_groups(kv_cache_config: KVCacheConfig, block_size: int) -> list[tuple[int, str, int]]:
    """The contract groups of vLLM's KV cache groups, in vLLM's order; unsupported ones are refused.

    Full-attention groups become prefix groups and take the first storage ids (the contract's group
    0 is a prefix); a sliding window of W tokens needs W-1 past tokens, at least one.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    full = [i for i, spec in enumerate(specs) if isinstance(spec, FullAttentionSpec) and not spec.sliding_window]
    if not full:
        raise ValueError("OrbitKVConnector needs at least one full-attention KV cache group")
    order = full + [i for i in range(len(specs)) if i not in full]
    storage = {vllm_index: sid for sid, vllm_index in enumerate(order)}
    groups = []
    for i, spec in enumerate(specs):
        if i in full:
            groups.append((storage[i], "attention", 0))
        elif isinstance(spec, SlidingWindowSpec):
            groups.append((storage[i], "window", max(1, int(spec.sliding_window) - 1)))
        elif isinstance(spec, MambaSpec) and getattr(spec, "mamba_cache_mode", "none") == "align":
            # One state per block boundary: the checkpoint page that ends at the boundary.
            groups.append((storage[i], "recurrent", 0))
        elif isinstance(spec, MambaSpec):
            raise ValueError(
                f"OrbitKVConnector: KV cache group {i} is a Mamba group in mamba_cache_mode "
                f"{getattr(spec, 'mamba_cache_mode', 'none')!r}; only 'align' keeps a state per block "
                "boundary to save and restore (vLLM selects it when prefix caching is on)"
            )
        else:
            raise ValueError(
                f"OrbitKVConnector: KV cache group {i} is {type(spec).__name__}, which this "
                "release does not restore (full attention, sliding windows and aligned Mamba are supported)"
            )
        if getattr(spec, "block_size", block_size) != block_size:
            raise ValueError(
                f"OrbitKVConnector: KV cache group {i} has block size {spec.block_size}, "
                f"not {block_size}; groups must share one logical block size"
            )
    return groups


def _prepare_timeout(extra: dict[str, Any]) -> float:
    value = extra.get("prepare_timeout_s", DEFAULT_PREPARE_TIMEOUT_S)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"OrbitKVConnector: prepare_timeout_s must be a number of seconds >= 0, got {value!r}")
    return seconds


def _switch_interval(extra: dict[str, Any]) -> float | None:
    """``load_switch_interval_us`` in seconds (None: 0, leave Python's interval alone)."""
    value = extra.get("load_switch_interval_us", LOAD_SWITCH_INTERVAL_S * 1e6)
    try:
        micros = float(value)
    except (TypeError, ValueError):
        micros = -1.0
    if isinstance(value, bool) or not 0 <= micros <= 1e6:
        raise ValueError(
            f"OrbitKVConnector: load_switch_interval_us must be a number of microseconds from 0 to 1e6, got {value!r}"
        )
    return micros / 1e6 or None


class OrbitKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        unknown = set(extra) - CONFIG_KEYS
        if unknown:
            raise ValueError(
                f"OrbitKVConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                f"known {sorted(CONFIG_KEYS)}"
            )
        save_decode = extra.get("save_decode", True)
        if not isinstance(save_decode, bool):
            raise ValueError(f"OrbitKVConnector: save_decode must be true or false, got {save_decode!r}")
        self.save_decode = save_decode
        endpoint = extra.get("endpoint") or os.environ.get("ORBITKV_ENDPOINT")
        if not endpoint:
            raise ValueError("OrbitKVConnector needs kv_connector_extra_config.endpoint (or ORBITKV_ENDPOINT)")
        self.endpoint: str = str(endpoint)
        self.prepare_timeout = _prepare_timeout(extra)
        self._handoff = LoadHandoff(_switch_interval(extra))  # worker: lowered while loads run
        self.loads_enabled = bool(self._kv_transfer_config.is_kv_consumer)
        self.saves_enabled = bool(self._kv_transfer_config.is_kv_producer)
        self.block_size = vllm_config.cache_config.block_size
        # Every tensor/pipeline rank holds its own shard of each page: its own namespace. The
        # scheduler restores only boundaries legal on every rank; each worker moves its own shard.
        parallel = vllm_config.parallel_config
        self.world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.groups = storage_groups(kv_cache_config, self.block_size)  # (storage id, kind, window) per vLLM group
        self.identities = [cache_identity(vllm_config, kv_cache_config, self.groups, r) for r in range(self.world_size)]
        self.namespaces = [identity.namespace for identity in self.identities]
        self.namespace = self.namespaces[0]  # the contract's; the rules are the same on every rank
        self.rank = 0  # a worker's rank, set in register_kv_caches
        self.contract = RecoveryContract.compile(self.namespace, self.block_size, self.groups)
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "orbitkv: kv_load_failure_policy is %r: a restore that fails (pages evicted between lookup "
                "and load, a checksum mismatch, the preparation limit) fails its request; set "
                '"kv_load_failure_policy": "recompute" to recompute such requests instead',
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # Made on first use, re-made after the manager restarts; the worker's is remade with its device.
        # The scheduler's only looks pages up: its arena mapping is never touched (no prefault).
        self.link = ManagerLink(self.endpoint, f"vllm-{role.name.lower()}-{os.getpid()}", log=log, prefault=False)
        # scheduler side
        self._matches: dict[str, _Match] = {}
        self._loads: dict[str, LoadJob] = {}  # allocated, to go out with the next metadata
        self._loading: set[str] = set()  # sent to the workers, not reported finished yet
        self._tracked: dict[str, _Tracked] = {}
        self._requests: dict[str, Request] = {}  # seen by the lookup, until finished
        self._hashed: dict[str, list[list[list[bytes]]]] = {}  # the lookup's page hashes, reused by the save
        self._failed: set[str] = set()  # a restore failed: recompute, never offer the hit again
        # worker side
        self._layouts: list[GroupLayout] = []
        self._loader: ThreadPoolExecutor | None = None
        self._load_stream: Any = None
        self._inflight: dict[str, Future[bool]] = {}
        self.layout_tags: list[str] = []  # per vLLM group: the physical layout of its pages, set with the caches
        self.stats = {
            "hit_tokens": 0,
            "planned_pages": 0,  # scheduler: pages of this rank's loads sent to the workers
            "loaded_bytes": 0,
            "pages_written": 0,  # pages copied into the engine's KV cache with their checksums matched
            "corrupt_pages": 0,
            "compiled_pages": 0,  # worker: pages a restore moved on the CPU's compiled route (good or bad)
            "saved_bytes": 0,
            "load_failures": 0,
            "loads": 0,
            # worker: seconds the loader spent leasing pages (read_recovery) and restoring them (the copies
            # and their checksum verdicts), summed over loads
            "lease_seconds": 0.0,
            "restore_seconds": 0.0,
            "leases_ahead": 0,  # worker: loads whose lease came in one exchange with others of their step
            "saves_together": 0,  # worker: saves that went in one exchange with others of their step
            "load_switch_interval_us": 0,  # worker: the thread switch interval the last load ran under
        }

    def _tag(self, group: int) -> str:
        """The page tag of vLLM group ``group``: its physical layout, as register_kv_caches found it."""
        return self.layout_tags[group] if self.layout_tags else ""

    def _hashes(self, tokens: list[int]) -> list[list[list[bytes]]]:
        """Per rank, per vLLM group: the page hashes of ``tokens``' full pages. One chain per group, seeded
        by the first rank's namespace, serves every rank (the same lists): a rank's pages are keyed under
        its own namespace (the manager's key is namespace, group and hash), so the chain need not name the
        rank, and the scheduler hashes a prompt once, not once per rank."""
        chains = [page_hashes(self.namespaces[0], tokens, self.block_size, sid) for sid, _, _ in self.groups]
        return [chains for _ in self.namespaces]

    def _pages(
        self, start: int, end: int, hashes: list[list[list[bytes]]], blocks: Any
    ) -> tuple[list[list[list[bytes]]], list[list[int]]]:
        """Per rank and group the page hashes, per group the blocks, the contract requires to resume at ``end``."""
        by_sid = {sid: (lo, hi) for sid, lo, hi in self.contract.required_ranges(self.namespace, start, end)}
        spans = [(by_sid[sid][0] // self.block_size, by_sid[sid][1] // self.block_size) for sid, _, _ in self.groups]
        out_hashes = [[h[a:b] for h, (a, b) in zip(rank, spans, strict=True)] for rank in hashes]
        out_blocks = [list(g[a:b]) for g, (a, b) in zip(blocks, spans, strict=True)]
        return out_hashes, out_blocks

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matches.pop(request.request_id, None)
        self._requests[request.request_id] = request  # its token ids grow as it decodes: pages saved as they fill
        if not self.loads_enabled or request.request_id in self._failed:
            return 0, False
        # A resumed (preempted) request recomputes its generated tokens too: restore them as well.
        tokens = list(request.all_token_ids or [])
        hashes = self._hashes(tokens)
        self._hashed[request.request_id] = hashes
        if not hashes[0][0]:
            return 0, False
        with self.link.session() as connection:
            if connection is None:  # the manager is unreachable: a miss, never a failure of the request
                return 0, False
            try:  # every rank's namespace in one request (the ranks share their hashes): one round trip
                founds = connection[0].lookup_namespaces(
                    self.namespaces, {sid: h for (sid, _, _), h in zip(self.groups, hashes[0], strict=True)}
                )
            except OrbitKVError as exc:
                self.link.failed(exc, connection[0])
                return 0, False
        shards = [
            {sid: [(i + 1) * self.block_size for i in cached_positions(found[sid])] for sid, _, _ in self.groups}
            for found in founds
        ]
        span_end = len(hashes[0][0]) * self.block_size
        # vLLM computes the final prompt token itself (its logits are needed): never restore past it.
        usable = [
            b
            for b in self.contract.common_boundaries(self.namespace, 0, span_end, shards)
            if num_computed_tokens < b <= len(tokens) - 1
        ]
        boundary = self.contract.select_boundary(usable, len(tokens) - 1)
        if boundary is None:
            return 0, False
        self._matches[request.request_id] = _Match(num_computed_tokens, frozenset(usable), hashes)
        return boundary - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens == 0 or match is None:
            return
        end = match.start + num_external_tokens
        deadline = time.time() + self.prepare_timeout
        if end not in match.boundaries:
            # vLLM trimmed the hit to a length the contract cannot restore: never claim tokens we
            # cannot load; the worker reports the load failed and vLLM recomputes the request.
            job = LoadJob(request.request_id, end, [], [], deadline, refused=f"{end} is not a legal boundary")
        else:
            hashes, block_ids = self._pages(match.start, end, match.hashes, blocks.get_block_ids())
            job = LoadJob(request.request_id, end, hashes, block_ids, deadline)
            self.stats["planned_pages"] += job_pages(job)
        self._loads[request.request_id] = job
        self.stats["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OrbitKVMetadata(loads=list(self._loads.values()))
        self._loading.update(self._loads)
        self._loads.clear()
        if not self.saves_enabled:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            # Pages are saved from the first: those vLLM found in its own prefix cache may have left the
            # manager, or been computed while decode saves were off (the manager skips stored ones).
            self._tracked[new.req_id] = _Tracked(
                tokens=list(new.prompt_token_ids or []),
                save_from=0,
                block_ids=[list(b) for b in new.block_ids],
                request=self._requests.get(new.req_id),
                # A new request's tokens are its prompt: the lookup hashed exactly its full pages.
                hashes=self._hashed.pop(new.req_id, None),
            )
        self._save_checkpoints(meta, scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            self._advance(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            computed = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and rescheduled: new block tables
                tracked.save_from = min(tracked.save_from, computed)
                tracked.block_ids = [list(b) for b in new_blocks] if new_blocks is not None else tracked.block_ids
            elif new_blocks is not None:
                for group, extra_blocks in zip(tracked.block_ids, new_blocks, strict=True):
                    group.extend(extra_blocks)
            self._advance(meta, req_id, computed + scheduled.get(req_id, 0))
        return meta

    def _advance(self, meta: OrbitKVMetadata, req_id: str, computed_after_step: int) -> None:
        """Note how far a request's KV is computed after this step and save the pages this step fills:
        the prompt's in the step that completes its prefill, then (``save_decode``) each page of
        generated tokens in the step that completes it. The save runs after this step's forward,
        while vLLM still holds every block of the request, so nothing waits for a later step: when the
        request finishes or is preempted, its full pages are already stored."""
        tracked = self._tracked[req_id]
        if not tracked.prompt_saved:
            if computed_after_step < len(tracked.tokens):
                return
            tracked.prompt_saved = True
            self._emit(meta, req_id, tracked, tracked.tokens)
        if self.save_decode and tracked.request is not None:
            # Token ids not delivered yet (asynchronous scheduling) wait for the next step.
            self._emit(meta, req_id, tracked, list(tracked.request.all_token_ids)[:computed_after_step])

    def _emit(self, meta: OrbitKVMetadata, req_id: str, tracked: _Tracked, tokens: list[int]) -> None:
        end = len(tokens) - len(tokens) % self.block_size
        if end <= tracked.save_from:
            return
        job = self._save_job(req_id, tokens, tracked.save_from, tracked.block_ids, self._extend_hashes(tracked, tokens))
        tracked.save_from = end
        if job is not None:
            meta.saves.append(job)

    def _extend_hashes(self, tracked: _Tracked, tokens: list[int]) -> list[list[list[bytes]]]:
        """The request's page hashes through the last full page of ``tokens``, continuing its chain."""
        full = len(tokens) // self.block_size
        if tracked.hashes is None:
            tracked.hashes = self._hashes(tokens[: full * self.block_size])
            return tracked.hashes
        first = tracked.hashes[0]  # every rank's chains are these lists (_hashes)
        have = len(first[0])
        if full > have:
            more = tokens[have * self.block_size : full * self.block_size]
            for (sid, _, _), chain in zip(self.groups, first, strict=True):
                chain.extend(page_hashes(self.namespaces[0], more, self.block_size, sid, chain[-1] if chain else None))
            tracked.hashes = [first for _ in self.namespaces]
        return tracked.hashes

    def _save_job(
        self,
        req_id: str,
        tokens: list[int],
        save_from: int,
        block_ids: list[list[int]],
        hashes: list[list[list[bytes]]] | None = None,
    ) -> SaveJob | None:
        """The pages a later restore at the last full page of ``tokens`` needs and that are not saved
        yet (from ``save_from``): every prefix page, and only the trailing window of a window group.
        Checkpoint groups are saved from vLLM's boundary-state offers instead (_save_checkpoints): an
        aligned Mamba block table is not positional. A window page whose block vLLM has released
        already is left out, which leaves that boundary unrestorable, never wrong. None: nothing to save."""
        end = len(tokens) - len(tokens) % self.block_size
        if end <= save_from:
            return None
        hashes = hashes if hashes is not None else self._hashes(tokens[:end])
        job_hashes, job_blocks = self._pages(save_from, end, hashes, block_ids)
        for g, (_, kind, _) in enumerate(self.groups):
            if kind in CHECKPOINT_KINDS or NULL_BLOCK in job_blocks[g]:
                job_blocks[g] = []
                for rank_hashes in job_hashes:
                    rank_hashes[g] = []
        if not any(job_blocks):
            return None
        return SaveJob(req_id, job_hashes, job_blocks)

    def _save_checkpoints(self, meta: OrbitKVMetadata, scheduler_output: SchedulerOutput) -> None:
        """Save the Mamba boundary states vLLM offers this step that fall on a prompt's full page."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id, entries in offers.items():
            prefill = self._tracked.get(req_id)
            if (
                prefill is None
                or prefill.prompt_saved
                or req_id in preempted
                or req_id in scheduler_output.finished_req_ids
            ):
                continue  # not a prompt being saved, or its blocks are being given up this step
            full_pages = len(prefill.tokens) // self.block_size
            job = SaveJob(req_id, [[[] for _ in self.groups] for _ in self.namespaces], [[] for _ in self.groups])
            for group_id, block_id, boundary in entries:
                page = boundary // self.block_size
                if self.groups[group_id][1] not in CHECKPOINT_KINDS or boundary % self.block_size or page > full_pages:
                    continue
                hashes = self._extend_hashes(prefill, prefill.tokens)
                for rank_job, rank_hashes in zip(job.hashes, hashes, strict=True):
                    rank_job[group_id].append(rank_hashes[group_id][page - 1])
                job.block_ids[group_id].append(block_id)
            if any(job.block_ids):
                meta.saves.append(job)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_recving:
            log.info("orbitkv connector %s stats: %s", self.role.name, self.stats)
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
        for req_id in connector_output.failed_recving or ():
            self._failed.add(req_id)
            self.stats["load_failures"] += 1
            log.warning("orbitkv restore of %s failed; vLLM recomputes it", req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, [block_ids])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, [list(b) for b in block_ids])

    def _finished(self, request: Request, block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        # Every full page was saved in the step that filled it (``_advance``), and vLLM itself holds
        # the blocks of a request whose load has not reported back: the connector keeps nothing alive.
        req_id = request.request_id
        self._matches.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._hashed.pop(req_id, None)
        self._tracked.pop(req_id, None)
        self._failed.discard(req_id)
        return False, None

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        self._layouts, self.layout_tags = [], []
        for index, group in enumerate(self._kv_cache_config.kv_cache_groups):
            segments: list[Any] = []
            tags: list[str] = []
            moved: set[Any] = set()
            for name in group.layer_names:
                cache: Any = kv_caches[name]  # a Tensor, or a Mamba layer's list of state tensors
                if _cache_key(cache) in moved:  # a layer that shares another's KV cache: moved once
                    continue
                moved.add(_cache_key(cache))
                try:
                    runs, tag = layer_runs(cache, num_blocks)
                except LayoutError as exc:
                    raise ValueError(
                        f"OrbitKVConnector cannot serve this engine's KV cache layout "
                        f"(VLLM_KV_CACHE_LAYOUT / cache layout {_resolved_layout(self._vllm_config)}): "
                        f"KV cache group {index}, layer {name}: {exc}"
                    ) from None
                segments += runs
                if tag not in tags:
                    tags.append(tag)
            self._layouts.append(GroupLayout(coalesce(segments)))
            self.layout_tags.append("+".join(tags))
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp = self._vllm_config.parallel_config.tensor_parallel_size
        self.rank = get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank()
        first: Any = next(iter(kv_caches.values()))
        first = first[0] if isinstance(first, (list, tuple)) else first
        device = str(first.device) if first.is_cuda else "cpu"
        if not first.is_cuda:  # the CPU page kernels compiled now (one to two seconds), not in the first restores
            compiled_checksum()
        self.link = ManagerLink(self.endpoint, f"vllm-worker-{self.rank}-{os.getpid()}", device=device, log=log)
        self.link.connect()  # map (and on CUDA register) the arena now, not in the first load
        if first.is_cuda:
            self._load_stream = torch.cuda.Stream(device=first.device)  # type: ignore[no-untyped-call]
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitkv-load")
        log.info(
            "orbitkv: rank %d of %d, groups %s, page bytes %s, transfers on %s",
            self.rank,
            self.world_size,
            self.groups,
            [layout.page_bytes for layout in self._layouts],
            device,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OrbitKVMetadata)
        if not meta.loads:
            return
        if self._loader is None:
            raise RuntimeError("OrbitKVConnector: a load arrived before register_kv_caches")
        futures: list[Future[bool]] = []
        for job in meta.loads:
            future: Future[bool] = Future()
            self._handoff.enter()  # until the load is done, whatever becomes of its request
            future.add_done_callback(lambda _: self._handoff.exit())
            self._inflight[job.req_id] = future
            futures.append(future)
        try:
            self._loader.submit(self._load_step, list(meta.loads), futures)
        except BaseException:
            for job, future in zip(meta.loads, futures, strict=True):
                del self._inflight[job.req_id]
                future.set_result(False)
            raise

    def _load_step(self, jobs: list[LoadJob], futures: list[Future[bool]]) -> None:
        """Restore a step's loads one after another on the loader thread, each future set as its load is
        done. The leases of the loads that fit half the pool together are asked for first in one exchange
        (``CacheClient.read_recoveries``: one round trip for all of them, not one each)."""
        pending = list(zip(jobs, futures, strict=True))
        try:
            with self.link.session() as connection:  # held until the copies are done: they read its arena
                if connection is None:
                    for job, future in pending:
                        future.set_result(self._load(job, None))
                    return
                ahead = self._lease_ahead(jobs, *connection)
                try:
                    while pending:
                        job, future = pending.pop(0)
                        try:
                            ok = self._load(job, connection, ahead.pop(job.req_id, _ON_ITS_OWN))
                        except Exception as exc:  # this load fails (get_transfer_results logs it), not the rest
                            future.set_exception(exc)
                            continue
                        future.set_result(ok)
                finally:
                    for rec in ahead.values():  # leased for loads that did not get to use them
                        _give_back(connection[0], rec)
        except BaseException as exc:  # every load still pending fails with it
            for _, future in pending:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise

    def _lease_ahead(self, jobs: list[LoadJob], client: CacheClient, arena: Arena) -> dict[str, Recovery | None]:
        """The leases of a step's loads, per request, asked for in one exchange: the loads restored in one
        part, in order, as long as their pages fit half the pool together (leases pin their pages: those on
        SSD are promoted into DRAM). Empty when fewer than two loads qualify (each leases on its own) or when
        the exchange fails (logged; each load then leases on its own)."""
        budget = max(1, int(client.info["arena_size"]) // 2)
        chosen: list[tuple[LoadJob, list[tuple[int, int, int]]]] = []
        used = 0
        for job in jobs:
            parts = self._parts(job, budget)
            size = sum((hi - lo) * self._layouts[g].page_bytes for g, lo, hi in parts[0]) if parts else 0
            if job.refused or len(parts) != 1 or used + size > budget or time.time() > job.deadline:
                continue
            chosen.append((job, parts[0]))
            used += size
        if len(chosen) < 2:
            return {}
        requests = [(job.boundary, self._wanted(job, part)) for job, part in chosen]
        began = time.perf_counter()
        try:
            granted = client.read_recoveries(self.namespaces[self.rank], requests)
        except OrbitKVError as exc:
            self.link.failed(exc, client)
            return {}
        finally:
            self.stats["lease_seconds"] += time.perf_counter() - began
        self.stats["leases_ahead"] += len(chosen)
        return {job.req_id: rec for (job, _), rec in zip(chosen, granted, strict=True)}

    def _load(self, job: LoadJob, connection: tuple[CacheClient, Arena] | None, ahead: Any = _ON_ITS_OWN) -> bool:
        """Restore one request's pages; True only when every required page landed intact. ``ahead``: its
        lease taken with others of its step (a ``Recovery``, or None for a miss), or ``_ON_ITS_OWN``."""
        self.stats["load_switch_interval_us"] = round(sys.getswitchinterval() * 1e6)
        if job.refused:
            log.warning("orbitkv load for %s refused: %s", job.req_id, job.refused)
            return False
        if time.time() > job.deadline:
            log.warning("orbitkv load for %s passed its preparation limit before it started", job.req_id)
            if connection is not None:  # a lease taken ahead is given back unread
                _give_back(connection[0], ahead)
            return False
        if connection is None:
            log.warning("orbitkv load for %s: no cache manager", job.req_id)
            return False
        return self._load_on(job, *connection, ahead)

    def _load_on(self, job: LoadJob, client: CacheClient, arena: Arena, ahead: Any = _ON_ITS_OWN) -> bool:
        """Restore a job in parts of at most half the manager's pool (lease, copy, release, next), so a
        prompt with more pages than the pool holds is restored whole from SSD; any part that misses
        fails the load, which vLLM recomputes. A lease taken ahead (``_lease_ahead``, a job of one part
        under the same budget) serves its one part."""
        parts = self._parts(job, max(1, int(client.info["arena_size"]) // 2))
        if ahead is not _ON_ITS_OWN:
            return self._load_part(job, parts[0], client, arena, ahead)
        if len(parts) > 1:
            log.info("orbitkv load for %s: %d pages in %d parts (pool-sized)", job.req_id, job_pages(job), len(parts))
        return all(self._load_part(job, part, client, arena) for part in parts)

    def _parts(self, job: LoadJob, budget: int) -> list[list[tuple[int, int, int]]]:
        """The job's pages as parts of at most ``budget`` bytes (one page at least): per part, per
        vLLM group, the slice ``[lo, hi)`` of its pages."""
        parts: list[list[tuple[int, int, int]]] = []
        part: list[tuple[int, int, int]] = []
        used = 0
        for g, blocks in enumerate(job.block_ids):
            size = self._layouts[g].page_bytes
            lo = 0
            while lo < len(blocks):
                room = (budget - used) // size
                if room == 0 and part:
                    parts.append(part)
                    part, used = [], 0
                    continue
                take = min(len(blocks) - lo, max(room, 1))
                part.append((g, lo, lo + take))
                used += take * size
                lo += take
        if part:
            parts.append(part)
        return parts

    def _wanted(self, job: LoadJob, part: list[tuple[int, int, int]]) -> list[tuple[int, list[bytes]]]:
        """A part's ranges as ``read_recovery`` takes them: per group, its storage id and page hashes."""
        return [(self.groups[g][0], job.hashes[self.rank][g][lo:hi]) for g, lo, hi in part]

    def _load_part(
        self,
        job: LoadJob,
        part: list[tuple[int, int, int]],
        client: CacheClient,
        arena: Arena,
        ahead: Any = _ON_ITS_OWN,
    ) -> bool:
        """Lease (or take the lease taken ahead: a ``Recovery``, or None for a miss), restore and release one
        part of a load."""
        began = time.perf_counter()
        if ahead is not _ON_ITS_OWN:
            rec, leased = ahead, began
        else:
            try:
                rec = client.read_recovery(self.namespaces[self.rank], job.boundary, self._wanted(job, part))
            except OrbitKVError as exc:
                self.link.failed(exc, client)
                return False
            finally:
                leased = time.perf_counter()
                self.stats["lease_seconds"] += leased - began
        if rec is None:  # evicted since lookup: every group released by the manager, a miss
            log.warning("orbitkv load for %s: pages gone since lookup", job.req_id)
            return False
        loaded = 0
        try:
            with torch.cuda.stream(self._load_stream) if self._load_stream is not None else contextlib.nullcontext():
                for g, lo, hi in part:
                    sid, layout, blocks = self.groups[g][0], self._layouts[g], job.block_ids[g][lo:hi]
                    if time.time() > job.deadline:  # stop new copies; submitted ones finished in wait()
                        log.warning("orbitkv load for %s passed its preparation limit", job.req_id)
                        return False
                    refs = rec.pages[sid]
                    wrong = lease_mismatch(refs, layout, self._tag(g))
                    if wrong is not None or len(refs) != len(blocks):
                        log.warning("orbitkv load for %s refused: %s", job.req_id, wrong or "page count differs")
                        return False
                    fence = restore(arena, layout, leased_pages(blocks, refs))
                    verdicts = fence.wait()
                    if fence.path == "compiled":
                        self.stats["compiled_pages"] += len(verdicts)
                    written = sum(verdicts)
                    self.stats["pages_written"] += written
                    if written != len(refs):
                        log.warning(
                            "orbitkv load for %s: %d of %d pages failed their checksums",
                            job.req_id,
                            len(refs) - written,
                            len(refs),
                        )
                        self.stats["corrupt_pages"] += len(refs) - written
                        return False
                    loaded += len(refs) * layout.page_bytes
        finally:
            self.stats["restore_seconds"] += time.perf_counter() - leased
            try:
                # Not waiting for the reply saves the load a round trip to a manager that sat idle while
                # the pages were copied; the release still runs before this connection's next request.
                client.release(rec.lease, wait=False)
            except OrbitKVError as exc:  # the manager went away: the lease went with its session
                self.link.failed(exc, client)
        self.stats["loaded_bytes"] += loaded
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request is scheduled only after its load reported finished

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        for req_id, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            self.stats["loads"] += 1
            try:
                ok = future.result()
            except Exception:  # a bug in the restore must not take the engine down: recompute
                log.exception("orbitkv load for %s raised", req_id)
                ok = False
            results.finished_recving.add(req_id)
            if not ok:
                self.stats["load_failures"] += 1
                results.failed_recving.add(req_id)
        if results.finished_recving:  # one line per step that finished restores: what reached the KV cache
            log.info("orbitkv connector %s stats: %s", self.role.name, self.stats)
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole pages are saved once the step's forward pass is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OrbitKVMetadata)
        if meta.saves:
            self._save(meta.saves)

    def _save(self, jobs: list[SaveJob]) -> None:
        try:
            with self.link.session() as connection:
                if connection is not None:  # without a cache manager: a future miss, nothing more
                    self._save_on(jobs, *connection)
        except Exception:  # a bug in a save must not take the engine down: the pages stay unsaved
            log.exception("orbitkv saves of %s failed; nothing stored", ", ".join(job.req_id for job in jobs))

    def _save_on(self, jobs: list[SaveJob], client: CacheClient, arena: Arena) -> None:
        """The step's saves in one pipelined exchange (``save_parts``): the parts reserved before the first
        copy (as many as hold half the pool), no commit waited for before the next part. A refused save
        costs its request a future miss, nothing more."""
        namespace, quarter = self.namespaces[self.rank], int(client.info["arena_size"]) // 4
        parts = []
        for job in jobs:
            for g, ((sid, _, _), layout, hashes, blocks) in enumerate(
                zip(self.groups, self._layouts, job.hashes[self.rank], job.block_ids, strict=True)
            ):
                # Parts of at most a quarter of the pool: reserved extents are never evicted, so a job
                # larger than the pool must commit (and let the manager demote) as it goes.
                per_part, tag = max(1, quarter // layout.page_bytes), self._tag(g)
                for first in range(0, len(hashes), per_part):
                    piece = slice(first, first + per_part)
                    parts.append(SavePart(namespace, sid, layout, hashes[piece], blocks[piece], tag, job.req_id))
        if len(jobs) > 1:
            self.stats["saves_together"] += len(jobs)
        try:
            outcomes = save_parts(client, arena, parts)
        except OrbitKVError as exc:  # a lost manager: nothing stays reserved, each a future miss
            self.link.failed(exc, client)
            return
        for part, outcome in zip(parts, outcomes, strict=True):
            if isinstance(outcome, int):
                self.stats["saved_bytes"] += outcome
            elif isinstance(outcome, OrbitKVError):  # a full pool, say
                self.link.failed(outcome, client)
            elif outcome is not None:
                log.error("orbitkv save for %s failed; nothing stored", part.key, exc_info=outcome)

    def shutdown(self) -> None:
        # Submitted restores keep their destinations until they finish: drain before unmapping.
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        log.info("orbitkv connector %s stats: %s", self.role.name, self.stats)
        self.link.close()


def layer_runs(cache: Any, num_blocks: int) -> tuple[list[Any], str]:
    """One layer's KV cache as transfer segments and the tag of its page layout.

    - a list of state tensors (a Mamba layer; ``[blocks, ...]`` each): ``states-...``;
    - ``[2, blocks, ...]`` (vLLM's V1 CPU runner): the K and V halves, ``kv-split``;
    - ``[blocks, ...]`` with any strides, as vLLM's GPU runner (Model Runner V2) views a layer:
      ``[B, H, N, C]``, C holding a token's K and V of one head, in the memory order of the
      resolved KV cache layout. Kernel blocks (``[B * k, ...]``) are grouped back into blocks.
      Each block's bytes move as they lie in memory: ``block-dense-NHC`` (LBNHC, BLNHC: one
      dense range per block), ``block-dense-HNC`` (LBHNC, BLHNC), ``block-runs-H_NC`` (LHBNC,
      BHLNC: one range per head).

    Raises ``LayoutError`` for anything else.
    """
    if isinstance(cache, (list, tuple)):
        states = [block_runs(state) for state in cache]
        return [s for runs in states for s in runs.segments], "states-" + "-".join(r.order for r in states)
    if cache.dim() >= 3 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
        k, v = block_runs(cache[0]), block_runs(cache[1])
        logical = "".join(str(d) for d in range(1, cache.dim() - 1) if cache.shape[d + 1] > 1)
        tag = "kv-split" if k.order == v.order == logical else f"kv-split-{k.order}-{v.order}"
        return [*k.segments, *v.segments], tag
    if cache.dim() < 2 or cache.shape[0] % num_blocks:
        raise LayoutError(
            f"its KV cache has shape {tuple(cache.shape)}; expected [2, {num_blocks}, ...] or [{num_blocks}, ...] "
            "(or whole kernel blocks of them)"
        )
    ratio = cache.shape[0] // num_blocks
    names = "HNC" if cache.dim() == 4 else None
    if ratio > 1:  # kernel blocks: the manager's block b is kernel blocks b*ratio .. b*ratio+ratio-1
        cache = cache.unflatten(0, (num_blocks, ratio))
        names = "K" + (names or "".join(str(d) for d in range(2, cache.dim())))
    runs = block_runs(cache, names)
    return list(runs.segments), ("block-runs-" if "_" in runs.order else "block-dense-") + runs.order


def _cache_key(cache: Any) -> Any:
    """What identifies a layer's KV cache memory (layers sharing a KV cache have the same)."""
    if isinstance(cache, (list, tuple)):
        return tuple(_cache_key(c) for c in cache)
    return (cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()), str(cache.dtype))


def _resolved_layout(vllm_config: VllmConfig) -> str:
    return str(getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default")


def _give_back(client: CacheClient, rec: Any) -> None:
    """Release a lease taken ahead that no restore read (not waited for; a connection gone took it along)."""
    if isinstance(rec, Recovery):
        with contextlib.suppress(OrbitKVError):
            client.release(rec.lease, wait=False)


def job_pages(job: LoadJob) -> int:
    return sum(len(blocks) for blocks in job.block_ids)


def scheduler_state(connector: OrbitKVConnector) -> dict[str, int]:
    """How many requests a scheduler-side connector still tracks, by kind (all zero when idle).

    A function, not a method: every public method of the connector is an override the API canary
    checks against vLLM's base classes.
    """
    return {
        "matches": len(connector._matches),
        "queued_loads": len(connector._loads),
        "loading": len(connector._loading),
        "tracked": len(connector._tracked),
        "requests": len(connector._requests),
        "hashed": len(connector._hashed),
        "failed": len(connector._failed),
    }
