"""OrbitKVLinker: SGLang 0.5.23's unified-cache external linker over the OrbitKV cache manager.

Enable with::

    sglang serve ... --enable-unified-cache-external-linker \\
      --unified-cache-external-linker-backend dynamic \\
      --unified-cache-external-linker-config '{"linker": "OrbitKVLinker",
          "linker_module_path": "cacheon_sglang.linker",
          "linker_extra_config": {"endpoint": "unix:///tmp/orbitkv.sock"}}'

``linker_extra_config`` keys: ``endpoint`` (else ``ORBITKV_SGLANG_ENDPOINT`` or ``ORBITKV_ENDPOINT``),
``model_fingerprint`` (the model part of the cache identity; default ``model_fingerprint`` of
``--model-path`` and ``--revision``: config.json and the weight files' names, sizes and first and
last MiB, not the path), ``prepare_timeout_s`` (with several attention ranks, where the lease is
taken when loading starts: how long a queued restore may wait for it before it is given up; default 5)
and ``save_decode`` (default true: the pages of generated tokens are saved as SGLang inserts them
when a request finishes; false saves only prompt pages, see ``offload``).

The namespace is a ``CacheIdentity``: model, KV dtype (``float8_e4m3fn`` pages never meet
``bfloat16`` ones), the pools' physical layout (per group ``sglang-mha-nhd-h<heads>-d<dim>-v<dim>``,
``-hnd`` under SGLANG_USE_HND_KVCACHE, ``sglang-mla-r<rank>-rope<dim>``, ``sglang-mamba-...`` with
the state dtypes), per group the page chunks (layers, heads, head size and page size show there),
TP/CP/PP sizes and the rank. Each page is saved with its group's layout as its tag; a leased page
of another length or tag is a miss (SGLang recomputes), never a copy.

The cache never takes SGLang down: a manager that cannot be reached, an arena that cannot be mapped,
a hung manager (calls time out), a malformed reply or a page that fails its checksum is a miss or a
recompute, with one warning naming the cause. Lookups have their own manager connection, so a
lookup never waits behind a restore's lease or a save on the loader and saver threads.

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
  leases exactly those pages (``read_recovery``) and, with one attention rank, restores them at
  once (checksums verified in the copy) and releases the lease: a partial result, a page of another
  layout or a page failing its checksum refuses the load, which SGLang turns into a recompute. With
  several attention ranks a refusal must be the same on every rank, so the lease and the restore
  happen when loading starts instead, and a missing or bad page fails the batch, which SGLang aborts.
- ``start_layer_wise_loading``: a loader thread restores every queued request not restored yet,
  releases the leases after the copies' fence, then completes every layer of SGLang's layer
  counter at once: the forward waits for the whole restore, not per layer.
- ``offload``: SGLang's write-through chain hands node pages (and a node's Mamba state); a saver
  thread reserves arena extents, copies and commits every group of the node, in order. SGLang
  inserts a request's prompt pages after its prefill and its generated tokens' full pages when it
  finishes, but hands the linker a node's page keys only, not the request. With ``save_decode``
  false a node is saved only as far as its leading pages are prompt pages, which the linker knows
  from its lookups: SGLang looks up every full page of a prompt's uncached tail below its match
  limit (N-1 tokens) before the prefill, so a node's Mamba state and SWA window are then dropped
  with any page past that prefix, and a page-aligned prompt's last page is not saved.

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
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from cacheon_orbitkv.client import CacheClient, Recovery, cached_positions
from cacheon_orbitkv.contract import ContractError, RecoveryContract
from cacheon_orbitkv.identity import CacheIdentity, IdentityError, geometry_of, model_fingerprint
from cacheon_orbitkv.link import Connection, ManagerLink, SavePart, lease_mismatch, leased_pages, save_parts
from cacheon_orbitkv.transfer import Arena, GroupLayout, paged_tokens, restore, segment_view
from cacheon_orbitkv.wire import ManagerUnavailable, OrbitKVError

log = logging.getLogger("sglang.cacheon.orbitkv")

DEFAULT_PREPARE_TIMEOUT_S = 5.0
LOOKUP_TIMEOUT_S = 5.0  # a lookup is metadata only: a manager silent this long is hung
CONFIG_KEYS = frozenset({"endpoint", "model_fingerprint", "prepare_timeout_s", "save_decode"})
PROMPT_PAGES_KEPT = 1 << 16  # with save_decode false: the prompt page keys remembered (oldest forgotten)
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
    """What the linker moves: per contract group its kind, window, segments, physical layout (the
    pages' tag) and SGLang pool."""

    groups: list[tuple[int, str, int]]
    layouts: dict[int, GroupLayout]
    tags: dict[int, str]
    pools: dict[PoolName, object]
    num_layers: int
    device: str
    dtype: str  # the KV cache's element type (fp8 pools name their fp8 type, not the uint8 they store)

    @property
    def layout(self) -> str:
        """Every group's physical layout: two pool layouts with equal chunk sizes never share a namespace."""
        return "+".join(f"g{group}={self.tags[group]}" for group, _, _ in self.groups)


def _exact(obj: object, *names: str) -> bool:
    return type(obj).__name__ in names


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _token_segments(pool: Any, page: int, what: str) -> tuple[str, list[Any], str]:
    """The prefix kind, per-layer page segments and physical layout of a plain MHA or MLA token pool."""
    if getattr(pool, "is_quantized_kv_cache", False):
        raise UnsupportedPools(f"{what} is quantized (scale buffers beside the KV); OrbitKV does not move them")
    if _exact(pool, "MHATokenToKVPool"):
        order = getattr(pool, "kv_cache_layout", "nhd")
        if order not in ("nhd", "hnd"):
            raise UnsupportedPools(f"{what} has KV cache layout {order!r}; OrbitKV restores NHD and HND pools")
        segments = []
        for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True):
            # NHD [slots, heads, dim] by default; HND (SGLANG_USE_HND_KVCACHE) is [pages, heads, page, dim].
            segments += (
                [segment_view(k), segment_view(v)] if k.dim() == 4 else [paged_tokens(k, page), paged_tokens(v, page)]
            )
        if (k.dim() == 4) != (order == "hnd"):
            raise UnsupportedPools(f"{what} says layout {order!r} but its buffers are {k.dim()}-dimensional")
        tag = f"sglang-mha-{order}-h{pool.head_num}-d{pool.head_dim}-v{pool.v_head_dim}"
        return "attention", segments, tag
    if _exact(pool, "MLATokenToKVPool"):
        tag = f"sglang-mla-r{pool.kv_lora_rank}-rope{pool.qk_rope_head_dim}"
        return "mla", [paged_tokens(buf, page) for buf in pool.kv_buffer], tag
    raise UnsupportedPools(
        f"{what} is {type(pool).__name__}; OrbitKV restores plain MHATokenToKVPool and MLATokenToKVPool "
        "buffers (DSA, quantized, page-major and unified-memory pools are not supported)"
    )


