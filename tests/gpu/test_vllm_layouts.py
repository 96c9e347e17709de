"""Pages of every KV cache layout vLLM 0.33's GPU runner (Model Runner V2) can allocate move as the
bytes of whole blocks, on the CPU path and both GPU paths, with the checksum ``wire.checksum`` gives.

Each layer is a ``[B, H, N, C]`` view (C: one head's K and V of a token) into one flat buffer,
its memory order one of vLLM's ``KVCacheLayout`` stride orders over ``[L, B, H, N, C]``, as
``vllm.v1.kv_cache_interface.create_kv_cache_views`` builds it.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from cacheon_orbitkv.transfer import Arena, GroupLayout, PagePlan, block_runs, coalesce, restore, save
from cacheon_orbitkv.wire import checksum

# vLLM 0.33's KVCacheLayout: the physical order of the logical axes [L, B, H, N, C]
LAYOUTS = {
    "LBHNC": ((0, 1, 2, 3, 4), "HNC", 1),
    "LBNHC": ((0, 1, 3, 2, 4), "NHC", 1),
    "LHBNC": ((0, 2, 1, 3, 4), "H_NC", 2),
    "BLHNC": ((1, 0, 2, 3, 4), "HNC", 1),
    "BLNHC": ((1, 0, 3, 2, 4), "NHC", 1),
    "BHLNC": ((1, 2, 0, 3, 4), "H_NC", 2),
}
L, B, H, N, C = 4, 8, 2, 32, 128  # layers, blocks, KV heads, tokens per block, K + V elements (bf16)


def layer_views(order: tuple[int, ...], device: str, seed: int) -> list[torch.Tensor]:
    shape = (L, B, H, N, C)
    strides = [0] * 5
    size = 1
    for dim in reversed(order):
        strides[dim] = size
        size *= shape[dim]
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(size, generator=g).to(torch.bfloat16).to(device)
    view = flat.as_strided(shape, strides)
    return [view[layer] for layer in range(L)]


def group(views: list[torch.Tensor]) -> tuple[GroupLayout, set[str]]:
    runs = [block_runs(v, "HNC") for v in views]
    return GroupLayout(coalesce([s for r in runs for s in r.segments])), {r.order for r in runs}


DEVICES = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cuda", "triton", marks=pytest.mark.gpu, id="cuda-triton"),
    pytest.param("cuda", "copy_engine", marks=pytest.mark.gpu, id="cuda-copy_engine"),
]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(("device", "path"), DEVICES)
def test_every_vllm_033_layout_moves_whole_blocks_with_the_wire_checksum(name, device, path):
    order, expected_order, runs_per_layer = LAYOUTS[name]
    src, dst = layer_views(order, device, 1), layer_views(order, device, 2)
    lay, orders = group(src)
    dlay, _ = group(dst)
    assert orders == {expected_order}
    assert lay.page_bytes == L * H * N * C * 2
    # block-outermost layouts hold all layers' pages of a block in one range: one chunk per page
    assert len(lay.chunks) == (1 if name.startswith("BL") else L * runs_per_layer)
    before = [v.clone() for v in dst]
    arena = Arena(mmap.mmap(-1, 4 << 20, flags=mmap.MAP_SHARED), device=device)
    try:
        sources, targets = [3, 0, 6], [1, 4, 6]
        pages = [PagePlan(b, i * lay.page_bytes) for i, b in enumerate(sources)]
        sums = save(arena, lay, pages, path=path).checksums()
        region = memoryview(arena.region)
        assert sums == [checksum(region[p.offset : p.offset + lay.page_bytes]) for p in pages]
        # the page is each layer's block bytes in memory order, layer after layer
        block = H * N * C * 2
        first = b"".join(v[3].cpu().contiguous().view(torch.uint8).numpy().tobytes() for v in src)
        if name in ("LBHNC", "BLHNC"):
            assert bytes(region[:block]) == first[:block]
        region.release()
        back = [PagePlan(t, p.offset, s) for t, p, s in zip(targets, pages, sums, strict=True)]
        assert restore(arena, dlay, back, path=path).wait() == [True, True, True]
        if device == "cuda":
            torch.cuda.synchronize()
        for s_view, d_view, b_view in zip(src, dst, before, strict=True):
            for s_block, d_block in zip(sources, targets, strict=True):
                assert torch.equal(d_view[d_block], s_view[s_block])
            for untouched in set(range(B)) - set(targets):
                assert torch.equal(d_view[untouched], b_view[untouched])
        # a wrong checksum is reported, never acknowledged
        wrong = [PagePlan(2, pages[0].offset, sums[0] ^ 1)]
        assert restore(arena, dlay, wrong, path=path).wait() == [False]
    finally:
        arena.close()


@pytest.mark.gpu
def test_kernel_blocks_are_grouped_back_into_the_managers_blocks():
    """A layer-compact cache split into kernel blocks ([B * k, H, N / k, C]) moves the manager's blocks."""
    from cacheon_vllm.connector import layer_runs

    flat = torch.randn(L * B * H * N * C, device="cuda").to(torch.bfloat16)
    kernel = flat.view(L, B * 4, H, N // 4, C)[0]  # LBHNC, 4 kernel blocks per block
    runs, tag = layer_runs(kernel, B)
    assert tag == "block-dense-KHNC" and len(runs) == 1 and runs[0].shape == (B, H * N * C * 2)
    assert runs[0][5].data_ptr() == kernel[20].data_ptr()


@pytest.mark.gpu
def test_a_layout_the_connector_cannot_move_is_refused_with_the_rule_it_breaks():
    from cacheon_orbitkv.transfer import LayoutError
    from cacheon_vllm.connector import layer_runs

    every_other = torch.zeros(B, H, N, 2 * C, device="cuda", dtype=torch.bfloat16)[..., ::2]  # no dense dim
    with pytest.raises(LayoutError, match="no dim of the buffer"):
        layer_runs(every_other, B)
    scattered = torch.zeros(N, C, B, H, device="cuda", dtype=torch.bfloat16).permute(2, 3, 0, 1)  # 64 runs of 2 bytes
    with pytest.raises(LayoutError, match="separate runs|64-bit words"):
        layer_runs(scattered, B)
    with pytest.raises(LayoutError, match="expected"):
        layer_runs(torch.zeros(B + 1, H, N, C, device="cuda"), B)
