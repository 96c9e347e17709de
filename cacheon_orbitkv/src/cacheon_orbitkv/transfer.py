"""Moving pages between an engine's paged KV buffers and the shared arena, with checksums in the copy.

A group's page is the concatenation of one chunk per *segment*: a segment is a 2-D byte view
``[blocks, chunk_bytes]`` of one engine buffer where row ``b`` is block ``b``'s bytes (vLLM's
``layer[0, b]`` and ``layer[1, b]``, SGLang's ``k_buffer[b*P:(b+1)*P]``, a Mamba state row). The
page checksum is ``mix64`` (see ``wire.checksum``): a wrapping sum of each 64-bit word mixed with
its word index in the page, so a kernel sums each chunk as it copies it, knowing the chunk's offset
in the page.

Paths:

- ``torch`` (CPU tensors: vLLM's CPU build, CI), in one of two routes: ``compiled`` (the default where
  numba compiled ``wire``'s page kernels, segments have contiguous rows and extents start on a 64-bit
  word; off with ``ORBITKV_COMPILED_COPIES=0``), in one compiled call per batch: a save copies and sums
  each page's chunks in one pass (``memcpy`` and then the extent's sum where a chunk is not whole words on
  the engine's side), and so does a restore (where a chunk is not whole words on the engine's side it sums
  the extent first and copies a page that matches by ``memcpy``); else per-chunk ``copy_`` and
  ``wire.checksum``, a restore summing each page before it copies any of it;
- ``triton``: one zero-copy kernel launch per direction reading or writing the CUDA-registered
  arena directly, summing as it goes, over a table of every work item's addresses that a small
  kernel fills on the device from one pinned, asynchronous copy of the layout's and the pages'
  numbers (small and medium pages);
- ``copy_engine``: the DMA engines, every chunk of a transfer in one ``cuMemcpyBatchAsync`` call
  (CUDA 12.8+ drivers; else one ``cudaMemcpyAsync`` per chunk), checksums from a summing kernel over
  the engine-side bytes in HBM (large pages);
- ``staged`` (restores and saves whose page extents are at least ``STAGED_MIN_EXTENT``, 512 KiB and
  1 MiB, with chunks too small for the copy engines): the copy engines move each page's whole arena extent,
  one contiguous copy, between the arena and a ring of device memory (one per direction), a group of pages at
  a time on a side stream, and the ``triton`` path's moving kernel scatters each group from there into the engine blocks
  (or gathers it there), summing as it goes, while the next group's copy runs.

A restore returns a ``Fence``: a CUDA event (or nothing on CPU) plus the per-page verdicts; the
engine waits on it before building the forward pass, and a page whose recomputed checksum does not
match is reported as a miss, never acknowledged.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Literal

import attrs
import numpy as np

from .wire import checksum, page_kernels

log = logging.getLogger(__name__)

Path = Literal["torch", "triton", "copy_engine", "staged"]
COPY_ENGINE_MIN_CHUNK = 1 << 20  # chunks of 1 MiB and more go to the copy engines


def segment_view(tensor: Any, rows: int | None = None) -> Any:
    """A ``[blocks, chunk_bytes]`` uint8 view of ``tensor`` whose dim 0 indexes blocks (each row dense)."""
    import torch

    if not tensor.is_contiguous() and not tensor[0].is_contiguous():
        raise ValueError("a segment's blocks must each be contiguous in memory")
    blocks = tensor.shape[0] if rows is None else rows
    flat = tensor.reshape(tensor.shape[0], -1) if tensor.is_contiguous() else tensor.flatten(1)
    out = flat.view(torch.uint8)
    return out[:blocks]


def paged_tokens(buffer: Any, page_size: int) -> Any:
    """SGLang-style token buffers ``[slots, heads, dim]`` as ``[pages, page_size * heads * dim]`` bytes."""
    pages = buffer.shape[0] // page_size
    return segment_view(buffer[: pages * page_size].reshape(pages, page_size, *buffer.shape[1:]))


def vllm_layer(layer: Any) -> list[Any]:
    """vLLM's per-layer ``[2, num_blocks, block_size, heads, dim]`` cache as its K and V segments."""
    return [segment_view(layer[0]), segment_view(layer[1])]


class LayoutError(ValueError):
    """An engine buffer whose blocks cannot be moved as a few dense byte runs each."""


MAX_RUNS_PER_BLOCK = 64  # more runs than this per block and layer: too fragmented to move well


@attrs.frozen
class BlockRuns:
    """A buffer whose dim 0 indexes blocks, as segments: each block's bytes as a few dense runs.

    ``order`` names the buffer's inner dims in memory order (outermost first, dims of size 1
    left out) with ``_`` after the dims the runs are split over: ``NHC`` is one dense run per
    block, tokens outermost; ``H_NC`` one run per head. Two buffers with the same order, shape
    and dtype give pages of the same bytes.
    """

    segments: tuple[Any, ...] = attrs.field(converter=tuple)
    order: str


def block_runs(tensor: Any, names: str | None = None) -> BlockRuns:
    """Segments of ``tensor`` (dim 0: blocks, any strides) moving each block's bytes as they lie.

    The innermost dims whose strides multiply up from one element form a dense run per block;
    any outer inner dims are split over, one segment per index (in index order), so a block is
    read as ``prod(split sizes)`` runs. ``names`` names dims 1.. (default their numbers). Raises
    ``LayoutError`` for a buffer with no dense innermost dim, runs that are not whole 64-bit
    words at 8-byte aligned addresses, or more than ``MAX_RUNS_PER_BLOCK`` runs per block.
    """
    import torch

    if tensor.dim() < 2:
        raise LayoutError(f"a {tensor.dim()}-d buffer has no per-block rows")
    names = names or "".join(str(d) for d in range(1, tensor.dim()))
    if len(names) != tensor.dim() - 1:
        raise LayoutError(f"{len(names)} dim names {names!r} for a {tensor.dim()}-d buffer")
    dims = sorted((d for d in range(1, tensor.dim()) if tensor.shape[d] > 1), key=tensor.stride, reverse=True)
    run, dense = 1, len(dims)
    while dense and tensor.stride(dims[dense - 1]) == run:
        dense -= 1
        run *= tensor.shape[dims[dense]]
    split, inner = dims[:dense], dims[dense:]
    item = tensor.element_size()
    run_bytes, row_bytes = run * item, tensor.stride(0) * item
    shape = f"shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}"
    if dims and not inner:
        raise LayoutError(f"no dim of the buffer ({shape}) is dense in memory")
    count = 1
    for d in split:
        count *= tensor.shape[d]
    if count > MAX_RUNS_PER_BLOCK:
        raise LayoutError(
            f"a block of the buffer ({shape}) lies in {count} separate runs (at most {MAX_RUNS_PER_BLOCK})"
        )
    starts = [0]
    for d in split:  # element offsets of each run, in index order of the split dims
        starts = [s + i * tensor.stride(d) for s in starts for i in range(tensor.shape[d])]
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    base = tensor.storage_offset() * item
    segments: list[Any] = [
        raw.as_strided((tensor.shape[0], run_bytes), (row_bytes, 1), base + start * item) for start in starts
    ]
    for segment in segments:
        if run_bytes % 8 or row_bytes % 8 or segment.data_ptr() % 8:
            raise LayoutError(
                f"the buffer's runs ({shape}: {run_bytes} bytes, {row_bytes} bytes apart) are not whole "
                "64-bit words at 8-byte aligned addresses (the checksum's and the copy kernel's unit)"
            )
    order = "".join(names[d - 1] for d in split) + ("_" if split else "") + "".join(names[d - 1] for d in inner)
    return BlockRuns(segments, order)


def coalesce(segments: Sequence[Any]) -> list[Any]:
    """Merge segments that continue each other in memory (same rows and row stride, each starting
    where the previous one's run ends) into one: fewer, longer runs per page, the same page bytes."""
    merged: list[Any] = []
    for segment in segments:
        if merged:
            last = merged[-1]
            if (
                last.device == segment.device
                and last.shape[0] == segment.shape[0]
                and last.stride(0) == segment.stride(0)
                and last.untyped_storage().data_ptr() == segment.untyped_storage().data_ptr()
                and last.data_ptr() + last.shape[1] == segment.data_ptr()
                and last.shape[1] + segment.shape[1] <= last.stride(0)
            ):
                merged[-1] = last.as_strided((last.shape[0], last.shape[1] + segment.shape[1]), (last.stride(0), 1))
                continue
        merged.append(segment)
    return merged


