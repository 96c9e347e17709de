"""SGLang's real pools, tree and scheduler pieces (sglang_cache.py) on a CUDA device.

``use_device("cuda")`` makes sglang_cache's builders put every pool on the GPU. ``DeviceScheduler``
is sglang_cache's ``Scheduler`` with its prefix check done on the pools' device. ``TensorScheduler``
replaces the per-token forward with one that a Llama-sized pool can afford: per layer it waits on
SGLang's layer counter (``get_key_buffer``), reads the restored prefix on the forward's stream as
attention would, and writes seeded random K and V for the batch's own tokens, recording when each
layer's wait returned. Import SGLang's modules only after ``absent_sgl_kernel.install`` on a GPU host.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch

from tests.sglang import sglang_cache as sc

POISON_BYTE = 0xA5  # bf16 0xA5A5 is a tiny negative number no seeded draw repeats across a whole row


def use_device(device: str) -> None:
    """Every builder of sglang_cache from now on puts SGLang's pools on ``device``."""
    sc.DEVICE = device


def poison(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.view(torch.uint8).fill_(POISON_BYTE)


def touched_rows(t: torch.Tensor) -> torch.Tensor:
    """Per first-dimension row of ``t``: whether it holds any byte other than the poison."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    return (flat != POISON_BYTE).any(dim=1)


class DeviceScheduler(sc.Scheduler):
    """sglang_cache's Scheduler, comparing the prefix a layer reads on the pool's own device."""

    def _check_prefix(self, req: Any, layer: int) -> bool:
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
        want = torch.tensor([sc.kv_value(fill[p], p, layer, 0) + self.salt for p in range(first, n)])
        buffer = pool.k_buffer[pool_layer]
        want = want.to(device=buffer.device, dtype=buffer.dtype)
        return bool((buffer[slots] == want[:, None, None]).all())


class TensorScheduler(sc.Scheduler):
    """A full-attention model's forward in whole-tensor operations on the current (forward) stream."""

    def __init__(self, fx: dict, seed: int = 0) -> None:
        super().__init__(fx)
        self.seed = seed
        self.layer_waits: list[float] = []  # seconds each layer's get_key_buffer waited
        self.layer_ready: list[float] = []  # perf_counter when each layer's wait returned
        self.prefix_sums: list[torch.Tensor] = []  # what each layer read of the prefix, kept on the GPU

    def forward(self, batch: ScheduleBatch) -> None:
        counter = self.cache.linker.layer_done_counter
        counter.set_consumer(batch.hicache_consumer_index)
        kv = self.kvcache
        loc = batch.out_cache_loc.to(torch.int64)
        prefixes = [
            self.r2t.req_to_token[req.kv.req_pool_idx, : req.prefix_len].to(torch.int64)
            for req in batch.reqs
            if req.prefix_len > 0
        ]
        self.layer_waits, self.layer_ready, self.prefix_sums = [], [], []
        shape = (loc.numel(), kv.head_num, kv.head_dim)
        for layer in range(self.fx["num_layers"]):
            start = time.perf_counter()
            k = kv.get_key_buffer(layer)  # SGLang's hook: waits for this layer's restore
            v = kv.get_value_buffer(layer)
            now = time.perf_counter()
            self.layer_waits.append(now - start)
            self.layer_ready.append(now)
            for slots in prefixes:  # attention reads the restored prefix on this stream
                self.prefix_sums.append(k[slots].float().sum() + v[slots].float().sum())
            gen = torch.Generator(device=k.device).manual_seed(self.seed * 100_003 + layer)
            k[loc] = torch.randn(shape, generator=gen, device=k.device).to(k.dtype)
            v[loc] = torch.randn(shape, generator=gen, device=k.device).to(v.dtype)
