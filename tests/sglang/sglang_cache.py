"""SGLang 0.5.23's real device pools, UnifiedRadixCache and external-linker wrapper on the CPU.

Builders make the pools SGLang's model runner makes for a full-attention, a sliding-window and a
Mamba hybrid model, attach a linker the way ``registry.create_unified_radix_cache`` does, and
``Scheduler`` drives one request through the scheduler's own pieces: ``Req.init_next_round_input``
(the match, with SGLang's N-1 limit), ``PrefillAdder.add_one_req`` (``init_load_back`` -> the
linker's ``load``), ``ScheduleBatch.init_new`` + ``prepare_for_extend``, ``ready_to_load_host_cache``,
``finish_external_linker_loads``, ``release_kv_cache`` (insert -> write-through -> ``offload``) and
``check_hicache_events``; ``generate`` goes on decoding through ``ScheduleBatch.prepare_for_decode``
and the decode result's finish (``release_kv_cache`` with the checkpoint, as SGLang's decode result
processor does). Only the model forward is replaced: it waits on the layer counter as SGLang's
layers do, records whether the prefix it reads holds what an earlier forward wrote, writes
deterministic values for its own tokens and picks each next token from the last one (``next_token``).
"""

from __future__ import annotations

import os
import time
from array import array
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool, MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
DEVICE = "cpu"
DTYPE = torch.bfloat16


def server_args(
    page_size: int,
    endpoint: str,
    model_path: str = "dummy",
    extra: dict | None = None,
    world_rank: int | None = None,
    **overrides: Any,
) -> ServerArgs:
    """The scheduler's published ServerArgs, selecting OrbitKVLinker through the dynamic backend
    (``extra``: more ``linker_extra_config`` keys; ``world_rank``: this process's rank, published
    as SGLang's launcher publishes a scheduler's placement)."""
    args = ServerArgs(
        model_path="dummy",
        page_size=page_size,
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_backend="dynamic",
        unified_cache_external_linker_config={
            "linker": "OrbitKVLinker",
            "linker_module_path": "cacheon_sglang.linker",
            "linker_extra_config": {"endpoint": endpoint, **(extra or {})},
        },
        **overrides,
    )
    if world_rank is None:
        set_global_server_args_for_scheduler(args)
    else:
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank))
    return args if model_path == "dummy" else _ModelAt(args, model_path)  # type: ignore[return-value]


class _ModelAt:
    """The published ServerArgs, seen with another ``model_path``: ServerArgs resolves a real model
    folder's device when published, which a CPU-only host lacks, and is read-only after that. The
    linker reads only the path (and revision) of it."""

    def __init__(self, args: ServerArgs, model_path: str) -> None:
        self._args = args
        self.model_path = model_path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def join_tensor_parallel(endpoint: str, page_size: int, rank: int, world: int, init_method: str) -> None:
    """Join a ``world``-rank tensor-parallel group over gloo the way SGLang's bootstrap does on a host
    without NCCL (``init_distributed_environment`` then ``initialize_model_parallel``)."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        set_custom_all_reduce,
    )

    os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"  # no NCCL here: SGLang uses gloo alone
    server_args(page_size, endpoint, world_rank=rank, tp_size=world)
    set_custom_all_reduce(False)
    init_distributed_environment(
        backend="gloo", world_size=world, rank=rank, local_rank=rank, distributed_init_method=init_method, timeout=60
    )
    initialize_model_parallel()


def _parallel_options() -> dict:
    """The cache groups SGLang's KV cache builder passes (``kv_cache_builder``), from its parallel state."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    parallel = get_parallel()
    return dict(
        tp_cache_group=get_dp_tp_group().cpu_group,
        attn_cp_cache_group=parallel.attn_cp_group.cpu_group,
        attn_tp_cache_group=parallel.attn_tp_group.cpu_group,
        pp_cache_group=parallel.pp_group.cpu_group,
    )


class _TpWorker:
    """What ``create_unified_radix_cache`` touches on the TP worker (no model runner on CPU)."""

    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(forward_stream=None)
        self.counter = None

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


