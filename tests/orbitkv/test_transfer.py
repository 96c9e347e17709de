"""Transfers between engine buffer layouts and the real manager's shared arena (torch path on the CPU)."""

from __future__ import annotations

import contextlib
import logging
import mmap
import platform
import re

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cacheon_orbitkv.client import CacheClient, page_hashes
from cacheon_orbitkv.link import leased_pages
from cacheon_orbitkv.manager import EmbeddedManager
from cacheon_orbitkv.transfer import (
    Arena,
    GroupLayout,
    PagePlan,
    Pages,
    paged_tokens,
    restore,
    save,
    save_rows,
    segment_view,
    vllm_layer,
)
from cacheon_orbitkv.wire import checksum

NS = "fp:bfloat16:nhd:p16:r0"


def engine_buffers(device: str = "cpu", seed: int = 0) -> dict[str, list]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    return {
        # vLLM: per layer [2, num_blocks, block_size, heads, dim]
        "vllm": [rand(2, 12, 16, 2, 32) for _ in range(3)],
        # SGLang: per layer k_buffer / v_buffer [slots, heads, dim], pages of 16 tokens
        "sglang_k": [rand(16 * 12, 2, 32) for _ in range(3)],
        "sglang_v": [rand(16 * 12, 2, 32) for _ in range(3)],
        # Mamba: per layer conv [slots, dim, width] and temporal [slots, heads, dim, state] per request slot
        "conv": [rand(6, 64, 4) for _ in range(2)],
        "temporal": [rand(6, 2, 16, 8) for _ in range(2)],
    }


def layouts(buffers) -> dict[str, GroupLayout]:
    return {
        "vllm": GroupLayout([seg for layer in buffers["vllm"] for seg in vllm_layer(layer)]),
        "sglang": GroupLayout(
            [paged_tokens(b, 16) for pair in zip(buffers["sglang_k"], buffers["sglang_v"], strict=True) for b in pair]
        ),
        "mamba": GroupLayout(
            [*(segment_view(c) for c in buffers["conv"]), *(segment_view(t) for t in buffers["temporal"])]
        ),
    }


def snapshot(buffers):
    return {k: [t.clone() for t in v] for k, v in buffers.items()}


def test_layouts_have_the_engines_page_sizes():
    lay = layouts(engine_buffers())
    assert lay["vllm"].page_bytes == 3 * 2 * 16 * 2 * 32 * 2
    assert lay["sglang"].page_bytes == 3 * 2 * 16 * 2 * 32 * 2
    assert lay["mamba"].page_bytes == 2 * (64 * 4 * 2) + 2 * (2 * 16 * 8 * 2)


@pytest.fixture(params=["compiled", "torch"])
def cpu_route(request, monkeypatch) -> str:
    """The CPU path's two routes: the compiled page kernels (numba), and the per-chunk torch copies that
    run where numba is missing or has not finished compiling."""
    from cacheon_orbitkv import wire

    assert wire.compiled_checksum(), "numba is missing or failed: the compiled route would not run"
    if request.param == "torch":
        monkeypatch.setattr(wire, "_compiled", None)
    return request.param


def _save_group(client, arena, group, layout, blocks, tokens, route="torch"):
    hashes = page_hashes(NS, tokens, 16, group)[: len(blocks)]
    reservation, offsets = client.reserve(NS, group, [(h, layout.page_bytes) for h in hashes])
    plans = [PagePlan(b, o) for b, o in zip(blocks, offsets, strict=True)]
    fence = save(arena, layout, plans)
    assert fence.path == route
    assert fence.checksums() == [checksum(client.view[o : o + layout.page_bytes]) for o in offsets]
    client.commit(reservation, fence.checksums())
    return hashes


def test_poisoned_destinations_are_restored_and_nothing_else_is_touched(sock_dir, cpu_route):
    endpoint = f"unix://{sock_dir / 'm.sock'}"
    with EmbeddedManager(endpoint, 16 << 20) as _, CacheClient(endpoint) as client:
        arena = Arena(client.arena)
        source = engine_buffers(seed=1)
        lay = layouts(source)
        tokens = list(range(16 * 8))
        saved = {
            g: (lay[name], blocks, _save_group(client, arena, g, lay[name], blocks, tokens, cpu_route))
            for g, name, blocks in ((0, "vllm", [3, 7, 1, 10]), (1, "sglang", [0, 5, 9]), (2, "mamba", [4]))
        }
        # A different engine instance, its caches poisoned with NaN.
        dest = engine_buffers(seed=2)
        for tensors in dest.values():
            for t in tensors:
                t.fill_(float("nan"))
        before = snapshot(dest)
        dlay = layouts(dest)
        names = {0: "vllm", 1: "sglang", 2: "mamba"}
        targets = {0: [2, 8, 0, 11], 1: [1, 2, 3], 2: [5]}  # restore into other blocks than saved from
        rec = client.read_recovery(NS, 128, [(g, saved[g][2]) for g in (0, 1, 2)])  # mixed groups in one restore
        assert rec is not None
        for g in (0, 1, 2):
            plans = [PagePlan(b, ref.offset, ref.checksum) for b, ref in zip(targets[g], rec.pages[g], strict=True)]
            fence = restore(arena, dlay[names[g]], plans)
            assert fence.path == cpu_route and fence.wait() == [True] * len(plans)
        client.release(rec.lease)
        # Every restored block equals its source block; every other block is byte-for-byte untouched.
        for g, name in names.items():
            src_segments, dst_segments = lay[name].segments, dlay[name].segments
            before_segments = layouts(before)[name].segments
            for s_seg, d_seg, b_seg in zip(src_segments, dst_segments, before_segments, strict=True):
                for block in range(d_seg.shape[0]):
                    if block in targets[g]:
                        src_block = saved[g][1][targets[g].index(block)]
                        assert torch.equal(d_seg[block], s_seg[src_block])
                    else:
                        assert torch.equal(d_seg[block], b_seg[block])


def test_a_corrupted_arena_page_is_reported_bad(sock_dir, cpu_route):
    """The torch copies sum a page before they copy any of it: a bad page never reaches the engine. The
    compiled route copies and sums in one pass, as the GPU paths do: the bad page's bytes are in its blocks,
    and its verdict is what tells the engine not to use them. Either way no other block is written."""
    endpoint = f"unix://{sock_dir / 'm.sock'}"
    with EmbeddedManager(endpoint, 16 << 20) as _, CacheClient(endpoint) as client:
        arena = Arena(client.arena)
        source = engine_buffers(seed=3)
        lay = layouts(source)["sglang"]
        hashes = _save_group(client, arena, 0, lay, [1, 2], list(range(32)), cpu_route)
        rec = client.read_recovery(NS, 32, [(0, hashes)])
        ref = rec.pages[0][1]
        client.view[ref.offset + 40] ^= 0xFF  # a raced or corrupted byte in the second page
        dest = engine_buffers(seed=4)
        dlay = layouts(dest)["sglang"]
        before = [s.clone() for s in dlay.segments]
        # As the engine adapters pass them: the pages as arrays (the test above passes PagePlans).
        fence = restore(arena, dlay, leased_pages([6, 7], rec.pages[0]))
        assert fence.path == cpu_route and fence.wait() == [True, False]
        stored = bytes(client.view[ref.offset : ref.offset + lay.page_bytes])
        assert b"".join(seg[7].numpy().tobytes() for seg in dlay.segments) == (
            stored if cpu_route == "compiled" else b"".join(old[7].numpy().tobytes() for old in before)
        )
        for seg, old, src in zip(dlay.segments, before, lay.segments, strict=True):
            assert torch.equal(seg[6], src[1])
            for block in range(seg.shape[0]):
                if block not in (6, 7):
                    assert torch.equal(seg[block], old[block])
        client.release(rec.lease)


def test_segments_whose_rows_are_not_contiguous_take_the_torch_copies(cpu_route):
    """The compiled route copies each chunk as one run of bytes: a layout whose rows are strided (or not
    byte tensors) takes the per-chunk torch copies, with the same checksums and verdicts."""
    g = torch.Generator().manual_seed(5)
    columns = torch.randint(0, 256, (64, 10), dtype=torch.uint8, generator=g)
    flat = torch.randint(0, 256, (10, 16), dtype=torch.uint8, generator=g)
    strided = GroupLayout([columns.t(), flat])  # 10 rows of 64 bytes 10 apart, then 10 rows of 16 bytes
    assert not strided.host_rows and GroupLayout([flat]).host_rows
    arena = Arena(mmap.mmap(-1, 4096))
    fence = save(arena, strided, Pages.of([3, 9], [512, 0]))
    page = strided.page_bytes
    assert fence.path == "torch"
    assert fence.checksums() == [checksum(arena.region[o : o + page]) for o in (512, 0)]
    dest = GroupLayout([torch.zeros(64, 10, dtype=torch.uint8).t(), torch.zeros(10, 16, dtype=torch.uint8)])
    back = restore(arena, dest, Pages.of([1, 2], [512, 0], fence.checksums()))
    assert back.path == "torch" and back.wait() == [True, True]
    assert torch.equal(dest.segments[0][1], columns[:, 3]) and torch.equal(dest.segments[1][2], flat[9])


