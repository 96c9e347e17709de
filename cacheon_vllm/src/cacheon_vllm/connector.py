"""OrbitKVConnector: vLLM's KV connector API over the OrbitKV cache manager.

Enable with ``--kv-transfer-config '{"kv_connector": "OrbitKVConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"endpoint": "unix:///tmp/orbitkv.sock"}}'`` once ``cacheon-vllm`` is
installed (its ``vllm.general_plugins`` entry point registers the name).

This release serves full-attention models (one KV cache group) with synchronous loads:

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
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class SaveJob:
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]


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


class OrbitKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        endpoint = extra.get("endpoint") or os.environ.get("ORBITKV_ENDPOINT")
        if not endpoint:
            raise ValueError("OrbitKVConnector needs kv_connector_extra_config.endpoint (or ORBITKV_ENDPOINT)")
        self.endpoint: str = str(endpoint)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"OrbitKVConnector serves one full-attention KV cache group; this model has {len(groups)} "
                "(hybrid models are not supported by this release)"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.namespace = model_namespace(vllm_config, self.block_size)
        self.contract = RecoveryContract.compile(self.namespace, self.block_size, [(0, "attention", 0)])
        self._client: CacheClient | None = None
        # scheduler side
        self._pending: dict[str, tuple[int, int, list[bytes]]] = {}  # req -> (start, boundary, hashes)
        self._loads: dict[str, LoadJob] = {}
        # worker side
        self._arena: Arena | None = None
        self._layout: GroupLayout | None = None
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
        hashes = page_hashes(self.namespace, tokens, self.block_size)
        if not hashes:
            return 0, False
        try:
            found = self.client.lookup(self.namespace, {0: hashes})[0]
        except OrbitKVError as exc:  # the manager is unreachable: a miss, never a failure of the request
            log.warning("orbitkv lookup failed, treating as a miss: %s", exc)
            return 0, False
        present = sorted(found["dram"] + found["ssd"])
        evidence = {0: [(i + 1) * self.block_size for i in present]}
        span_end = len(hashes) * self.block_size
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
        block_ids = blocks.get_block_ids()[0]
        first, last = start // self.block_size, boundary // self.block_size
        self._loads[request.request_id] = LoadJob(
            request.request_id, boundary, hashes[first:last], list(block_ids[first:last])
        )
        self.stats["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OrbitKVMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        loading = {job.req_id for job in meta.loads}
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            done = new.num_computed_tokens + scheduled
            if new.req_id in loading or done < len(tokens):
                continue  # saves cover prompts whose prefill completes in this step
            hashes = page_hashes(self.namespace, tokens, self.block_size)
            first = new.num_computed_tokens // self.block_size
            block_ids = new.block_ids[0]
            if len(hashes) > first:
                meta.saves.append(SaveJob(new.req_id, hashes[first:], list(block_ids[first : len(hashes)])))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        segments = []
        for name, cache in kv_caches.items():
            if cache.dim() >= 3 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
                segments += vllm_layer(cache)  # [2, blocks, ...]: K and V halves
            elif cache.shape[0] == num_blocks:
                segments.append(segment_view(cache))  # [blocks, ...]: one chunk per block
            else:
                raise ValueError(
                    f"OrbitKVConnector: layer {name} has KV cache shape {tuple(cache.shape)}; expected "
                    f"[2, {num_blocks}, ...] or [{num_blocks}, ...]"
                )
        self._layout = GroupLayout(segments)
        device = "cuda" if segments and segments[0].is_cuda else "cpu"
        self._arena = Arena(self.client.arena, device=device)
        log.info(
            "orbitkv: %d segments, %d bytes per page, transfers on %s", len(segments), self._layout.page_bytes, device
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OrbitKVMetadata)
        for job in meta.loads:
            self._load(job)

    def _load(self, job: LoadJob) -> None:
        assert self._arena is not None and self._layout is not None
        try:
            rec = self.client.read_recovery(self.namespace, job.boundary, [(0, job.hashes)])
        except OrbitKVError as exc:
            log.warning("orbitkv load for %s failed: %s", job.req_id, exc)
            rec = None
        if rec is None:  # evicted since lookup, or the manager went away: recompute these blocks
            self._load_errors.update(job.block_ids)
            self.stats["load_failures"] += 1
            return
        try:
            plans = [PagePlan(b, ref.offset, ref.checksum) for b, ref in zip(job.block_ids, rec.pages[0], strict=True)]
            verdicts = restore(self._arena, self._layout, plans).wait()
            for block, good in zip(job.block_ids, verdicts, strict=True):
                if not good:
                    self._load_errors.add(block)
            self.stats["loaded_bytes"] += sum(verdicts) * self._layout.page_bytes
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
        assert self._arena is not None and self._layout is not None
        # Batches of at most a quarter of the pool: reserved extents are never evicted, so a job
        # larger than the pool must commit (and let the manager demote) as it goes.
        per_batch = max(1, self.client.info["arena_size"] // 4 // self._layout.page_bytes)
        for first in range(0, len(job.hashes), per_batch):
            if not self._save_batch(
                job.req_id, job.hashes[first : first + per_batch], job.block_ids[first : first + per_batch]
            ):
                return

    def _save_batch(self, req_id: str, hashes: list[bytes], block_ids: list[int]) -> bool:
        assert self._arena is not None and self._layout is not None
        layout = self._layout
        try:
            reservation, offsets = self.client.reserve(self.namespace, 0, [(h, layout.page_bytes) for h in hashes])
        except OrbitKVError as exc:  # a full pool or a missing manager costs a future miss, nothing more
            log.warning("orbitkv save for %s skipped: %s", req_id, exc)
            return False
        plans = [PagePlan(b, o) for b, o in zip(block_ids, offsets, strict=True) if o is not None]
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
