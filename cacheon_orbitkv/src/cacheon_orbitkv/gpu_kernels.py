"""The Triton kernels of OrbitKV transfers: zero-copy page moves with mix64 checksums in the copy.

``move_table`` (save, restore, and the checksum pass of the copy-engine path) reads each work item's
addresses from a table that ``build_table`` fills on the device (bounded by a live page count read on
the device when ``transfer.restore`` replays them from a captured CUDA graph); ``move`` looks them up
through segment and page tables on the device, which a captured CUDA graph can refresh in place
(``transfer.GraphRestore``).

Imported only when a Triton path runs (``transfer`` imports it lazily), so CPU-only installs never
need Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix_sum(data, index, mask):
    # mix64 (wire.checksum) of the words ``data`` at word indices ``index`` of their page: each word
    # mixed with its index, then summed; words outside ``mask`` add 0.
    mixed = (data ^ (index.to(tl.uint64) * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9
    mixed = mixed ^ (mixed >> 31)
    mixed = tl.where(mask, mixed, 0)
    return tl.sum(mixed.to(tl.int64, bitcast=True), axis=0)


@triton.jit
def step(
    work,
    seg_ptrs,
    seg_strides,
    seg_chunks,
    seg_offsets,
    blocks,
    offsets,
    arena_ptr,
    sums,
    n_segments,
    n_tiles,
    count_ptr,
    TO_ARENA: tl.constexpr,
    CHECKSUM: tl.constexpr,
    BLOCK: tl.constexpr,
    SUM_ONLY: tl.constexpr,
    BOUNDED: tl.constexpr,
):
    # One work item: (page, segment, tile of BLOCK 64-bit words). BOUNDED: a fixed-size grid (a
    # captured CUDA graph) whose live page count is read from device memory at run time.
    tile = work % n_tiles
    page = work // n_tiles // n_segments
    seg = work // n_tiles % n_segments
    chunk = tl.load(seg_chunks + seg)  # bytes
    idx = tile * BLOCK + tl.arange(0, BLOCK)
    mask = idx < chunk // 8
    if BOUNDED:
        mask = mask & (page < tl.load(count_ptr))
    base = tl.load(seg_ptrs + seg).to(tl.pointer_type(tl.uint64))
    stride = tl.load(seg_strides + seg) // 8
    engine = base + tl.load(blocks + page) * stride + idx
    host = (arena_ptr + tl.load(offsets + page) + tl.load(seg_offsets + seg)).to(
        tl.pointer_type(tl.uint64), bitcast=True
    )
    if SUM_ONLY:
        data = tl.load(engine, mask=mask, other=0)
    elif TO_ARENA:
        data = tl.load(engine, mask=mask, other=0)
        tl.store(host + idx, data, mask=mask)
    else:
        data = tl.load(host + idx, mask=mask, other=0)
        tl.store(engine, data, mask=mask)
    if CHECKSUM:
        # Masked-off words add nothing, so a page past the live count adds 0 to its (unused) sum.
        tl.atomic_add(sums + page, mix_sum(data, tl.load(seg_offsets + seg) // 8 + idx, mask))


@triton.jit
def move(
    seg_ptrs,
    seg_strides,
    seg_chunks,
    seg_offsets,
    blocks,
    offsets,
    arena_ptr,
    sums,
    n_segments,
    n_tiles,
    n_work,
    count_ptr,
    TO_ARENA: tl.constexpr,
    CHECKSUM: tl.constexpr,
    BLOCK: tl.constexpr,
    SUM_ONLY: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
    BOUNDED: tl.constexpr = False,
):
    # A full grid runs one work item per program; a capped (persistent) grid loops over its share,
    # so that two transfers can share the GPU. SUM_ONLY sums engine rows without moving anything.
    if PERSISTENT:
        for work in range(tl.program_id(0), n_work, tl.num_programs(0)):
            step(
                work,
                seg_ptrs,
                seg_strides,
                seg_chunks,
                seg_offsets,
                blocks,
                offsets,
                arena_ptr,
                sums,
                n_segments,
                n_tiles,
                count_ptr,
                TO_ARENA,
                CHECKSUM,
                BLOCK,
                SUM_ONLY,
                BOUNDED,
            )
    else:
        step(
            tl.program_id(0),
            seg_ptrs,
            seg_strides,
            seg_chunks,
            seg_offsets,
            blocks,
            offsets,
            arena_ptr,
            sums,
            n_segments,
            n_tiles,
            count_ptr,
            TO_ARENA,
            CHECKSUM,
            BLOCK,
            SUM_ONLY,
            BOUNDED,
        )


# The page, item and segment counts change from call to call: not specialized on (a count divisible
# by 16 or equal to 1 would otherwise compile another variant the first time it comes, mid-serving).
@triton.jit(do_not_specialize=["n_segments", "n_pages", "n_tiles", "n_work", "live_at"])
def build_table(
    small,
    n_segments,
    n_pages,
    n_tiles,
    arena_ptr,
    table,
    n_work,
    sums,
    live_at,
    TILE: tl.constexpr,
    ITEMS: tl.constexpr,
    BOUNDED: tl.constexpr = False,
):
    # Fills ``move_table``'s work table on the device from the small per-segment and per-page tables
    # (``small``: segment pointers, strides, chunk bytes, offsets in the page, then the pages' blocks
    # and arena offsets), so the host copies only those to the device; and zeroes the pages' sums
    # (there are at least as many work items as pages). BOUNDED: ``n_pages`` is a capacity (a captured
    # CUDA graph's) and ``small[live_at]`` the live page count, read at run time: the items of the pages
    # past it get no words, so ``move_table`` touches nothing for them.
    work = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    live = work < n_work
    tl.store(sums + work, tl.zeros_like(work).to(tl.int64), mask=work < n_pages)
    tile = work % n_tiles
    seg = work // n_tiles % n_segments
    page = work // n_tiles // n_segments
    base = tl.load(small + seg, mask=live, other=0)
    stride = tl.load(small + n_segments + seg, mask=live, other=0)
    chunk = tl.load(small + 2 * n_segments + seg, mask=live, other=0)
    seg_offset = tl.load(small + 3 * n_segments + seg, mask=live, other=0)
    block = tl.load(small + 4 * n_segments + page, mask=live, other=0)
    offset = tl.load(small + 4 * n_segments + n_pages + page, mask=live, other=0)
    first = tile * TILE
    host = arena_ptr + offset + seg_offset + first * 8  # arena_ptr: the arena's address, an integer
    tl.store(table + work, host, mask=live)
    tl.store(table + n_work + work, base + block * stride + first * 8, mask=live)
    tl.store(table + 2 * n_work + work, seg_offset // 8 + first, mask=live)
    tl.store(table + 3 * n_work + work, page.to(tl.int64), mask=live)
    words = tl.minimum(tl.maximum(chunk // 8 - first, 0), TILE)
    if BOUNDED:
        words = tl.where(page < tl.load(small + live_at), words, 0)
    tl.store(table + 4 * n_work + work, words, mask=live)


@triton.jit
def item(
    work,
    table,
    n_work,
    sums,
    TO_ARENA: tl.constexpr,
    CHECKSUM: tl.constexpr,
    BLOCK: tl.constexpr,
    SUM_ONLY: tl.constexpr,
):
    # One work item (page, segment, tile) of a precomputed table: five independent loads (host and
    # engine addresses, the tile's first word index in its page, the page, its word count) instead
    # of a chain of lookups through segment and page tables before the data can move.
    host = tl.load(table + work).to(tl.pointer_type(tl.uint64))
    engine = tl.load(table + n_work + work).to(tl.pointer_type(tl.uint64))
    first = tl.load(table + 2 * n_work + work)
    page = tl.load(table + 3 * n_work + work)
    idx = tl.arange(0, BLOCK)
    mask = idx < tl.load(table + 4 * n_work + work)
    if SUM_ONLY:
        data = tl.load(engine + idx, mask=mask, other=0)
    elif TO_ARENA:
        data = tl.load(engine + idx, mask=mask, other=0)
        tl.store(host + idx, data, mask=mask)
    else:
        data = tl.load(host + idx, mask=mask, other=0)
        tl.store(engine + idx, data, mask=mask)
    if CHECKSUM:
        tl.atomic_add(sums + page, mix_sum(data, first + idx, mask))


@triton.jit(do_not_specialize=["n_work", "first"])
def move_table(
    table,
    n_work,
    sums,
    first,
    TO_ARENA: tl.constexpr,
    CHECKSUM: tl.constexpr,
    BLOCK: tl.constexpr,
    SUM_ONLY: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
):
    # ``move`` over a work table filled by ``build_table``: what save and restore launch. ``n_work`` is
    # the table's item count (its rows' stride); the launch moves the items from ``first`` on, one a
    # program (the staged restore launches one group of pages at a time), or with PERSISTENT all of them
    # from ``first`` over a capped grid.
    if PERSISTENT:
        for work in range(first + tl.program_id(0), n_work, tl.num_programs(0)):
            item(work, table, n_work, sums, TO_ARENA, CHECKSUM, BLOCK, SUM_ONLY)
    else:
        item(first + tl.program_id(0), table, n_work, sums, TO_ARENA, CHECKSUM, BLOCK, SUM_ONLY)
