"""The Triton kernel of OrbitKV transfers: zero-copy page moves with sum64 checksums in the copy."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def kernels() -> Any:
    import triton
    import triton.language as tl

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
        TO_ARENA: tl.constexpr,
        CHECKSUM: tl.constexpr,
        BLOCK: tl.constexpr,
        SUM_ONLY: tl.constexpr = False,
    ):
        # One program per (page, segment, tile of BLOCK 64-bit words). SUM_ONLY reads the engine
        # rows and sums them without moving anything (checksums beside a copy-engine transfer).
        pid = tl.program_id(0)
        tile = tl.program_id(1)
        page = pid // n_segments
        seg = pid % n_segments
        chunk = tl.load(seg_chunks + seg)  # bytes
        words = chunk // 8
        idx = tile * BLOCK + tl.arange(0, BLOCK)
        mask = idx < words
        base = tl.load(seg_ptrs + seg).to(tl.pointer_type(tl.uint64))
        stride = tl.load(seg_strides + seg) // 8
        block = tl.load(blocks + page)
        engine = base + block * stride + idx
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
            tl.atomic_add(sums + page, tl.sum(data.to(tl.int64, bitcast=True), axis=0))

    return move
