"""OrbitKVLinker on SGLang 0.5.23's real pools, cache tree and scheduler pieces, with a real manager.

The cache and linker are built by SGLang's own registry (``dynamic`` backend importing
``cacheon_sglang.linker``); requests go through the scheduler's match, admission, load, forward
hand-off, insert and event processing (tests/sglang/sglang_cache.py). HBM is lost with SGLang's
``flush_cache``; the store lives in a separate manager process.
"""

from __future__ import annotations

import threading
import time
from array import array

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.utils import get_storage_hash_str

from cacheon_orbitkv import link as link_module
from cacheon_orbitkv.client import CacheClient
from cacheon_sglang import linker as orbit
from tests.sglang import sglang_cache as sc

POISON = 3.5  # never written by the fake forward (its values are integers)
BUILDERS = {"mha": sc.build_mha, "swa": sc.build_swa, "mamba": sc.build_mamba}


def _buffers(fx: dict) -> dict[str, list[torch.Tensor]]:
    """Every device buffer of the model's pools, by pool."""
    kv = fx["kvcache"]
    if fx["kind"] == "swa":
        pools = {"kv": kv.full_kv_pool, "swa": kv.swa_kv_pool}
    elif fx["kind"] == "mamba":
        pools = {"kv": kv.full_kv_pool}
    else:
        pools = {"kv": kv}
    out = {name: [*p.k_buffer, *p.v_buffer] for name, p in pools.items()}
    if fx["kind"] == "mamba":
        cache = fx["mamba_pool"].mamba_cache
        out["mamba"] = [cache.temporal[i] for i in range(cache.temporal.shape[0])] + [
            c[i] for c in cache.conv for i in range(c.shape[0])
        ]
    return out


def _poison(fx: dict) -> None:
    for tensors in _buffers(fx).values():
        for t in tensors:
            t.fill_(POISON)