def _state_segments(mamba_pool: Any) -> tuple[list[Any], str]:
    """Per Mamba layer, each conv tensor's and the temporal tensor's ``[slots, bytes]`` rows, and
    the state's physical layout (tensor count and dtypes: equal sizes of other types never mix)."""
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
    convs = "-".join(_dtype_name(conv.dtype) for conv in cache.conv)
    return segments, f"sglang-mamba-conv-{convs}-ssm-{_dtype_name(temporal.dtype)}"


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
    tags: dict[int, str] = {}
    pools: dict[PoolName, object] = {}
    if ComponentType.SWA in components:
        if not _exact(kvcache, "SWAKVPool"):
            raise UnsupportedPools(f"a sliding-window model's KV pool is {type(kvcache).__name__}, not SWAKVPool")
        if not getattr(params, "swa_gates_prefix_match", True):
            raise UnsupportedPools("the SWA state is a per-request ring that tree nodes do not own")
        window = params.sliding_window_size
        if not window:
            raise UnsupportedPools("SWA component without a sliding_window_size")
        kind, full_segments, tags[KV_GROUP] = _token_segments(kvcache.full_kv_pool, page, "the full-attention pool")
        _, swa_segments, tags[SWA_GROUP] = _token_segments(kvcache.swa_kv_pool, page, "the sliding-window pool")
        groups += [(KV_GROUP, kind, 0), (SWA_GROUP, "window", int(window))]
        layouts[KV_GROUP], layouts[SWA_GROUP] = GroupLayout(full_segments), GroupLayout(swa_segments)
        pools[PoolName.KV], pools[PoolName.SWA] = kvcache.full_kv_pool, kvcache.swa_kv_pool
        num_layers = len(kvcache.layers_mapping)
        device, dtype = kvcache.full_kv_pool.device, kvcache.full_kv_pool.dtype
        if kvcache.swa_kv_pool.dtype != dtype:  # the namespace names the full pool's dtype
            tags[SWA_GROUP] += f"-{_dtype_name(kvcache.swa_kv_pool.dtype)}"
    else:
        kind, full_segments, tags[KV_GROUP] = _token_segments(kvcache, page, "the KV pool")
        groups.append((KV_GROUP, kind, 0))
        layouts[KV_GROUP] = GroupLayout(full_segments)
        pools[PoolName.KV] = kvcache
        num_layers = int(kvcache.layer_num)
        device, dtype = kvcache.device, kvcache.dtype
    if mamba_pool is not None:
        groups.append((MAMBA_GROUP, "recurrent", 0))
        state_segments, tags[MAMBA_GROUP] = _state_segments(mamba_pool)
        layouts[MAMBA_GROUP] = GroupLayout(state_segments)
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
    return PoolLayout(groups, layouts, tags, pools, num_layers, str(device), _dtype_name(dtype))


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
    landed: bool = False  # restored already (one attention rank restores in load)


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
        save_decode = config.get("save_decode", True)
        if not isinstance(save_decode, bool):
            raise ValueError(f"OrbitKVLinker: save_decode must be true or false, got {save_decode!r}")
        self.save_decode = save_decode
        # Storage keys of prompt pages SGLang looked up, the only pages saved with save_decode false.
        self._prompt_pages: collections.OrderedDict[str, None] = collections.OrderedDict()
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
        rank = (pp_rank * cp_size + cp_rank) * tp_size + tp_rank
        chunks: dict[int, Sequence[int]] = {g: lay.chunks for g, lay in self.pool_layout.layouts.items()}
        self.identity = CacheIdentity(
            model=str(config.get("model_fingerprint") or _model_fingerprint(server_args)),
            kv_dtype=self.pool_layout.dtype,
            layout=self.pool_layout.layout,
            page_size=self.page_size,
            geometry=geometry_of(self.groups, chunks),
            parallel=(("tp", tp_size), ("cp", cp_size), ("pp", pp_size)),
            rank=rank,
        )
        self.namespace = self.identity.namespace
        self.contract = RecoveryContract.compile(self.namespace, self.page_size, self.groups)
        self.layer_done_counter = LayerWiseLoadCounter(self.pool_layout.num_layers)
        if PoolName.MAMBA in self.pools:
            # SGLang registers the counter with the KV pool only; Mamba layers wait through the
            # request pool, which must not read a state the restore has not written yet.
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.device = self.pool_layout.device
        name = f"sglang-{os.getpid()}-r{rank}"
        self.link = ManagerLink(self.endpoint, name, device=self.device, log=log)
        # Lookups run on the scheduler thread: their own connection never queues behind a lease
        # or a save on the loader and saver threads' connection. Metadata only: no CUDA arena, and its
        # mapping of the arena is never touched (no prefault: connecting costs nothing per pool byte).
        self.lookup_link = ManagerLink(
            self.endpoint, f"{name}-lookup", timeout=LOOKUP_TIMEOUT_S, log=log, prefault=False
        )
        self._lookup_epoch = 0  # self.link.connects when the lookup connection was last re-made
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()
        self._queued: dict[str, _Load] = {}
        self._started: dict[int, Future[bool]] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitkv-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitkv-save")
        self._offloads: collections.deque[Future[bool]] = collections.deque()
        self._load_stream = torch.cuda.Stream() if self.device.startswith("cuda") else None  # type: ignore[no-untyped-call]
        # loads: restores that held a lease; load_misses: loads refused before any copy (SGLang
        # recomputes); load_failures: restores that did not land; pages_restored: pages written
        # into SGLang's pools by restores that landed, every group counted; decode_pages_skipped:
        # pages of offered nodes not saved because save_decode is false, every group counted.
        self.stats = {
            "lookups": 0,
            "loads": 0,
            "load_misses": 0,
            "load_failures": 0,
            "pages_restored": 0,
            "loaded_bytes": 0,
            "offloads": 0,
            "saved_bytes": 0,
            "decode_pages_skipped": 0,
        }
        log.info(
            "orbitkv linker: namespace %s (layout %s), groups %s, page bytes %s, %d layers, transfers on %s",
            self.namespace,
            self.pool_layout.layout,
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

    def _warn(self, message: str) -> None:
        """One warning per distinct cause; repeats go to debug (a lookup runs on every match)."""
        with self._warn_lock:
            first = message not in self._warned
            self._warned.add(message)
        (log.warning if first else log.debug)("orbitkv: %s", message)

    def _acquire(self, link: ManagerLink) -> Connection | None:
        """``link``'s connection, held until ``link.release``; None while the manager is unusable."""
        try:
            return link.acquire()
        except Exception as exc:  # a hello the link does not expect (not a manager?): no cache, no crash
            self._warn(f"cache manager at {self.endpoint} unusable, serving without it: {type(exc).__name__}: {exc}")
            return None

    @contextlib.contextmanager
    def _held(self, link: ManagerLink) -> Iterator[Connection | None]:
        """``link``'s connection, held for the block; None while the manager is unusable."""
        connection = self._acquire(link)
        if connection is None:
            yield None
            return
        try:
            yield connection
        finally:
            link.release(connection)

    def _failed(self, link: ManagerLink, exc: Exception, client: CacheClient | None) -> None:
        """A manager call through ``client`` (None: any of ``link``'s) raised: a lost, hung or garbled
        connection is retired (and re-made later), a typed refusal is logged."""
        if not isinstance(exc, OrbitKVError):  # a malformed reply: stop talking to whatever sent it
            exc = ManagerUnavailable(f"malformed reply from the cache manager: {type(exc).__name__}: {exc}")
        link.failed(exc, client)

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        try:
            keys, _ = self._tail_keys(transfers)
        except OrbitKVError as exc:  # a lookup never fails a request: it is a miss
            self._warn(f"lookup of {rid}: {exc}")
            return []
        if not keys:
            return []
        if not self.save_decode:
            self._note_prompt_pages(keys)
        # The payload connection's state decides whether the cache is usable (and says why not, once):
        # a lookup connection of its own is made only while that one stands.
        if not self.link.connect():
            return []
        if self.link.connects != self._lookup_epoch:  # the payload connection was re-made: this one too
            self.lookup_link.close()
            self._lookup_epoch = self.link.connects
        ids = {g: [storage_hash(k, g) for k in keys] for g, _, _ in self.groups}
        with self._held(self.lookup_link) as connection:
            if connection is None:
                return []
            self.stats["lookups"] += 1
            page = self.page_size
            try:
                found = connection.client.lookup(self.namespace, ids)
                evidence = {g: [(i + 1) * page for i in cached_positions(found[g])] for g in ids}
                boundaries = self.contract.restorable_boundaries(self.namespace, 0, len(keys) * page, evidence)
            except Exception as exc:  # a hung, lost or garbled manager: a miss
                if isinstance(exc, OrbitKVError) and not isinstance(exc, ManagerUnavailable):
                    self._warn(f"lookup of {rid}: {type(exc).__name__}: {exc}")
                    return []
                # Reported once, by the payload connection, which a hung manager would stall next.
                self._failed(self.link, exc, None)
                self.lookup_link.close()
                return []
        return [b // page for b in boundaries]

    def _note_prompt_pages(self, keys: list[str]) -> None:
        for key in keys:
            self._prompt_pages[key] = None
            self._prompt_pages.move_to_end(key)
        while len(self._prompt_pages) > PROMPT_PAGES_KEPT:
            self._prompt_pages.popitem(last=False)

    def _prompt_part(self, transfers: list[PoolTransfer]) -> list[PoolTransfer]:
        """The part of an offered node that holds only prompt pages (save_decode false): all of it,
        or its leading attention pages without the state and window that end at the node's end."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        keys = list(kv.keys or []) if kv is not None else []
        prompt = 0
        while prompt < len(keys) and keys[prompt] in self._prompt_pages:
            prompt += 1
        if kv is None or prompt == len(keys):
            return transfers
        self.stats["decode_pages_skipped"] += sum(len(t.keys or []) for t in transfers) - prompt
        if prompt == 0:
            return []
        indices = kv.device_indices.reshape(-1)[: prompt * self.page_size] if kv.device_indices is not None else None
        return [PoolTransfer(name=PoolName.KV, keys=keys[:prompt], device_indices=indices)]

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
        ``_release``. False (a miss, nothing copied) without a manager, a complete lease, or pages
        of this layout: a page of another length or layout tag is never copied."""
        connection = job.connection = self._acquire(self.link)
        if connection is None:
            self.stats["load_misses"] += 1
            return False
        why = None
        try:
            job.recovery = connection.client.read_recovery(
                self.namespace, job.boundary, [r for r in job.ranges if r[1]]
            )
            if job.recovery is None:
                why = "no lease (pages gone since the lookup)"
            else:
                for group, hashes in job.ranges:
                    refs = job.recovery.pages[group] if hashes else []
                    if len(refs) != len(hashes):
                        why = f"group {group}: {len(refs)} pages leased for {len(hashes)} asked"
                        break
                    mismatch = lease_mismatch(refs, self.pool_layout.layouts[group], self.pool_layout.tags[group])
                    if mismatch is not None:
                        why = f"group {group}: {mismatch}"
                        break
        except Exception as exc:  # the link's warning names the cause
            self._failed(self.link, exc, connection.client)
            self._release(job)
            self.stats["load_misses"] += 1
            return False
        if why is not None:
            self._warn(f"load of {job.rid} is a miss (SGLang recomputes): {why}")
            self._release(job)
            self.stats["load_misses"] += 1
            return False
        return True

    def _release(self, job: _Load, wait: bool = True) -> None:
        recovery, job.recovery = job.recovery, None
        connection, job.connection = job.connection, None
        if connection is None:
            return
        try:
            if recovery is not None and not connection.retired:  # a lost connection took its leases along
                connection.client.release(recovery.lease, wait=wait)
        except Exception as exc:
            self._failed(self.link, exc, connection.client)
        finally:
            self.link.release(connection)

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        try:
            job = self._plan(rid, transfers)
        except (OrbitKVError, ContractError) as exc:
            self._warn(f"load of {rid} refused: {exc}")
            self.stats["load_misses"] += 1
            return False
        if self.lease_at_queue:
            # One attention rank: lease and restore now, so that a page that is gone, of another
            # layout or failing its checksum is a recompute (SGLang frees the private slots), not
            # a failed batch, which SGLang would abort.
            if not self._restore(job):
                return False
            job.landed = True
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
            # Every job runs (and releases) even after a failure.
            landed = all([job.landed or self._restore(job) for job in jobs])
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
        """Lease (unless leased already) and copy one request's pages into its destinations, checksums
        verified in the copy; the lease goes after the fence. True only when every page landed."""
        if job.recovery is None:
            if time.monotonic() > job.deadline:  # several ranks: leased now, within the preparation limit
                self._warn(f"load of {job.rid} passed its preparation limit ({self.prepare_timeout} s)")
                self.stats["load_misses"] += 1
                return False
            if not self._lease(job):
                return False
        self.stats["loads"] += 1
        landed = False
        try:
            landed = self._copy(job)
        except Exception as exc:  # a bad extent from the manager, a failed copy: the load fails, SGLang lives
            self._warn(f"load of {job.rid} failed: {type(exc).__name__}: {exc}")
        finally:
            if not landed:
                self.stats["load_failures"] += 1
            # Not waiting for the release's reply spares finish_layer_wise_loading a round trip to a
            # manager that sat idle during the copy; it still runs before this connection's next request.
            self._release(job, wait=False)
        return landed

    def _copy(self, job: _Load) -> bool:
        assert job.recovery is not None and job.connection is not None
        if job.connection.retired:  # the manager went away since the lease: its pages with it
            self._warn(f"load of {job.rid} failed: the cache manager connection was lost after the lease")
            return False
        arena = job.connection.arena
        moved = pages = 0
        stream = torch.cuda.stream(self._load_stream) if self._load_stream is not None else contextlib.nullcontext()
        with stream:
            fences = []
            for group, hashes in job.ranges:
                if not hashes:
                    continue
                layout = self.pool_layout.layouts[group]
                refs = job.recovery.pages[group]
                planned = leased_pages(job.rows[group], refs)
                fences.append(restore(arena, layout, planned))
                moved += len(planned) * layout.page_bytes
                pages += len(planned)
            verdicts = [ok for fence in fences for ok in fence.wait()]
        if not all(verdicts):
            self._warn(f"load of {job.rid} failed: {verdicts.count(False)} page(s) failed their checksums")
            return False
        self.stats["loaded_bytes"] += moved
        self.stats["pages_restored"] += pages
        return True

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        future = self._started.pop(counter_index, None)
        landed = bool(self.layer_done_counter.finish(counter_index))
        if future is not None:
            try:
                landed = future.result() and landed
            except Exception:
                landed = False
        return landed

    def cancel_queued_load(self, rid: str) -> bool:
        job = self._queued.pop(rid, None)
        if job is None:
            return False  # started (SGLang finishes it before freeing the slots) or never queued
        self._release(job)
        return True

    # -- offload ---------------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        if not self.save_decode:
            transfers = self._prompt_part(transfers)
            if not transfers:
                return False  # nothing to save: SGLang keeps the node unstored
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
        with self._held(self.link) as connection:
            if connection is None:
                return False
            return self._persist_on(job, connection.client, connection.arena)

    def _persist_on(self, job: _Save, client: CacheClient, arena: Arena) -> bool:
        layouts, tags = self.pool_layout.layouts, self.pool_layout.tags
        parts = [SavePart(self.namespace, g, layouts[g], hashes, rows, tags[g]) for g, hashes, rows in job.ranges]
        try:
            outcomes = save_parts(client, arena, parts)  # a failed group: the groups after it are not stored
            self.stats["saved_bytes"] += sum(o for o in outcomes if isinstance(o, int))
            failure = next((o for o in outcomes if isinstance(o, Exception)), None)
            if failure is not None:
                raise failure
        except Exception as exc:  # a refused, lost or garbled save is skipped: SGLang keeps serving
            self._failed(self.link, exc, client)
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
        self.lookup_link.close()
        self.link.close()


def _model_fingerprint(server_args: Any) -> str:
    model = getattr(server_args, "model_path", None)
    if not model:
        raise ValueError("OrbitKVLinker: no model path in server_args; set linker_extra_config.model_fingerprint")
    try:
        return model_fingerprint(model, getattr(server_args, "revision", None))
    except (IdentityError, OSError) as exc:
        raise ValueError(f"OrbitKVLinker: cannot fingerprint model {model!r} ({exc}); set model_fingerprint") from exc