WORDS_PER_TILE = 2048  # 64-bit words one Triton program moves at most


@attrs.frozen
class GroupLayout:
    """The segments of one storage group, in page order; every page of the group has ``page_bytes``.

    The layout holds the segments' addresses as they were when it was built: an engine that
    reallocates its KV buffers must build its layouts again.
    """

    segments: tuple[Any, ...] = attrs.field(converter=tuple)
    # Worked out once per layout (each transfer call reads them; from the segments, 30 us a call):
    # every segment's chunk bytes, the page's bytes, the per-segment part of the table every
    # Triton transfer copies to the device (pointers, row strides, chunk bytes, offsets in the
    # page), the Triton tile (64-bit words) and tiles per chunk, and the first chunk that is not
    # whole 64-bit words (None when all are).
    chunks: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    page_bytes: int = attrs.field(init=False, eq=False, repr=False)
    segment_table: np.ndarray = attrs.field(init=False, eq=False, repr=False)
    tile_words: int = attrs.field(init=False, eq=False, repr=False)
    tiles: int = attrs.field(init=False, eq=False, repr=False)
    misaligned: int | None = attrs.field(init=False, eq=False, repr=False)
    rows: int = attrs.field(init=False, eq=False, repr=False)  # engine blocks every segment has
    # Whether every segment is a CPU byte tensor whose rows are contiguous: the compiled CPU path's
    # copies address them raw (``_compiled_pages``).
    host_rows: bool = attrs.field(init=False, eq=False, repr=False)
    # The segment table's rows as uint64 (pointers, row strides, chunk bytes, offsets in the page): the
    # CPU's compiled route adds the pages' numbers to them (``_copy_addresses``, ``save_rows``).
    address_rows: tuple[np.ndarray, ...] = attrs.field(init=False, eq=False, repr=False)
    # Restores captured in CUDA graphs for this layout (``_Replayed``), by arena address, stream and
    # page capacity: they address the layout's segments as they are now, so they live and die with it.
    replays: dict[tuple[int, int, int], Any] = attrs.field(init=False, eq=False, repr=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        chunks = tuple(int(s.shape[1]) for s in self.segments)
        # Small chunks get smaller tiles (no masked-off half tiles) and fewer warps per program.
        words = max(chunks, default=8) // 8
        tile = min(WORDS_PER_TILE, 1 << max(words - 1, 0).bit_length())  # the next power of 2
        object.__setattr__(self, "tile_words", tile)
        object.__setattr__(self, "tiles", -(-words // tile))
        object.__setattr__(self, "misaligned", next((c for c in chunks if c % 8), None))
        object.__setattr__(self, "rows", min((int(s.shape[0]) for s in self.segments), default=0))
        object.__setattr__(
            self,
            "host_rows",
            all(s.device.type == "cpu" and s.element_size() == 1 and s.stride(1) == 1 for s in self.segments),
        )
        sizes = np.asarray(chunks, dtype=np.int64)
        table = np.concatenate(
            [
                np.asarray([s.data_ptr() for s in self.segments], dtype=np.int64),
                np.asarray([s.stride(0) for s in self.segments], dtype=np.int64),
                sizes,
                np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64),
            ]
        )
        table.flags.writeable = False
        rows = table.reshape(4, -1).astype(np.uint64)
        rows.flags.writeable = False
        object.__setattr__(self, "address_rows", tuple(rows))
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "page_bytes", sum(chunks))
        object.__setattr__(self, "segment_table", table)


@attrs.frozen
class PagePlan:
    """One page to move: the engine block it lives in and its arena extent (``checksum`` on restore)."""

    block: int
    offset: int
    checksum: int | None = None


def _frozen(values: Any, dtype: Any, what: str) -> np.ndarray:
    """``values`` as a read-only array of ``dtype``, copied (the caller's list or array may change
    afterwards); a ``ValueError`` for anything but non-negative integers in range (numpy's own
    conversion would take 1.5, True or "3" without a word, and wrap a negative number)."""
    try:
        if isinstance(values, np.ndarray):
            if values.dtype.kind not in "iu":
                raise TypeError(f"not integers ({values.dtype})")
            if values.dtype.kind == "i" and dtype is np.uint64 and values.size and values.min() < 0:
                raise ValueError("negative")  # the cast would wrap it (int64 targets: the validator checks)
            if values.dtype.kind == "u" and values.size and dtype is np.int64 and values.max() >= 1 << 63:
                raise OverflowError("out of range")
            array = values.astype(dtype)
        else:
            kinds = set(map(type, values))
            if not all(issubclass(k, (int, np.integer)) and not issubclass(k, (bool, np.bool_)) for k in kinds):
                raise TypeError("not integers")
            if dtype is np.uint64 and kinds and min(values) < 0:
                raise ValueError("negative")  # numpy refuses it for uint64 too, with a less clear error
            array = np.array(values, dtype=dtype)  # OverflowError past the dtype's range
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"the pages' {what} must be integers in [0, {np.iinfo(dtype).max}]: {e}") from None
    array.flags.writeable = False
    return array


def _check_pages(pages: Pages, attribute: Any, value: Any) -> None:
    arrays: list[tuple[str, Any, Any]] = [("blocks", pages.blocks, np.int64), ("offsets", pages.offsets, np.int64)]
    if pages.checksums is not None:
        arrays.append(("checksums", pages.checksums, np.uint64))
    for what, array, dtype in arrays:
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
            raise ValueError(f"the pages' {what} must be a one-dimensional {np.dtype(dtype).name} array")
    if len({len(array) for _, array, _ in arrays}) > 1:
        raise ValueError(f"the pages' arrays differ in length: {[len(a) for _, a, _ in arrays]}")
    if len(pages.blocks) and (pages.blocks.min() < 0 or pages.offsets.min() < 0):
        raise ValueError("the pages' blocks and offsets must not be negative")


@attrs.frozen
class Pages:
    """Pages to move, as arrays: the engine block each lives in, its arena offset and, for a
    restore, its committed checksum. What save and restore work from: a caller that has these
    numbers as lists builds one ``Pages`` (``Pages.of``) instead of a ``PagePlan`` per page, so the
    numbers reach the device table without a Python step per page (BENCHMARKS.md, 2026-12-02).
    Built directly, the arrays must already be int64 (blocks, offsets) and uint64 (checksums), one
    value per page; anything else is a ``ValueError``."""

    blocks: np.ndarray = attrs.field()  # int64
    offsets: np.ndarray = attrs.field()  # int64
    checksums: np.ndarray | None = attrs.field(default=None, validator=_check_pages)  # uint64

    @classmethod
    def of(cls, blocks: Any, offsets: Any, checksums: Any = None) -> Pages:
        """Pages from sequences (or arrays) of equal length; a typed error for anything else."""
        return cls(
            _frozen(blocks, np.int64, "blocks"),
            _frozen(offsets, np.int64, "offsets"),
            None if checksums is None else _frozen(checksums, np.uint64, "checksums"),
        )

    @classmethod
    def from_plans(cls, plans: Sequence[PagePlan]) -> Pages:
        """One ``PagePlan`` per page, as arrays (checksums only when every plan has one)."""
        sums = list(map(_CHECKSUM, plans))
        return cls.of(list(map(_BLOCK, plans)), list(map(_OFFSET, plans)), None if None in sums else sums)

    def __len__(self) -> int:
        return len(self.blocks)


def _pages(arena: Arena, layout: GroupLayout, pages: Pages | Sequence[PagePlan], committed: bool = False) -> Pages:
    """The pages as arrays, checked against the layout and the arena before anything moves: every
    block one of the engine's, every extent inside the arena (the kernels and copy engines address
    both raw, so a page past either would read or write memory that is not theirs)."""
    out = pages if isinstance(pages, Pages) else Pages.from_plans(pages)
    if committed and out.checksums is None:
        raise ValueError("restore needs each page's committed checksum")
    if len(out):
        if out.blocks.max() >= layout.rows:
            raise ValueError(f"block {out.blocks.max()} is past the engine buffers' {layout.rows} blocks")
        if out.offsets.max() > arena.size - layout.page_bytes:
            raise ValueError(
                f"the extent at arena offset {out.offsets.max()} ({layout.page_bytes} bytes) ends past the "
                f"arena's {arena.size} bytes"
            )
    return out


