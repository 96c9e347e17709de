"""The Triton kernel of OrbitKV transfers: zero-copy page moves with mix64 checksums in the copy.

Imported only when a Triton path runs (``transfer`` imports it lazily), so CPU-only installs never
need Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
        # mix64 (wire.checksum): each word mixed with its index in the page, then summed. Masked-off
        # words are zeroed after the mix, so a page past the live count adds 0 to its (unused) sum.
        index = (tl.load(seg_offsets + seg) // 8 + idx).to(tl.uint64)
        mixed = (data ^ (index * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9
        mixed = mixed ^ (mixed >> 31)
        mixed = tl.where(mask, mixed, 0)
        tl.atomic_add(sums + page, tl.sum(mixed.to(tl.int64, bitcast=True), axis=0))


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
