"""OrbitKVConnector: vLLM's KV connector API over the OrbitKV cache manager.

Enable with ``--kv-transfer-config '{"kv_connector": "OrbitKVConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"endpoint": "unix:///tmp/orbitkv.sock"}}'`` once ``cacheon-vllm`` is
installed (its ``vllm.general_plugins`` entry point registers the name).

It implements ``SupportsHMA``, so vLLM keeps its hybrid allocator on: every full-attention KV cache
group is a prefix group of the recovery contract (storage groups 0..), every sliding-window group a
window of W-1 past tokens (vLLM counts the next query token in its window), rounded up to pages.
Mamba groups are rejected at startup. Loads are synchronous:

- scheduler side: metadata-only ``lookup`` of the prompt's full pages, the legal boundary from the
  recovery contract, clamped so the final prompt token is always computed, then a load job for the
  allocated blocks; a save job for the pages a new request's prefill completes;
- worker side: ``read_recovery`` leases the pages, the transfer path restores them into the
  request's blocks with checksums verified in the copy, and the lease is released; pages that fail
  (evicted since lookup, bad checksum) are reported through vLLM's load-error path and recomputed.
  Saves reserve arena extents, gather the blocks into them and commit with the copy's checksums.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from cacheon_orbitkv.client import CacheClient, make_namespace, page_hashes
from cacheon_orbitkv.contract import RecoveryContract
from cacheon_orbitkv.transfer import Arena, GroupLayout, PagePlan, restore, save, segment_view, vllm_layer
from cacheon_orbitkv.wire import OrbitKVError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class LoadJob:
    req_id: str
    boundary: int
    # per vLLM KV cache group: the page hashes to lease and the blocks they restore into
    hashes: list[list[bytes]]
    block_ids: list[list[int]]


@dataclass
class SaveJob:
    req_id: str
    hashes: list[list[bytes]]
    block_ids: list[list[int]]


@dataclass
class OrbitKVMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def model_namespace(vllm_config: VllmConfig, block_size: int, rank: int = 0) -> str:
    """The cache identity: model (path and revision), dtype, layout, page size and rank."""
    model = vllm_config.model_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
    fingerprint = (
        extra.get("model_fingerprint")
        or hashlib.sha256(f"{model.model}@{getattr(model, 'revision', None)}".encode()).hexdigest()[:32]
    )
    return make_namespace(fingerprint, str(model.dtype).removeprefix("torch."), "vllm", block_size, rank)


def storage_groups(kv_cache_config: KVCacheConfig, block_size: int) -> list[tuple[int, str, int]]:
    """The contract groups of vLLM's KV cache groups, in vLLM's order; unsupported ones are refused.

    Full-attention groups become prefix groups and take the first storage ids (the contract's group
    0 is a prefix); a sliding window of W tokens needs W-1 past tokens, at least one.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    full = [i for i, spec in enumerate(specs) if isinstance(spec, FullAttentionSpec) and not spec.sliding_window]
    if not full:
        raise ValueError("OrbitKVConnector needs at least one full-attention KV cache group")
    order = full + [i for i in range(len(specs)) if i not in full]
    storage = {vllm_index: sid for sid, vllm_index in enumerate(order)}
    groups = []
    for i, spec in enumerate(specs):
        if getattr(spec, "block_size", block_size) != block_size:
            raise ValueError(
                f"OrbitKVConnector: KV cache group {i} has block size {spec.block_size}, "
                f"not {block_size}; groups must share one logical block size"
            )
        if i in full:
            groups.append((storage[i], "attention", 0))
        elif isinstance(spec, SlidingWindowSpec):
            groups.append((storage[i], "window", max(1, int(spec.sliding_window) - 1)))
        else:
            raise ValueError(
                f"OrbitKVConnector: KV cache group {i} is {type(spec).__name__}, which this "
                "release does not restore (full attention and sliding windows are supported)"
            )
    return groups


class OrbitKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        endpoint = extra.get("endpoint") or os.environ.get("ORBITKV_ENDPOINT")
        if not endpoint:
            raise ValueError("OrbitKVConnector needs kv_connector_extra_config.endpoint (or ORBITKV_ENDPOINT)")
        self.endpoint: str = str(endpoint)
        self.block_size = vllm_config.cache_config.block_size
        self.namespace = model_namespace(vllm_config, self.block_size)
        self.groups = storage_groups(kv_cache_config, self.block_size)  # (storage id, kind, window) per vLLM group
        self.contract = RecoveryContract.compile(self.namespace, self.block_size, self.groups)
        self._client: CacheClient | None = None
        # scheduler side
        self._pending: dict[str, tuple[int, int, list[list[bytes]]]] = {}  # req -> (start, boundary, hashes)
        self._loads: dict[str, LoadJob] = {}
        # worker side
        self._arena: Arena | None = None
        self._layouts: list[GroupLayout] = []
        self._load_errors: set[int] = set()
        self.stats = {"hit_tokens": 0, "loaded_bytes": 0, "saved_bytes": 0, "load_failures": 0}

    @property
    def client(self) -> CacheClient:
        if self._client is None:
            self._client = CacheClient(self.endpoint, name=f"vllm-{self.role.name.lower()}-{os.getpid()}")
        return self._client

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        hashes = self._hashes(tokens)
        if not hashes[0]:
            return 0, False
        try:
            found = self.client.lookup(
                self.namespace, {sid: h for (sid, _, _), h in zip(self.groups, hashes, strict=True)}
            )
        except OrbitKVError as exc:  # the manager is unreachable: a miss, never a failure of the request
            log.warning("orbitkv lookup failed, treating as a miss: %s", exc)
            return 0, False
        evidence = {
            sid: [(i + 1) * self.block_size for i in sorted(found[sid]["dram"] + found[sid]["ssd"])]
            for sid, _, _ in self.groups
        }
        span_end = len(hashes[0]) * self.block_size
        boundaries = self.contract.restorable_boundaries(self.namespace, 0, span_end, evidence)
        # vLLM computes the final prompt token itself (its logits are needed): never restore past it.
        boundary = self.contract.select_boundary(boundaries, len(tokens) - 1)
        if boundary is None or boundary <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = (num_computed_tokens, boundary, hashes)
        return boundary - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pending = self._pending.pop(request.request_id, None)
        if num_external_tokens == 0 or pending is None:
            return
        start, boundary, hashes = pending
        job = LoadJob(request.request_id, boundary, [], [])
        ranges = self.contract.required_ranges(self.namespace, start, boundary)
        by_sid = {sid: (lo, hi) for sid, lo, hi in ranges}
        for (sid, _, _), group_hashes, group_blocks in zip(self.groups, hashes, blocks.get_block_ids(), strict=True):
            lo, hi = by_sid[sid]
            first, last = lo // self.block_size, hi // self.block_size
            job.hashes.append(group_hashes[first:last])
            job.block_ids.append(list(group_blocks[first:last]))
        self._loads[request.request_id] = job
        self.stats["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OrbitKVMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        loading = {job.req_id for job in meta.loads}
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if new.req_id in loading or new.num_computed_tokens + scheduled < len(tokens):
                continue  # saves cover prompts whose prefill completes in this step
            hashes = self._hashes(tokens)
            end = len(hashes[0]) * self.block_size
            if end <= new.num_computed_tokens:
                continue
            # What a later restore at the prompt's last page needs: every prefix page, and only the
            # trailing window of a window group (vLLM has already released its earlier blocks).
            by_sid = {
                sid: (lo, hi)
                for sid, lo, hi in self.contract.required_ranges(self.namespace, new.num_computed_tokens, end)
            }
            job = SaveJob(new.req_id, [], [])
            for (sid, _, _), group_hashes, group_blocks in zip(self.groups, hashes, new.block_ids, strict=True):
                lo, hi = by_sid[sid]
                first, last = lo // self.block_size, hi // self.block_size
                job.hashes.append(group_hashes[first:last])
                job.block_ids.append(list(group_blocks[first:last]))
            meta.saves.append(job)
        return meta

    def _hashes(self, tokens: list[int]) -> list[list[bytes]]:
        return [page_hashes(self.namespace, tokens, self.block_size, sid) for sid, _, _ in self.groups]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete within the step that finishes the prefill: nothing holds blocks past the request.
        self._pending.pop(request.request_id, None)
        return False, None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        self._layouts = []
        for group in self._kv_cache_config.kv_cache_groups:
            segments = []
            for name in group.layer_names:
                cache = kv_caches[name]
                if cache.dim() >= 3 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
                    segments += vllm_layer(cache)  # [2, blocks, ...]: K and V halves
                elif cache.shape[0] == num_blocks:
                    segments.append(segment_view(cache))  # [blocks, ...]: one chunk per block
                else:
                    raise ValueError(
                        f"OrbitKVConnector: layer {name} has KV cache shape {tuple(cache.shape)}; expected "
                        f"[2, {num_blocks}, ...] or [{num_blocks}, ...]"
                    )
            self._layouts.append(GroupLayout(segments))
        device = "cuda" if next(iter(kv_caches.values())).is_cuda else "cpu"
        self._arena = Arena(self.client.arena, device=device)
        log.info(
            "orbitkv: groups %s, page bytes %s, transfers on %s",
            self.groups,
            [layout.page_bytes for layout in self._layouts],
            device,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OrbitKVMetadata)
        for job in meta.loads:
            self._load(job)

    def _load(self, job: LoadJob) -> None:
        assert self._arena is not None
        wanted = [(sid, h) for (sid, _, _), h in zip(self.groups, job.hashes, strict=True) if h]
        try:
            rec = self.client.read_recovery(self.namespace, job.boundary, wanted)
        except OrbitKVError as exc:
            log.warning("orbitkv load for %s failed: %s", job.req_id, exc)
            rec = None
        if rec is None:  # evicted since lookup, or the manager went away: recompute these blocks
            for blocks in job.block_ids:
                self._load_errors.update(blocks)
            self.stats["load_failures"] += 1
            return
        try:
            for (sid, _, _), layout, blocks in zip(self.groups, self._layouts, job.block_ids, strict=True):
                if not blocks:
                    continue
                plans = [PagePlan(b, r.offset, r.checksum) for b, r in zip(blocks, rec.pages[sid], strict=True)]
                verdicts = restore(self._arena, layout, plans).wait()
                self._load_errors.update(b for b, good in zip(blocks, verdicts, strict=True) if not good)
                self.stats["loaded_bytes"] += sum(verdicts) * layout.page_bytes
        finally:
            self.client.release(rec.lease)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole pages are saved once the step's forward pass is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OrbitKVMetadata)
        for job in meta.saves:
            self._save(job)

    def _save(self, job: SaveJob) -> None:
        for (sid, _, _), layout, hashes, blocks in zip(
            self.groups, self._layouts, job.hashes, job.block_ids, strict=True
        ):
            # Batches of at most a quarter of the pool: reserved extents are never evicted, so a job
            # larger than the pool must commit (and let the manager demote) as it goes.
            per_batch = max(1, self.client.info["arena_size"] // 4 // layout.page_bytes)
            for first in range(0, len(hashes), per_batch):
                batch = (hashes[first : first + per_batch], blocks[first : first + per_batch])
                if not self._save_batch(job.req_id, sid, layout, *batch):
                    return

    def _save_batch(self, req_id: str, sid: int, layout: GroupLayout, hashes: list[bytes], blocks: list[int]) -> bool:
        assert self._arena is not None
        try:
            reservation, offsets = self.client.reserve(self.namespace, sid, [(h, layout.page_bytes) for h in hashes])
        except OrbitKVError as exc:  # a full pool or a missing manager costs a future miss, nothing more
            log.warning("orbitkv save for %s skipped: %s", req_id, exc)
            return False
        plans = [PagePlan(b, o) for b, o in zip(blocks, offsets, strict=True) if o is not None]
        try:
            sums = save(self._arena, layout, plans).checksums() if plans else []
        except BaseException:
            self.client.abort(reservation)
            raise
        it = iter(sums)
        self.stats["saved_bytes"] += self.client.commit(reservation, [None if o is None else next(it) for o in offsets])
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        log.info("orbitkv connector %s stats: %s", self.role.name, self.stats)
        if self._arena is not None:
            self._arena.close()
        if self._client is not None:
            self._client.close()