@attrs.define
class Fence:
    """Completion of a transfer: wait before using the destinations; ``ok`` says which pages are good."""

    event: Any = None
    verdicts: Any = None  # device bool tensor or list[bool]; True = checksum matched
    sums: Any = None  # list[int] (checksums), or a device tensor of sums that ``length`` finishes
    # What ran: "compiled" or "torch" (the CPU path's two routes), "triton", "copy_engine" or "staged".
    path: str = "torch"
    length: int = 0  # a device sum XORed with the page's length is the page's checksum (wire.checksum)

    def wait(self) -> list[bool]:
        if self.event is not None:
            self.event.synchronize()
        if self.verdicts is None:
            return []
        if isinstance(self.verdicts, list):
            return self.verdicts
        return [bool(v) for v in self.verdicts.cpu().tolist()]

    def checksums(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        if isinstance(self.sums, list):
            return self.sums
        return [(int(v) ^ self.length) & 0xFFFFFFFFFFFFFFFF for v in self.sums.cpu().tolist()]


_BLOCK, _OFFSET, _CHECKSUM = attrgetter("block"), attrgetter("offset"), attrgetter("checksum")


def _check_alignment(layout: GroupLayout) -> None:
    if layout.misaligned is not None:
        raise ValueError(f"segment chunks must be multiples of 8 bytes (the checksum's word), got {layout.misaligned}")


class Arena:
    """The shared arena as tensors: a CPU byte tensor, and on CUDA machines the registered device alias."""

    def __init__(self, region: mmap.mmap, device: str = "cpu") -> None:
        import torch

        self.region = region
        self.size = len(region)
        self.cpu = torch.frombuffer(region, dtype=torch.uint8)
        self.words = np.frombuffer(region, np.uint64, self.size >> 3)  # what the compiled CPU kernels sum
        self.address = np.uint64(self.cpu.data_ptr())  # byte 0, as the CPU kernels and staged copies address it
        self.device = device
        self.cuda: Any = None
        self._registered = False
        if device.startswith("cuda"):
            self.cuda = _register(self.cpu, device)
            self._registered = True

    @property
    def kernel_view(self) -> Any:
        """The byte tensor kernels address: the registered CUDA alias, or (under Triton's CPU
        interpreter, ``TRITON_INTERPRET=1``) the host tensor itself."""
        if self.cuda is not None:
            return self.cuda
        if _interpreting():
            return self.cpu
        raise RuntimeError("the Triton path needs a CUDA-registered arena (or TRITON_INTERPRET=1 on the CPU)")

    def close(self) -> None:
        if self._registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.cpu.data_ptr())  # type: ignore[no-untyped-call]
            self._registered = False


def _register(host: Any, device: str) -> Any:
    """``cudaHostRegister`` the arena (mapped, portable) and return a CUDA byte tensor aliasing it."""
    import torch

    ptr, size = host.data_ptr(), host.numel()
    # Pre-fault happened when the arena was mapped (wire.prefault); registration pins the pages.
    flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, flags)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {size}-byte arena failed with error {int(err)}")

    class _Alias:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    with torch.cuda.device(device):
        return torch.as_tensor(_Alias(), device=device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fence_event(arena: Arena) -> Any:
    if arena.cuda is None:
        return None  # the interpreter ran synchronously on the CPU
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(arena.device))  # the arena's device, where the transfer ran
    return event


def choose_path(layout: GroupLayout, device: str) -> Path:
    if not device.startswith("cuda"):
        return "torch"
    return "copy_engine" if min(layout.chunks) >= COPY_ENGINE_MIN_CHUNK else "triton"


# -- torch path (CPU) ----------------------------------------------------------------------------


# The CPU path's compiled route; "0" in $ORBITKV_COMPILED_COPIES keeps the per-chunk torch copies.
COMPILED_COPIES = os.environ.get("ORBITKV_COMPILED_COPIES", "1") != "0"


def _compiled_pages(layout: GroupLayout, pages: Pages) -> Any:
    """The compiled page kernels (``wire``), where they can serve this CPU call: numba compiled them, every
    segment is a CPU byte tensor with contiguous rows, every extent starts on a 64-bit word, and
    ``COMPILED_COPIES`` is on. None otherwise: the per-chunk torch copies run, with the same bytes, checksums
    and verdicts."""
    if not COMPILED_COPIES or not layout.host_rows or not len(pages) or (pages.offsets & 7).any():
        return None
    return page_kernels()


def _save_torch(arena: Arena, layout: GroupLayout, pages: Pages) -> Fence:
    kernels = _compiled_pages(layout, pages)
    if kernels is not None:
        return _compiled_save(kernels, arena, layout, pages.blocks.astype(np.uint64), pages.offsets.astype(np.uint64))
    sums = []
    for block, offset in zip(pages.blocks.tolist(), pages.offsets.tolist(), strict=True):
        at = offset
        for seg, chunk in zip(layout.segments, layout.chunks, strict=True):
            arena.cpu[at : at + chunk].copy_(seg[block])
            at += chunk
        view = memoryview(arena.region)[offset : offset + layout.page_bytes]
        sums.append(checksum(view))
        view.release()
    return Fence(sums=sums, path="torch")


def _restore_torch(arena: Arena, layout: GroupLayout, pages: Pages) -> Fence:
    assert pages.checksums is not None
    kernels = _compiled_pages(layout, pages)
    if kernels is not None:
        # One compiled call: each page copied out and summed in one pass, its verdict whether it matched.
        dst, src, sizes = _copy_addresses(arena, layout, pages, to_arena=False)
        good = np.zeros(len(pages), np.bool_)
        kernels.pages_out(
            arena.words, pages.offsets >> 3, layout.page_bytes >> 3, pages.checksums, dst, src, sizes, good
        )
        return Fence(verdicts=good.tolist(), path="compiled")
    verdicts = []
    for block, offset, committed in zip(
        pages.blocks.tolist(), pages.offsets.tolist(), pages.checksums.tolist(), strict=True
    ):
        view = memoryview(arena.region)[offset : offset + layout.page_bytes]
        good = checksum(view) == committed
        view.release()
        verdicts.append(good)
        if not good:
            continue  # a page that fails its checksum is never written into the engine
        at = offset
        for seg, chunk in zip(layout.segments, layout.chunks, strict=True):
            seg[block].copy_(arena.cpu[at : at + chunk])
            at += chunk
    return Fence(verdicts=verdicts, path="torch")


# -- GPU paths -----------------------------------------------------------------------------------


def _tables(layout: GroupLayout, device: str) -> tuple[Any, ...]:
    """The layout's segment table on the device, as its four rows: pointers, row strides, chunk
    bytes and offsets in the page."""
    import torch

    return tuple(torch.from_numpy(layout.segment_table.reshape(4, -1).copy()).to(device).unbind(0))


def _finish(sums: Any, page_bytes: int) -> Any:
    import torch

    return torch.bitwise_xor(sums, page_bytes)


def _small_table(layout: GroupLayout, pages: Pages, device: str, expected: bool = False) -> Any:
    """The layout's segment table, then the pages' blocks and arena offsets (and, for a restore, the
    committed checksums), in one pinned int64 tensor: one asynchronous copy to the device, which
    never waits for the work already queued on the stream."""
    import torch

    n = len(pages)
    head = layout.segment_table.size
    pinned = device.startswith("cuda")  # not under Triton's CPU interpreter
    host = torch.empty(head + (3 if expected else 2) * n, dtype=torch.int64, pin_memory=pinned)
    table = host.numpy()
    table[:head] = layout.segment_table
    _stage(table, head, n, pages, layout.page_bytes if expected else None)
    return host


def _stage(table: np.ndarray, head: int, stride: int, pages: Pages, page_bytes: int | None) -> None:
    """Write the pages' blocks, arena offsets and, for a restore (``page_bytes`` given), committed checksums
    into ``table`` from ``head``, each list ``stride`` entries after the one before. The checksums as the
    kernel's sums come out (before the XOR with the page's length), so that one comparison on the device
    gives the verdicts."""
    n = len(pages)
    table[head : head + n] = pages.blocks
    table[head + stride : head + stride + n] = pages.offsets
    if page_bytes is not None:
        assert pages.checksums is not None
        table[head + 2 * stride : head + 2 * stride + n] = (pages.checksums ^ np.uint64(page_bytes)).view(np.int64)