def test_orbitkv_compiled_copies_0_keeps_the_torch_copies(monkeypatch):
    """``ORBITKV_COMPILED_COPIES=0`` (read at import) turns the compiled route off: the same sums, by torch."""
    import os
    import subprocess
    import sys

    from cacheon_orbitkv import transfer, wire

    code = "from cacheon_orbitkv import transfer; print(transfer.COMPILED_COPIES)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "ORBITKV_COMPILED_COPIES": value}
        said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert said.stdout.strip() == expected
    assert wire.compiled_checksum()
    layout = GroupLayout([torch.arange(4 * 64, dtype=torch.int64).view(torch.uint8).view(4, -1)])
    arena = Arena(mmap.mmap(-1, 8192))
    compiled = save(arena, layout, Pages.of([2, 1], [4096, 0]))
    monkeypatch.setattr(transfer, "COMPILED_COPIES", False)
    copied = save(arena, layout, Pages.of([2, 1], [4096, 0]))
    assert (compiled.path, copied.path) == ("compiled", "torch") and compiled.checksums() == copied.checksums()


def test_the_compiled_page_kernels_are_checked_against_numpy_before_they_are_used(monkeypatch, caplog):
    """A page kernel that copied a page failing its checksum, or put a chunk in the wrong place, fails the
    compile's own probe: saves and restores on the CPU take the torch copies (one warning), and the checksum
    still runs compiled."""
    from cacheon_orbitkv import wire

    assert wire.compiled_checksum()
    shipped_out, shipped_in = wire._copy_pages_out, wire._copy_pages_in
    for name in KERNEL_PARTS:
        monkeypatch.setattr(wire, name, getattr(wire, name))  # restored after: the shipped kernels' parts

    def copies_every_page(words, starts, page_words, expected, dst, src, sizes, verdicts):
        for j in range(dst.size):
            wire._memcpy(dst[j], src[j], sizes[j])
        for p in range(starts.size):
            verdicts[p] = True

    def skips_the_first_chunk(words, starts, page_words, dst, src, sizes, sums):
        per = dst.size // starts.size
        for p in range(starts.size):
            for j in range(p * per + 1, (p + 1) * per):
                wire._memcpy(dst[j], src[j], sizes[j])
            sums[p] = wire._whole(words[starts[p] : starts[p] + page_words]) ^ np.uint64(page_words << 3)

    caplog.set_level(logging.WARNING, logger="cacheon_orbitkv.wire")
    data = bytes(range(256)) * 40
    for broken, wrong in ((copies_every_page, "restore kernel"), (skips_the_first_chunk, "save kernel")):
        monkeypatch.setattr(wire, "_copy_pages_out" if broken is copies_every_page else "_copy_pages_in", broken)
        caplog.clear()
        kernels = wire._compile_kernels()
        assert kernels.pages_out is None and kernels.pages_in is None
        assert int(kernels.mix(np.frombuffer(data, np.uint64))) ^ len(data) == wire._checksum_numpy(data)
        said = [r.getMessage() for r in caplog.records if r.name == "cacheon_orbitkv.wire"]
        assert len(said) == 1 and wrong in said[0] and "torch" in said[0], said
        monkeypatch.setattr(wire, "_copy_pages_out", shipped_out)
        monkeypatch.setattr(wire, "_copy_pages_in", shipped_in)
        monkeypatch.setattr(wire, "_compiled", kernels)
        assert wire.page_kernels() is None
    kernels = wire._compile_kernels()
    assert kernels.pages_out is not None and kernels.pages_in is not None


@given(
    pages=st.lists(
        st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), st.integers(0, 2**64 - 1)), max_size=40
    )
)
def test_pages_hold_exactly_the_plans_numbers_as_read_only_copies(pages):
    blocks, offsets, sums = ([p[i] for p in pages] for i in range(3))
    batch = Pages.of(blocks, offsets, sums)
    plans = Pages.from_plans([PagePlan(*p) for p in pages])
    for got in (batch, plans):
        assert got.blocks.dtype == np.int64 and got.offsets.dtype == np.int64 and got.checksums.dtype == np.uint64
        assert (got.blocks.tolist(), got.offsets.tolist(), got.checksums.tolist()) == (blocks, offsets, sums)
        assert not got.blocks.flags.writeable and not got.checksums.flags.writeable
    source = np.asarray(blocks, dtype=np.int64)
    again = Pages.of(source, offsets)
    source[:] = 7  # the caller's array changing afterwards changes nothing moved
    assert again.blocks.tolist() == blocks and again.checksums is None
    assert Pages.from_plans([PagePlan(1, 0), PagePlan(2, 8, 5)]).checksums is None  # not every plan has one


@pytest.mark.parametrize(
    "args",
    [
        ([1.5], [0]),
        ([True], [0]),
        (["3"], [0]),
        (np.array([1.0]), [0]),
        ([-1], [0]),
        ([1], [-8]),
        ([2**63], [0]),
        ([[1]], [[0]]),
        ([1, 2], [0]),
        ([1], [0], [None]),
        ([1], [0], [-1]),
        ([1], [0], np.array([-1])),
        ([1], [0], [2**64]),
        ([1], [0], [1.0]),
        ([1], [0], [1, 2]),
        ([1, True], [0, 8]),
        ([1], [0], [np.int64(-1)]),
        (np.array([2**63], dtype=np.uint64), [0]),
        (np.array([-1]), [0]),
    ],
)
def test_pages_refuse_anything_but_integers_in_range_with_a_typed_error(args):
    with pytest.raises(ValueError, match="the pages'"):
        Pages.of(*args)


@pytest.mark.parametrize(
    "arrays",
    [
        (np.array([1.7]), np.array([0])),  # not int64
        (np.array([1, 2]), np.array([0])),  # one offset for two blocks
        (np.array([1]), np.array([0]), np.array([1, 2], dtype=np.uint64)),
        (np.array([1]), np.array([0]), np.array([1])),  # checksums not uint64
        (np.array([-1]), np.array([0])),
        (np.array([[1]]), np.array([[0]])),
        ([1], [0]),  # lists: Pages.of takes those
    ],
)
def test_pages_built_directly_are_checked_too(arrays):
    with pytest.raises(ValueError, match="the pages'"):
        Pages(*arrays)


def _arena_with_a_committed_page(lay):
    from cacheon_orbitkv.wire import checksum

    arena = Arena(mmap.mmap(-1, 4 * lay.page_bytes, flags=mmap.MAP_SHARED))
    arena.cpu[: lay.page_bytes] = torch.arange(lay.page_bytes, dtype=torch.int64).to(torch.uint8)
    view = memoryview(arena.region)[: lay.page_bytes]
    committed = checksum(view)
    view.release()
    return arena, committed


def test_a_restore_without_every_committed_checksum_is_refused_before_anything_moves():
    lay = layouts(engine_buffers())["vllm"]
    arena, committed = _arena_with_a_committed_page(lay)
    before = [seg.clone() for seg in lay.segments]
    # The first page is good: a refusal made page by page would already have written it.
    for pages in ([PagePlan(1, 0, committed), PagePlan(2, lay.page_bytes)], Pages.of([1], [0])):
        with pytest.raises(ValueError, match="committed checksum"):
            restore(arena, lay, pages)
    assert all(torch.equal(seg, old) for seg, old in zip(lay.segments, before, strict=True))
    assert restore(arena, lay, [PagePlan(1, 0, committed)]).wait() == [True]  # the same page alone moves
    assert not all(torch.equal(seg, old) for seg, old in zip(lay.segments, before, strict=True))


def test_a_page_past_the_engine_buffers_or_the_arena_is_refused_before_anything_moves():
    lay = layouts(engine_buffers())["vllm"]
    arena, committed = _arena_with_a_committed_page(lay)
    rows = lay.segments[0].shape[0]
    before = [seg.clone() for seg in lay.segments]
    extent = arena.size - lay.page_bytes
    for blocks, offsets, match in (
        ([1, rows], [0, lay.page_bytes], "past the engine buffers"),
        ([1, 2], [0, extent + 8], "ends past the arena"),
    ):
        with pytest.raises(ValueError, match=match):
            restore(arena, lay, Pages.of(blocks, offsets, [committed, committed]))
        with pytest.raises(ValueError, match=match):
            save(arena, lay, Pages.of(blocks, offsets))
    assert all(torch.equal(seg, old) for seg, old in zip(lay.segments, before, strict=True))
    # The last block and the last extent themselves are in bounds.
    save(arena, lay, Pages.of([rows - 1], [extent]))


@given(
    kind=st.sampled_from(["vllm", "sglang", "mamba"]),
    picks=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 7)), min_size=1, max_size=6),
    shift=st.sampled_from([0, 8, 64, 4]),
)
def test_save_rows_writes_and_sums_as_save_does_without_building_pages(kind, picks, shift):
    """``save_rows`` (the engines' CPU save of one part) against ``save`` of the same pages: the same bytes in
    each extent, the same checksums, nothing else written. Plain ints in range on word-aligned extents take
    its own route (``save`` is not called); an extent off a word (``shift`` 4) goes to ``save``."""
    from cacheon_orbitkv import transfer, wire

    assert wire.compiled_checksum() and wire.page_kernels() is not None
    lay = layouts(engine_buffers(seed=len(picks)))[kind]
    rows = [min(row, lay.rows - 1) for row, _ in picks]
    slots = sorted({slot for _, slot in picks})[: len(rows)]
    rows = rows[: len(slots)]
    offsets = [shift + slot * lay.page_bytes for slot in slots]
    size = 8 * lay.page_bytes + 64
    shipped = Arena(mmap.mmap(-1, size, flags=mmap.MAP_SHARED))
    fast = Arena(mmap.mmap(-1, size, flags=mmap.MAP_SHARED))
    shipped.cpu[:] = 0xA5
    fast.cpu[:] = 0xA5
    wanted = save(shipped, lay, Pages.of(rows, offsets)).checksums()
    called = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transfer, "save", lambda *args: called.append(args) or save(*args))
        fence = save_rows(fast, lay, rows, offsets)
    assert fence.checksums() == wanted
    assert bytes(fast.region) == bytes(shipped.region)
    assert fence.path == ("compiled" if shift % 8 == 0 else "torch") and len(called) == (shift % 8 != 0)
    for row, offset, sum_ in zip(rows, offsets, wanted, strict=True):
        page = b"".join(seg[row].contiguous().numpy().tobytes() for seg in lay.segments)
        assert bytes(fast.region[offset : offset + lay.page_bytes]) == page and checksum(page) == sum_