def _touched(fx: dict, page: int) -> dict[str, set[int]]:
    """Per pool, the rows (pages of token pools, slots of the state pool) not holding the poison."""
    out = {}
    for name, tensors in _buffers(fx).items():
        rows: set[int] = set()
        for t in tensors:
            flat = t.reshape(t.shape[0], -1) != POISON
            changed = flat.any(dim=1).nonzero().flatten().tolist()
            rows |= {r // page for r in changed} if name != "mamba" else set(changed)
        out[name] = rows
    return out


def _pages_of(slots: torch.Tensor, page: int) -> set[int]:
    return {int(s) // page for s in slots.reshape(-1).tolist()}


@pytest.mark.parametrize("kind", ["mha", "swa", "mamba"])
def test_poisoned_destinations_are_restored_exactly_and_nothing_else_is_written(kind, manager_factory):
    m = manager_factory()
    fx = BUILDERS[kind](m.endpoint)
    linker: orbit.OrbitKVLinker = fx["linker"]
    page = fx["params"].page_size
    sched = sc.Scheduler(fx)
    ids = list(range(1000, 1070)) if kind == "mamba" else list(range(100, 118))
    cold = sched.run("cold", ids)
    assert cold["host_loaded"] == 0 and not cold["failed"]
    saved = m.stats()["bytes_written"]["dram"]
    assert saved > 0 and linker.stats["offloads"] >= 1
    sched.flush()
    _poison(fx)

    # The restored request, stopped between the restore and the forward.
    req = sched.new_req("warm", ids)
    batch = sched.schedule(req)
    counter = linker.layer_done_counter
    counter.set_consumer(batch.hicache_consumer_index)
    counter.wait_until(counter.num_layers - 1)
    loaded = req.host_loaded_length
    # SGLang's limit: the last prompt token is computed; Mamba's extra buffer keeps states every 64.
    assert loaded == {"mha": 16, "swa": 16, "mamba": 64}[kind]
    plan = {"kv": _pages_of(fx["cache"].linker.private_load_indices["warm"], page)}
    if kind == "swa":
        full = fx["cache"].linker.private_load_indices["warm"]
        window_pages = -(-fx["params"].sliding_window_size // page)
        swa = fx["allocator"].translate_loc_from_full_to_swa(full[-window_pages * page :])
        plan["swa"] = _pages_of(swa, page)
    if kind == "mamba":
        plan["mamba"] = {int(req.kv.mamba_pool_idx)}
    touched = _touched(fx, page)
    # Exactly the planned destinations were written: every other page and slot still holds the poison.
    assert touched == plan, (touched, plan)
    assert len(plan["kv"]) == loaded // page
    # The linker's own account: every planned page written, no load failed or missed.
    planned = sum(len(rows) for rows in plan.values())
    assert linker.stats["pages_restored"] == planned and linker.stats["loads"] == 1
    assert linker.stats["load_failures"] == 0 and linker.stats["load_misses"] == 0

    sched.forward(batch)
    assert sched.checks and all(sched.checks.values()), sched.checks  # every layer read the cold bytes
    assert sched.finish(batch) == []
    sched.settle()
    stats = m.stats()
    page_bytes = {g: lay.page_bytes for g, lay in linker.pool_layout.layouts.items()}
    want = len(plan["kv"]) * page_bytes[0] + len(plan.get("swa", ())) * page_bytes.get(1, 0)
    want += len(plan.get("mamba", ())) * page_bytes.get(2, 0)
    assert linker.stats["loaded_bytes"] == want == stats["bytes_read"]["dram"]
    assert stats["leases"] == 0 and stats["reservations"] == 0
    # The restored tail joins the tree and is offered again: already stored, nothing is rewritten.
    assert stats["bytes_written"]["dram"] == saved
    linker.close()


def test_the_match_limit_reuses_448_of_a_512_token_prompt_and_512_of_513(manager_factory):
    m = manager_factory()
    fx = sc.build_mha(m.endpoint, page_size=64, size=2048)
    sched = sc.Scheduler(fx)
    ids = [int(x) for x in torch.randint(10, 30000, (520,), generator=torch.Generator().manual_seed(1))]
    assert sched.run("cold", ids)["host_loaded"] == 0  # saves 8 full pages (512 tokens)
    restored = 0
    for n, reused in ((512, 448), (513, 512)):
        sched.flush()
        warm = sched.run(f"warm-{n}", ids[:n])
        assert warm["host_loaded"] == reused and all(warm["checks"].values()), (n, warm)
        restored += reused // 64
        stats = fx["linker"].stats
        assert stats["pages_restored"] == restored and stats["load_failures"] == stats["load_misses"] == 0
    fx["linker"].close()


def _keys(ids: list[int], page: int) -> list[str]:
    return get_storage_hash_str(RadixKey(array("q", ids)), None, page_size=page)


def _store(client: CacheClient, linker: orbit.OrbitKVLinker, group: int, keys: list[str], seed: int) -> list[bytes]:
    size = linker.pool_layout.layouts[group].page_bytes
    gen = torch.Generator().manual_seed(seed)
    payloads = [bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).tolist()) for _ in keys]
    pages = [(orbit.storage_hash(k, group), p) for k, p in zip(keys, payloads)]
    client.store(linker.namespace, group, pages, tag=linker.pool_layout.tags[group])
    return payloads


def _row_bytes(linker: orbit.OrbitKVLinker, group: int, row: int) -> bytes:
    return b"".join(bytes(seg[row].tolist()) for seg in linker.pool_layout.layouts[group].segments)


def test_discovery_reads_no_payload_and_the_load_reads_only_the_selected_ranges(manager_factory):
    """Mamba fixture, SSD only: attention pages 1-4, checkpoints at pages 2 (early, unused), 4 (the
    boundary) and 6 (an orphan past the attention prefix). Lookup reads no payload byte; the load
    reads four attention pages and one checkpoint, never the early checkpoint or the orphan."""
    m = manager_factory(pool="64kb", ssd=True)
    fx = sc.build_mamba(m.endpoint)
    linker: orbit.OrbitKVLinker = fx["linker"]
    page = fx["params"].page_size
    ids = list(range(500, 525))  # 25 tokens: SGLang looks up 24, six pages
    keys = _keys(ids[:24], page)
    with CacheClient(m.endpoint) as client:
        kv = _store(client, linker, 0, keys[:4], seed=1)
        checkpoints = dict(zip((2, 4, 6), _store(client, linker, 2, [keys[1], keys[3], keys[5]], seed=2)))
        # Filler pages push every page above out of the 64 KiB of DRAM, onto SSD.
        client.store("filler:bf16:x:p4:r0", 0, [(bytes([i]) * 16, b"\0" * 4096) for i in range(40)])
    before = m.stats()
    assert before["pages"]["dram"] < 40 and before["bytes_read"]["ssd"] == 0

    sched = sc.Scheduler(fx)
    req = sched.new_req("r", ids)
    sched.match(req)
    assert req.host_hit_length == 16  # boundaries 2 and 4 are legal; 6 lacks attention pages
    assert m.stats()["bytes_read"]["ssd"] == 0  # discovery is metadata only
    sched.admit(req)
    index = sched.cache.ready_to_load_host_cache()
    assert linker.finish_layer_wise_loading(index)
    sched.cache.linker.inflight_load_rids.clear()
    stats = m.stats()
    layouts = linker.pool_layout.layouts
    assert stats["bytes_read"]["ssd"] == 4 * layouts[0].page_bytes + layouts[2].page_bytes
    assert stats["leases"] == 0
    rows = [int(s) // page for s in sched.cache.linker.private_load_indices["r"][::page].tolist()]
    assert [_row_bytes(linker, 0, r) for r in rows] == kv
    assert _row_bytes(linker, 2, int(req.kv.mamba_pool_idx)) == checkpoints[4]
    assert linker.stats["pages_restored"] == 5 and linker.stats["load_failures"] == linker.stats["load_misses"] == 0
    linker.close()


def test_a_repeated_512_token_prompt_never_takes_the_checkpoint_at_512(manager_factory):
    """The seed's rule on a recurrent model: with a checkpoint only at 512, a 512-token prompt (limit
    511) reuses nothing; a 513-token prompt reuses 512."""
    m = manager_factory()
    fx = sc.build_mamba(m.endpoint, page_size=64, size=2048)
    linker = fx["linker"]
    ids = list(range(2000, 2513))
    keys = _keys(ids[:512], 64)
    with CacheClient(m.endpoint) as client:
        _store(client, linker, 0, keys, seed=3)
        _store(client, linker, 2, keys[-1:], seed=4)
    sched = sc.Scheduler(fx)
    for n, hit in ((512, 0), (513, 512)):
        req = sched.new_req(f"r{n}", ids[:n])
        sched.match(req)
        assert req.host_hit_length == hit, n
        fx["cache"].linker.hit_markers.clear()
    assert m.stats()["bytes_read"]["dram"] == 0
    linker.close()


def _transfer(name: PoolName, keys: list[str], slots: list[int], trailing: bool = False) -> PoolTransfer:
    policy = PoolHitPolicy.TRAILING_PAGES if trailing else PoolHitPolicy.ALL_PAGES
    return PoolTransfer(name=name, keys=keys, device_indices=torch.tensor(slots, dtype=torch.int64), hit_policy=policy)


def test_a_plan_outside_the_compiled_range_is_refused_before_any_lease(manager_factory):
    m = manager_factory()
    fx = sc.build_swa(m.endpoint)  # page 4, window 8 tokens: two pages
    linker: orbit.OrbitKVLinker = fx["linker"]
    keys = _keys(list(range(300, 316)), 4)  # four pages
    with CacheClient(m.endpoint) as client:
        _store(client, linker, 0, keys, seed=5)
        _store(client, linker, 1, keys, seed=6)
    kv = _transfer(PoolName.KV, keys, list(range(16, 32)))

    def swa(page_keys: list[str]) -> PoolTransfer:
        return _transfer(PoolName.SWA, page_keys, list(range(40, 40 + 4 * len(page_keys))), trailing=True)

    assert linker.lookup("probe", [kv, swa(keys[-2:])]) == [1, 2, 3, 4]
    assert linker.lookup("probe", [kv, PoolTransfer(name=PoolName.DRAFT, keys=keys)]) == []  # not a pool it holds
    refused = {
        "a window page outside the window": [kv, swa(keys[-3:])],
        "a window page missing": [kv, swa(keys[-1:])],
        "a page not in the attention tail": [kv, swa([keys[-1], "f" * 64])],
        "destinations not whole pages": [_transfer(PoolName.KV, keys, list(range(17, 33))), swa(keys[-2:])],
        "fewer destinations than pages": [_transfer(PoolName.KV, keys, list(range(16, 28))), swa(keys[-2:])],
    }
    for what, transfers in refused.items():
        assert linker.load(what, transfers) is False, what
        assert m.stats()["leases"] == 0, what
    assert linker.stats["load_misses"] == len(refused) and linker.stats["pages_restored"] == 0
    assert linker.load("good", [kv, swa(keys[-2:])]) is True
    # One attention rank: restored within load (a page that does not land is a recompute), lease released.
    assert m.stats()["leases"] == 0
    assert linker.stats["pages_restored"] == 4 + 2 and linker.stats["load_failures"] == 0
    assert linker.cancel_queued_load("good") is True
    linker.close()


def test_cancelling_after_the_restore_started_finishes_it_before_anything_is_released(manager_factory):
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

    m = manager_factory()
    fx = sc.build_mha(m.endpoint)
    linker: orbit.OrbitKVLinker = fx["linker"]
    linker.lease_at_queue = False  # several attention ranks: leased and restored when loading starts
    sched = sc.Scheduler(fx)
    ids = list(range(700, 718))
    sched.run("cold", ids)
    sched.flush()
    _poison(fx)
    wrapper = fx["cache"].linker

    # Queued, not started: cancelled at once, nothing leased, nothing written.
    req = sched.new_req("queued", ids)
    sched.match(req)
    sched.admit(req)
    assert m.stats()["leases"] == 0
    private = wrapper.private_load_indices["queued"]
    fx["cache"].finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
    assert m.stats()["leases"] == 0 and "queued" not in wrapper.inflight_load_rids
    assert _touched(fx, 4)["kv"] == set()
    fx["cache"].unlock(req.lock)
    req.lock = None
    fx["allocator"].free(private)

    # Started: the destinations are published to the forward; an abort now cannot cancel the copy.
    gate = threading.Event()
    linker._loader.submit(gate.wait)  # hold the loader thread so the restore is still in flight
    req = sched.new_req("started", ids)
    sched.match(req)
    sched.admit(req)
    index = fx["cache"].ready_to_load_host_cache()
    destinations = wrapper.private_load_indices["started"]
    fx["cache"].finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
    assert "started" in wrapper.inflight_load_rids  # SGLang keeps it: finish_loads must wait for it
    assert _touched(fx, 4)["kv"] == set()
    gate.set()
    assert fx["cache"].finish_external_linker_loads([req]) == []
    assert wrapper.inflight_load_rids == [] and index >= 0
    assert _touched(fx, 4)["kv"] == _pages_of(destinations, 4) and len(destinations) == 16
    assert m.stats()["leases"] == 0  # released after the copy landed
    assert linker.stats["pages_restored"] == 4 and linker.stats["load_failures"] == 0
    linker.close()


def test_a_vanished_hit_is_a_recompute_and_a_restarted_manager_is_found(manager_factory, monkeypatch):
    monkeypatch.setattr(link_module, "RETRY_S", 0.2)
    m = manager_factory()
    fx = sc.build_mha(m.endpoint)
    sched = sc.Scheduler(fx)
    ids = list(range(900, 918))
    sched.run("cold", ids)
    sched.flush()
    req = sched.new_req("gone", ids)
    sched.match(req)
    assert req.host_hit_length == 16
    m.stop()  # the manager dies between lookup and load: no lease, the load is refused, SGLang recomputes
    sched.admit(req)
    assert req.host_loaded_length == 0 and "gone" not in fx["cache"].linker.private_load_indices
    assert fx["linker"].stats["loads"] == 0
    restarted = manager_factory(sock=m.sock)  # the same address, an empty store
    time.sleep(0.3)
    sched.flush()
    assert sched.run("again", ids)["host_loaded"] == 0  # reconnected: a miss, then saved again
    assert restarted.stats()["bytes_written"]["dram"] > 0
    sched.flush()
    assert sched.run("warm", ids)["host_loaded"] == 16
    assert fx["linker"].stats["pages_restored"] == 4 and fx["linker"].stats["load_failures"] == 0
    fx["linker"].close()


# -- supported combinations and refusals -------------------------------------------------------


def test_supported_pool_combinations_compile_their_contract(manager_factory):
    m = manager_factory()
    kinds = {}
    for kind, build in BUILDERS.items():
        fx = build(m.endpoint)
        kinds[kind] = [(g, k, w) for g, k, w in fx["linker"].groups]
        fx["linker"].close()
    assert kinds == {
        "mha": [(0, "attention", 0)],
        "swa": [(0, "attention", 0), (1, "window", 8)],
        "mamba": [(0, "attention", 0), (2, "recurrent", 0)],
    }


def test_an_mla_pool_is_a_single_mla_prefix_group(manager_factory):
    import dataclasses

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    fx = sc.build_mha(manager_factory().endpoint)
    mla = MLATokenToKVPool(
        size=256, page_size=4, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=2, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(256, 4, torch.bfloat16, "cpu", mla, need_sort=False)
    linker = _linker(dataclasses.replace(fx["params"], token_to_kv_pool_allocator=allocator), {ComponentType.FULL})
    assert linker.groups == [(0, "mla", 0)]
    assert linker.pool_layout.layouts[0].page_bytes == 2 * 4 * (16 + 8) * 2  # layers x tokens x dim x bf16
    linker.close()
    fx["linker"].close()


def test_a_pool_whose_pages_are_not_whole_64_bit_words_is_refused(manager_factory):
    import dataclasses

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    fx = sc.build_mha(manager_factory().endpoint)
    odd = MHATokenToKVPool(
        size=64, page_size=2, dtype=torch.bfloat16, head_num=1, head_dim=1, layer_num=1, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip  # 2 tokens x 1 head x 1 dim x 2 bytes: 4-byte page chunks
    allocator = PagedTokenToKVPoolAllocator(64, 2, torch.bfloat16, "cpu", odd, need_sort=False)
    params = dataclasses.replace(fx["params"], token_to_kv_pool_allocator=allocator, page_size=2)
    with pytest.raises(orbit.UnsupportedPools, match=r"page chunks \(4, 4\) are not multiples of 8 bytes"):
        _linker(params, {ComponentType.FULL})
    fx["linker"].close()


def _mamba_params(fx: dict, **pool_args):
    """The Mamba fixture's params with a request pool built with other SGLang options."""
    import dataclasses

    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16, state_size=8, conv_kernel=4
        )
    args = dict(
        size=8, mamba_size=16, mamba_spec_state_size=8, max_context_len=256, device="cpu", enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]), mamba_layer_ids=[0, 2],
        enable_mamba_extra_buffer=True, speculative_num_draft_tokens=None, enable_overlap_schedule=False,
    )  # fmt: skip
    r2t = HybridReqToTokenPool(**{**args, **pool_args})
    kv = HybridLinearKVPool(
        size=256, dtype=torch.bfloat16, page_size=4, head_num=2, head_dim=8, full_attention_layer_ids=[1],
        device="cpu", mamba_pool=r2t.mamba_pool, enable_memory_saver=False,
    )  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(256, 4, torch.bfloat16, "cpu", kv, need_sort=False)
    return dataclasses.replace(fx["params"], token_to_kv_pool_allocator=allocator, req_to_token_pool=r2t)


@pytest.mark.parametrize(
    ("options", "server", "reason"),
    [
        ({"speculative_num_draft_tokens": 2, "speculative_eagle_topk": 1}, {}, "SpeculativeState"),
        ({"enable_linear_replayssm": True}, {}, "ReplaySSM"),
        ({}, {"enable_int8_mamba_checkpoint": True}, "int8 checkpoint storage"),
    ],
    ids=["speculative", "replayssm", "int8-checkpoints"],
)
def test_unsupported_recurrent_state_is_refused(manager_factory, options, server, reason):
    m = manager_factory()
    fx = sc.build_mamba(m.endpoint)
    assert _linker(_mamba_params(fx), {ComponentType.FULL, ComponentType.MAMBA}).groups[1] == (2, "recurrent", 0)
    sc.server_args(4, m.endpoint, mamba_radix_cache_strategy="extra_buffer", **server)
    with pytest.raises(orbit.UnsupportedPools, match=reason):
        _linker(_mamba_params(fx, **options), {ComponentType.FULL, ComponentType.MAMBA})
    fx["linker"].close()


def _linker(params, components, endpoint="unix:///nonexistent.sock", **extra):
    return orbit.OrbitKVLinker(
        None, params, components=components, extra_config={"endpoint": endpoint, "model_fingerprint": "t", **extra}
    )


def test_unsupported_pools_and_configs_are_refused_with_the_reason(manager_factory):
    m = manager_factory()
    fx = sc.build_mha(m.endpoint)
    params = fx["params"]
    with pytest.raises(orbit.UnsupportedPools, match="OrbitKV needs FULL"):
        _linker(params, {ComponentType.FULL, ComponentType.C128})
    with pytest.raises(orbit.UnsupportedPools, match="sliding-window model's KV pool is MHATokenToKVPool"):
        _linker(params, {ComponentType.FULL, ComponentType.SWA})
    with pytest.raises(orbit.UnsupportedPools, match="Mamba model's KV pool is MHATokenToKVPool"):
        _linker(params, {ComponentType.FULL, ComponentType.MAMBA})
    params.mtp_draft_device_pools = (fx["kvcache"],)
    with pytest.raises(orbit.UnsupportedPools, match="draft state"):
        _linker(params, {ComponentType.FULL})
    params.mtp_draft_device_pools = ()
    with pytest.raises(ValueError, match="unknown linker_extra_config keys \\['warm'\\]"):
        _linker(params, {ComponentType.FULL}, warm=True)
    with pytest.raises(ValueError, match="prepare_timeout_s"):
        _linker(params, {ComponentType.FULL}, prepare_timeout_s=-1)
    fx["linker"].close()

    swa = sc.build_swa(m.endpoint)
    swa["params"].swa_gates_prefix_match = False
    with pytest.raises(orbit.UnsupportedPools, match="per-request ring"):
        _linker(swa["params"], {ComponentType.FULL, ComponentType.SWA})
    swa["linker"].close()


def test_an_unreachable_manager_is_a_miss_not_an_error(manager_factory):
    m = manager_factory()
    fx = sc.build_mha(m.endpoint)
    lonely = _linker(fx["params"], {ComponentType.FULL})
    keys = _keys(list(range(16)), 4)
    assert lonely.lookup("r", [PoolTransfer(name=PoolName.KV, keys=keys)]) == []
    assert lonely.load("r", [_transfer(PoolName.KV, keys, list(range(16, 32)))]) is False
    assert lonely.offload([_transfer(PoolName.KV, keys, list(range(16, 32)))]) is True
    while lonely.num_completed_offloads() == 0:
        time.sleep(0.01)
    assert lonely.pop_completed_offload() is False
    lonely.close()
    fx["linker"].close()


def _queued_without_lease(endpoint: str, rid: str, prepare_timeout: float | None = None) -> tuple[dict, object]:
    """A restorable request admitted by a linker that leases when loading starts, as one with
    attention TP > 1 decides at construction (a refusal in load() must be the same on every rank)."""
    fx = sc.build_mha(endpoint)
    linker: orbit.OrbitKVLinker = fx["linker"]
    linker.lease_at_queue = False
    if prepare_timeout is not None:
        linker.prepare_timeout = prepare_timeout  # linker_extra_config.prepare_timeout_s
    sched = sc.Scheduler(fx)
    ids = list(range(40, 58))
    sched.run("cold", ids)
    sched.flush()
    req = sched.new_req(rid, ids)
    sched.match(req)
    sched.admit(req)
    assert req.host_loaded_length == 16
    return fx, req


def test_with_several_ranks_the_lease_waits_for_the_loader_and_a_miss_fails_the_batch(manager_factory):
    m = manager_factory(pool="64kb")
    fx, req = _queued_without_lease(m.endpoint, "warm")
    assert m.stats()["leases"] == 0  # queued without a lease
    with CacheClient(m.endpoint) as client:  # evict everything: 40 pages through 64 KiB of DRAM
        client.store("filler:bf16:x:p4:r0", 0, [(bytes([i]) * 16, b"\0" * 4096) for i in range(40)])
    assert fx["cache"].ready_to_load_host_cache() >= 0
    assert [r.rid for r in fx["cache"].finish_external_linker_loads([req])] == ["warm"]  # SGLang aborts it
    stats = fx["linker"].stats
    assert stats["load_misses"] == 1 and stats["pages_restored"] == 0 and m.stats()["leases"] == 0
    fx["linker"].close()


def test_with_several_ranks_a_load_waiting_past_prepare_timeout_is_given_up(manager_factory):
    m = manager_factory()
    fx, req = _queued_without_lease(m.endpoint, "late", prepare_timeout=0.0)
    read_before = m.stats()["bytes_read"]["dram"]
    time.sleep(0.01)
    fx["cache"].ready_to_load_host_cache()
    assert [r.rid for r in fx["cache"].finish_external_linker_loads([req])] == ["late"]
    stats = m.stats()
    assert stats["leases"] == 0 and stats["bytes_read"]["dram"] == read_before  # never leased, nothing read
    fx["linker"].close()