def _fixture(
    kind: str,
    args: ServerArgs,
    kvcache: Any,
    allocator: Any,
    r2t: Any,
    components: tuple[ComponentType, ...],
    num_layers: int,
    mamba_layer_ids: tuple[int, ...] = (),
    **options: Any,
) -> dict:
    """The cache over these pools, built by SGLang's registry (which builds the linker), as a dict."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache

    tp_size, tp_rank, tp_group = 1, 0, None
    if options.get("tp_cache_group") is not None:
        tp_group = options["tp_cache_group"]
        tp_size, tp_rank = torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=r2t,
        token_to_kv_pool_allocator=allocator,
        page_size=args.page_size,
        tree_components=components,
        **options,
    )
    ctx = TreeCacheBuildContext(
        server_args=args,
        params=params,
        is_hybrid_swa=ComponentType.SWA in components,
        is_hybrid_ssm=ComponentType.MAMBA in components,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=_TpWorker(),
        model_config=None,
        tp_size=tp_size,
        tp_rank=tp_rank,
        tp_group=tp_group,
    )
    cache = create_unified_radix_cache(ctx)
    assert isinstance(cache, UnifiedRadixCache)
    fx = dict(kind=kind, kvcache=kvcache, allocator=allocator, r2t=r2t, params=params, cache=cache)
    fx.update(linker=cache.linker.cache_linker, num_layers=num_layers, mamba_layer_ids=list(mamba_layer_ids))
    if mamba_layer_ids:
        fx["mamba_pool"] = r2t.mamba_pool
    return fx


def build_mha(
    endpoint: str,
    page_size: int = 4,
    layers: int = 2,
    size: int = 512,
    max_context: int = 1024,
    dtype: torch.dtype = DTYPE,
    heads: int = 2,
    head_dim: int = 8,
    model_path: str = "dummy",
    extra: dict | None = None,
    tp: tuple[int, int] | None = None,
) -> dict:
    """A full-attention model's pools (``dtype`` the KV dtype; SGLANG_USE_HND_KVCACHE picks HND;
    ``tp``: (rank, size) in the tensor-parallel group ``join_tensor_parallel`` joined, each rank
    holding its shard of the heads)."""
    parallel: dict = {}
    if tp is not None:
        parallel = _parallel_options()
        args = server_args(page_size, endpoint, extra=extra, world_rank=tp[0], tp_size=tp[1])
    else:
        args = server_args(page_size, endpoint, model_path=model_path, extra=extra)
    kvcache = MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device=DEVICE,
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype, DEVICE, kvcache, need_sort=False)
    r2t = ReqToTokenPool(size=8, max_context_len=max_context, device=DEVICE, enable_memory_saver=False)
    return _fixture("mha", args, kvcache, allocator, r2t, (ComponentType.FULL,), layers, **parallel)


def build_swa(endpoint: str, page_size: int = 4, window: int = 8, size: int = 256, size_swa: int = 128) -> dict:
    args = server_args(page_size, endpoint)
    r2t = ReqToTokenPool(size=8, max_context_len=256, device=DEVICE, enable_memory_saver=False)
    kvcache = SWAKVPool(
        size=size,
        size_swa=size_swa,
        page_size=page_size,
        dtype=DTYPE,
        head_num=2,
        head_dim=8,
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1],
        device=DEVICE,
    )
    allocator = SWATokenToKVPoolAllocator(
        size, size_swa, page_size=page_size, dtype=DTYPE, device=DEVICE, kvcache=kvcache, need_sort=False,
        req_to_token_pool=r2t,
    )  # fmt: skip
    fx = _fixture(
        "swa", args, kvcache, allocator, r2t, (ComponentType.FULL, ComponentType.SWA), 3, sliding_window_size=window
    )
    # Two SWA pages held aside: SWA slot ids then differ from full ones, as they do in a busy server.
    allocator.swa_attn_allocator.alloc(2 * page_size)
    return fx


def build_mamba(endpoint: str, page_size: int = 4, size: int = 256) -> dict:
    """Full attention (layer 1) and Mamba2 layers (0, 2); page > 1 uses SGLang's extra-buffer strategy."""
    from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs

    extra = page_size > 1
    args = server_args(page_size, endpoint, **({"mamba_radix_cache_strategy": "extra_buffer"} if extra else {}))
    args._mamba_cache_chunk_size = max(CHUNK_SIZE, page_size)
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16, state_size=8, conv_kernel=4
        )
        cache_params = Mamba2CacheParams(shape=shape, layers=[0, 2])
    r2t = HybridReqToTokenPool(
        size=8,
        mamba_size=16,
        mamba_spec_state_size=8,
        max_context_len=256,
        device=DEVICE,
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=[0, 2],
        enable_mamba_extra_buffer=extra,
        speculative_num_draft_tokens=None,
        enable_overlap_schedule=False,
    )
    kvcache = HybridLinearKVPool(
        size=size,
        dtype=DTYPE,
        page_size=page_size,
        head_num=2,
        head_dim=8,
        full_attention_layer_ids=[1],
        device=DEVICE,
        mamba_pool=r2t.mamba_pool,
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(size, page_size, DTYPE, DEVICE, kvcache, need_sort=False)
    components = (ComponentType.FULL, ComponentType.MAMBA)
    return _fixture("mamba", args, kvcache, allocator, r2t, components, 3, (0, 2), enable_mamba_extra_buffer=extra)


def storage_keys(ids: list[int], page: int) -> list[str]:
    """SGLang's per-page storage hashes of ``ids`` (whole pages), as its tree computes them."""
    return get_storage_hash_str(RadixKey(array("q", ids)), None, page_size=page)


def kv_value(token: int, pos: int, layer: int, which: int) -> float:
    return float((token * 7 + pos * 3 + layer * 11 + which * 5) % 97)


def mamba_value(seqlen: int, layer: int, which: int) -> float:
    return float((seqlen * 13 + layer * 5 + which) % 89)


def next_token(token: int, pos: int) -> int:
    """The fake model's greedy choice after ``token`` at position ``pos``."""
    return 10 + (token * 31 + pos * 17) % 29000


class Scheduler:
    """One prefill step at a time, through SGLang's own scheduling code."""

    def __init__(self, fx: dict, salt: int = 0) -> None:
        """``salt`` shifts every KV value the forward writes: another model's weights, same tokens."""
        self.fx = fx
        self.salt = salt
        self.cache: UnifiedRadixCache = fx["cache"]
        self.kvcache = fx["kvcache"]
        self.r2t = fx["r2t"]
        self.allocator = fx["allocator"]
        self.page_size = fx["params"].page_size
        self.model_config = SimpleNamespace(
            vocab_size=32000, is_encoder_decoder=False, hf_text_config=SimpleNamespace()
        )
        self.checks: dict[tuple[str, int], bool] = {}

    def new_req(self, rid: str, ids: list[int], max_new_tokens: int = 1) -> Req:
        sampling = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        sampling.normalize(None)
        return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids), sampling_params=sampling)

    def match(self, req: Req) -> None:
        self.cache.check_hicache_events()
        req.init_next_round_input(self.cache)

    def admit(self, req: Req) -> PrefillAdder:
        adder = PrefillAdder(self.page_size, self.cache, self.allocator, None, 0.5, 4096, None)
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        assert adder.can_run_list == [req]
        return adder

    def schedule(self, req: Req, after_match: Any = None, after_admit: Any = None) -> ScheduleBatch:
        self.match(req)
        if after_match is not None:  # a test's step between the lookup and the load
            after_match(req)
        adder = self.admit(req)
        if after_admit is not None:  # a test's step between the load and the batch's loading start
            after_admit(req)
        batch = ScheduleBatch.init_new(
            adder.can_run_list, self.r2t, self.allocator, self.cache, self.model_config, False,
            SpeculativeAlgorithm.NONE,
            chunked_req=adder.new_chunked_req,
        )  # fmt: skip
        batch.hicache_consumer_index = self.cache.ready_to_load_host_cache()
        batch.prepare_for_extend()
        return batch

    def forward(self, batch: ScheduleBatch) -> None:
        """The model's layers: wait for the layer's restore, check the prefix read, write the tail."""
        counter = self.cache.linker.layer_done_counter
        counter.set_consumer(batch.hicache_consumer_index)
        loc = batch.out_cache_loc
        tokens, positions = [], []
        for req in batch.reqs:
            fill = req.full_untruncated_fill_ids
            tokens += list(fill[req.prefix_len : req.extend_end])
            positions += list(range(req.prefix_len, req.extend_end))
        self.checks = {}
        for layer in range(self.fx["num_layers"]):
            if layer in self.fx["mamba_layer_ids"]:
                self.r2t.mamba2_layer_cache(layer)  # waits for this layer like a Mamba layer
                pool = self.fx["mamba_pool"]
                ml = self.r2t.mamba_map[layer]
                for i, req in enumerate(batch.reqs):
                    slot = int(req.kv.mamba_pool_idx)
                    if req.prefix_len > 0:
                        want = torch.tensor(mamba_value(req.prefix_len, layer, 0))
                        got = pool.mamba_cache.temporal[ml, slot]
                        self.checks[("mamba", layer)] = bool((got == want.to(got.dtype)).all())
                    self._write_mamba(pool, ml, [slot], req.extend_end, layer)
                    mask = getattr(batch, "mamba_prefill_track_mask_cpu", None)
                    if mask and mask[i]:  # the extra buffer's snapshot at the tracked boundary
                        self._write_mamba(
                            pool, ml, [int(batch.mamba_track_indices[i])], req.kv.mamba_last_track_seqlen, layer
                        )
                continue
            self.kvcache.get_key_buffer(layer)  # waits for this layer like an attention layer
            for req in batch.reqs:
                if req.prefix_len > 0:
                    self.checks[("attn", layer)] = self._check_prefix(req, layer)
            for i, (tok, pos) in enumerate(zip(tokens, positions, strict=True)):
                self._write_kv(layer, int(loc[i]), tok, pos)

    def _pool_for(self, layer: int) -> tuple[Any, int, bool]:
        kv = self.kvcache
        if isinstance(kv, SWAKVPool):
            pool_layer, is_swa = kv.layers_mapping[layer]
            return (kv.swa_kv_pool if is_swa else kv.full_kv_pool), pool_layer, is_swa
        if isinstance(kv, HybridLinearKVPool):
            return kv.full_kv_pool, kv.full_attention_layer_id_mapping[layer], False
        return kv, layer, False

    def _check_prefix(self, req: Req, layer: int) -> bool:
        pool, pool_layer, is_swa = self._pool_for(layer)
        n = req.prefix_len
        full_slots = self.r2t.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
        first = 0
        if is_swa:
            first = max(0, n - self.fx["params"].sliding_window_size)
            slots = self.kvcache.translate_loc_from_full_to_swa(full_slots[first:])
        else:
            slots = full_slots
        fill = req.full_untruncated_fill_ids
        want = torch.tensor([kv_value(fill[p], p, layer, 0) + self.salt for p in range(first, n)])
        want = want.to(pool.k_buffer[0].dtype)
        return bool((pool.k_buffer[pool_layer][slots] == want[:, None, None]).all())

    def _write_kv(self, layer: int, slot: int, tok: int, pos: int) -> None:
        pool, pool_layer, is_swa = self._pool_for(layer)
        if is_swa:
            slot = int(self.kvcache.translate_loc_from_full_to_swa(torch.tensor([slot]))[0])
        pool.k_buffer[pool_layer][slot].fill_(kv_value(tok, pos, layer, 0) + self.salt)
        pool.v_buffer[pool_layer][slot].fill_(kv_value(tok, pos, layer, 1) + self.salt)

    @staticmethod
    def _write_mamba(pool: Any, mamba_layer: int, slots: list[int], seqlen: int, layer: int) -> None:
        cache = pool.mamba_cache
        for s in slots:
            cache.temporal[mamba_layer, s].fill_(mamba_value(seqlen, layer, 0))
            for i, conv in enumerate(cache.conv):
                conv[mamba_layer, s].fill_(mamba_value(seqlen, layer, 1 + i))

    def finish(self, batch: ScheduleBatch) -> list[Req]:
        """After the forward: the scheduler's load verdict, then the insert (which offloads)."""
        failed = self.cache.finish_external_linker_loads(batch.reqs)
        for req in batch.reqs:
            req.output_ids.append(7)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.cache, checkpoint=True)
            else:
                checkpoint_kv_cache(req, self.cache)
        return failed

    def settle(self, timeout: float = 30.0) -> None:
        """Let the scheduler's per-step event check commit every offload in flight."""
        deadline = time.monotonic() + timeout
        wrapper = self.cache.linker
        while wrapper.pending_offloads:
            self.cache.check_hicache_events()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(wrapper.pending_offloads)} offloads still pending")
            time.sleep(0.01)

    def flush(self) -> None:
        """The scheduler's flush_cache: HBM forgets everything (the store does not)."""
        self.settle()
        self.cache.reset()
        self.r2t.clear()
        self.allocator.clear()
        self.r2t.reset_aux_cache_allocator()

    def forward_decode(self, batch: ScheduleBatch) -> None:
        """A decode step's layers: each request's last output token, at its position, into its slot."""
        counter = self.cache.linker.layer_done_counter
        counter.set_consumer(-1)  # a decode batch loads nothing
        for layer in range(self.fx["num_layers"]):
            self.kvcache.get_key_buffer(layer)
            for i, req in enumerate(batch.reqs):
                pos = len(req.origin_input_ids) + len(req.output_ids) - 1
                self._write_kv(layer, int(batch.out_cache_loc[i]), int(req.output_ids[-1]), pos)

    def sample(self, batch: ScheduleBatch) -> None:
        """The result processor's part: append each next token, release a finished request (the
        checkpoint inserts prompt and generated tokens), checkpoint a prefilled one that goes on."""
        prefill = batch.forward_mode.is_extend()
        for req in batch.reqs:
            fill = req.full_untruncated_fill_ids
            last, pos = (
                (int(fill[req.extend_end - 1]), req.extend_end - 1)
                if prefill
                else (int(req.output_ids[-1]), len(req.origin_input_ids) + len(req.output_ids) - 1)
            )
            req.output_ids.append(next_token(last, pos))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.cache, checkpoint=True)
            elif prefill:
                checkpoint_kv_cache(req, self.cache)

    def generate(
        self,
        rid: str,
        ids: list[int],
        max_new_tokens: int,
        after_match: Any = None,
        after_admit: Any = None,
        after_step: Any = None,
    ) -> dict:
        """A request prefilled (restoring what the store holds) and decoded to ``max_new_tokens``
        (``after_step(req)`` after each step's result, the prefill's included)."""
        req = self.new_req(rid, ids, max_new_tokens)
        batch = self.schedule(req, after_match, after_admit)
        info = {"req": req, "prefix_len": req.prefix_len, "host_loaded": req.host_loaded_length}
        self.forward(batch)
        info["failed"] = self.cache.finish_external_linker_loads(batch.reqs)
        info["checks"] = dict(self.checks)
        self.sample(batch)
        while True:
            if after_step is not None:
                after_step(req)
            if req.finished():
                break
            batch.prepare_for_decode()
            self.forward_decode(batch)
            self.sample(batch)
        self.settle()
        info["output_ids"] = list(req.output_ids)
        return info

    def run(self, rid: str, ids: list[int], after_match: Any = None) -> dict:
        req = self.new_req(rid, ids)
        batch = self.schedule(req, after_match)
        info = {
            "req": req,
            "prefix_len": req.prefix_len,
            "host_loaded": req.host_loaded_length,
            "out_cache_loc": batch.out_cache_loc.clone(),
        }
        self.forward(batch)
        info["failed"] = self.finish(batch)
        info["checks"] = dict(self.checks)
        self.settle()
        return info