@pytest.mark.parametrize(
    "rows, offsets, match",
    [
        ([1.5], [0], "the pages'"),
        ([1, True], [0, 8], "the pages'"),
        ([np.int64(-1)], [0], "the pages'"),
        ([1], [-8], "the pages'"),
        ([1, 2], [0], "the pages'"),
        ([12], [0], "past the engine buffers"),
        ([1], [None], "the pages'"),
        ([1, 2], [0, "extent"], "ends past the arena"),
    ],
)
def test_save_rows_refuses_what_save_refuses_before_anything_moves(rows, offsets, match):
    lay = layouts(engine_buffers())["vllm"]
    arena = Arena(mmap.mmap(-1, 4 * lay.page_bytes, flags=mmap.MAP_SHARED))
    arena.cpu[:] = 0xA5
    offsets = [arena.size - lay.page_bytes + 8 if o == "extent" else o for o in offsets]
    with pytest.raises(ValueError, match=match):
        save_rows(arena, lay, rows, offsets)
    assert not (arena.cpu != 0xA5).any()


def _mix64_of_chunk(chunk: bytes, first_word: int) -> int:
    """One chunk's share of a page checksum, computed word by word in plain Python (an oracle
    independent of the numpy code), knowing where the chunk starts in its page."""
    total = 0
    for i in range(0, len(chunk), 8):
        word = int.from_bytes(chunk[i : i + 8], "little")
        x = ((word ^ ((first_word + i // 8) * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        total += x ^ (x >> 31)
    return total


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_checksum_is_a_sum_over_chunks_that_knows_each_chunks_place(sizes, seed):
    """Kernels sum each segment's chunk as they copy it; the chunks' shares add up to the page's."""
    from cacheon_orbitkv.wire import checksum

    rng = np.random.default_rng(seed)
    parts = [rng.bytes(8 * n) for n in sizes]
    whole = b"".join(parts)
    total, first = 0, 0
    for part in parts:
        total += _mix64_of_chunk(part, first)
        first += len(part) // 8
    assert checksum(whole) == (total & (2**64 - 1)) ^ len(whole)


@given(words=st.integers(2, 64), data=st.data())
def test_checksum_detects_swapped_and_shifted_words(words, data):
    """The layout mix-ups that corrupt KV in practice (swapped rows, K/V halves, layers; shifted
    data) change the checksum, which a plain sum of words would not notice."""
    from cacheon_orbitkv.wire import checksum

    page = bytearray(np.random.default_rng(words).bytes(8 * words))
    i = data.draw(st.integers(0, words - 1))
    j = data.draw(st.integers(0, words - 1).filter(lambda k: page[8 * k : 8 * k + 8] != page[8 * i : 8 * i + 8]))
    swapped = bytearray(page)
    swapped[8 * i : 8 * i + 8], swapped[8 * j : 8 * j + 8] = page[8 * j : 8 * j + 8], page[8 * i : 8 * i + 8]
    assert checksum(swapped) != checksum(page)
    half = 8 * (words // 2)
    if page[:half] != page[half : 2 * half]:
        halves = page[half : 2 * half] + page[:half] + page[2 * half :]
        assert checksum(halves) != checksum(page)  # K and V halves exchanged
    shifted = page[8:] + page[:8]
    if shifted != page:
        assert checksum(shifted) != checksum(page)


def _random_bytes(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


# Lengths 0..64 (every ragged tail), then any up to 1 MiB (pages with or without a tail).
_lengths = st.one_of(st.integers(0, 64), st.integers(65, 1 << 20))


@given(size=_lengths, seed=st.integers(0, 2**32 - 1), src_shift=st.integers(0, 7), dst_shift=st.integers(0, 71))
# the kernels' blocks of 64 words, and their prefetch 256 words ahead: either side of each edge, with a
# tail; destinations on a line boundary, a word past one (7 words before the next) and between words
@example(size=8 * 64 - 1, seed=1, src_shift=0, dst_shift=0)
@example(size=8 * (256 + 64) - 8, seed=2, src_shift=1, dst_shift=3)
@example(size=8 * (256 + 64), seed=3, src_shift=0, dst_shift=0)
@example(size=8 * (256 + 128) + 5, seed=4, src_shift=7, dst_shift=8)
@example(size=8 * (64 + 7), seed=5, src_shift=0, dst_shift=8)
@example(size=8 * (64 + 6), seed=6, src_shift=0, dst_shift=8)
@example(size=8 * (2 * 64 + 7) + 3, seed=7, src_shift=3, dst_shift=56)
def test_compiled_checksum_and_fused_copy_are_the_numpy_checksum(size, seed, src_shift, dst_shift):
    """The compiled mix64 (numba) equals numpy's for every length and alignment, and the fused copy
    writes exactly the source's bytes, into a shared mapping like the arena, and nothing around them:
    at every offset of its destination from a 64-byte line (its whole-line stores start at the first
    line boundary) and from a word."""
    from cacheon_orbitkv.wire import _checksum_numpy, checksum, compiled_checksum, copy_with_checksum

    assert compiled_checksum(), "numba is missing or failed: this would compare numpy with itself"
    data = _random_bytes(seed, size)
    expected = _checksum_numpy(data)
    backing = bytearray(size + 8)
    backing[src_shift : src_shift + size] = data
    source = memoryview(backing)[src_shift : src_shift + size]  # read-write, unaligned by src_shift
    assert checksum(data) == expected
    assert checksum(source) == expected
    assert checksum(source.toreadonly()) == expected
    region = mmap.mmap(-1, size + 80, flags=mmap.MAP_SHARED)
    try:
        region[:] = b"\xa5" * len(region)
        view = memoryview(region)
        try:
            for src in (data, source):
                dst = view[dst_shift : dst_shift + size]
                assert copy_with_checksum(dst, src) == expected
                dst.release()
                assert region[dst_shift : dst_shift + size] == data
                assert region[:dst_shift] == b"\xa5" * dst_shift
                assert region[dst_shift + size :] == b"\xa5" * (len(region) - dst_shift - size)
                region[:] = b"\xa5" * len(region)
        finally:
            view.release()
    finally:
        region.close()


@given(
    chunks=st.lists(st.integers(1, 2600), min_size=1, max_size=4),
    pages=st.integers(1, 3),
    shift=st.integers(0, 71),
    bad=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
# chunks past the prefetch's reach (256 words) and of whole lines; one word past a block; the engine's
# side not word-aligned (memcpy, then the sum); a restore's first, middle or last page bad
@example(chunks=[1100, 8, 1], pages=2, shift=0, bad=0, seed=1)
@example(chunks=[65, 64], pages=1, shift=8, bad=0, seed=2)
@example(chunks=[3, 1, 5], pages=3, shift=4, bad=1, seed=3)
@example(chunks=[2000, 300], pages=3, shift=16, bad=1, seed=4)
@example(chunks=[2000, 300], pages=3, shift=16, bad=2, seed=5)  # two good pages in a row, then a bad one
@example(chunks=[64, 1, 71], pages=3, shift=0, bad=0, seed=6)
def test_compiled_page_kernels_copy_and_sum_as_numpy(chunks, pages, shift, bad, seed):
    """The CPU path's compiled page kernels against numpy, on pages of several chunks of whole words (as
    many as a layout has segments; a layout refuses others) at every alignment of the engine's side: a save
    writes each page's chunks end to end into its arena extent and returns the page's checksum (word
    indices running on across the chunks); a restore copies each page out and reports whether it matched
    its checksum (a page that does not is written only where its copy and sum are one pass), and writes
    nothing else."""
    from cacheon_orbitkv import wire

    assert wire.compiled_checksum(), "numba is missing or failed: this would compare numpy with itself"
    kernels = wire._kernels()
    assert kernels is not None and kernels.pages_in is not None and kernels.pages_out is not None
    sizes_of = np.asarray([8 * c for c in chunks], np.uint64)
    page = int(sizes_of.sum())
    page_words = page // 8
    rng = np.random.default_rng(seed)
    engine = np.frombuffer(mmap.mmap(-1, (pages + 1) * page + 128), np.uint8)  # page-aligned, as tensors
    engine[:] = rng.integers(0, 256, engine.size, dtype=np.uint8)
    region = mmap.mmap(-1, (pages + 1) * page_words * 8, flags=mmap.MAP_SHARED)
    arena = np.frombuffer(region, np.uint8)
    arena[:] = 0xA5
    extents = (np.arange(pages, dtype=np.int64)[::-1] + 1) * page_words * 8  # out of order, first one free
    at = np.concatenate([[0], np.cumsum(sizes_of[:-1])]).astype(np.uint64)
    blocks = rng.permutation(pages + 1)[:pages].astype(np.uint64)  # engine blocks of ``page`` bytes
    engine_at = (np.uint64(engine.ctypes.data + shift) + blocks[:, None] * np.uint64(page) + at).ravel()
    arena_at = (np.uint64(arena.ctypes.data) + extents.astype(np.uint64)[:, None] + at).ravel()
    sizes = np.tile(sizes_of, pages)
    sums = np.zeros(pages, np.uint64)
    kernels.pages_in(arena.view(np.uint64), extents >> 3, page_words, arena_at, engine_at, sizes, sums)
    wanted = [engine[shift + int(b) * page : shift + (int(b) + 1) * page].tobytes() for b in blocks]
    for p in range(pages):
        assert arena[extents[p] : extents[p] + page].tobytes() == wanted[p]
        assert int(sums[p]) == wire._checksum_numpy(wanted[p])
    assert not (arena[:page] != 0xA5).any()  # the free extent untouched
    # Out again into a zeroed engine, one page's committed checksum wrong: reported bad. Where the engine's
    # side is whole words it was copied out as it was summed (as on the GPU), else summed first and not
    # copied; nothing outside the pages' blocks is written.
    bad %= pages
    sums[bad] ^= np.uint64(1)
    engine[:] = 0
    verdicts = np.zeros(pages, np.bool_)
    kernels.pages_out(arena.view(np.uint64), extents >> 3, page_words, sums, engine_at, arena_at, sizes, verdicts)
    assert verdicts.tolist() == [p != bad for p in range(pages)]
    image = np.zeros_like(engine)
    for p in range(pages):
        if p != bad or shift % 8 == 0:
            image[shift + int(blocks[p]) * page : shift + (int(blocks[p]) + 1) * page] = np.frombuffer(
                wanted[p], np.uint8
            )
    assert np.array_equal(engine, image)


@given(size=st.integers(0, 300), seed=st.integers(0, 2**32 - 1), shift=st.integers(-17, 17))
def test_fused_copy_between_overlapping_extents_is_a_memmove(size, seed, shift):
    """Source and destination in one buffer, overlapping either way: the copy is ``memmove``'s and the
    checksum is the source's as it was before the copy."""
    from cacheon_orbitkv.wire import _checksum_numpy, copy_with_checksum

    buffer = bytearray(_random_bytes(seed, size + 40))
    start = 20
    data = bytes(buffer[start : start + size])
    view = memoryview(buffer)
    assert copy_with_checksum(view[start + shift : start + shift + size], view[start : start + size]) == (
        _checksum_numpy(data)
    )
    assert buffer[start + shift : start + shift + size] == data


def test_fused_copy_refuses_a_wrong_length_or_a_read_only_destination():
    from cacheon_orbitkv.wire import copy_with_checksum

    target = bytearray(b"\0" * 16)
    with pytest.raises(ValueError):
        copy_with_checksum(memoryview(target)[:15], b"x" * 16)
    with pytest.raises(TypeError):
        copy_with_checksum(memoryview(target).toreadonly(), b"x" * 16)
    assert target == b"\0" * 16


def test_the_numpy_checksum_runs_until_compiled_and_without_numba_said_once(monkeypatch, caplog):
    """No caller waits for the compiler: the numpy checksum (the same numbers) runs meanwhile, and for
    good where numba is missing (said once, at INFO: the extra is optional) or fails to compile."""
    import logging
    import threading

    from cacheon_orbitkv import wire

    wire.compiled_checksum()  # no compiler of this process still at work while its state is replaced
    release = threading.Event()

    def no_numba():
        release.wait(10)  # the compiler at work until the checks below have run
        raise ImportError("No module named 'numba'")

    monkeypatch.setattr(wire, "_compile_kernels", no_numba)
    monkeypatch.setattr(wire, "_compiled", None)
    monkeypatch.setattr(wire, "_compile_started", False)
    monkeypatch.setattr(wire, "_compile_done", threading.Event())
    caplog.set_level(logging.INFO, logger="cacheon_orbitkv.wire")
    data = _random_bytes(7, 4099)
    target = bytearray(len(data))
    for _ in range(2):
        assert wire.checksum(data) == wire._checksum_numpy(data)
        assert wire.copy_with_checksum(target, data) == wire._checksum_numpy(data) and target == data
    assert wire._compile_started and not wire._compile_done.is_set()  # all of it while it compiled
    release.set()
    assert not wire.compiled_checksum()
    assert wire.checksum(data) == wire._checksum_numpy(data)
    said = [r for r in caplog.records if r.name == "cacheon_orbitkv.wire"]
    assert len(said) == 1 and "cacheon-orbitkv[fast]" in said[0].getMessage(), said
    assert said[0].levelno == logging.INFO


# wire's module globals that the kernels read when numba compiles them: a test that recompiles restores them.
KERNEL_PARTS = (
    "_prefetch",
    "_store_word",
    "_drain_stores",
    "_sum",
    "_ahead",
    "_whole",
    "_memcpy",
    "_store_line",
    "_address",
    "_mixed_copy",
    "_words_at",
    "_in_page",
    "_pointer",
    "_carray",
    "_page_copy",
)


def _asm(kernel) -> str:
    (code,) = kernel.inspect_asm().values()
    return code


def _same_sums_and_bytes(mix, copy) -> None:
    from cacheon_orbitkv import wire

    for size in (8, 8 * 64, 8 * 320, 8 * 333, 1 << 18):
        data = _random_bytes(size, size)
        words = np.frombuffer(data, np.uint64)
        sink = np.zeros_like(words)
        expected = wire._checksum_numpy(data) ^ size
        assert int(mix(words)) == expected and int(copy(sink, words)) == expected
        assert sink.tobytes() == data


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86-64 instructions are checked")
def test_the_compiled_kernels_prefetch_stream_their_stores_and_compile_without_either(monkeypatch):
    """The kernels as shipped on x86-64 prefetch the source ahead of each block (prefetcht0), and the copy
    writes the arena with streaming stores, a whole line per vector store from its first line boundary
    (a vector movnt) and word by word before it (movnti), and ends with a store fence (sfence); the save's
    and the restore's page kernels too. Where either cannot be built they compile without it, and sum and
    copy the same."""
    from cacheon_orbitkv import wire

    assert wire.compiled_checksum()
    mix, copy, pages_out, pages_in = wire._compiled
    assert "prefetcht0" in _asm(mix) and "prefetcht0" in _asm(copy)
    for kernel in (copy, pages_in, pages_out):
        code = _asm(kernel)
        assert "movnti" in code and "sfence" in code and re.search(r"\bv?movnt(dq|ps|pd)\b", code)
    assert "movnt" not in _asm(mix)
    for name in KERNEL_PARTS:
        monkeypatch.setattr(wire, name, getattr(wire, name))  # restored after: the shipped intrinsics

    def unavailable():
        raise RuntimeError("not on this LLVM")

    monkeypatch.setattr(wire, "_streaming_intrinsics", unavailable)
    mix, copy = wire._compile_kernels()[:2]
    assert "prefetcht0" in _asm(copy) and "movnt" not in _asm(copy) and "sfence" not in _asm(copy)
    _same_sums_and_bytes(mix, copy)
    monkeypatch.setattr(wire, "_prefetch_intrinsic", unavailable)
    mix, copy = wire._compile_kernels()[:2]
    assert "prefetcht0" not in _asm(mix) + _asm(copy) and "movnt" not in _asm(copy)
    _same_sums_and_bytes(mix, copy)


def test_a_fork_waits_for_the_compiler_and_the_child_can_use_numba(monkeypatch):
    """A child forked while numba compiles in the parent's thread would inherit numba's locks held by
    a thread it does not have: the fork waits until the compiler is done instead."""
    import os
    import threading
    import time

    from cacheon_orbitkv import wire

    wire.compiled_checksum()
    started, finished = threading.Event(), threading.Event()

    def slow_compiler():
        started.set()
        time.sleep(0.5)
        finished.set()
        raise ImportError("No module named 'numba'")

    monkeypatch.setattr(wire, "_compile_kernels", slow_compiler)
    monkeypatch.setattr(wire, "_compiled", None)
    monkeypatch.setattr(wire, "_compile_started", False)
    monkeypatch.setattr(wire, "_compile_done", threading.Event())
    wire.compiled_checksum(wait=False)
    assert started.wait(10) and not finished.is_set()
    pid = os.fork()
    if pid == 0:  # the child: no lock of the compiler held, numpy's checksum
        free = wire._COMPILING.acquire(blocking=False)
        os._exit(0 if free and wire._compile_done.is_set() and wire.checksum(b"x" * 8) else 1)
    assert finished.is_set()  # the parent's fork returned only once the compiler was done
    assert os.waitpid(pid, 0)[1] == 0
    wire.compiled_checksum()
    assert wire._COMPILING.acquire(blocking=False)  # released again in the parent
    wire._COMPILING.release()


def test_copy_engine_addresses_are_each_chunks_own(tmp_path):
    # The batched copy-engine path hands the driver raw addresses: each must be exactly where the
    # chunk-by-chunk path copies, in both directions.
    from cacheon_orbitkv.transfer import _copy_addresses

    region = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
    arena = Arena(region)
    lay = layouts(engine_buffers("cpu", seed=1))["vllm"]
    pages = [PagePlan(5, 3 * lay.page_bytes), PagePlan(2, 0), PagePlan(7, lay.page_bytes)]
    expected = []
    for page in pages:
        at = page.offset
        for seg, chunk in zip(lay.segments, lay.chunks, strict=True):
            expected.append((arena.cpu[at:].data_ptr(), seg[page.block].data_ptr(), chunk))
            at += chunk
    dst, src, sizes = _copy_addresses(arena, lay, Pages.from_plans(pages), to_arena=True)
    assert list(zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True)) == expected
    dst, src, sizes = _copy_addresses(arena, lay, Pages.from_plans(pages), to_arena=False)
    assert list(zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True)) == expected
    arena.close()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["triton", "triton_capped", "copy_engine", "copy_engine_chunked"])
def test_gpu_paths_round_trip_and_match_the_cpu_checksums(sock_dir, path, monkeypatch):
    from cacheon_orbitkv.transfer import BatchCopy

    # triton_capped: a grid of 2 persistent programs, as save and restore run when they share the GPU
    capped = {"programs": 2} if path == "triton_capped" else {}
    path = "triton" if path == "triton_capped" else path
    if path == "copy_engine":
        assert BatchCopy.get() is not None, "this driver has no cuMemcpyBatchAsync"
    elif path == "copy_engine_chunked":  # one cudaMemcpyAsync per chunk, as on a driver older than CUDA 12.8
        monkeypatch.setattr(BatchCopy, "_looked_up", True)
        monkeypatch.setattr(BatchCopy, "_instance", None)
        path = "copy_engine"
    endpoint = f"unix://{sock_dir / 'm.sock'}"
    with EmbeddedManager(endpoint, 16 << 20) as _, CacheClient(endpoint) as client:
        arena = Arena(client.arena, device="cuda")
        try:
            source = engine_buffers("cuda", seed=5)
            lay = layouts(source)
            hashes = page_hashes(NS, list(range(64)), 16)[:4]
            reservation, offsets = client.reserve(NS, 0, [(h, lay["vllm"].page_bytes) for h in hashes])
            fence = save(
                arena,
                lay["vllm"],
                [PagePlan(b, o) for b, o in zip([1, 3, 5, 7], offsets, strict=True)],
                path=path,
                **capped,
            )
            sums = fence.checksums()
            assert sums == [client.checksum_of(o, lay["vllm"].page_bytes) for o in offsets]
            client.commit(reservation, sums)
            rec = client.read_recovery(NS, 64, [(0, hashes)])
            dest = engine_buffers("cuda", seed=6)
            dlay = layouts(dest)["vllm"]
            before = [s.clone() for s in dlay.segments]
            plans = [PagePlan(b, r.offset, r.checksum) for b, r in zip([0, 2, 4, 6], rec.pages[0], strict=True)]
            assert restore(arena, dlay, plans, path=path, **capped).wait() == [True] * 4
            for s, d, b in zip(lay["vllm"].segments, dlay.segments, before, strict=True):
                for src, dst in zip([1, 3, 5, 7], [0, 2, 4, 6], strict=True):
                    assert torch.equal(d[dst], s[src])
                for untouched in (1, 3, 5, 7, 8, 9, 10, 11):
                    assert torch.equal(d[untouched], b[untouched])
            client.release(rec.lease)
        finally:
            arena.close()


INTERPRETED = """
import mmap, torch
from cacheon_orbitkv.transfer import Arena, GroupLayout, PagePlan, restore, save, vllm_layer
from cacheon_orbitkv.wire import checksum
region = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
arena = Arena(region)
g = torch.Generator().manual_seed(0)
src = [torch.randn(2, 8, 16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
dst = [torch.full_like(t, float("nan")) for t in src]
lay = GroupLayout([s for layer in src for s in vllm_layer(layer)])
dlay = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
pages = [PagePlan(5, 0), PagePlan(2, lay.page_bytes), PagePlan(7, 2 * lay.page_bytes)]
fence = save(arena, lay, pages, path="triton")
sums = fence.checksums()
assert fence.path == "triton"
assert sums == [checksum(memoryview(region)[p.offset : p.offset + lay.page_bytes]) for p in pages], sums
region[2 * lay.page_bytes + 8] ^= 0xFF  # corrupt the third page in the arena
back = [PagePlan(b, p.offset, s) for b, p, s in zip([0, 1, 3], pages, sums)]
verdicts = restore(arena, dlay, back, path="triton").wait()
assert verdicts == [True, True, False], verdicts
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    assert torch.equal(d_seg[0], s_seg[5]) and torch.equal(d_seg[1], s_seg[2])
    assert torch.isnan(d_seg[2].view(torch.bfloat16)).all()  # never named: untouched
print("ok")
"""


def interpreted(script: str) -> None:
    """Run ``script`` in a fresh interpreter with Triton's CPU interpreter on; it must print "ok"."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_the_triton_kernels_round_trip_under_the_interpreter_and_flag_a_corrupt_page():
    interpreted(INTERPRETED)


REPLAYED = """
import mmap, torch
from cacheon_orbitkv import transfer
from cacheon_orbitkv.transfer import Arena, GroupLayout, Pages, PagePlan, restore, save, vllm_layer
region = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
arena = Arena(region)
g = torch.Generator().manual_seed(0)
src = [torch.randn(2, 10, 16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
dst = [torch.full_like(t, float("nan")) for t in src]
lay = GroupLayout([s for layer in src for s in vllm_layer(layer)])
dlay = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
saved = [PagePlan(b, i * lay.page_bytes) for i, b in enumerate([3, 6, 1, 8])]
sums = save(arena, lay, saved, path="triton").checksums()
def pages(pairs, wrong=()):  # (saved page, engine block) pairs
    return Pages.of([b for _, b in pairs], [saved[i].offset for i, _ in pairs],
                    [sums[i] ^ (1 if i in wrong else 0) for i, _ in pairs])
replayed, stream = transfer._replayed(arena, dlay, 3)  # the interpreter: the graph's kernels, launched eagerly
assert replayed.capacity == transfer.REPLAY_MIN_PAGES and not replayed.execs and stream is None
assert transfer._replayed(arena, dlay, 16)[0] is replayed and transfer._replayed(arena, dlay, 17)[0] is not replayed
first = pages([(0, 5), (1, 2), (2, 7)])
got_sums, first_verdicts = replayed.run(first)
assert first_verdicts.tolist() == [True] * 3
eager = restore(arena, dlay, first, path="triton", graphs=False)  # the same pages, eagerly: the same sums
assert eager.wait() == [True] * 3 and torch.equal(got_sums, eager.sums)
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    for a, b in ((3, 5), (6, 2), (1, 7)):
        assert torch.equal(d_seg[b], s_seg[a])
for _ in range(transfer.REPLAY_SLOTS - 1):  # the other slots, then the first one again with fewer pages
    assert replayed.run(pages([(3, 9)]))[1].tolist() == [True]
for d_seg in dlay.segments:
    d_seg[2].view(torch.bfloat16).fill_(float("nan"))
    d_seg[7].view(torch.bfloat16).fill_(float("nan"))
assert replayed.turn % transfer.REPLAY_SLOTS == 0
_, verdicts = replayed.run(pages([(3, 0)], wrong={3}))  # a wrong checksum: reported, not acknowledged
assert verdicts.tolist() == [False]
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    assert torch.equal(d_seg[0], s_seg[8])
    # the slot's stale pages past the live count (blocks 2 and 7 of the first call) are not moved again
    assert torch.isnan(d_seg[2].view(torch.bfloat16)).all() and torch.isnan(d_seg[7].view(torch.bfloat16)).all()
assert replayed.replays == transfer.REPLAY_SLOTS + 1
assert first_verdicts.tolist() == [True] * 3  # each call's verdicts are its own, not the capture's buffer
# A capture that fails: one warning, then that layout's restores launch eagerly; other layouts still replay.
import logging
warnings = []
class Kept(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("cacheon_orbitkv.transfer").addHandler(Kept())
other = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
shipped = transfer._Replayed.__init__
def refused(*args, **kwargs):
    raise RuntimeError("capture refused")
transfer._Replayed.__init__ = refused
assert transfer._replayed(arena, other, 3) is None and transfer._replayed(arena, other, 40) is None
transfer._Replayed.__init__ = shipped
assert transfer._replayed(arena, other, 3) is None  # that layout stays eager
assert len(warnings) == 1 and "capture refused" in warnings[0], warnings
assert transfer._replayed(arena, dlay, 3)[0] is replayed
# restore() takes the replayed path (here, under the interpreter, its kernels one by one); a replay that
# fails (as a launch the driver refused) warns once, and that call and the layout's next run eagerly.
third = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
back = pages([(0, 4), (1, 6)])
assert restore(arena, third, back, path="triton").wait() == [True, True] and len(third.replays) == 1
shipped_run = transfer._Replayed.run
def refused_launch(self, pages, stream=None):
    raise RuntimeError("launch refused")
transfer._Replayed.run = refused_launch
assert restore(arena, third, pages([(0, 4), (1, 6)], wrong={1}), path="triton").wait() == [True, False]
assert restore(arena, third, back, path="triton").wait() == [True, True]
transfer._Replayed.run = shipped_run
assert third.replays == {(0, 0, 0): False} and sum("a replay failed" in w for w in warnings) == 1
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    assert torch.equal(d_seg[4], s_seg[3]) and torch.equal(d_seg[6], s_seg[6])
print("ok")
"""


def test_the_replayed_restore_moves_only_its_live_pages_under_the_interpreter():
    interpreted(REPLAYED)


STAGED = """
import logging, mmap, torch
from cacheon_orbitkv import transfer
from cacheon_orbitkv.transfer import Arena, GroupLayout, Pages, PagePlan, restore, save, vllm_layer
warnings = []
class Kept(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("cacheon_orbitkv.transfer").addHandler(Kept())
region = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
arena = Arena(region)
g = torch.Generator().manual_seed(0)
src = [torch.randn(2, 12, 16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
dst = [torch.full_like(t, float("nan")) for t in src]
lay = GroupLayout([s for layer in src for s in vllm_layer(layer)])
dlay = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
saved = [PagePlan(b, i * lay.page_bytes) for i, b in enumerate([3, 6, 1, 8, 0, 11, 4])]
sums = save(arena, lay, saved, path="triton").checksums()
def pages(pairs, wrong=()):  # (saved page, engine block) pairs
    return Pages.of([b for _, b in pairs], [saved[i].offset for i, _ in pairs],
                    [sums[i] ^ (1 if i in wrong else 0) for i, _ in pairs])
# A ring of 3 slots of 2 pages (the interpreter's ring is host memory): 7 pages are 4 groups, the last one
# in the first slot again, refilled after the kernel that read it.
stager = transfer._STAGERS["cpu", False] = transfer._Staged("cpu", 2 * lay.page_bytes, 3)
assert transfer.restore(arena, dlay, pages([(0, 0)]), path="triton").path == "triton"  # only when asked on the CPU
assert stager.turn == 0
first = pages([(i, b) for i, b in enumerate([2, 5, 7, 9, 10, 1, 3])], wrong={5})
fence = restore(arena, dlay, first, path="staged")
assert fence.path == "staged" and stager.turn == 4
assert fence.wait() == [True] * 5 + [False, True]  # a wrong committed checksum: reported, not acknowledged
assert fence.checksums() == sums  # the bytes' own sums, as the triton path computes them
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    for i, b in enumerate([2, 5, 7, 9, 10, 1, 3]):
        assert torch.equal(d_seg[b], s_seg[saved[i].block]), (i, b)
    for untouched in (4, 6, 8, 11):  # (block 0: the triton call above)
        assert torch.isnan(d_seg[untouched].view(torch.bfloat16)).all()
# the next call starts where the last left the ring: slot 4 % 3 = 1
assert restore(arena, dlay, pages([(6, 4)]), path="staged").wait() == [True] and stager.turn == 5
page = lay.page_bytes
assert bytes(stager.ring[2 * page : 3 * page].numpy()) == region[saved[6].offset : saved[6].offset + page]
# a corrupt arena page, staged: the verdict is False
region[saved[2].offset + 16] ^= 0x40
assert restore(arena, dlay, pages([(2, 6), (3, 8)]), path="staged").wait() == [False, True]
region[saved[2].offset + 16] ^= 0x40
# One copy per run of extents that lie end to end in the arena: pages out of their arena order and one arena
# page twice (3 groups of 2) break the runs there; every block gets its own page.
shipped_runs, runs = transfer._runs, []
def counted(places, offsets, page):
    found = shipped_runs(places, offsets, page)
    runs.append(found[2].tolist())
    return found
transfer._runs = counted
order = [(5, 1), (4, 2), (0, 4), (1, 6), (3, 8), (3, 10)]
assert restore(arena, dlay, pages(order), path="staged").wait() == [True] * 6
transfer._runs = shipped_runs
page = lay.page_bytes
assert runs == [[page, page], [2 * page], [page, page]], runs
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    for i, b in order:
        assert torch.equal(d_seg[b], s_seg[saved[i].block]), (i, b)
# a page that does not fit a slot: a typed error when asked for, the SMs when not
wide = GroupLayout([s for layer in dst for s in vllm_layer(layer)] * 3)
try:
    restore(arena, wide, Pages.of([1], [0], [0]), path="staged")
except ValueError as e:
    assert "staging ring" in str(e)
else:
    raise AssertionError("a page wider than a slot was staged")
# a staged restore that fails (a copy the driver refused): one warning, the call and the next on the SMs
shipped = transfer._Staged.run
def refused(self, arena, layout, pages):
    raise RuntimeError("copy refused")
transfer._Staged.run = refused
for d_seg in dlay.segments:
    d_seg[9].view(torch.bfloat16).fill_(float("nan"))
again = restore(arena, dlay, pages([(3, 9), (4, 10)], wrong={4}), path="staged")
transfer._Staged.run = shipped
assert again.path == "triton" and again.wait() == [True, False]
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    assert torch.equal(d_seg[9], s_seg[8])
assert transfer._STAGERS["cpu", False] is False and transfer._STAGERS_FAILED == [stager]
assert sum("restores run without a staging ring on cpu: a staged one failed" in w for w in warnings) == 1, warnings
assert len(warnings) == 1, warnings
try:
    restore(arena, dlay, pages([(0, 0)]), path="staged")
except ValueError:
    pass
else:
    raise AssertionError("staged without a ring")
# Saves through a ring of their own: the same blocks saved again at fresh offsets, 4 groups in 3 slots: the
# same bytes in the arena, the same checksums as the triton path gave them.
saver = transfer._STAGERS["cpu", True] = transfer._Staged("cpu", 2 * lay.page_bytes, 3)
again_at = [PagePlan(p.block, (10 + i) * page) for i, p in enumerate(saved)]
fence = save(arena, lay, again_at, path="staged")
assert fence.path == "staged" and saver.turn == 4 and fence.checksums() == sums
for p, q in zip(saved, again_at):
    assert region[p.offset : p.offset + page] == region[q.offset : q.offset + page]
assert save(arena, lay, again_at[:1], path="triton").path == "triton"  # only when asked on the CPU
shipped_save = transfer._Staged.save
def refused_save(self, arena, layout, pages):
    raise RuntimeError("copy refused")
transfer._Staged.save = refused_save
region[again_at[0].offset : again_at[0].offset + page] = bytes(page)
fallback = save(arena, lay, again_at[:2], path="staged")
transfer._Staged.save = shipped_save
assert fallback.path == "triton" and fallback.checksums() == sums[:2]
assert region[again_at[0].offset : again_at[0].offset + page] == region[saved[0].offset : saved[0].offset + page]
assert transfer._STAGERS["cpu", True] is False and transfer._STAGERS_FAILED == [stager, saver]
assert sum("saves run without a staging ring on cpu: a staged one failed" in w for w in warnings) == 1, warnings
assert len(warnings) == 2, warnings
# A ring that cannot be allocated (an engine that left no device memory): one warning, no ring, and a
# restore asked to stage is refused with a typed error; the SMs' restore still works.
transfer._STAGERS.clear()
shipped_init = transfer._Staged.__init__
def no_memory(self, *args, **kwargs):
    raise MemoryError("out of memory")
transfer._Staged.__init__ = no_memory
assert transfer._stager(arena, dlay, asked=True) is None and transfer._stager(arena, dlay, asked=True) is None
transfer._Staged.__init__ = shipped_init
assert transfer._STAGERS["cpu", False] is False
refused_ring = "restores run without a staging ring on cpu: setting it up failed: out of memory"
assert sum(refused_ring in w for w in warnings) == 1, warnings
assert len(warnings) == 3, warnings
assert restore(arena, dlay, pages([(0, 0), (1, 1)]), path="triton").wait() == [True, True]
print("ok")
"""


@settings(max_examples=200)
@given(
    page=st.sampled_from([8, 64, 4096]),
    steps=st.lists(st.sampled_from(["next", "same", "back", "jump"]), min_size=0, max_size=40),
    first=st.integers(0, 64),
)
def test_staged_runs_cover_each_extent_once_and_merge_only_extents_end_to_end(page, steps, first):
    from cacheon_orbitkv.transfer import _runs

    offsets = [first * page]
    for step in steps:
        offsets.append(offsets[-1] + {"next": page, "same": 0, "back": -page, "jump": 3 * page}[step])
    shift = -min(offsets)
    offsets_arr = np.array([o + shift for o in offsets], dtype=np.int64)
    places = np.arange(len(offsets), dtype=np.int64) * page + 5 * page  # a group's places in its slot
    at, into, lengths = _runs(places, offsets_arr, page)
    assert lengths.dtype == np.uint64 and len(at) == len(into) == len(lengths)
    # Expanded page by page, the runs are the pages' (place, offset) pairs, in order: each extent once.
    expanded = [
        (int(a) + k * page, int(o) + k * page)
        for a, o, n in zip(at, into, lengths, strict=True)
        for k in range(int(n) // page)
    ]
    assert expanded == list(zip(places.tolist(), offsets_arr.tolist(), strict=True))
    # Maximal: no run could go on into the next one.
    for k in range(len(at) - 1):
        assert into[k + 1] != into[k] + int(lengths[k])
    assert len(at) == 1 + sum(step != "next" for step in steps)


def test_the_staged_restore_moves_each_group_through_its_slot_under_the_interpreter():
    interpreted(STAGED)


BOUNDED = """
import mmap, torch
from cacheon_orbitkv.transfer import Arena, GraphRestore, GroupLayout, PagePlan, save, vllm_layer
region = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
arena = Arena(region)
g = torch.Generator().manual_seed(0)
src = [torch.randn(2, 8, 16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
dst = [torch.full_like(t, float("nan")) for t in src]
lay = GroupLayout([s for layer in src for s in vllm_layer(layer)])
dlay = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
pages = [PagePlan(b, i * lay.page_bytes) for i, b in enumerate([3, 6, 1])]
sums = save(arena, lay, pages, path="triton").checksums()
graph = GraphRestore(arena, dlay, capacity=4)
graph.prepare([PagePlan(5, pages[0].offset, sums[0]), PagePlan(2, pages[1].offset, sums[1])])
graph.launch()
assert graph.verdicts_now() == [True, True]
for s_seg, d_seg in zip(lay.segments, dlay.segments):
    assert torch.equal(d_seg[5], s_seg[3]) and torch.equal(d_seg[2], s_seg[6])
    assert torch.isnan(d_seg[0].view(torch.bfloat16)).all()  # stale table rows (block 0) are past the count
graph.prepare([PagePlan(7, pages[2].offset, sums[2] ^ 1)])  # a wrong checksum: reported, not acknowledged
graph.launch()
assert graph.verdicts_now() == [False]
print("ok")
"""


def test_the_graph_restore_is_bounded_by_its_device_side_count():
    interpreted(BOUNDED)


@pytest.mark.gpu
def test_the_restore_path_replays_in_a_cuda_graph_with_fresh_pages(sock_dir):
    from cacheon_orbitkv.transfer import GraphRestore

    endpoint = f"unix://{sock_dir / 'm.sock'}"
    with EmbeddedManager(endpoint, 16 << 20) as _, CacheClient(endpoint) as client:
        arena = Arena(client.arena, device="cuda")
        try:
            source = engine_buffers("cuda", seed=7)
            lay = layouts(source)["vllm"]
            hashes = page_hashes(NS, list(range(16 * 12)), 16)
            reservation, offsets = client.reserve(NS, 0, [(h, lay.page_bytes) for h in hashes])
            sums = save(arena, lay, [PagePlan(b, o) for b, o in zip(range(12), offsets, strict=True)]).checksums()
            client.commit(reservation, sums)
            dest = engine_buffers("cuda", seed=8)
            dlay = layouts(dest)["vllm"]
            restorer = GraphRestore(arena, dlay, capacity=6)
            restorer.prepare([PagePlan(0, offsets[0], sums[0])])
            restorer.launch()  # warm up (compile) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                restorer.launch()
            rounds = [([1, 4, 9], [2, 3, 5]), ([0, 11], [0, 11]), ([6, 7, 8, 10, 2], [6, 7, 8, 10, 1])]
            for sources, targets in rounds:
                before = [s.clone() for s in dlay.segments]
                restorer.prepare([PagePlan(t, offsets[s], sums[s]) for s, t in zip(sources, targets, strict=True)])
                graph.replay()
                torch.cuda.synchronize()
                assert restorer.verdicts_now() == [True] * len(sources)
                for s_seg, d_seg, b_seg in zip(lay.segments, dlay.segments, before, strict=True):
                    for src_block, dst_block in zip(sources, targets, strict=True):
                        assert torch.equal(d_seg[dst_block], s_seg[src_block])
                    for block in set(range(12)) - set(targets):
                        assert torch.equal(d_seg[block], b_seg[block])
            restorer.prepare([PagePlan(3, offsets[5], sums[5] ^ 1)])
            graph.replay()
            assert restorer.verdicts_now() == [False]
        finally:
            arena.close()


@pytest.mark.gpu
def test_restores_replay_captured_graphs_back_to_back_each_with_its_own_verdicts(monkeypatch):
    # Five restores issued before any is waited for, of 3, 16, 17, 40 and 5 pages: captures of 16, 32 and
    # 64 pages (two kept per layout here, so 64 drops 16 and 5 captures it again), each call's fence its own.
    from cacheon_orbitkv import transfer

    monkeypatch.setattr(transfer, "REPLAYS_PER_LAYOUT", 2)
    runs: list[tuple[int, int]] = []
    shipped = transfer._Replayed.run

    def counted(self, pages, stream=None):
        runs.append((self.capacity, len(pages)))
        return shipped(self, pages, stream)

    monkeypatch.setattr(transfer._Replayed, "run", counted)
    g = torch.Generator().manual_seed(11)
    src = [torch.randn(2, 96, 16, 2, 32, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
    dst = [torch.full_like(t, float("nan")) for t in src]
    lay = GroupLayout([s for layer in src for s in vllm_layer(layer)])
    dlay = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
    arena = Arena(mmap.mmap(-1, 96 * lay.page_bytes, flags=mmap.MAP_SHARED), device="cuda")
    try:
        sums = save(arena, lay, [PagePlan(b, b * lay.page_bytes) for b in range(96)]).checksums()
        targets = torch.randperm(96, generator=g).tolist()
        rounds, fences, at = [], [], 0
        for n in (3, 16, 17, 40, 5):
            sources = torch.randint(0, 96, (n,), generator=g).tolist()
            wrong = {1} if n == 17 else set()  # the second page of the 17 has a wrong checksum
            plan = Pages.of(
                targets[at : at + n],
                [s * lay.page_bytes for s in sources],
                [sums[s] ^ (1 if i in wrong else 0) for i, s in enumerate(sources)],
            )
            rounds.append((sources, targets[at : at + n], wrong))
            fences.append(restore(arena, dlay, plan))
            at += n
        assert runs == [(16, 3), (16, 16), (32, 17), (64, 40), (16, 5)]
        assert sorted(key[2] for key in dlay.replays) == [16, 64]
        assert all(len(r.execs) == transfer.REPLAY_SLOTS for r in dlay.replays.values())
        for fence, (sources, blocks, wrong) in zip(fences, rounds, strict=True):
            assert fence.wait() == [i not in wrong for i in range(len(sources))]
            for i, (s, b) in enumerate(zip(sources, blocks, strict=True)):
                if i not in wrong:
                    for s_seg, d_seg in zip(lay.segments, dlay.segments, strict=True):
                        assert torch.equal(d_seg[b], s_seg[s])
        for b in targets[at:]:  # never named: untouched
            assert all(torch.isnan(d_seg[b].view(torch.bfloat16)).all() for d_seg in dlay.segments)
        # The eager restore of the last round's pages gives the replayed call's very sums.
        sources, blocks, _ = rounds[-1]
        again = Pages.of(blocks, [s * lay.page_bytes for s in sources], [sums[s] for s in sources])
        eager = restore(arena, dlay, again, graphs=False)
        assert eager.wait() == [True] * 5 and runs[-1] == (16, 5)
        assert eager.checksums() == fences[-1].checksums() == [sums[s] for s in sources]
    finally:
        arena.close()


def _graphed_setup(blocks: int = 64, seed: int = 13):
    """Source and destination vLLM-shaped buffers on the GPU, every source block saved into an arena."""
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(2, blocks, 16, 2, 32, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
    dst = [torch.full_like(t, float("nan")) for t in src]
    lay = GroupLayout([s for layer in src for s in vllm_layer(layer)])
    dlay = GroupLayout([s for layer in dst for s in vllm_layer(layer)])
    arena = Arena(mmap.mmap(-1, blocks * lay.page_bytes, flags=mmap.MAP_SHARED), device="cuda")
    sums = save(arena, lay, [PagePlan(b, b * lay.page_bytes) for b in range(blocks)]).checksums()
    return lay, dlay, arena, sums


@pytest.mark.gpu
def test_a_restore_capture_leaves_other_threads_random_draws_alone():
    # An engine samples on the GPU in one thread while restores capture in another: a capture through
    # torch.cuda.CUDAGraph (torch 2.11) makes such draws fail ("Offset increment outside graph capture").
    import threading

    from cacheon_orbitkv import transfer

    lay, dlay, arena, sums = _graphed_setup()
    errors: list[BaseException] = []
    draws = [0]
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            try:
                torch.rand(4096, device="cuda").sum().item()
                draws[0] += 1
            except BaseException as e:  # any failure is the finding
                errors.append(e)
                return

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        for _ in range(10):
            dlay.replays.clear()  # every restore below captures again
            for n in (3, 20, 40):
                pages = Pages.of(list(range(n)), [b * lay.page_bytes for b in range(n)], sums[:n])
                assert restore(arena, dlay, pages).wait() == [True] * n
                assert transfer._replayed(arena, dlay, n) is not None
    finally:
        stop.set()
        thread.join()
        arena.close()
    assert not errors, errors[0]
    assert draws[0] > 0


@pytest.mark.gpu
def test_a_staging_slot_is_rewritten_only_after_its_last_call_ran():
    # Three times as many calls as slots queued behind a sleeping GPU, each with other pages: every call
    # must move and check its own pages, though the host fills each slot again before the GPU has run.
    from cacheon_orbitkv import transfer

    lay, dlay, arena, sums = _graphed_setup(blocks=96)
    try:
        g = torch.Generator().manual_seed(3)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the first restore can start
        fences, plans = [], []
        for k in range(3 * transfer.REPLAY_SLOTS):
            sources = torch.randint(0, 96, (8,), generator=g).tolist()
            targets = list(range(8 * k, 8 * k + 8))
            plans.append((sources, targets))
            fences.append(
                restore(
                    arena, dlay, Pages.of(targets, [s * lay.page_bytes for s in sources], [sums[s] for s in sources])
                )
            )
        for fence, (sources, targets) in zip(fences, plans, strict=True):
            assert fence.wait() == [True] * 8
            assert fence.checksums() == [sums[s] for s in sources]
            for s, t in zip(sources, targets, strict=True):
                for s_seg, d_seg in zip(lay.segments, dlay.segments, strict=True):
                    assert torch.equal(d_seg[t], s_seg[s])
        (replayed,) = dlay.replays.values()
        assert replayed.replays == 3 * transfer.REPLAY_SLOTS and len(replayed.execs) == transfer.REPLAY_SLOTS
    finally:
        arena.close()


@pytest.mark.gpu
def test_a_capture_that_fails_midway_falls_back_and_leaves_torch_working(monkeypatch, caplog):
    # A call that is not allowed while a stream captures (a device-wide synchronize) ends the capture:
    # one warning, the restore runs eagerly with the right verdicts, and torch's random draws and
    # allocations go on as before.
    from cacheon_orbitkv import transfer

    lay, dlay, arena, sums = _graphed_setup()
    shipped = transfer._Replayed._launch
    launches = [0]

    def synchronizing(self):
        shipped(self)
        launches[0] += 1
        if launches[0] > 1:  # the warm-up runs outside the capture; the next launch is captured
            torch.cuda.synchronize()

    monkeypatch.setattr(transfer._Replayed, "_launch", synchronizing)
    try:
        pages = Pages.of([1, 2, 3], [b * lay.page_bytes for b in (4, 5, 6)], [sums[b] for b in (4, 5, 6)])
        with caplog.at_level("WARNING", logger="cacheon_orbitkv.transfer"):
            assert restore(arena, dlay, pages).wait() == [True] * 3
            assert restore(arena, dlay, pages).wait() == [True] * 3
        warned = [r for r in caplog.records if "without CUDA graphs" in r.getMessage()]
        assert len(warned) == 1 and launches[0] == 2
        assert dlay.replays == {(0, 0, 0): False}
        for t, s in zip((1, 2, 3), (4, 5, 6), strict=True):
            for s_seg, d_seg in zip(lay.segments, dlay.segments, strict=True):
                assert torch.equal(d_seg[t], s_seg[s])
        torch.rand(1024, device="cuda").sum().item()
        reserved = torch.cuda.memory_reserved()
        for _ in range(20):
            block = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
            del block
        assert torch.cuda.memory_reserved() - reserved <= 32 << 20
    finally:
        arena.close()


def _wide_pages(seed: int, blocks: int = 128) -> GroupLayout:
    """8 layers of K and V rows of 64 KiB: 1 MiB page extents, restored staged by default."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    layers = [
        torch.randint(0, 256, (2, blocks, 64 << 10), dtype=torch.uint8, device="cuda", generator=g) for _ in range(8)
    ]
    return GroupLayout([half for layer in layers for half in (layer[0], layer[1])])


@pytest.mark.gpu
@pytest.mark.parametrize("batched", [True, False])
def test_staged_saves_and_restores_back_to_back_each_with_its_own_pages(batched, monkeypatch):
    from cacheon_orbitkv import transfer

    if batched:
        assert transfer.BatchCopy.get() is not None, "this driver has no cuMemcpyBatchAsync"
    else:  # one copy per extent, as on a driver older than CUDA 12.8
        monkeypatch.setattr(transfer.BatchCopy, "_looked_up", True)
        monkeypatch.setattr(transfer.BatchCopy, "_instance", None)

    region = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_SHARED)
    arena = Arena(region, device="cuda")
    try:
        lay, dlay = _wide_pages(1), _wide_pages(2)
        assert lay.page_bytes == transfer.STAGED_MIN_EXTENT[True] > transfer.STAGED_MIN_EXTENT[False]
        n = 120
        saved = [PagePlan(b, i * lay.page_bytes) for i, b in enumerate(range(n))]
        first = save(arena, lay, saved)  # staged too: gathered into a ring of its own, copied out by the engines
        sums = first.checksums()
        assert first.path == "staged" and save(arena, lay, saved, path="triton").checksums() == sums
        for i in (0, 59, 119):  # the SMs rewrote the same bytes
            torch.cuda.synchronize()
            want = torch.cat([seg[i].cpu() for seg in lay.segments])
            assert torch.equal(arena.cpu[saved[i].offset : saved[i].offset + lay.page_bytes], want)
        region[saved[7].offset + 4096] ^= 0x01  # a corrupt page in the arena
        region[saved[90].offset + lay.page_bytes - 1] ^= 0x80  # and one corrupt in its last byte
        before = [s.clone() for s in dlay.segments]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        fences = []
        # Three calls of 40 pages issued back to back (the third from another stream, as an engine's load
        # stream): 2 groups each in slots of 32 pages, the ring of 3 slots wrapped twice before any waits.
        for call in range(3):
            picked = Pages.of(
                [8 + call * 40 + i for i in range(40)],
                [saved[call * 40 + i].offset for i in range(40)],
                [sums[call * 40 + i] for i in range(40)],
            )
            with torch.cuda.stream(side) if call == 2 else contextlib.nullcontext():
                fences.append(restore(arena, dlay, picked))
        verdicts = [v for fence in fences for v in fence.wait()]
        assert all(f.path == "staged" for f in fences)
        assert [i for i, ok in enumerate(verdicts) if not ok] == [7, 90]
        good = [i for i in range(n) if i not in (7, 90)]
        computed = [s for fence in fences for s in fence.checksums()]
        assert [computed[i] for i in good] == [sums[i] for i in good]
        torch.cuda.synchronize()
        for s_seg, d_seg, b_seg in zip(lay.segments, dlay.segments, before, strict=True):
            for i in good:
                assert torch.equal(d_seg[8 + i], s_seg[i])
            for block in range(8):
                assert torch.equal(d_seg[block], b_seg[block])
        # A staged save straight before the staged restore of the same extents, no synchronization between: the
        # caller's stream waits for the save's last copy, the restore's copies for the caller's stream.
        fresh = [PagePlan(b, (n + i) * lay.page_bytes) for i, b in enumerate(range(40, 80))]
        committed = save(arena, lay, fresh).checksums()  # the checksums, as a first save commits them
        region[fresh[0].offset : fresh[-1].offset + lay.page_bytes] = bytes(40 * lay.page_bytes)
        torch.cuda.synchronize()
        save(arena, lay, fresh)  # again, the arena zeroed since: unfinished when the restore is issued
        back = restore(arena, dlay, Pages.of(range(80), [p.offset for p in fresh] * 2, committed * 2))
        assert back.path == "staged" and back.wait() == [True] * 80
        for s_seg, d_seg in zip(lay.segments, dlay.segments, strict=True):
            assert torch.equal(d_seg[:40], s_seg[40:80]) and torch.equal(d_seg[40:80], s_seg[40:80])
        # The SMs' path gives the same sums of the same pages.
        again = restore(arena, dlay, Pages.of(range(40), [p.offset for p in fresh], committed), path="triton")
        assert again.path == "triton" and again.checksums() == committed
    finally:
        arena.close()


@pytest.mark.gpu
def test_half_mib_extents_restore_staged_and_save_on_the_sms_quarter_mib_neither():
    from cacheon_orbitkv import transfer

    region = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED)
    arena = Arena(region, device="cuda")
    try:
        for chunk, restored_by in ((32 << 10, "staged"), (16 << 10, "triton")):  # 8 layers of K and V
            g = torch.Generator(device="cuda").manual_seed(chunk)
            src, dst = (
                [torch.randint(0, 256, (2, 48, chunk), dtype=torch.uint8, device="cuda", generator=g) for _ in range(8)]
                for _ in range(2)
            )
            lay, dlay = (GroupLayout([half for layer in side for half in (layer[0], layer[1])]) for side in (src, dst))
            assert (lay.page_bytes >= transfer.STAGED_MIN_EXTENT[False]) == (restored_by == "staged")
            saved = [PagePlan(b, i * lay.page_bytes) for i, b in enumerate(range(3, 43))]
            first = save(arena, lay, saved)
            assert first.path == "triton"  # saves are staged from 1 MiB extents
            sums = first.checksums()
            region[saved[5].offset + 100] ^= 0x04  # one page corrupt in the arena
            back = restore(arena, dlay, Pages.of(range(40), [p.offset for p in saved], sums))
            assert back.path == restored_by
            assert [i for i, ok in enumerate(back.wait()) if not ok] == [5]
            assert [c for i, c in enumerate(back.checksums()) if i != 5] == [c for i, c in enumerate(sums) if i != 5]
            torch.cuda.synchronize()
            for s_seg, d_seg in zip(lay.segments, dlay.segments, strict=True):
                assert torch.equal(torch.cat([d_seg[:5], d_seg[6:40]]), torch.cat([s_seg[3:8], s_seg[9:43]]))
    finally:
        arena.close()


def test_a_compile_without_the_page_copies_sums_compiled_and_leaves_the_copies_to_torch():
    # The cache manager's start: the checksum compiled, the CPU page copies (which only clients run) not.
    import subprocess
    import sys

    script = (
        "import os\n"
        "from cacheon_orbitkv import wire\n"
        "assert wire.compiled_checksum(page_copies=False)\n"
        "assert wire.page_kernels() is None\n"
        "assert wire.compiled_checksum()  # a later call changes nothing: the compile was the first call's\n"
        "assert wire.page_kernels() is None\n"
        "data = os.urandom(4099)\n"
        "target = bytearray(len(data))\n"
        "assert wire.checksum(data) == wire._checksum_numpy(data)\n"
        "assert wire.copy_with_checksum(target, data) == wire._checksum_numpy(data) and target == data\n"
    )
    without = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert without.returncode == 0, without.stderr
    whole = "from cacheon_orbitkv import wire\nassert wire.compiled_checksum() and wire.page_kernels() is not None\n"
    default = subprocess.run([sys.executable, "-c", whole], capture_output=True, text=True, timeout=120)
    assert default.returncode == 0, default.stderr