@attrs.frozen
class _Work:
    """One Triton transfer's work table on the device, with the pages' sums it zeroed."""

    table: Any
    sums: Any
    small: Any  # the device copy of ``_small_table``
    block: int  # 64-bit words per tile
    items: int

    def committed(self, layout: GroupLayout, n: int) -> Any:
        """The ``n`` pages' committed checksums in the small table (a restore's, ``expected``)."""
        return self.small[layout.segment_table.size + 2 * n :]


def _work_table(arena: Arena, layout: GroupLayout, pages: Pages, expected: bool = False, source: Any = None) -> _Work:
    """The work table of ``pages``, their extents at their offsets in the arena (or in ``source``, a byte
    tensor on the arena's device: a staged transfer's ring)."""
    import torch

    from .gpu_kernels import build_table

    device = arena.device
    n_segments, n = len(layout.segments), len(pages)
    block, tiles = layout.tile_words, layout.tiles
    items = n * n_segments * tiles
    # Everything the host prepares is one pinned copy, issued without a synchronization; the sums
    # are zeroed by the table kernel. The host work before the moving kernel starts is the GPU's
    # idle time in a call from an idle stream (BENCHMARKS.md, 2026-12-02).
    small = _small_table(layout, pages, device, expected).to(device, non_blocking=True)
    sums = torch.empty(n, dtype=torch.int64, device=device)
    # Every work item's addresses in a table built on the device, so that the moving kernel starts
    # each item with independent loads instead of a chain of lookups (measured on the H200 with a
    # prebuilt table: restores of 16 KiB / 64 KiB pages at 0.88 / 0.92 of the ceiling, against
    # 0.66 / 0.86 with the lookups in the moving kernel; BENCHMARKS.md).
    table = torch.empty((5, items), dtype=torch.int64, device=device)
    build_table[(-(-items // 1024),)](  # not triton.cdiv: a 2.6 us host call in Triton 3.6
        small,
        n_segments,
        n,
        tiles,
        (arena.kernel_view if source is None else source).data_ptr(),
        table,
        items,
        sums,
        0,
        TILE=block,
        ITEMS=1024,
        num_warps=4,
    )
    return _Work(table, sums, small, block, items)


def _move_items(
    work: _Work,
    to_arena: bool,
    checksums: bool = True,
    sum_only: bool = False,
    programs: int | None = None,
    items: range | None = None,
) -> None:
    """Move the table's work ``items`` (default all), one a program or, ``programs``, over a capped grid."""
    from .gpu_kernels import move_table

    span = items or range(work.items)
    assert programs is None or span.stop == work.items, "a capped grid moves the table's items to its end"
    grid = (min(len(span), programs) if programs else len(span),)
    move_table[grid](
        work.table,
        work.items,
        work.sums,
        span.start,
        TO_ARENA=to_arena,
        CHECKSUM=checksums,
        BLOCK=work.block,
        SUM_ONLY=sum_only,
        PERSISTENT=grid[0] < len(span),  # the capped grid walks to the table's end
        num_warps=8 if work.block >= 2048 else 4,
    )


def _launch_triton(
    arena: Arena,
    layout: GroupLayout,
    pages: Pages,
    to_arena: bool,
    checksums: bool = True,
    sum_only: bool = False,
    programs: int | None = None,
    expected: bool = False,
) -> Any:
    """Launch one move (or, ``sum_only``, a checksum pass over the engine rows) of ``pages``; returns
    the pages' sums as a device tensor (each page's checksum before the XOR with its length: see
    ``Fence.length``), and with ``expected`` (a restore) the device tensor of their committed
    checksums in the same form."""
    work = _work_table(arena, layout, pages, expected)
    _move_items(work, to_arena, checksums, sum_only, programs)
    if expected:
        return work.sums, work.committed(layout, len(pages))
    return work.sums


class _CopyAttributes(ctypes.Structure):
    # CUmemcpyAttributes (CUDA 12.8): source access order, source and destination location hints, flags
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", ctypes.c_int * 2),
        ("dst_loc_hint", ctypes.c_int * 2),
        ("flags", ctypes.c_uint),
    ]


class BatchCopy:
    """``cuMemcpyBatchAsync``: many copies in one driver call, looked up at its CUDA 12.8 ABI.

    One call per transfer instead of one ``cudaMemcpyAsync`` per chunk: measured on the H200, 2 MiB
    pages (1 MiB chunks) moved at 0.97-0.98 of the contiguous ceiling this way against 0.88-0.90
    chunk by chunk (BENCHMARKS.md). The driver refuses batches on the legacy default stream, so a
    transfer issued there runs on a side stream ordered after and before it.
    """

    _instance: BatchCopy | None = None
    _looked_up = False

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._attributes = _CopyAttributes(1, (0, 0), (0, 0), 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attribute_index = (ctypes.c_size_t * 1)(0)
        self._side: dict[int, Any] = {}

    @classmethod
    def get(cls) -> BatchCopy | None:
        """The process's batch copier, or None where the driver has no ``cuMemcpyBatchAsync``."""
        if not cls._looked_up:
            cls._looked_up = True
            try:
                cuda = ctypes.CDLL("libcuda.so.1")
                fn = ctypes.c_void_p()
                found = ctypes.c_int()
                rc = cuda.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080, 0, ctypes.byref(found))
                if rc != 0 or not fn.value:
                    raise OSError(f"cuGetProcAddress returned {rc}")
                prototype = ctypes.CFUNCTYPE(
                    ctypes.c_int,
                    *[ctypes.c_void_p] * 3,
                    ctypes.c_size_t,
                    *[ctypes.c_void_p] * 2,
                    ctypes.c_size_t,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                )
                cls._instance = cls(prototype(fn.value))
            except (OSError, AttributeError) as exc:
                log.info("orbitkv: no cuMemcpyBatchAsync (%s); large pages are copied chunk by chunk", exc)
        return cls._instance

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` (addresses) on ``stream`` (default the
        current stream)."""
        import torch

        stream = stream or torch.cuda.current_stream()
        side = None
        if stream.cuda_stream == 0:  # the legacy default stream
            side = self._side.get(stream.device.index or 0)
            if side is None:
                side = self._side[stream.device.index or 0] = torch.cuda.Stream(stream.device)  # type: ignore[no-untyped-call]
            side.wait_stream(stream)
        count = len(sizes)
        if not count:
            return
        failed = ctypes.c_size_t()
        rc = self._fn(
            dst.ctypes.data,
            src.ctypes.data,
            sizes.ctypes.data,
            count,
            ctypes.addressof(self._attributes),
            ctypes.addressof(self._attribute_index),
            1,
            ctypes.addressof(failed),
            ctypes.c_void_p((side or stream).cuda_stream),
        )
        if side is not None:
            stream.wait_stream(side)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA error {rc} at copy {failed.value} of {count}")


def _copy_addresses(
    arena: Arena, layout: GroupLayout, pages: Pages, to_arena: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every chunk's (destination, source, size), page by page, as arrays of addresses and sizes."""
    host, engine, sizes = _addresses(arena, layout, pages.blocks.astype(np.uint64), pages.offsets.astype(np.uint64))
    return (host, engine, sizes) if to_arena else (engine, host, sizes)


def _addresses(
    arena: Arena, layout: GroupLayout, blocks: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every chunk's arena address, engine address and size, page by page (uint64 blocks and offsets)."""
    bases, strides, chunks, seg_offsets = layout.address_rows
    host = (offsets + arena.address)[:, None] + seg_offsets
    engine = blocks[:, None] * strides + bases
    sizes = np.empty(host.shape, np.uint64)
    sizes[:] = chunks
    return host.ravel(), engine.ravel(), sizes.ravel()


def _copy_engine(
    arena: Arena,
    layout: GroupLayout,
    pages: Pages,
    to_arena: bool,
    checksums: bool = True,
    expected: bool = False,
) -> Any:
    # The registered arena is pinned host memory: these copies run on the copy engines.
    batch = BatchCopy.get()
    if batch is not None:
        batch.copy(*_copy_addresses(arena, layout, pages, to_arena))
    else:
        for block, offset in zip(pages.blocks.tolist(), pages.offsets.tolist(), strict=True):
            at = offset
            for seg, chunk in zip(layout.segments, layout.chunks, strict=True):
                if to_arena:
                    arena.cpu[at : at + chunk].copy_(seg[block], non_blocking=True)
                else:
                    seg[block].copy_(arena.cpu[at : at + chunk], non_blocking=True)
                at += chunk
    if not checksums:
        return None
    # Checksums over the engine side, in HBM (the copies are ordered before it on this stream): the
    # bytes just gathered on save, the bytes that landed on restore. No second pass over PCIe.
    return _launch_triton(arena, layout, pages, to_arena, checksums=True, sum_only=True, expected=expected)


RESTORE_GRAPHS = os.environ.get("ORBITKV_RESTORE_GRAPHS", "1") != "0"
REPLAY_MIN_PAGES = 16  # the smallest capacity captured: page counts are rounded up to a power of 2
# Work items of the largest capture: its table holds 40 bytes an item in device memory for as long as
# the layout lives (10 MiB here; a 32k-token prefix of 32 layers in 16-token pages is 1 << 18 items).
# Larger restores launch eagerly, where the host's work weighs least against the move.
REPLAY_MAX_ITEMS = 1 << 18
REPLAY_SLOTS = 4  # pinned staging buffers per capture, each rewritten once its last call has finished
REPLAYS_PER_LAYOUT = 8  # captures kept per layout (arena, stream, capacity); the oldest is dropped
_REPLAYS_LOCK = threading.Lock()  # finding, capturing and dropping captures


class _Graphs:
    """Stream capture and graph launch through the CUDA driver (``libcuda.so.1``, ctypes), not
    ``torch.cuda.CUDAGraph``: in torch 2.11 a torch capture puts the process's default CUDA random
    generator into capture mode, so that another thread's random draw on the GPU (an engine's sampler)
    fails while it runs, and a capture that fails leaves the generator and the caching allocator so.
    Nothing captured here allocates or draws random numbers."""

    _cuda: Any = None
    THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: other threads' CUDA calls go on

    @classmethod
    def driver(cls) -> Any:
        if cls._cuda is None:
            cuda = ctypes.CDLL("libcuda.so.1")
            voids = ctypes.c_void_p
            signatures = {
                "cuStreamBeginCapture_v2": (voids, ctypes.c_int),
                "cuStreamEndCapture": (voids, ctypes.POINTER(voids)),
                "cuGraphInstantiateWithFlags": (ctypes.POINTER(voids), voids, ctypes.c_ulonglong),
                "cuGraphLaunch": (voids, voids),
                "cuGraphDestroy": (voids,),
                "cuGraphExecDestroy": (voids,),
                "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, voids, ctypes.c_size_t, voids),
            }
            for name, arguments in signatures.items():
                fn = getattr(cuda, name)
                fn.argtypes, fn.restype = arguments, ctypes.c_int
            cls._cuda = cuda
        return cls._cuda

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")


class _Replayed:
    """A Triton restore of up to ``capacity`` pages of one layout from one arena on one stream, captured once in CUDA
    graphs and replayed per call: the staging slot's copy to the device, the table kernel (reading the live page count
    on the device), the moving kernel and the verdicts' comparison in one graph launch, so a call's host work before
    the move is writing the pages' numbers into a pinned staging slot and launching that slot's graph (BENCHMARKS.md).
    Its tables and outputs are fixed buffers: each call copies its verdicts and sums out (after the launch, on the
    same stream) so a later call cannot overwrite a fence's; a slot is rewritten only once its last call has finished.

    Under Triton's CPU interpreter (``capture=False``) the same kernels run eagerly on the same
    buffers: the bounded table and the stale-slot handling are tested there."""

    def __init__(self, arena: Arena, layout: GroupLayout, capacity: int, capture: bool) -> None:
        import torch

        # The layout's numbers, not the layout (which holds its captures) nor the arena (kept alive else).
        self.capacity, self.page_bytes = capacity, layout.page_bytes
        self.n_segments, self.tiles, self.tile_words = len(layout.segments), layout.tiles, layout.tile_words
        self.arena_ptr = arena.kernel_view.data_ptr()
        self.head = layout.segment_table.size
        self.live_at = self.head + 3 * capacity  # the live page count's place in the small table
        self.items = capacity * len(layout.segments) * layout.tiles
        self.done: list[Any] = [None] * REPLAY_SLOTS  # each slot's last call, finished on the device
        self.execs: list[int] = []  # the slots' instantiated graphs
        self.turn = 0
        self.replays = 0
        self.lock = threading.Lock()
        device = arena.device
        with torch.cuda.device(device) if capture else contextlib.nullcontext():
            self.small = torch.zeros(self.live_at + 1, dtype=torch.int64, device=device)
            self.table = torch.empty((5, self.items), dtype=torch.int64, device=device)
            self.sums = torch.zeros(capacity, dtype=torch.int64, device=device)
            self.verdicts = torch.zeros(capacity, dtype=torch.bool, device=device)
            self.work = _Work(self.table, self.sums, self.small, self.tile_words, self.items)
            self.slots = [
                torch.zeros(self.live_at + 1, dtype=torch.int64, pin_memory=capture) for _ in range(REPLAY_SLOTS)
            ]
            for slot in self.slots:
                slot.numpy()[: self.head] = layout.segment_table
            self.small.copy_(self.slots[0])  # live count 0: the warm-up below moves nothing
            self._launch()  # compiles the kernels outside the capture
            if capture:
                self._capture(torch.cuda.current_stream(device))

    def _capture(self, current: Any) -> None:
        """One graph per staging slot, its first node the slot's copy to the device; captured on a side
        stream, thread-local, so that other threads' CUDA calls are not part of it."""
        import torch

        cuda, check = _Graphs.driver(), _Graphs.check
        side = torch.cuda.Stream(current.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        handle = ctypes.c_void_p(side.cuda_stream)
        nbytes = self.small.numel() * self.small.element_size()
        for slot in self.slots:
            check(cuda.cuStreamBeginCapture_v2(handle, _Graphs.THREAD_LOCAL), "cuStreamBeginCapture")
            graph = ctypes.c_void_p()
            try:
                check(
                    cuda.cuMemcpyHtoDAsync_v2(self.small.data_ptr(), slot.data_ptr(), nbytes, handle),
                    "cuMemcpyHtoDAsync",
                )
                with torch.cuda.stream(side):
                    self._launch()
            finally:
                ended = cuda.cuStreamEndCapture(handle, ctypes.byref(graph))
            check(ended, "cuStreamEndCapture")
            executable = ctypes.c_void_p()
            try:
                check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(executable), graph, 0), "cuGraphInstantiate")
            finally:
                cuda.cuGraphDestroy(graph)
            self.execs.append(int(executable.value or 0))
        current.wait_stream(side)

    def _launch(self) -> None:
        import torch

        from .gpu_kernels import build_table

        build_table[(-(-self.items // 1024),)](
            self.small,
            self.n_segments,
            self.capacity,
            self.tiles,
            self.arena_ptr,
            self.table,
            self.items,
            self.sums,
            self.live_at,
            TILE=self.tile_words,
            ITEMS=1024,
            BOUNDED=True,
            num_warps=4,
        )
        _move_items(self.work, to_arena=False)
        expected = self.small[self.head + 2 * self.capacity : self.live_at]
        torch.eq(self.sums, expected, out=self.verdicts)

    def run(self, pages: Pages, stream: Any = None) -> tuple[Any, Any]:
        """Restore ``pages`` (at most ``capacity``, checked against the layout and arena) on ``stream`` (the
        stream it was captured for); returns the pages' sums and verdicts as device tensors of their own."""
        import torch

        n = len(pages)
        with self.lock:
            slot = self.turn % REPLAY_SLOTS
            self.turn += 1
            if self.done[slot] is not None:
                self.done[slot].synchronize()  # the slot's call of REPLAY_SLOTS calls ago has read it
            staged = self.slots[slot].numpy()
            _stage(staged, self.head, self.capacity, pages, self.page_bytes)
            staged[self.live_at] = n
            if not self.execs:
                self.small.copy_(self.slots[slot])
                self._launch()
            else:
                _Graphs.check(
                    _Graphs.driver().cuGraphLaunch(self.execs[slot], ctypes.c_void_p(stream.cuda_stream)),
                    "cuGraphLaunch",
                )
                event = self.done[slot] or torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                self.done[slot] = event
            self.replays += 1
            with torch.cuda.stream(stream) if self.execs else contextlib.nullcontext():
                return self.sums[:n].clone(), self.verdicts[:n].clone()

    def finish(self) -> None:
        """Wait for every call still running on the device (before the buffers may be freed)."""
        for event in self.done:
            if event is not None:
                event.synchronize()

    def __del__(self) -> None:
        try:
            self.finish()
            for executable in self.execs:
                _Graphs.driver().cuGraphExecDestroy(ctypes.c_void_p(executable))
            self.execs = []
        except Exception:  # at interpreter exit the CUDA context may be gone already
            pass


def _replayed(arena: Arena, layout: GroupLayout, n: int) -> tuple[_Replayed, Any] | None:
    """The captured restore for ``n`` pages of ``layout`` on the arena device's current stream, with that
    stream, captured on first use (the first call at each capacity compiles and captures: milliseconds);
    None where none runs (no pages, too many, inside a capture, or a capture for the layout failed: a
    warning once, then the eager restore for that layout)."""
    import torch

    capture = arena.cuda is not None
    if not n or (capture and torch.cuda.is_current_stream_capturing()):
        return None
    capacity = max(REPLAY_MIN_PAGES, 1 << (n - 1).bit_length())
    if capacity * len(layout.segments) * layout.tiles > REPLAY_MAX_ITEMS:
        return None
    stream = torch.cuda.current_stream(arena.device) if capture else None
    key = (arena.kernel_view.data_ptr(), stream.cuda_stream if stream is not None else 0, capacity)
    replays = layout.replays
    found = replays.get(key)
    if found is not None:
        return found, stream
    with _REPLAYS_LOCK:
        found = replays.get(key)
        if found is None and replays.get((0, 0, 0)) is None:  # (0, 0, 0): a capture failed for this layout
            try:
                found = _Replayed(arena, layout, capacity, capture)
                if len(replays) >= REPLAYS_PER_LAYOUT:
                    oldest = next(iter(replays))
                    replays.pop(oldest).finish()
            except Exception as e:  # any failure of the capture: the eager restore still works
                log.warning("restores of this layout run without CUDA graphs: capturing one failed: %s", e)
                replays[(0, 0, 0)] = False
                return None
            replays[key] = found
    return (found, stream) if found else None


# Restores and saves (keyed by "to the arena") of page extents this large, chunks below COPY_ENGINE_MIN_CHUNK, are
# staged. On three H100 hosts whose SMs read the arena at 0.85-0.95 of the link, restores of 256 pages of 512 KiB
# extents ran staged within 2.2% of the SMs in 6 of 7 runs (the seventh 8% slower), four calls back to back 2-5%
# faster on two hosts and 7-9% slower in the third's one run; another host's SMs read the arena at 0.61-0.63, where
# only the copy engines reach the link. Saves of 512 KiB extents staged took 0-4% longer than on the SMs, so saves
# keep 1 MiB (BENCHMARKS.md, 2026-12-06).
STAGED_MIN_EXTENT = {False: 512 << 10, True: 1 << 20}
# The staging ring in device memory, per device and direction, allocated on first use and kept: "0" turns
# staging off. STAGING_SLOTS groups of pages are in flight at once.
STAGING_BYTES = max(0, int(os.environ.get("ORBITKV_STAGING_MIB", "96"))) << 20
STAGING_SLOTS = 3
STAGED_SAVES = os.environ.get("ORBITKV_STAGED_SAVES", "1") != "0"  # saves staged too (a ring of their own)
_STAGERS: dict[tuple[str, bool], Any] = {}  # (device, to the arena) -> _Staged, or False where one failed
_STAGERS_FAILED: list[Any] = []  # the rings of failed stagers, kept: kernels queued before the failure may read them
_STAGERS_LOCK = threading.Lock()


class _Staged:
    """Transfers through device memory in one direction: a ring of ``slots`` slots of ``group_bytes`` on the
    arena's device, and a side stream for the copy engines.

    The SMs reach the registered arena over PCIe at 0.61-0.95 of what the copy engines reach with large
    contiguous copies, by host (BENCHMARKS.md), and a page's chunks (one per layer and K/V) are too small for
    the copy engines one by one; its whole arena extent is one contiguous copy. A restore (``run``), per group
    of pages that fills a slot: one batched copy of their extents into the slot on the side stream (a copy per
    run of extents that lie end to end in the arena, as pages stored together do: ``_runs``), then the
    moving kernel over the group's items of one work table (built once per call, its arena side the ring)
    on the caller's stream, scattering the pages into the engine blocks and summing them as the ``triton``
    path does; the next group's copy runs meanwhile. A save (``save``) the other way round: the moving
    kernel gathers a group into its slot with the sums, then one batched copy of the slot's extents into
    the arena on the side stream while the kernel gathers the next group; the caller's stream waits for the
    last copy. A slot is refilled only after its last reader finished (an event per slot, kept across
    calls); a restore's copies are ordered after the work already on the caller's stream.

    Under Triton's CPU interpreter the ring is host memory and the copies are ``copy_`` calls: the groups,
    the ring's places, the runs and the table's item ranges are tested there."""

    def __init__(self, device: str, group_bytes: int, slots: int) -> None:
        import torch

        self.device, self.group_bytes, self.slots = device, group_bytes, slots
        self.gpu = device.startswith("cuda")
        self.turn = 0
        self.lock = threading.Lock()
        self.freed: list[Any] = [None] * slots  # each slot's last reader (a restore's kernel, a save's copy)
        with torch.cuda.device(device) if self.gpu else contextlib.nullcontext():
            self.ring = torch.empty(slots * group_bytes, dtype=torch.uint8, device=device)
            self.side = torch.cuda.Stream(device) if self.gpu else None  # type: ignore[no-untyped-call]
            self.landed = [torch.cuda.Event() for _ in range(slots)] if self.gpu else []  # type: ignore[no-untyped-call]

    def _read(self, slot: int, stream: Any) -> None:
        """Record ``slot``'s last reader: the work queued on ``stream`` so far (the slot is refilled after it)."""
        import torch

        freed = self.freed[slot] or torch.cuda.Event()  # type: ignore[no-untyped-call]
        freed.record(stream)
        self.freed[slot] = freed

    def fits(self, layout: GroupLayout) -> bool:
        return layout.page_bytes <= self.group_bytes

    def _groups(self, layout: GroupLayout, pages: Pages) -> tuple[int, list[int], np.ndarray, Any]:
        """A call's plan (under the lock): pages per slot, each group's slot (the ring's next ones), each page's
        place in the ring, and the copier (None: one ``copy_`` per run of extents)."""
        n, page = len(pages), layout.page_bytes
        per = self.group_bytes // page
        turns = (self.turn + np.arange(-(-n // per))) % self.slots
        self.turn += len(turns)
        places = (np.repeat(turns, per)[:n] * self.group_bytes + np.arange(n) % per * page).astype(np.int64)
        return per, turns.tolist(), places, BatchCopy.get() if self.gpu else None

    def _copy(
        self, copier: Any, arena: Arena, page: int, places: np.ndarray, offsets: np.ndarray, to_arena: bool
    ) -> None:
        """One group's extents between the ring (``places``) and the arena (``offsets``), a copy per run of them
        (``_runs``), in one batched copy on the side stream, or (no batched copies, or the interpreter) one
        ``copy_`` per run."""
        import torch

        at, offset, lengths = _runs(places, offsets, page)
        if copier is not None:
            ring = np.uint64(self.ring.data_ptr()) + at.astype(np.uint64)
            host = arena.address + offset.astype(np.uint64)
            copier.copy(host if to_arena else ring, ring if to_arena else host, lengths, self.side)
            return
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            for start, held, n in zip(at.tolist(), offset.tolist(), lengths.tolist(), strict=True):
                ring_side, arena_side = self.ring[start : start + n], arena.cpu[held : held + n]
                if to_arena:
                    arena_side.copy_(ring_side, non_blocking=True)
                else:
                    ring_side.copy_(arena_side, non_blocking=True)

    def run(self, arena: Arena, layout: GroupLayout, pages: Pages) -> tuple[Any, Any]:
        """Restore ``pages`` (checked against the layout and arena, each extent fitting a slot); returns the
        pages' sums and committed checksums as device tensors, as ``_launch_triton`` does."""
        import torch

        n, page, items_per_page = len(pages), layout.page_bytes, len(layout.segments) * layout.tiles
        current = torch.cuda.current_stream(self.device) if self.gpu else None
        with self.lock:
            per, turns, places, copier = self._groups(layout, pages)
            staged = Pages(pages.blocks, places, pages.checksums)
            if self.side is not None and current is not None:
                self.side.wait_stream(current)
            work = None
            for g, slot in enumerate(turns):
                lo, hi = g * per, min(n, (g + 1) * per)
                if self.side is not None and self.freed[slot] is not None:
                    self.side.wait_event(self.freed[slot])
                self._copy(copier, arena, page, places[lo:hi], pages.offsets[lo:hi], to_arena=False)
                if self.side is not None and current is not None:
                    self.landed[slot].record(self.side)
                    current.wait_event(self.landed[slot])
                if work is None:  # after the first copy is on its way
                    work = _work_table(arena, layout, staged, expected=True, source=self.ring)
                _move_items(work, False, items=range(lo * items_per_page, hi * items_per_page))
                if current is not None:
                    self._read(slot, current)
        assert work is not None
        return work.sums, work.committed(layout, n)

    def save(self, arena: Arena, layout: GroupLayout, pages: Pages) -> Any:
        """Save ``pages`` (checked against the layout and arena, each extent fitting a slot); returns the pages'
        sums as a device tensor, as ``_launch_triton`` does, the caller's stream ordered after the last copy."""
        import torch

        n, page, items_per_page = len(pages), layout.page_bytes, len(layout.segments) * layout.tiles
        current = torch.cuda.current_stream(self.device) if self.gpu else None
        with self.lock:
            per, turns, places, copier = self._groups(layout, pages)
            work = _work_table(arena, layout, Pages(pages.blocks, places), source=self.ring)
            for g, slot in enumerate(turns):
                lo, hi = g * per, min(n, (g + 1) * per)
                if current is not None and self.freed[slot] is not None:
                    current.wait_event(self.freed[slot])  # the slot's last copy into the arena has read it
                _move_items(work, True, items=range(lo * items_per_page, hi * items_per_page))
                if self.side is not None and current is not None:
                    self.landed[slot].record(current)
                    self.side.wait_event(self.landed[slot])
                self._copy(copier, arena, page, places[lo:hi], pages.offsets[lo:hi], to_arena=True)
                if self.side is not None:
                    self._read(slot, self.side)
            if current is not None and self.freed[turns[-1]] is not None:
                current.wait_event(self.freed[turns[-1]])  # the fence covers the copies
        return work.sums


def _runs(places: np.ndarray, offsets: np.ndarray, page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A group's page extents as runs of pages that lie end to end both in the ring (``places``) and in the arena
    (``offsets``), as pages stored together do: each run's ring place, arena offset and byte length (uint64), so
    that one copy moves a run (the copy engines move one large copy nearer the link's rate than many small ones)."""
    n = len(places)
    apart = np.flatnonzero((np.diff(places) != page) | (np.diff(offsets) != page)) + 1
    starts = np.concatenate(([0], apart))
    lengths = np.diff(np.concatenate((starts, [n]))).astype(np.uint64) * np.uint64(page)
    return places[starts], offsets[starts], lengths


def _stager(arena: Arena, layout: GroupLayout, asked: bool = False, to_arena: bool = False) -> _Staged | None:
    """The arena device's staging ring for restores (or ``to_arena``, saves) of ``layout``: extents that fit a
    slot, of at least ``STAGED_MIN_EXTENT`` for the direction unless ``asked`` (``path="staged"``), not inside a
    capture; None else, or where setting the ring up or a transfer through it failed (a warning once, then the
    ``triton`` path)."""
    import torch

    if not STAGING_BYTES or (layout.page_bytes < STAGED_MIN_EXTENT[to_arena] and not asked):
        return None
    if arena.cuda is not None and torch.cuda.is_current_stream_capturing():
        return None
    device = str(arena.cuda.device) if arena.cuda is not None else arena.device
    found = _STAGERS.get((device, to_arena))
    if found is None:
        with _STAGERS_LOCK:
            found = _STAGERS.get((device, to_arena))
            if found is None:
                try:
                    found = _Staged(device, STAGING_BYTES // STAGING_SLOTS, STAGING_SLOTS)
                except Exception as e:  # no device memory for the ring: the SMs reach the arena directly
                    log.warning(
                        "%s run without a staging ring on %s: setting it up failed: %s", _WAY[to_arena], device, e
                    )
                    found = False
                _STAGERS[device, to_arena] = found
    return found if isinstance(found, _Staged) and found.fits(layout) else None


_WAY = {False: "restores", True: "saves"}


def _staged(
    arena: Arena,
    layout: GroupLayout,
    batch: Pages,
    chosen: Path,
    path: Path | None,
    programs: int | None,
    to_arena: bool,
) -> Any:
    """The staged save or restore of ``batch`` where one runs (its sums; a restore's with the committed checksums),
    else None: asked for (``path="staged"``; a ``ValueError`` where no ring holds a page's extent), or chosen for
    the ``triton`` path when neither ``path`` nor ``programs`` was given. A staged transfer that fails logs one
    warning; that direction goes on the SMs from then on (this call too: None)."""
    if not len(batch) or not (chosen == "staged" or (path is None and programs is None and chosen == "triton")):
        return None
    usable = arena.cuda is not None or _interpreting()
    stager = _stager(arena, layout, asked=chosen == "staged", to_arena=to_arena) if usable else None
    if stager is None:
        if chosen == "staged":
            raise ValueError(f"staged {_WAY[to_arena]} need a staging ring that holds one page's extent")
        return None
    try:
        return stager.save(arena, layout, batch) if to_arena else stager.run(arena, layout, batch)
    except Exception as e:  # a copy the driver refused: this call and the next go on the SMs
        log.warning("%s run without a staging ring on %s: a staged one failed: %s", _WAY[to_arena], stager.device, e)
        with _STAGERS_LOCK:
            _STAGERS[stager.device, to_arena] = False
            _STAGERS_FAILED.append(stager)
        return None


def save(
    arena: Arena,
    layout: GroupLayout,
    pages: Pages | Sequence[PagePlan],
    path: Path | None = None,
    programs: int | None = None,
) -> Fence:
    """Gather each page's chunks into its arena extent; the fence carries the checksums to commit.

    ``programs`` caps the Triton grid, so a save and a restore can share the GPU at once. Pages whose extents
    are at least ``STAGED_MIN_EXTENT[True]`` (1 MiB) with chunks below ``COPY_ENGINE_MIN_CHUNK`` are staged
    (``path`` "staged", see ``_Staged``) where neither ``path`` nor ``programs`` is given, unless
    ``$ORBITKV_STAGED_SAVES`` is "0" or ``$ORBITKV_STAGING_MIB`` is "0".
    """
    _check_alignment(layout)
    batch = _pages(arena, layout, pages)
    chosen = path or choose_path(layout, arena.device)
    if chosen == "torch":
        return _save_torch(arena, layout, batch)
    if STAGED_SAVES or chosen == "staged":
        sums = _staged(arena, layout, batch, chosen, path, programs, to_arena=True)
        if sums is not None:
            return _saved(arena, sums, "staged", layout.page_bytes)
        chosen = "triton" if chosen == "staged" else chosen
    sums = (
        _launch_triton(arena, layout, batch, True, programs=programs)
        if chosen == "triton"
        else _copy_engine(arena, layout, batch, True)
    )
    return _saved(arena, sums, chosen, layout.page_bytes)


def save_rows(arena: Arena, layout: GroupLayout, rows: Sequence[int], offsets: Sequence[int]) -> Fence:
    """``save`` of engine row ``rows[i]`` into the extent at arena offset ``offsets[i]``, from sequences of
    ints. On the CPU's compiled route (``_compiled_pages``) the numbers are checked as ``save`` checks them
    and turned into the kernel's addresses without building ``Pages``: on the 2-core CPU machine an engine's
    save of 8 parts took 0.1-0.2 ms less (BENCHMARKS.md, 2026-12-06). Anywhere else, and for anything
    these checks do not take (numbers that are not plain ints, out of range, unaligned), exactly ``save``:
    the same bytes, checksums and errors."""
    fast = _save_rows_compiled(arena, layout, rows, offsets)
    return fast if fast is not None else save(arena, layout, Pages.of(rows, offsets))


def _save_rows_compiled(arena: Arena, layout: GroupLayout, rows: Sequence[int], offsets: Sequence[int]) -> Fence | None:
    n = len(offsets)
    if arena.cuda is not None or not COMPILED_COPIES or not layout.host_rows or layout.misaligned is not None:
        return None
    if not n or len(rows) != n or {type(v) for v in rows} != _INT or {type(v) for v in offsets} != _INT:
        return None
    if min(rows) < 0 or max(rows) >= layout.rows or min(offsets) < 0 or max(offsets) > arena.size - layout.page_bytes:
        return None
    kernels = page_kernels()
    if kernels is None or kernels.pages_in is None:
        return None
    at = np.array(offsets, np.uint64)
    if int(np.bitwise_or.reduce(at)) & 7:
        return None
    return _compiled_save(kernels, arena, layout, np.array(rows, np.uint64), at)


def _compiled_save(kernels: Any, arena: Arena, layout: GroupLayout, blocks: np.ndarray, offsets: np.ndarray) -> Fence:
    """One compiled call (uint64 blocks and word-aligned offsets, checked by the caller): each page's chunks
    copied into its extent and summed in the same pass."""
    host, engine, sizes = _addresses(arena, layout, blocks, offsets)
    summed = np.zeros(len(offsets), np.uint64)
    kernels.pages_in(
        arena.words, (offsets >> np.uint64(3)).astype(np.int64), layout.page_bytes >> 3, host, engine, sizes, summed
    )
    return Fence(sums=summed.tolist(), path="compiled")


_INT = {int}


def _saved(arena: Arena, sums: Any, path: Path, page_bytes: int) -> Fence:
    """A save's fence, its device sums copied to pinned host memory behind the save's work on the same
    stream: waiting for it waits for this save alone, not for later work queued on the stream (a
    blocking ``.cpu()`` would wait for the next save's copy too)."""
    import torch

    if isinstance(sums, torch.Tensor) and sums.is_cuda:
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        sums = host
    return Fence(event=_fence_event(arena), sums=sums, path=path, length=page_bytes)


def restore(
    arena: Arena,
    layout: GroupLayout,
    pages: Pages | Sequence[PagePlan],
    path: Path | None = None,
    programs: int | None = None,
    graphs: bool | None = None,
) -> Fence:
    """Scatter leased pages into their engine blocks; the fence says which pages matched their checksums.

    The copy and the check run in one pass (on the GPU, and on the CPU's compiled route), so the fence's
    verdict is what the engine must honour: a page reported bad is a miss, its destination blocks may hold
    its bytes, are not acknowledged and must be recomputed. The CPU's torch copies (and the compiled route
    where a chunk is not whole words on the engine's side) sum a page before they copy any of it: a page
    reported bad there is not written at all.

    Pages whose extents are at least ``STAGED_MIN_EXTENT[False]`` (512 KiB) with chunks below
    ``COPY_ENGINE_MIN_CHUNK`` are staged (``path`` "staged", see ``_Staged``) where the device has a staging ring
    (``$ORBITKV_STAGING_MIB``, default 96; "0" turns it off). On the Triton path without ``programs``,
    the restore replays a CUDA graph captured for the layout, the stream and the page count rounded up to
    a power of 2 (``graphs``: default ``RESTORE_GRAPHS``, from ``$ORBITKV_RESTORE_GRAPHS``, off when "0");
    the same kernels, the same verdicts. Under Triton's CPU interpreter the same bounded kernels run on the
    capture's buffers, launched one by one.
    """
    _check_alignment(layout)
    batch = _pages(arena, layout, pages, committed=True)
    chosen = path or choose_path(layout, arena.device)
    if chosen == "torch":
        return _restore_torch(arena, layout, batch)
    staged = _staged(arena, layout, batch, chosen, path, programs, to_arena=False)
    if staged is not None:
        sums, expected = staged
        return Fence(
            event=_fence_event(arena), verdicts=sums == expected, sums=sums, path="staged", length=layout.page_bytes
        )
    chosen = "triton" if chosen == "staged" else chosen
    if (
        chosen == "triton"
        and programs is None
        and (arena.cuda is not None or _interpreting())
        and (RESTORE_GRAPHS if graphs is None else graphs)
    ):
        found = _replayed(arena, layout, len(batch))
        if found is not None:
            replayed, stream = found
            try:
                sums, verdicts = replayed.run(batch, stream)
            except Exception as e:  # a launch the driver refused: this call and the layout's next go eagerly
                log.warning("restores of this layout run without CUDA graphs: a replay failed: %s", e)
                with _REPLAYS_LOCK:
                    layout.replays.clear()
                    layout.replays[(0, 0, 0)] = False
            else:
                return Fence(
                    event=_fence_event(arena), verdicts=verdicts, sums=sums, path=chosen, length=layout.page_bytes
                )
    sums, expected = (
        _launch_triton(arena, layout, batch, False, programs=programs, expected=True)
        if chosen == "triton"
        else _copy_engine(arena, layout, batch, False, expected=True)
    )
    verdicts = sums == expected
    return Fence(event=_fence_event(arena), verdicts=verdicts, sums=sums, path=chosen, length=layout.page_bytes)


class GraphRestore:
    """A restore that can be captured in a CUDA graph and replayed with new pages.

    Its tables have a fixed capacity and live in device memory; ``prepare(pages)`` refreshes them in
    place (outside the graph, like any graph-dynamic input), and ``launch()`` (capturable) runs one
    bounded kernel over the capacity that reads the live page count on the device, then writes the
    per-page verdicts in place. Pages past the count are never touched.
    """

    def __init__(self, arena: Arena, layout: GroupLayout, capacity: int) -> None:
        import torch

        _check_alignment(layout)
        self.arena, self.layout, self.capacity = arena, layout, capacity
        device = arena.device
        self.ptrs, self.strides, self.chunks, self.seg_offsets = _tables(layout, device)
        self.blocks = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.offsets = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.expected = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.sums = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.verdicts = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.block, self.tiles = layout.tile_words, layout.tiles
        self._host = torch.zeros(3, capacity, dtype=torch.int64, pin_memory=device.startswith("cuda"))
        # The staging buffer is rewritten only after the previous copies out of it completed.
        self._staged = torch.cuda.Event() if device.startswith("cuda") else None  # type: ignore[no-untyped-call]
        self._live = 0

    def prepare(self, pages: Pages | Sequence[PagePlan]) -> None:
        """Refresh the tables in place for the next launch or replay (not inside a capture)."""
        batch = _pages(self.arena, self.layout, pages, committed=True)
        assert batch.checksums is not None
        n = len(batch)
        if n > self.capacity:
            raise ValueError(f"{n} pages exceed the captured capacity of {self.capacity}")
        if self._staged is not None:
            self._staged.synchronize()
        staged = self._host.numpy()
        staged[:] = 0
        staged[0, :n], staged[1, :n], staged[2, :n] = batch.blocks, batch.offsets, batch.checksums.view(np.int64)
        host = self._host
        self.blocks.copy_(host[0], non_blocking=True)
        self.offsets.copy_(host[1], non_blocking=True)
        self.expected.copy_(host[2], non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        self.count.fill_(n)
        self._live = n

    def launch(self) -> None:
        """Restore the prepared pages; capturable (no allocation, no host synchronization)."""
        import torch

        from .gpu_kernels import move

        self.sums.zero_()
        work = self.capacity * len(self.layout.segments) * self.tiles
        move[(work,)](
            self.ptrs,
            self.strides,
            self.chunks,
            self.seg_offsets,
            self.blocks,
            self.offsets,
            self.arena.kernel_view,
            self.sums,
            len(self.layout.segments),
            self.tiles,
            work,
            self.count,
            TO_ARENA=False,
            CHECKSUM=True,
            BLOCK=self.block,
            BOUNDED=True,
            num_warps=8 if self.block >= 2048 else 4,
        )
        torch.eq(_finish(self.sums, self.layout.page_bytes), self.expected, out=self.verdicts)

    def verdicts_now(self) -> list[bool]:
        """The verdicts of the live pages (synchronizes)."""
        return [bool(v) for v in self.verdicts[: self._live].cpu().tolist()]
