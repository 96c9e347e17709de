"""Tried changes to OrbitKV's GPU transfers, each measured against the shipped path and the ceiling
in the same run (needs a CUDA device):

- several work items (page, segment, tile) per Triton program, at 16 KiB and 64 KiB pages, with 4 or
  8 warps, against the shipped one-item kernel (checksums on in both);
- ``flat``: each work item's addresses precomputed into a table (one independent load per item
  instead of a chain of table lookups), one or several items per program, or a persistent grid
  software-pipelined by Triton (``tl.range(..., num_stages)``);
- ``calls``: the restore call as shipped until 2026-12-01 (its tables copied to the device with
  synchronizing copies), the call with one ``PagePlan`` per page (what the engine adapters passed
  until 2026-12-02) and the moving kernel alone, against the shipped call (the pages as ``Pages``
  arrays), at 16 KiB and 64 KiB;
- ``cuMemcpyBatchAsync`` (CUDA driver, 12.8 ABI, one call for every chunk) against the path
  ``choose_path`` picks, at 16 KiB to 2 MiB pages (its first run, at 2 MiB pages, was against one
  ``cudaMemcpyAsync`` per chunk, the copy-engine path before it adopted the batch);
- ``hybrid``: one restore split between the copy engines (a share of its pages, batched) and the
  SMs (the rest), both at once, at 64 KiB and 256 KiB pages;
- ``sm``: the SMs' own ceiling, a plain contiguous copy kernel (no checksum, no table) between HBM
  and the arena at several tile shapes and load flavours, one way and both at once;
- ``engines``: save and restore at once on the copy engines at 256 KiB and 2 MiB pages: batched as shipped,
  batched with location hints, one ``cudaMemcpyAsync`` per chunk, and the control: the same bytes each way
  in batched copies of the chunk's size between a contiguous HBM buffer and the arena, nothing else;
- ``staged``: the shipped staged restore (the copy engines move each page's whole arena extent into a
  ring in HBM, a group of pages per slot, and the moving kernel scatters each group from there) with
  rings of other shapes (16-64 MiB slots, 2 or 3 of them), at 16 KiB to 256 KiB pages, against the
  shipped restore, the restore on the SMs and the extents' copy alone;
- ``sums``: the shipped save (its checksums copied to pinned memory behind it on the stream) against
  the same save with its checksums read back by a blocking copy when asked for (as until 2026-12-05),
  each call timed on the host from launch to its checksums, at 16 KiB and 64 KiB pages;
- save and restore at once: Triton grids capped unequally (the SMs split between the directions),
  and one direction on the copy engines (batched) while the other runs on the SMs, at 256 KiB
  pages; at 2 MiB pages, both directions on the copy engines.

Every variant's bytes (and, where it sums, its checksums) are checked against the shipped path
before it is timed. Layouts and page counts are benchmarks/transfer.py's.

    python benchmarks/transfer_tries.py [--out DIR]
        [--sections items,flat,calls,batch,hybrid,staged,sm,engines,sums,both]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from transfer import (
    AtOnce,
    as_pages,
    ceilings,
    event_time,
    extents_copy,
    interleaved_medians,
    layout_for,
    make_arena,
    plans,
    rated,
)

from cacheon_orbitkv import transfer
from cacheon_orbitkv.transfer import PagePlan, Pages, restore, save


@triton.jit
def sm_copy(src, dst, n_words, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr, CACHE: tl.constexpr):  # noqa: N803
    # The plainest copy the SMs can do: contiguous 64-bit words, no checksum, no table.
    if PERSISTENT:
        for start in range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK):
            idx = start + tl.arange(0, BLOCK)
            mask = idx < n_words
            tl.store(dst + idx, tl.load(src + idx, mask=mask, cache_modifier=CACHE), mask=mask)
    else:
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n_words
        tl.store(dst + idx, tl.load(src + idx, mask=mask, cache_modifier=CACHE), mask=mask)


def sm_ceiling(arena, rows: list, ceiling: dict, results: dict) -> None:
    """What the SMs alone can move between HBM and the registered arena: contiguous copies with no
    checksum and no table, at several tile sizes, warps and load flavours, one way and both at once.
    The restore kernel moves pages through the SMs, so this bounds it the way the copy engines'
    contiguous copy bounds the copy-engine path."""
    nbytes = 2 << 30
    words = nbytes // 8
    dev = torch.empty(2 * words, dtype=torch.int64, device="cuda")
    dev.random_()
    host = arena.kernel_view[: 2 * nbytes].view(torch.int64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launch(src, dst, block, warps, programs=None, cache=""):
        grid = (min(programs, triton.cdiv(words, block)) if programs else triton.cdiv(words, block),)
        sm_copy[grid](src, dst, words, BLOCK=block, PERSISTENT=programs is not None, CACHE=cache, num_warps=warps)

    shapes = [
        (1024, 4, None, ""),
        (2048, 8, None, ""),
        (4096, 8, None, ""),
        (4096, 16, None, ""),
        (2048, 8, None, ".cg"),
    ]
    shapes += [(2048, 8, 2 * sms, ""), (2048, 8, 4 * sms, ""), (2048, 8, 8 * sms, "")]
    # correctness first: each shape's bytes both ways
    for block, warps, programs, cache in shapes:
        host[:words].zero_()
        launch(dev[:words], host[:words], block, warps, programs, cache)
        torch.cuda.synchronize()
        assert torch.equal(host[:words], dev[:words]), ("to the arena", block, warps, programs, cache)
        dev[words:].zero_()
        launch(host[:words], dev[words:], block, warps, programs, cache)
        torch.cuda.synchronize()
        assert torch.equal(dev[words:], dev[:words]), ("from the arena", block, warps, programs, cache)
    for block, warps, programs, cache in shapes:
        shape = f"{block * 8 >> 10} KiB tiles x {warps} warps" + (
            f", {programs // sms}/SM persistent" if programs else ""
        )
        shape += f", loads {cache}" if cache else ""
        shaped = (block, warps, programs, cache)
        t_out = event_time(lambda shaped=shaped: launch(dev[:words], host[:words], *shaped), 5)
        t_in = event_time(lambda shaped=shaped: launch(host[:words], dev[words:], *shaped), 5)
        results[f"sm_{shape}"] = (
            rated(rows, f"SM copy, device -> arena, {shape}", nbytes, t_out, ceiling["save"]),
            rated(rows, f"SM copy, arena -> device, {shape}", nbytes, t_in, ceiling["restore"]),
        )
    at_once = AtOnce()
    for per_sm in (1, 2, 4, None):
        programs = per_sm * sms if per_sm else None
        both = at_once.of(
            lambda programs=programs: launch(dev[:words], host[:words], 2048, 8, programs),
            lambda programs=programs: launch(host[words : 2 * words], dev[words:], 2048, 8, programs),
        )
        t = event_time(both, 5)
        name = f"{per_sm}/SM persistent each" if per_sm else "full grids"
        results[f"sm_both_{name}"] = rated(
            rows, f"SM copy, both directions at once, 16 KiB tiles x 8 warps, {name}", 2 * nbytes, t, ceiling["both"]
        )


@triton.jit
def move_items(
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
    TO_ARENA: tl.constexpr,  # noqa: N803 - Triton's constexpr style
    BLOCK: tl.constexpr,  # noqa: N803 - Triton's constexpr style
    ITEMS: tl.constexpr,  # noqa: N803 - Triton's constexpr style
):
    # ITEMS work items per program as one [ITEMS, BLOCK] tile: more bytes in flight per program.
    work = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    live = work < n_work
    work = tl.where(live, work, 0)
    tile = work % n_tiles
    page = work // n_tiles // n_segments
    seg = work // n_tiles % n_segments
    chunk = tl.load(seg_chunks + seg)
    idx = tile[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (idx < (chunk // 8)[:, None]) & live[:, None]
    base = tl.load(seg_ptrs + seg).to(tl.pointer_type(tl.uint64))
    stride = tl.load(seg_strides + seg) // 8
    engine = (base + tl.load(blocks + page) * stride)[:, None] + idx
    seg_off = tl.load(seg_offsets + seg)
    host = (arena_ptr + tl.load(offsets + page) + seg_off).to(tl.pointer_type(tl.uint64), bitcast=True)[:, None] + idx
    if TO_ARENA:
        data = tl.load(engine, mask=mask, other=0)
        tl.store(host, data, mask=mask)
    else:
        data = tl.load(host, mask=mask, other=0)
        tl.store(engine, data, mask=mask)
    index = ((seg_off // 8)[:, None] + idx).to(tl.uint64)
    mixed = (data ^ (index * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9
    mixed = mixed ^ (mixed >> 31)
    mixed = tl.where(mask, mixed, 0)
    tl.atomic_add(sums + page, tl.sum(mixed.to(tl.int64, bitcast=True), axis=1), mask=live)


@triton.jit
def move_flat(
    src,
    dst,
    first_word,
    page_of,
    words,
    sums,
    n_work,
    BLOCK: tl.constexpr,  # noqa: N803 - Triton's constexpr style
    ITEMS: tl.constexpr,  # noqa: N803
):
    # Each work item's source and destination addresses, first word index in its page, page and
    # length, precomputed: one independent load each, instead of a chain of table lookups.
    work = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    live = work < n_work
    work = tl.where(live, work, 0)
    source = tl.load(src + work).to(tl.pointer_type(tl.uint64))
    target = tl.load(dst + work).to(tl.pointer_type(tl.uint64))
    first = tl.load(first_word + work)
    page = tl.load(page_of + work)
    count = tl.load(words + work)
    idx = tl.arange(0, BLOCK)[None, :]
    mask = (idx < count[:, None]) & live[:, None]
    data = tl.load(source[:, None] + idx, mask=mask, other=0)
    tl.store(target[:, None] + idx, data, mask=mask)
    index = (first[:, None] + idx).to(tl.uint64)
    mixed = (data ^ (index * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9
    mixed = mixed ^ (mixed >> 31)
    mixed = tl.where(mask, mixed, 0)
    tl.atomic_add(sums + page, tl.sum(mixed.to(tl.int64, bitcast=True), axis=1), mask=live)


@triton.jit
def move_flat_loop(
    src,
    dst,
    first_word,
    page_of,
    words,
    sums,
    n_work,
    BLOCK: tl.constexpr,  # noqa: N803 - Triton's constexpr style
    STAGES: tl.constexpr,  # noqa: N803
):
    # A persistent grid over the same precomputed items, software-pipelined by Triton (num_stages).
    idx = tl.arange(0, BLOCK)
    for work in tl.range(tl.program_id(0), n_work, tl.num_programs(0), num_stages=STAGES):
        source = tl.load(src + work).to(tl.pointer_type(tl.uint64))
        target = tl.load(dst + work).to(tl.pointer_type(tl.uint64))
        mask = idx < tl.load(words + work)
        data = tl.load(source + idx, mask=mask, other=0)
        tl.store(target + idx, data, mask=mask)
        index = (tl.load(first_word + work) + idx).to(tl.uint64)
        mixed = (data ^ (index * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9
        mixed = mixed ^ (mixed >> 31)
        mixed = tl.where(mask, mixed, 0)
        tl.atomic_add(sums + tl.load(page_of + work), tl.sum(mixed.to(tl.int64, bitcast=True), axis=0))


def flat_tables(arena, layout, pages, to_arena: bool) -> tuple:
    """Per work item (page, segment, tile): source and destination addresses, first word, page, words."""
    device = arena.device
    block = min(transfer.WORDS_PER_TILE, triton.next_power_of_2(max(layout.chunks) // 8))
    chunks = torch.tensor(layout.chunks, dtype=torch.int64, device=device)
    seg_off = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64, device=device), chunks[:-1]]), 0)
    bases = torch.tensor([s.data_ptr() for s in layout.segments], dtype=torch.int64, device=device)
    strides = torch.tensor([s.stride(0) for s in layout.segments], dtype=torch.int64, device=device)
    blocks = torch.tensor([p.block for p in pages], dtype=torch.int64, device=device)
    offsets = torch.tensor([p.offset for p in pages], dtype=torch.int64, device=device)
    tiles = triton.cdiv(max(layout.chunks) // 8, block)
    tile = torch.arange(tiles, dtype=torch.int64, device=device) * block  # first word of each tile
    host = arena.kernel_view.data_ptr() + offsets[:, None, None] + seg_off[None, :, None] + tile * 8
    engine = (bases[None, :] + blocks[:, None] * strides[None, :])[:, :, None] + tile * 8
    first = (seg_off[None, :, None] // 8 + tile).expand(len(pages), -1, -1)
    words = (chunks[None, :, None] // 8 - tile).clamp(min=0, max=block).expand(len(pages), -1, -1)
    page = torch.arange(len(pages), dtype=torch.int64, device=device)[:, None, None].expand_as(first)
    src, dst = (engine, host) if to_arena else (host, engine)
    flat = [t.expand_as(first).reshape(-1).contiguous() for t in (src, dst, first, page, words)]
    return (*flat, block, layout.page_bytes)


def launch_flat(tables, n_pages: int, items: int, warps: int, stages: int = 0):
    src, dst, first, page, words, block, page_bytes = tables
    sums = torch.zeros(n_pages, dtype=torch.int64, device=src.device)
    work = src.numel()
    if stages:
        programs = torch.cuda.get_device_properties(0).multi_processor_count * items
        move_flat_loop[(min(programs, work),)](
            src, dst, first, page, words, sums, work, BLOCK=block, STAGES=stages, num_warps=warps
        )
    else:
        move_flat[(triton.cdiv(work, items),)](
            src, dst, first, page, words, sums, work, BLOCK=block, ITEMS=items, num_warps=warps
        )
    return transfer._finish(sums, page_bytes)


def launch_items(arena, layout, pages, to_arena: bool, items: int, warps: int):
    ptrs, strides, chunks, seg_offsets = transfer._tables(layout, arena.device)
    blocks = torch.tensor([p.block for p in pages], dtype=torch.int64, device=arena.device)
    offsets = torch.tensor([p.offset for p in pages], dtype=torch.int64, device=arena.device)
    sums = torch.zeros(len(pages), dtype=torch.int64, device=arena.device)
    block = min(transfer.WORDS_PER_TILE, triton.next_power_of_2(max(layout.chunks) // 8))
    tiles = triton.cdiv(max(layout.chunks) // 8, block)
    work = len(pages) * len(layout.segments) * tiles
    move_items[(triton.cdiv(work, items),)](
        ptrs,
        strides,
        chunks,
        seg_offsets,
        blocks,
        offsets,
        arena.kernel_view,
        sums,
        len(layout.segments),
        tiles,
        work,
        TO_ARENA=to_arena,
        BLOCK=block,
        ITEMS=items,
        num_warps=warps,
    )
    return transfer._finish(sums, layout.page_bytes)


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def restore_synchronous(arena, layout, pages):
    """The restore call shipped until 2026-12-01: the committed checksums and the small table each
    copied to the device with a synchronizing copy, the sums zeroed by a kernel of their own."""
    from cacheon_orbitkv.gpu_kernels import build_table, move_table

    device = arena.device
    expected = torch.tensor([signed(p.checksum) for p in pages], dtype=torch.int64, device=device)
    small = np.concatenate(
        [
            layout.segment_table,
            np.asarray([p.block for p in pages], dtype=np.int64),
            np.asarray([p.offset for p in pages], dtype=np.int64),
        ]
    )
    small = torch.from_numpy(small).to(device)
    sums = torch.zeros(len(pages), dtype=torch.int64, device=device)
    block = min(transfer.WORDS_PER_TILE, triton.next_power_of_2(max(layout.chunks) // 8))
    tiles = triton.cdiv(max(layout.chunks) // 8, block)
    work = len(pages) * len(layout.segments) * tiles
    table = torch.empty((5, work), dtype=torch.int64, device=device)
    build_table[(triton.cdiv(work, 1024),)](
        small, len(layout.segments), len(pages), tiles, arena.kernel_view.data_ptr(), table, work, sums, 0,
        TILE=block, ITEMS=1024, num_warps=4,
    )  # fmt: skip
    move_table[(work,)](
        table, work, sums, 0, TO_ARENA=False, CHECKSUM=True, BLOCK=block, num_warps=8 if block >= 2048 else 4
    )
    return transfer._finish(sums, layout.page_bytes) == expected


def engine_bytes(layout, pages) -> torch.Tensor:
    return torch.cat([seg[p.block] for p in pages for seg in layout.segments])


def items_per_program(arena, rows: list, ceiling: dict, results: dict, sections: set) -> None:
    for size in (16 << 10, 64 << 10):
        items_one_size(arena, rows, ceiling, results, size, sections)


def items_one_size(arena, rows: list, ceiling: dict, results: dict, size: int, sections: set) -> None:
    layout = layout_for(size, layers=32)
    pages = plans(layout, 256, size)
    total = 256 * layout.page_bytes
    shipped_sums = save(arena, layout, pages, path="triton").checksums()
    want = engine_bytes(layout, pages).clone()
    restore_plans = [PagePlan(p.block, p.offset, s) for p, s in zip(pages, shipped_sums, strict=True)]
    restore_pages = Pages.from_plans(restore_plans)  # as the engine adapters now build them
    variants = {
        "shipped save": lambda: save(arena, layout, pages, path="triton"),
        "shipped restore": lambda: restore(arena, layout, restore_pages, path="triton"),
    }
    if "calls" in sections:
        for seg in layout.segments:
            seg[[p.block for p in pages]] = 0
        verdicts = restore_synchronous(arena, layout, restore_plans)
        assert bool(verdicts.all()) and torch.equal(engine_bytes(layout, pages), want), "synchronous restore"
        variants["restore as shipped until 2026-12-01 (synchronizing copies of its tables)"] = lambda: (
            restore_synchronous(arena, layout, restore_plans)
        )
        variants["restore of one PagePlan per page (the engine adapters' call until 2026-12-02)"] = lambda: restore(
            arena, layout, restore_plans, path="triton"
        )
        work = transfer._work_table(arena, layout, restore_pages, expected=True)
        variants["restore's moving kernel alone (work table built before timing)"] = lambda: transfer._move_items(
            work, False
        )
    launchers = {}  # name -> (save, restore), each returning the per-page sums
    for items, warps in ((2, 4), (2, 8), (4, 4), (4, 8), (8, 4), (8, 8)) if "items" in sections else ():
        launchers[f"{items} items x {warps} warps"] = (
            lambda i=items, w=warps: launch_items(arena, layout, pages, True, i, w),
            lambda i=items, w=warps: launch_items(arena, layout, pages, False, i, w),
        )
    if "flat" in sections:
        to_tables = flat_tables(arena, layout, pages, True)
        from_tables = flat_tables(arena, layout, pages, False)
        n = len(pages)
        for items, warps, stages in (
            (1, 4, 0),
            (1, 8, 0),
            (2, 4, 0),
            (2, 8, 0),
            (4, 8, 0),
            (4, 4, 2),
            (8, 4, 3),
            (4, 8, 3),
        ):
            shape = f"{items} programs/SM, {stages} stages" if stages else f"{items} items"
            name = f"address table, {shape} x {warps} warps"
            launchers[name] = (
                lambda i=items, w=warps, st=stages: launch_flat(to_tables, n, i, w, st),
                lambda i=items, w=warps, st=stages: launch_flat(from_tables, n, i, w, st),
            )
    for name, (to_arena, from_arena) in launchers.items():
        # correctness first: the same checksums as the shipped kernel, the same bytes back
        try:
            to_arena()
            torch.cuda.synchronize()
        except Exception as exc:  # a variant that does not compile here is reported, not timed
            results[f"items_{size}_{name}_error"] = repr(exc)
            print(f"{size >> 10} KiB pages: {name} did not run: {exc!r}"[:400])
            continue
        got = to_arena()
        assert [int(v) for v in got.tolist()] == [signed(s) for s in shipped_sums], name
        for seg in layout.segments:
            seg[[p.block for p in pages]] = 0
        sums = from_arena()
        torch.cuda.synchronize()
        assert torch.equal(engine_bytes(layout, pages), want), ("restore bytes", name)
        assert [int(v) for v in sums.tolist()] == [signed(s) for s in shipped_sums], name
        variants[f"save, {name}"] = to_arena
        variants[f"restore, {name}"] = from_arena
    for name, t in interleaved_medians(variants, 7).items():
        way = "save" if "save" in name else "restore"
        results[f"items_{size}_{name}"] = rated(rows, f"{size >> 10} KiB pages: {name}", total, t, ceiling[way])


class BatchCopy:
    """cuMemcpyBatchAsync through the driver, looked up at the CUDA 12.8 ABI (cuGetProcAddress)."""

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Attributes(ctypes.Structure):
        _fields_ = [
            ("srcAccessOrder", ctypes.c_int),
            ("srcLocHint", ctypes.c_int * 2),
            ("dstLocHint", ctypes.c_int * 2),
            ("flags", ctypes.c_uint),
        ]

    def __init__(self) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        fn = ctypes.c_void_p()
        status = ctypes.c_int()
        rc = cuda.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080, 0, ctypes.byref(status))
        if rc != 0 or not fn.value:
            raise RuntimeError(f"cuMemcpyBatchAsync not found (cuGetProcAddress {rc}, status {status.value})")
        proto = ctypes.CFUNCTYPE(
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_void_p,
        )
        self.fn = proto(fn.value)
        self.attrs = self.Attributes(1, (0, 0), (0, 0), 0)  # source access order: stream
        self.attr_index = (ctypes.c_size_t * 1)(0)
        self.fail = ctypes.c_size_t()

    def plan(self, arena, layout, pages, to_arena: bool):
        dst, src, size = [], [], []
        host = arena.cpu.data_ptr()
        for page in pages:
            at = page.offset
            for seg, chunk in zip(layout.segments, layout.chunks, strict=True):
                engine = seg[page.block].data_ptr()
                a, b = (host + at, engine) if to_arena else (engine, host + at)
                dst.append(a)
                src.append(b)
                size.append(chunk)
                at += chunk
        n = len(size)
        return ((ctypes.c_uint64 * n)(*dst), (ctypes.c_uint64 * n)(*src), (ctypes.c_size_t * n)(*size), n)

    def __call__(self, planned, stream) -> None:
        dst, src, size, n = planned
        rc = self.fn(
            dst,
            src,
            size,
            n,
            ctypes.byref(self.attrs),
            self.attr_index,
            1,
            ctypes.byref(self.fail),
            ctypes.c_void_p(stream.cuda_stream),
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync returned {rc} (failed at copy {self.fail.value})")


def batched_copies(arena, rows: list, ceiling: dict, results: dict, batch: BatchCopy, size: int) -> None:
    layout = layout_for(size, layers=32)
    pages = plans(layout, 256, size)
    total = 256 * layout.page_bytes
    side = torch.cuda.Stream()  # batched copies are not allowed on the legacy default stream
    to_arena, from_arena = batch.plan(arena, layout, pages, True), batch.plan(arena, layout, pages, False)
    want = engine_bytes(layout, pages).clone()
    side.wait_stream(torch.cuda.current_stream())
    batch(to_arena, side)
    side.synchronize()
    for seg in layout.segments:
        seg[[p.block for p in pages]] = 0
    torch.cuda.synchronize()
    batch(from_arena, side)
    side.synchronize()
    assert torch.equal(engine_bytes(layout, pages), want), "batched restore bytes"

    def on_side(fn):
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)

        return run

    path = transfer.choose_path(layout, "cuda")
    as_arrays = Pages.from_plans(pages)
    launch = transfer._launch_triton if path == "triton" else transfer._copy_engine
    variants = {
        f"shipped {path} save (no checksum)": lambda: launch(arena, layout, as_arrays, True, checksums=False),
        f"shipped {path} restore (no checksum)": lambda: launch(arena, layout, as_arrays, False, checksums=False),
        "cuMemcpyBatchAsync save": on_side(lambda: batch(to_arena, side)),
        "cuMemcpyBatchAsync restore": on_side(lambda: batch(from_arena, side)),
    }
    for name, t in interleaved_medians(variants, 7).items():
        way = "save" if "save" in name else "restore"
        results[f"batch_{size}_{name}"] = rated(rows, f"{size >> 10} KiB pages: {name}", total, t, ceiling[way])


def both_ways(arena, rows: list, ceiling: dict, results: dict, batch: BatchCopy | None, size: int, count: int) -> None:
    out_layout, in_layout = layout_for(size, layers=32), layout_for(size, layers=32)
    total = count * out_layout.page_bytes
    out_pages = plans(out_layout, count, 11)
    in_pages = plans(in_layout, count, 12, base=total)
    sums = save(arena, in_layout, in_pages).checksums()
    in_restore = [PagePlan(p.block, p.offset, s) for p, s in zip(in_pages, sums, strict=True)]
    in_arrays, out_arrays = Pages.from_plans(in_pages), Pages.from_plans(out_pages)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pair = AtOnce().of  # each direction on its own stream

    variants = {}
    splits = ((2, 2), (1, 3), (3, 1), (1, 2), (2, 1), (2, 4), (4, 2)) if size < (2 << 20) else ((2, 2),)
    for save_sm, restore_sm in splits:
        variants[f"SM split: save {save_sm}/SM, restore {restore_sm}/SM"] = pair(
            lambda c=save_sm * sms: save(arena, out_layout, out_pages, path="triton", programs=c),
            lambda c=restore_sm * sms: restore(arena, in_layout, in_restore, path="triton", programs=c),
        )
    if batch is not None:
        to_arena = batch.plan(arena, out_layout, out_pages, True)
        from_arena = batch.plan(arena, in_layout, in_pages, False)

        def batched_restore_checked() -> None:
            batch(from_arena, torch.cuda.current_stream())
            transfer._launch_triton(arena, in_layout, in_arrays, False, checksums=True, sum_only=True)

        def batched_save_checked() -> None:
            batch(to_arena, torch.cuda.current_stream())
            transfer._launch_triton(arena, out_layout, out_arrays, True, checksums=True, sum_only=True)

        variants["save on the SMs, restore batched on the copy engines (+ HBM checksum)"] = pair(
            lambda: save(arena, out_layout, out_pages, path="triton"), batched_restore_checked
        )
        variants["save batched on the copy engines (+ HBM checksum), restore on the SMs"] = pair(
            batched_save_checked, lambda: restore(arena, in_layout, in_restore, path="triton")
        )
        variants["both batched on the copy engines (+ HBM checksums)"] = pair(
            batched_save_checked, batched_restore_checked
        )
    for fn in variants.values():
        fn()
    torch.cuda.synchronize()
    assert all(restore(arena, in_layout, in_restore).wait()), "restored pages failed their checksums"
    for name, t in interleaved_medians(variants, 5).items():
        name_ = f"both at once, {size >> 10} KiB pages x {count}: {name}"
        results[f"both_{size}_{name}"] = rated(rows, name_, 2 * total, t, ceiling["both"])


def hybrid(arena, rows: list, ceiling: dict, results: dict, size: int) -> None:
    """A restore split between the copy engines (the first share of its pages, batched, on a side
    stream, checksummed in HBM after) and the SMs (the rest, the shipped Triton kernel), both at
    once: the SMs' reads of host memory level off near 0.92 of the ceiling at every page size, and
    the copy engines, slower alone at these chunk sizes, may fill what is left of the link."""
    layout = layout_for(size, layers=32)
    n = 256
    pages = plans(layout, n, size + 7)
    total = n * layout.page_bytes
    sums = save(arena, layout, pages).checksums()
    batch = Pages.from_plans([PagePlan(p.block, p.offset, s) for p, s in zip(pages, sums, strict=True)])
    want = engine_bytes(layout, pages).clone()
    side = torch.cuda.Stream()

    def split(k: int):
        first = Pages(batch.blocks[:k], batch.offsets[:k], batch.checksums[:k])
        rest = Pages(batch.blocks[k:], batch.offsets[k:], batch.checksums[k:])

        def run():
            fences = []
            if k:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fences.append(restore(arena, layout, first, path="copy_engine"))
            if k < n:
                fences.append(restore(arena, layout, rest, path="triton"))
            if k:
                torch.cuda.current_stream().wait_stream(side)
            return fences

        return run

    variants = {f"{k}/{n} pages on the copy engines, the rest on the SMs": split(k) for k in (0, 32, 64, 96, 128)}
    for name, fn in variants.items():  # correctness first: every page's bytes and verdict
        for seg in layout.segments:
            seg[[p.block for p in pages]] = 0
        torch.cuda.synchronize()
        fences = fn()
        assert all(ok for f in fences for ok in f.wait()), name
        assert torch.equal(engine_bytes(layout, pages), want), name
    for name, t in interleaved_medians(variants, 7).items():
        results[f"hybrid_{size}_{name}"] = rated(
            rows, f"{size >> 10} KiB pages: restore, {name}", total, t, ceiling["restore"]
        )


def staged(arena, rows: list, ceiling: dict, results: dict, size: int) -> None:
    layout = layout_for(size, layers=32)
    n = 256
    pages = plans(layout, n, size + 11)
    total = n * layout.page_bytes
    sums = save(arena, layout, pages).checksums()
    batch = Pages.from_plans([PagePlan(p.block, p.offset, s) for p, s in zip(pages, sums, strict=True)])
    want = engine_bytes(layout, pages).clone()
    variants = {
        "shipped restore": lambda: restore(arena, layout, batch),
        "on the SMs (replayed)": lambda: restore(arena, layout, batch, path="triton"),
        "extents' copy alone (copy engines, one batch)": extents_copy(arena, batch, layout.page_bytes),
    }
    # The shipped staged restore (transfer._Staged) with rings of other shapes: slot MiB x slots.
    for slot_mib, slots in ((16, 3), (32, 3), (64, 2), (64, 3)):
        stager = transfer._Staged("cuda:0", slot_mib << 20, slots)
        if not stager.fits(layout):
            continue

        def run(stager=stager) -> tuple:
            return stager.run(arena, layout, batch)

        variants[f"staged, {slot_mib} MiB slots x {slots}"] = run
    for name, fn in variants.items():  # correctness first: every page's bytes and verdict
        if name.startswith("extents"):
            continue
        for seg in layout.segments:
            seg[batch.blocks.tolist()] = 0
        torch.cuda.synchronize()
        out = fn()
        if isinstance(out, tuple):
            got, expected = out
            assert torch.equal(got, expected), name
            assert [(int(v) ^ layout.page_bytes) & 0xFFFFFFFFFFFFFFFF for v in got.tolist()] == sums, name
        else:
            assert all(out.wait()), name
        torch.cuda.synchronize()
        assert torch.equal(engine_bytes(layout, pages), want), name
    for fn in variants.values():
        fn()
    for name, t in interleaved_medians(variants, 9).items():
        results[f"staged_{size}_{name}"] = rated(
            rows, f"{size >> 10} KiB pages: restore, {name}", total, t, ceiling["restore"]
        )


def engines_both_ways(arena, rows: list, ceiling: dict, results: dict, batch: BatchCopy | None, size: int) -> None:
    """Save and restore at once, both on the copy engines: batched as shipped, batched with the
    copies' source and destination location hints, and one ``cudaMemcpyAsync`` per chunk (the
    path without ``cuMemcpyBatchAsync``); each direction on its own stream, checksums in HBM."""
    count = 64
    out_layout, in_layout = layout_for(size, layers=32), layout_for(size, layers=32)
    total = count * out_layout.page_bytes
    out_pages, in_pages = plans(out_layout, count, 21), plans(in_layout, count, 22, base=total)
    sums = save(arena, in_layout, in_pages, path="copy_engine").checksums()
    in_restore = Pages.from_plans([PagePlan(p.block, p.offset, s) for p, s in zip(in_pages, sums, strict=True)])
    out_save = Pages.from_plans(out_pages)
    want_in = engine_bytes(in_layout, in_pages).clone()
    want_out = engine_bytes(out_layout, out_pages).clone()
    pair = AtOnce().of  # each direction on its own stream
    shipped_get = transfer.BatchCopy.__dict__["get"]  # the classmethod itself, put back as it was

    def chunked(fn):
        def run():
            transfer.BatchCopy.get = staticmethod(lambda: None)  # the path where the driver has no batched copy
            try:
                return fn()
            finally:
                transfer.BatchCopy.get = shipped_get

        return run

    def shipped_save():
        return save(arena, out_layout, out_save, path="copy_engine")

    def shipped_restore():
        return restore(arena, in_layout, in_restore, path="copy_engine")

    variants = {
        "shipped (batched), both at once": pair(shipped_save, shipped_restore),
        "one cudaMemcpyAsync per chunk, both at once": pair(chunked(shipped_save), chunked(shipped_restore)),
        "restore alone, shipped (batched)": shipped_restore,
        "restore alone, one cudaMemcpyAsync per chunk": chunked(shipped_restore),
    }
    if batch is not None:
        device = torch.cuda.current_device()
        to_host, to_device = BatchCopy(), BatchCopy()
        # CUmemLocation hints: type 1 = device (id = ordinal), 2 = host
        to_host.attrs = BatchCopy.Attributes(1, (1, device), (2, 0), 0)
        to_device.attrs = BatchCopy.Attributes(1, (2, 0), (1, device), 0)
        to_arena = to_host.plan(arena, out_layout, out_pages, True)
        from_arena = to_device.plan(arena, in_layout, in_pages, False)

        def hinted_save():
            to_host(to_arena, torch.cuda.current_stream())
            return transfer._launch_triton(arena, out_layout, out_save, True, checksums=True, sum_only=True)

        def hinted_restore():
            to_device(from_arena, torch.cuda.current_stream())
            return transfer._launch_triton(arena, in_layout, in_restore, False, checksums=True, sum_only=True)

        variants["batched with location hints, both at once"] = pair(hinted_save, hinted_restore)
        variants["restore alone, batched with location hints"] = hinted_restore
    copier = transfer.BatchCopy.get()
    if copier is not None:
        # The control: the same bytes each way as batched copies of `size` between a contiguous HBM buffer and
        # the same arena ranges, nothing else (no engine blocks, no checksums): what the copy engines do with
        # copies of this size both ways at once, against the one-copy ceiling.
        device_out = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
        device_in = torch.empty(total, dtype=torch.uint8, device="cuda")
        starts = np.arange(total // size, dtype=np.uint64) * np.uint64(size)
        lengths = np.full(len(starts), size, dtype=np.uint64)
        arena_at = np.uint64(arena.cpu.data_ptr()) + starts

        def plain_save():
            copier.copy(arena_at, np.uint64(device_out.data_ptr()) + starts, lengths)

        def plain_restore():
            copier.copy(np.uint64(device_in.data_ptr()) + starts, arena_at + np.uint64(total), lengths)

        variants["control: the same bytes in batched copies of contiguous buffers, both at once"] = pair(
            plain_save, plain_restore
        )
    for name, fn in list(variants.items()):  # correctness first: the bytes each way
        for seg in in_layout.segments:
            seg[[p.block for p in in_pages]] = 0
        arena.cpu[:total].zero_()
        torch.cuda.synchronize()
        try:
            fn()
            torch.cuda.synchronize()
        except RuntimeError as exc:  # a variant the driver refuses is reported, not timed
            results[f"engines_{size}_{name}_error"] = repr(exc)
            print(f"{name} did not run: {exc!r}")
            del variants[name]
            continue
        if name.startswith("control"):
            assert torch.equal(arena.cpu[:total].cuda(), device_out), name
            assert torch.equal(arena.cpu[total : 2 * total].cuda(), device_in), name
            continue
        assert torch.equal(engine_bytes(in_layout, in_pages), want_in), ("restored bytes", name)
        if "both" in name:
            for page, at in zip(out_pages, range(0, total, out_layout.page_bytes), strict=True):
                assert torch.equal(
                    arena.cpu[at : at + out_layout.page_bytes].cuda(), engine_bytes(out_layout, [page])
                ), name
    assert want_out.numel() == total
    assert all(restore(arena, in_layout, in_restore, path="copy_engine").wait()), (
        "restored pages failed their checksums"
    )
    for name, t in interleaved_medians(variants, 5).items():
        moved = 2 * total if "both" in name else total
        ref = ceiling["both"] if "both" in name else ceiling["restore"]
        results[f"engines_{size}_{name}"] = rated(
            rows, f"copy engines, {size >> 10} KiB pages x {count}: {name}", moved, t, ref
        )


def sums_read_back(arena, rows: list, ceiling: dict, results: dict, size: int) -> None:
    """The save to its checksums, host-timed: shipped, and with the device sums read by a blocking copy."""
    import time

    layout = layout_for(size)
    pages = as_pages(plans(layout, 256, seed=11))
    nbytes = 256 * layout.page_bytes
    shipped_saved = transfer._saved

    def blocking(arena_, sums, path, page_bytes):  # the fence as it was: device sums, read by .cpu()
        return transfer.Fence(event=transfer._fence_event(arena_), sums=sums, path=path, length=page_bytes)

    def with_blocking() -> list[int]:
        transfer._saved = blocking
        try:
            return save(arena, layout, pages).checksums()
        finally:
            transfer._saved = shipped_saved

    variants = {"shipped": lambda: save(arena, layout, pages).checksums(), "blocking": with_blocking}
    first = {name: fn() for name, fn in variants.items()}
    assert first["shipped"] == first["blocking"], "the two reads disagree on the checksums"
    timed: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(15):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            timed[name].append(time.perf_counter() - began)
    med = {name: float(np.median(ts)) for name, ts in timed.items()}
    results[f"sums {size}"] = {"median_s": med, "all_s": timed}
    for name, what in (("shipped", "pinned copy behind the save"), ("blocking", "blocking read when asked")):
        seconds = med[name]
        rows.append([f"save to its checksums, {size >> 10} KiB pages, {what}", nbytes, seconds,
                     nbytes / seconds / 1e9, nbytes / seconds / 1e9 / ceiling["save"]])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write transfer_tries.json here")
    parser.add_argument(
        "--sections",
        default="items,flat,calls,batch,hybrid,staged,sm,engines,sums,both",
        help="comma list of items, flat, calls, batch, hybrid, staged, sm, engines, sums, both (default all)",
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    arena = make_arena(20 << 30)  # benchmarks/transfer.py's arena and ceiling copies
    rows: list = []
    results: dict = {}
    ceiling = ceilings(arena, rows, 4 << 30)
    results["ceiling"] = ceiling
    steps = []
    if sections & {"items", "flat", "calls"}:
        steps.append(("items", lambda: items_per_program(arena, rows, ceiling, results, sections)))
    batch = None
    try:
        batch = BatchCopy()
    except Exception as exc:
        results["batch_error"] = repr(exc)
    if batch is not None and "batch" in sections:
        for size in (16 << 10, 64 << 10, 256 << 10, 2 << 20):
            steps.append(
                (f"batch {size}", lambda size=size: batched_copies(arena, rows, ceiling, results, batch, size))
            )
    if "sm" in sections:
        steps.append(("sm ceiling", lambda: sm_ceiling(arena, rows, ceiling, results)))
    if "staged" in sections:
        for size in (16 << 10, 64 << 10, 256 << 10):
            steps.append((f"staged {size}", lambda size=size: staged(arena, rows, ceiling, results, size)))
    if "hybrid" in sections:
        for size in (64 << 10, 256 << 10):
            steps.append((f"hybrid {size}", lambda size=size: hybrid(arena, rows, ceiling, results, size)))
    if "engines" in sections:
        for size in (256 << 10, 2 << 20):
            steps.append(
                (
                    f"engines both ways {size}",
                    lambda size=size: engines_both_ways(arena, rows, ceiling, results, batch, size),
                )
            )
    if "sums" in sections:
        for size in (16 << 10, 64 << 10):
            steps.append((f"sums {size}", lambda size=size: sums_read_back(arena, rows, ceiling, results, size)))
    if "both" in sections:
        steps.append(("both ways", lambda: both_ways(arena, rows, ceiling, results, batch, 256 << 10, 256)))
        steps.append(("both ways, 2 MiB", lambda: both_ways(arena, rows, ceiling, results, batch, 2 << 20, 64)))
    failed = []
    for name, fn in steps:
        try:
            fn()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            results[f"{name}_error"] = repr(exc)
            failed.append(name)
        torch.cuda.empty_cache()
    print("| what | bytes | seconds | GB/s | of the ceiling |")
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r[4]:.2f}" if len(r) > 4 else ""
        print(f"| {r[0]} | {r[1]} | {r[2]:.5f} | {r[3]:.1f} | {ratio} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "transfer_tries.json").write_text(json.dumps({"rows": rows, "results": results}, indent=1))
    print("failed:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
