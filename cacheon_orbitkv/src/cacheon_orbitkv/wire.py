"""The control-plane protocol: length-prefixed msgpack frames, never pickle.

A frame is a 4-byte big-endian length and a msgpack map. Requests are ``{"id", "op", "args"}``;
replies ``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "error": {"type", "message"}}``.
The first request on a connection must be ``hello`` with the protocol version (and ``token`` when
the manager requires one). Payload bytes never
cross the socket: pages live in the shared arena, and frames carry offsets, lengths and checksums.

A granted ``read_recovery`` carries each group's leased pages as columns (``pack_leased``), not a list per
page: ``[group, offsets, lengths, checksums, tags, which]``, the first three as bytes of little-endian 64-bit
integers (one per page, in request order), ``tags`` the distinct layout tags, ``which`` each page's index
into them as little-endian 32-bit integers (empty bytes when there is one tag). A lease of 256 pages is
then a few byte strings each way instead of 256 lists built, encoded, decoded and turned into objects.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import platform
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sized
from typing import Any, NamedTuple

import msgpack
import numpy as np

PROTOCOL_VERSION = 3  # 3: read_recovery's pages as columns
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024

log = logging.getLogger(__name__)


class OrbitKVError(Exception):
    """Base of every error the manager reports; ``type`` travels in error replies."""

    type = "OrbitKVError"


class ProtocolError(OrbitKVError):
    type = "ProtocolError"


class BadRequest(OrbitKVError):
    type = "BadRequest"


class PoolFull(OrbitKVError):
    type = "PoolFull"


class UnknownLease(OrbitKVError):
    type = "UnknownLease"


class InternalError(OrbitKVError):
    """A request failed inside the manager for a reason its handler did not foresee (logged there with
    its traceback); the manager's state is unchanged and it keeps serving the connection."""

    type = "InternalError"


class ManagerUnavailable(OrbitKVError):
    """The manager cannot be reached or went away; engines treat this as a miss."""

    type = "ManagerUnavailable"


class Unauthorized(ManagerUnavailable):
    """The manager requires an auth token and the hello carried none or a wrong one; it closes the
    connection. A ``ManagerUnavailable``: to an engine, a manager it may not use is one it cannot reach."""

    type = "Unauthorized"


ERRORS: dict[str, type[OrbitKVError]] = {
    cls.type: cls
    for cls in (
        OrbitKVError,
        ProtocolError,
        BadRequest,
        PoolFull,
        UnknownLease,
        InternalError,
        ManagerUnavailable,
        Unauthorized,
    )
}

MAX_TAG_BYTES = 128  # a page's layout tag, UTF-8


def encode(message: Any, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds the {max_frame}-byte limit")
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, max_bin_len=len(body), max_str_len=len(body))
    except Exception as exc:  # any undecodable body is a protocol error, named
        raise ProtocolError(f"frame is not valid msgpack: {type(exc).__name__}: {exc}") from exc


LEASED_INTS, LEASED_SUMS, LEASED_TAGS = np.dtype("<i8"), np.dtype("<u8"), np.dtype("<u4")


def pack_leased(
    group: int, offsets: Iterable[int], lengths: Iterable[int], checksums: Iterable[int], tags: list[str]
) -> list[Any]:
    """One group's leased pages (``len(tags)`` of them) in ``read_recovery``'s reply (the module's docstring)."""
    n = len(tags)
    names = list(dict.fromkeys(tags))
    if len(names) > 1:
        place = {name: i for i, name in enumerate(names)}
        which = np.fromiter(map(place.__getitem__, tags), LEASED_TAGS, n).tobytes()
    else:
        which = b""
    return [
        group,
        np.fromiter(offsets, LEASED_INTS, n).tobytes(),
        np.fromiter(lengths, LEASED_INTS, n).tobytes(),
        np.fromiter(checksums, LEASED_SUMS, n).tobytes(),
        names,
        which,
    ]


# The page checksum's constants (``mix64``): an odd multiplier per word index, and the finalizer of
# splitmix64. Kernels use the same numbers (``gpu_kernels``).
INDEX_MULTIPLIER = 0x9E3779B97F4A7C15
MIX_MULTIPLIER = 0xBF58476D1CE4E5B9
CHECKSUM_NAME = "mix64"


@functools.lru_cache(maxsize=64)
def _index_keys(words: int) -> np.ndarray:
    """``i * INDEX_MULTIPLIER`` for each word index of a page (wrapping), cached per page size."""
    keys = np.arange(words, dtype=np.uint64) * np.uint64(INDEX_MULTIPLIER)
    keys.setflags(write=False)
    return keys


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The per-page checksum stored at commit and verified on every read: ``mix64``.

    Each little-endian 64-bit word ``w`` at word index ``i`` of the page (a ragged tail is
    zero-padded) is mixed with its index, ``x = (w ^ i * 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9;
    x ^= x >> 31``, the mixed words are summed modulo 2**64, and the sum is XORed with the page's
    byte length. Unlike a plain sum it changes when words, token rows, K and V halves or layer
    segments are swapped, shifted or misplaced, besides catching corrupted words and torn or
    truncated pages. It is still a sum of independent terms, so a kernel computes it inside the
    copy, chunk by chunk, from each word's index in the page. It is not a MAC.

    On CPUs it runs compiled (numba, the ``fast`` extra) in one pass at memory speed, else in numpy.
    """
    kernels = _kernels()
    if kernels is None:
        return _checksum_numpy(data)
    view = _flat(data)
    size = len(view)
    if not size:
        return 0
    words = size >> 3
    if not size & 7:
        return kernels[0](np.frombuffer(view, np.uint64)) ^ size
    total = kernels[0](np.frombuffer(view, np.uint64, words)) if words else 0
    total += _mix_tail(view[words << 3 :], words)
    return (total & _WORD_MASK) ^ size


def copy_with_checksum(dst: bytearray | memoryview, src: bytes | bytearray | memoryview) -> int:
    """Copy ``src`` into ``dst``, a writable buffer of the same byte length, and return
    ``checksum(src)``, in one pass over ``src``: compiled, each block of 512 bytes is summed and then
    copied while it is in the cache (on x86-64 with streaming stores, which do not read ``dst`` first).

    Raises ValueError when the lengths differ and TypeError when ``dst`` is read-only, before
    anything is written. Overlapping buffers are copied as by ``memmove``, and summed before.
    """
    s = _flat(src)
    d = _flat(dst)
    size = len(s)
    if len(d) != size:
        raise ValueError(f"copy_with_checksum: a destination of {len(d)} bytes for a source of {size}")
    if isinstance(d, bytes) or d.readonly:
        raise TypeError("copy_with_checksum: the destination is read-only")
    kernels = _kernels()
    if kernels is None or size < 8:
        total = checksum(s)  # before the copy: the two may overlap
        d[:] = s
        return total
    words = size >> 3
    whole = words << 3
    tail = b""
    if size & 7:  # the ragged tail, read before anything is written
        tail = bytes(s[whole:])
        src_words = np.frombuffer(s, np.uint64, words)
        dst_words = np.frombuffer(d, np.uint64, words)
    else:
        src_words = np.frombuffer(s, np.uint64)
        dst_words = np.frombuffer(d, np.uint64)
    # A bytes object shares memory with no writable buffer; any other source is checked (bounds only).
    if type(src) is not bytes and np.may_share_memory(dst_words, src_words):
        total = kernels[0](src_words)  # read every word before any is written
        d[:whole] = s[:whole]
    else:
        total = kernels[1](dst_words, src_words)
    if tail:
        total += _mix_tail(tail, words)
        d[whole:] = tail
    return (total & _WORD_MASK) ^ size


def _flat(data: bytes | bytearray | memoryview) -> bytes | memoryview:
    """``data`` as a flat run of bytes (``len`` is its byte length); raises TypeError for a
    non-contiguous buffer, as ``memoryview.cast`` does."""
    if type(data) is bytes:
        return data
    if type(data) is memoryview and data.format == "B" and data.ndim == 1 and data.c_contiguous:
        return data
    return memoryview(data).cast("B")


def _checksum_numpy(data: bytes | bytearray | memoryview) -> int:
    """``checksum`` in numpy (five passes over scratch arrays): where the compiled kernels are not available."""
    view = memoryview(data).cast("B")
    words = -(-len(view) // 8)
    if not words:
        return 0
    whole = len(view) - len(view) % 8
    if whole == len(view):
        w = np.frombuffer(view, dtype="<u8")
    else:
        w = np.zeros(words, dtype="<u8")
        w.view(np.uint8)[: len(view)] = np.frombuffer(view, dtype=np.uint8)
    # Into this thread's scratch arrays: fresh page-sized temporaries cost a page fault per 4 KiB
    # (mmap-backed allocations), which made the checksum 5x slower than the arithmetic.
    x, y = _scratch(words)
    np.bitwise_xor(w, _index_keys(words), out=x)
    np.multiply(x, _MIX, out=x)
    np.right_shift(x, _SHIFT, out=y)
    np.bitwise_xor(x, y, out=x)
    total = int(np.add.reduce(x, dtype=np.uint64))
    return (total & 0xFFFFFFFFFFFFFFFF) ^ len(view)


_MIX = np.uint64(MIX_MULTIPLIER)
_SHIFT = np.uint64(31)
_SCRATCH = threading.local()


def _scratch(words: int) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 arrays of ``words`` for this thread, kept for the page sizes it last saw."""
    cache: dict[int, tuple[np.ndarray, np.ndarray]] | None = getattr(_SCRATCH, "arrays", None)
    if cache is None:
        cache = _SCRATCH.arrays = {}
    arrays = cache.get(words)
    if arrays is None:
        if len(cache) >= 8:  # a few page sizes per process; never an unbounded set
            cache.pop(next(iter(cache)))
        arrays = cache[words] = (np.empty(words, np.uint64), np.empty(words, np.uint64))
    return arrays


_WORD_MASK = (1 << 64) - 1
_INDEX = np.uint64(INDEX_MULTIPLIER)
_ZERO = np.uint64(0)


def _mix_tail(tail: bytes | memoryview, index: int) -> int:
    """The mixed term of a ragged last word (fewer than 8 bytes, zero-padded) at word ``index``."""
    x = ((int.from_bytes(tail, "little") ^ (index * INDEX_MULTIPLIER & _WORD_MASK)) * MIX_MULTIPLIER) & _WORD_MASK
    return x ^ (x >> 31)


# The compiled checksum (numba, the ``fast`` extra): one pass over a page's whole words, the index key
# advanced by addition. Plain Python functions here, compiled on first use by ``_kernels``; never run
# uncompiled. The words go in blocks of _BLOCK_WORDS, each summed by ``_mixed`` (inlined; LLVM
# vectorizes it), and before each block the source's cache lines _AHEAD_WORDS further on are prefetched
# (``_prefetch_ahead``), so the loads are not held back behind the vector arithmetic. Measured on a
# 2-core AMD EPYC host (256 pages of 256 KiB into a shared mapping, best of 15, two runs): the checksum
# alone 10-11% faster with the prefetch (BENCHMARKS.md, the cache manager's tables of 2026-12-02). On a
# later host of that kind 512 and 1024 words ahead were no faster than 256 by turns in one process.
#
# The copy (``_copy_mixed``) sums each block, then writes it from the source (in L1 by then) and ends with
# ``_drain_stores``: on x86-64 non-temporal stores and one store fence, elsewhere ordinary stores and
# nothing (set by ``_compile_kernels``). A copy through ordinary stores first reads every destination line
# into the cache: on that host a plain compiled copy loop ran at 0.85 of memcpy. Streaming stores write
# whole lines without reading them, as memcpy does. From the destination's first 64-byte boundary each
# line is one vector store (``store_line``): one instruction where the CPU has 512-bit vectors, against
# eight for word stores (``_store_word``), which the words before the boundary and a destination that is
# not word-aligned take. The copies address the words from the boundary as views that start there: with
# indices the compiler cannot prove non-negative it summed through gathers. A source changed while it is
# copied can leave the page unlike its checksum: every read of the page then fails its check (a miss).
_BLOCK_WORDS = 64
_AHEAD_WORDS = 256
_LINE_WORDS = 8  # a 64-byte cache line
_prefetch: Any = None
_store_word: Any = None
_drain_stores: Any = None
_sum: Any = None  # _mixed and _prefetch_ahead, compiled to be inlined into the kernels
_ahead: Any = None
_whole: Any = None  # _mix64_words, inlined into the page kernels
_store_line: Any = None  # store_line and address (_line_intrinsics)
_address: Any = None
_mixed_copy: Any = None  # _copy_mixed, inlined into the kernels
_words_at: Any = None  # _words_at_address, inlined into the page kernels, and what it calls
_in_page: Any = None  # _tiles, inlined into the page kernels
_pointer: Any = None
_carray: Any = None
_memcpy: Any = None  # memcpy(dst, src, size) on raw addresses (_memcpy_intrinsic)
_page_copy: Any = None  # _copy_chunks, inlined into the page kernels


def _mixed(words: np.ndarray, start: int, stop: int, first: int) -> np.uint64:
    """The mixed sum of ``words[start:stop]``, each word keyed by its index in the page, ``first`` more than
    its index in ``words`` (inlined into the kernels)."""
    total = _ZERO
    key = np.uint64(start + first) * _INDEX
    for i in range(start, stop):
        x = (words[i] ^ key) * _MIX
        x ^= x >> _SHIFT
        total += x
        key += _INDEX
    return total


def _prefetch_ahead(words: np.ndarray, start: int) -> None:
    """Prefetch the cache lines of the block _AHEAD_WORDS past ``start``, where the words go on so far."""
    if start + _AHEAD_WORDS + _BLOCK_WORDS <= words.size:
        for line in range(0, _BLOCK_WORDS, _LINE_WORDS):
            _prefetch(words, start + _AHEAD_WORDS + line)


def _mix64_words(words: np.ndarray) -> int:
    n = words.size
    blocked = n - n % _BLOCK_WORDS
    total = _ZERO
    for start in range(0, blocked, _BLOCK_WORDS):
        _ahead(words, start)
        total += _sum(words, start, start + _BLOCK_WORDS, 0)
    return total + _sum(words, blocked, n, 0)  # type: ignore[no-any-return]  # a numba uint64: an int


def _copy_mix64_words(dst: np.ndarray, src: np.ndarray) -> int:
    total = _mixed_copy(dst, src, 0)
    _drain_stores()
    return total  # type: ignore[no-any-return]  # a numba uint64: an int


def _copy_mixed(dst: np.ndarray, src: np.ndarray, first: int) -> np.uint64:
    """``dst[:] = src[:]``, returning the mixed sum of ``src`` with its words keyed from index ``first`` of
    the page: each block summed, then stored from L1, a whole line per store from ``dst``'s first 64-byte
    boundary on. Where ``dst`` is not word-aligned, or too short for a block past its boundary: all of
    ``src`` summed, then stored word by word. The caller drains the stores."""
    n = src.size
    at = _address(dst)
    lead = (-at & 63) >> 3  # words before dst's first line boundary, 0-7
    if at & 7 or lead + _BLOCK_WORDS > n:
        total = _sum(src, 0, n, first)
        for i in range(n):
            _store_word(dst, i, src[i])
        return total  # type: ignore[no-any-return]  # a numba uint64
    total = _sum(src, 0, lead, first)
    for i in range(lead):
        _store_word(dst, i, src[i])
    # The rest as views that start at the boundary: indices from 0 are the loops' fastest (the compiler
    # proves them in bounds and vectorizes the sums without gathers).
    body, into = src[lead:], dst[lead:]
    rest = n - lead
    blocked = rest - rest % _BLOCK_WORDS
    for start in range(0, blocked, _BLOCK_WORDS):
        _ahead(body, start)
        total += _sum(body, start, start + _BLOCK_WORDS, first + lead)
        for line in range(start, start + _BLOCK_WORDS, _LINE_WORDS):
            _store_line(into, line, body, line)
    total += _sum(body, blocked, rest, first + lead)
    for i in range(blocked, rest):
        _store_word(into, i, body[i])
    return total  # type: ignore[no-any-return]  # a numba uint64


def _words_at_address(address: np.uint64, n: int) -> np.ndarray:
    """The ``n`` words at a raw address as an array (inlined into the page kernels)."""
    return _carray(_pointer(address), n)  # type: ignore[no-any-return]


def _tiles(
    words: np.ndarray,
    start: int,
    page_words: int,
    arena_side: np.ndarray,
    engine_side: np.ndarray,
    sizes: np.ndarray,
    lo: int,
    hi: int,
) -> bool:
    """Whether a page's chunks ``lo``..``hi`` lie end to end, in order, over its arena extent (``page_words``
    words from ``words[start]``) and are whole words on the engine's side too: then chunk by chunk they are
    the extent's words in page order, and the page kernels copy them as words with their indices known."""
    base = np.uint64(_address(words))
    expect = base + np.uint64(start) * np.uint64(8)
    for j in range(lo, hi):
        if arena_side[j] != expect or (engine_side[j] | sizes[j]) & np.uint64(7):
            return False
        expect += sizes[j]
    return expect == base + np.uint64(start + page_words) * np.uint64(8)  # type: ignore[no-any-return]


def _copy_chunks(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, lo: int, hi: int) -> np.uint64:
    """A page's chunks ``lo``..``hi`` (raw addresses and sizes, whole words) copied from ``src`` to ``dst`` in
    one pass as ``_copy_mixed`` copies, the next chunk's first lines prefetched before each; returns the
    mixed sum of the page's words, their indices running on across the chunks (inlined into the page
    kernels; the caller drains the stores)."""
    total = _ZERO
    first = np.intp(0)
    for j in range(lo, hi):
        n = np.intp(sizes[j]) >> 3
        if j + 1 < src.size:  # the next chunk's first lines, which the copy's prefetch cannot see
            ahead = _words_at(src[j + 1], min(np.intp(sizes[j + 1]) >> 3, _AHEAD_WORDS))
            for line in range(0, ahead.size, _LINE_WORDS):
                _prefetch(ahead, line)
        total += _mixed_copy(_words_at(dst[j], n), _words_at(src[j], n), first)
        first += n
    return total


def _copy_pages_out(
    words: np.ndarray,
    starts: np.ndarray,
    page_words: int,
    expected: np.ndarray,
    dst: np.ndarray,
    src: np.ndarray,
    sizes: np.ndarray,
    verdicts: np.ndarray,
) -> None:
    """A restore on the CPU: each page's chunks (its share of ``dst``, ``src`` and ``sizes``, raw addresses
    checked by the caller, in page order) copied out of its arena extent (``page_words`` words from
    ``starts[p]`` of the arena's ``words``) and summed in one pass as ``_copy_mixed`` copies, the next
    chunk's first lines prefetched before each; ``verdicts[p]`` whether the sum matches ``expected[p]``. As
    on the GPU, a page whose sum does not match has been written all the same: its verdict says the engine
    must not use it. Where the engine's side is not whole words (or the chunks do not lie end to end over
    the extent): the extent summed first, and only a page that matches copied out (memcpy)."""
    per = dst.size // starts.size
    for p in range(starts.size):
        lo, hi = p * per, (p + 1) * per
        if _in_page(words, starts[p], page_words, src, dst, sizes, lo, hi):
            verdicts[p] = _page_copy(dst, src, sizes, lo, hi) ^ np.uint64(page_words << 3) == expected[p]
        else:
            good = _whole(words[starts[p] : starts[p] + page_words]) ^ np.uint64(page_words << 3) == expected[p]
            verdicts[p] = good
            if good:
                for j in range(lo, hi):
                    _memcpy(dst[j], src[j], sizes[j])
    _drain_stores()


def _copy_pages_in(
    words: np.ndarray,
    starts: np.ndarray,
    page_words: int,
    dst: np.ndarray,
    src: np.ndarray,
    sizes: np.ndarray,
    sums: np.ndarray,
) -> None:
    """A save on the CPU: each page's chunks copied into its arena extent and summed into ``sums[p]``, the
    page's checksum, in one pass as ``_copy_mixed`` copies, the next chunk's first lines prefetched before
    each (where the engine's side is not whole words: memcpy, then the extent summed from the cache)."""
    per = dst.size // starts.size
    for p in range(starts.size):
        lo, hi = p * per, (p + 1) * per
        if _in_page(words, starts[p], page_words, dst, src, sizes, lo, hi):
            sums[p] = _page_copy(dst, src, sizes, lo, hi) ^ np.uint64(page_words << 3)
        else:
            for j in range(lo, hi):
                _memcpy(dst[j], src[j], sizes[j])
            sums[p] = _whole(words[starts[p] : starts[p] + page_words]) ^ np.uint64(page_words << 3)
    _drain_stores()


class _Kernels(NamedTuple):
    mix: Callable[[np.ndarray], int]  # checksum's words
    copy: Callable[[np.ndarray, np.ndarray], int]  # copy_with_checksum's words
    pages_out: Callable[..., None] | None  # _copy_pages_out; None where it failed (the torch copies run)
    pages_in: Callable[..., None] | None  # _copy_pages_in


_KERNELS_LOCK = threading.Lock()
_compiled: _Kernels | None = None
_compile_started = False
_compile_done = threading.Event()
_page_copies = True  # whether the compile includes the CPU page copies (compiled_checksum's page_copies)


def _kernels() -> _Kernels | None:
    """The compiled checksum kernels, or None: until they are compiled (one to two seconds, in a thread the
    first call starts, so that no caller waits for the compiler), and wherever numba is missing or
    fails (one warning). Until then the numpy checksum runs: the same numbers."""
    if not _compile_started:
        _start_compile()
    return _compiled


def page_kernels() -> _Kernels | None:
    """The compiled kernels with the CPU page copies, or None until they are compiled (or where they cannot
    be, or in a process that started the compiler without them: ``compiled_checksum``): ``transfer``'s CPU
    path moves whole batches of pages with ``pages_in`` and ``pages_out``, which take raw addresses that it
    has checked against the engine's buffers and the arena."""
    kernels = _kernels()
    return kernels if kernels is not None and kernels.pages_out is not None else None


def compiled_checksum(wait: bool = True, page_copies: bool = True) -> bool:
    """Whether ``checksum`` and ``copy_with_checksum`` run compiled, waiting for the compiler if it is
    still at work. A process that wants its first pages summed compiled calls this at start; with
    ``wait=False`` it only starts the compiler (and says whether it has finished and succeeded). With
    ``page_copies=False``, a call that starts the compiler leaves out the CPU page copies
    (``page_kernels`` is None in that process; they are three quarters of the compile): for a process
    that never moves pages between an engine's buffers and the arena, as the cache manager, whose loop
    would otherwise share the interpreter with that compile for a second or two more at its start."""
    _start_compile(page_copies)
    if wait:
        _compile_done.wait()
    return _compiled is not None


def _start_compile(page_copies: bool = True) -> None:
    global _compile_started, _page_copies
    with _KERNELS_LOCK:
        if _compile_started:
            return
        _compile_started = True
        _page_copies = page_copies
        try:
            # Not a daemon: a process that exits while it compiles waits for it rather than tearing
            # the compiler down mid-way.
            threading.Thread(target=_compile, name="orbitkv-checksum-compile").start()
        except RuntimeError as exc:  # no new threads at interpreter shutdown: numpy from here on
            log.debug("the page checksum is not compiled: %s", exc)
            _compile_done.set()


def _compile() -> None:
    global _compiled
    start = time.perf_counter()
    try:
        with _COMPILING:  # a fork waits for it (_before_fork)
            _compiled = _compile_kernels()
    except ImportError as exc:  # the optional extra is not installed: said once, not a failure
        log.info(
            "numba is not importable (%s): the page checksum runs on numpy, about 5x slower; "
            "install cacheon-orbitkv[fast]",
            exc,
        )
    except Exception as exc:  # any failure to compile or to match numpy: the numpy checksum
        log.warning(
            "the compiled page checksum is unusable (%s: %s): it runs on numpy, about 5x slower",
            type(exc).__name__,
            exc,
        )
    else:
        log.debug("compiled the page checksum in %.2f s", time.perf_counter() - start)
    finally:
        _compile_done.set()


# Held while numba is imported and compiles. A fork waits for it: a child forked mid-way would
# inherit numba's import and compiler locks held by a thread it does not have, and hang the first
# time it imported numba or compiled anything with it (vLLM compiles some of its own code with
# numba). The wait is the compile's rest, one to two seconds, and at most FORK_WAIT_S.
_COMPILING = threading.Lock()
FORK_WAIT_S = 30.0
_forking = threading.local()  # per forking thread: whether its fork holds _COMPILING


def _before_fork() -> None:
    _forking.held = _COMPILING.acquire(timeout=FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    if getattr(_forking, "held", False):
        _forking.held = False
        _COMPILING.release()


def _after_fork_in_child() -> None:
    """A child has no compiling thread: one forked before the compile finished (only past
    ``FORK_WAIT_S``, or between the compile's start and its taking the lock) keeps the numpy
    checksum. Kernels compiled before the fork are the child's too."""
    global _KERNELS_LOCK, _COMPILING, _compile_done, _forking
    _KERNELS_LOCK, _COMPILING, _forking = threading.Lock(), threading.Lock(), threading.local()
    if _compile_started and not _compile_done.is_set():
        _compile_done = threading.Event()
        _compile_done.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _prefetch_intrinsic() -> Any:
    """A numba intrinsic ``prefetch(array, index)``: LLVM's prefetch of the element's cache line, for
    reading, kept in every cache level. A hint: it never faults and changes no value."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core import types as nb_types
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[untyped-decorator]  # numba is untyped
    def prefetch(typingctx: Any, array: Any, index: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            byte_ptr = ir.IntType(8).as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [byte_ptr, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            read, highest_locality, data_cache = (ir.Constant(ir.IntType(32), v) for v in (0, 3, 1))
            address = builder.bitcast(builder.gep(data, [args[1]]), byte_ptr)
            builder.call(fn, [address, read, highest_locality, data_cache])
            return context.get_dummy_value()

        return nb_types.void(array, index), codegen

    return prefetch


def _streaming_intrinsics() -> tuple[Any, Any]:
    """Numba intrinsics ``store_streaming(array, index, value)`` (a store LLVM marks non-temporal:
    the line is written without being read into the cache) and ``drain_stores()`` (x86's sfence: every
    streaming store is visible before any later store, the commit's message among them). x86-64 only."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"no streaming stores on {platform.machine()}")
    from llvmlite import ir
    from numba.core import types as nb_types
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[untyped-decorator]  # numba is untyped
    def store_streaming(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            store = builder.store(args[2], builder.gep(data, [args[1]]))
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()

        return nb_types.void(array, index, array.dtype), codegen

    @intrinsic  # type: ignore[untyped-decorator]
    def drain_stores(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            fence = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fence, [])
            return context.get_dummy_value()

        return nb_types.void(), codegen

    return store_streaming, drain_stores


def _line_intrinsics(streaming: bool) -> tuple[Any, Any]:
    """Numba intrinsics ``store_line(dst, i, src, j)`` (the 8 words ``src[j:j+8]`` into ``dst[i:i+8]``
    as one vector: loaded at any alignment, stored at a 64-byte boundary of ``dst``, which the caller
    guarantees; with ``streaming`` non-temporal, as ``_streaming_intrinsics``' stores, drained by their
    fence; one instruction per line where the CPU has 64-byte vectors) and ``address(array)`` (the raw
    address of ``array[0]``, as an intp)."""
    from llvmlite import ir
    from numba.core import types as nb_types
    from numba.extending import intrinsic

    line = ir.VectorType(ir.IntType(64), _LINE_WORDS)

    @intrinsic  # type: ignore[untyped-decorator]  # numba is untyped
    def store_line(typingctx: Any, dst: Any, dst_index: Any, src: Any, src_index: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            to = context.make_array(signature.args[0])(context, builder, args[0]).data
            of = context.make_array(signature.args[2])(context, builder, args[2]).data
            value = builder.load(builder.bitcast(builder.gep(of, [args[3]]), line.as_pointer()), align=1)
            store = builder.store(value, builder.bitcast(builder.gep(to, [args[1]]), line.as_pointer()), align=64)
            if streaming:
                store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()

        return nb_types.void(dst, dst_index, src, src_index), codegen

    @intrinsic  # type: ignore[untyped-decorator]
    def address(typingctx: Any, array: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            return builder.ptrtoint(data, ir.IntType(64))

        return nb_types.intp(array), codegen

    return store_line, address


def _words_at_intrinsic() -> Any:
    """A numba intrinsic ``words_pointer(address)``: a raw address (uint64) as a pointer to uint64 words,
    for ``numba.carray``. Nothing is checked: the caller's addresses must be valid."""
    from llvmlite import ir
    from numba.core import types as nb_types
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[untyped-decorator]  # numba is untyped
    def words_pointer(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], ir.IntType(64).as_pointer())

        return nb_types.CPointer(nb_types.uint64)(nb_types.uint64), codegen

    return words_pointer


def _memcpy_intrinsic() -> Any:
    """A numba intrinsic ``memcpy(dst, src, size)`` on raw addresses (uint64): LLVM's memcpy, which calls
    the C library's for sizes it does not know. Nothing is checked: the caller's addresses must be valid."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core import types as nb_types
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[untyped-decorator]  # numba is untyped
    def memcpy(typingctx: Any, dst: Any, src: Any, size: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            byte_ptr = ir.IntType(8).as_pointer()
            to, of = builder.inttoptr(args[0], byte_ptr), builder.inttoptr(args[1], byte_ptr)
            cgutils.raw_memcpy(builder, to, of, args[2], 1)
            return context.get_dummy_value()

        return nb_types.void(nb_types.uint64, nb_types.uint64, nb_types.uint64), codegen

    return memcpy


def _compile_kernels() -> _Kernels:
    global _prefetch, _store_word, _drain_stores, _sum, _ahead, _whole, _memcpy, _store_line, _address, _mixed_copy
    global _words_at, _in_page, _pointer, _carray, _page_copy
    import numba
    from numba import types

    if sys.byteorder != "little":
        raise RuntimeError("the kernels read the page's little-endian words natively; this host is big-endian")
    if numba.config.DISABLE_JIT:
        raise RuntimeError("NUMBA_DISABLE_JIT is set")
    # One signature each, compiled now: any page, aligned or not, read-only or not, converts to them.
    words = types.Array(types.uint64, 1, "C", readonly=True, aligned=False)
    out = types.Array(types.uint64, 1, "C", aligned=False)
    indices = types.Array(types.int64, 1, "C", readonly=True)  # the page kernels' word offsets
    addresses = types.Array(types.uint64, 1, "C", readonly=True)  # their raw addresses, sizes, checksums
    flags = types.Array(types.boolean, 1, "C")

    def plain_stores() -> tuple[Any, Any]:
        return numba.njit(inline="always")(_plain_store), numba.njit(inline="always")(_no_drain)

    def no_prefetch() -> Any:
        return numba.njit(inline="always")(_no_prefetch)

    # The kernels read _prefetch, _store_word and _drain_stores when numba compiles them: with the
    # prefetch and streaming stores (x86-64), else with ordinary stores, else with neither.
    for prefetch, stores in (
        (_prefetch_intrinsic, _streaming_intrinsics),
        (_prefetch_intrinsic, plain_stores),
        (no_prefetch, plain_stores),
    ):
        try:
            _prefetch = prefetch()
            _store_word, _drain_stores = stores()
            _store_line, _address = _line_intrinsics(streaming=stores is _streaming_intrinsics)
            _mixed_copy = numba.njit(inline="always")(_copy_mixed)
            _sum, _ahead = numba.njit(inline="always")(_mixed), numba.njit(inline="always")(_prefetch_ahead)
            mix = numba.njit(types.uint64(words), nogil=True, cache=False)(_mix64_words)
            copy = numba.njit(types.uint64(out, words), nogil=True, cache=False)(_copy_mix64_words)
            break
        except Exception as exc:
            log.debug(
                "the page kernels do not compile with %s and %s: %s: %s",
                prefetch.__name__,
                stores.__name__,
                type(exc).__name__,
                exc,
            )
    else:
        raise RuntimeError("the page kernels do not compile")
    # Against the numpy checksum, before it is trusted, on bytes whose every word and index matters:
    # enough words for the blocks, the prefetch ahead of them and a tail past the last block.
    raw = bytes(range(256)) * (5 * _BLOCK_WORDS // 32) + bytes(range(1, 209, 2))  # 5 blocks and 13 words
    probe = np.frombuffer(raw, np.uint64)
    expected = _checksum_numpy(raw) ^ len(raw)
    sink = np.zeros_like(probe)
    if int(mix(probe)) != expected or int(copy(sink, probe)) != expected or not np.array_equal(sink, probe):
        raise RuntimeError("the compiled kernels disagree with the numpy checksum")
    if not _page_copies:
        return _Kernels(mix, copy, None, None)
    # The CPU transfer path's kernels, on their own: where they fail to compile or to match numpy, the
    # checksum above still runs compiled and saves and restores on the CPU take the torch copies.
    try:
        _whole, _memcpy = numba.njit(inline="always")(_mix64_words), _memcpy_intrinsic()
        _in_page = numba.njit(inline="always")(_tiles)
        _pointer, _carray = _words_at_intrinsic(), numba.carray
        _words_at = numba.njit(inline="always")(_words_at_address)
        _page_copy = numba.njit(inline="always")(_copy_chunks)
        pages_out = numba.njit(
            types.void(words, indices, types.int64, addresses, addresses, addresses, addresses, flags),
            nogil=True,
            cache=False,
        )(_copy_pages_out)
        pages_in = numba.njit(
            types.void(words, indices, types.int64, addresses, addresses, addresses, out), nogil=True, cache=False
        )(_copy_pages_in)
        _probe_page_kernels(pages_out, pages_in)
    except Exception as exc:
        log.warning(
            "the compiled CPU page copies are unusable (%s: %s): saves and restores on the CPU copy chunk by "
            "chunk with torch",
            type(exc).__name__,
            exc,
        )
        return _Kernels(mix, copy, None, None)
    return _Kernels(mix, copy, pages_out, pages_in)


def _probe_page_kernels(pages_out: Callable[..., None], pages_in: Callable[..., None]) -> None:
    """The page kernels on two pages of three chunks each, into and out of a small arena, against numpy:
    the chunks where they belong, the checksums ``checksum``'s, a page whose checksum is wrong reported."""
    chunks = np.asarray([24, 8, 40], np.uint64)
    page = int(chunks.sum())
    source = np.random.default_rng(7).integers(0, 256, 4 * page, dtype=np.uint8)  # the engine's side
    arena = np.zeros(3 * page, np.uint8)
    extents = np.asarray([2 * page, 0], np.int64)  # the pages' arena offsets, out of order
    at = np.concatenate([[0], np.cumsum(chunks[:-1])]).astype(np.uint64)
    engine = (np.uint64(source.ctypes.data) + np.asarray([[3 * page], [page]], np.uint64) + at).ravel()
    host = (np.uint64(arena.ctypes.data) + extents.astype(np.uint64)[:, None] + at).ravel()
    sizes = np.tile(chunks, 2)
    sums = np.zeros(2, np.uint64)
    words, starts = arena.view(np.uint64), extents >> 3
    pages_in(words, starts, page >> 3, host, engine, sizes, sums)
    wanted = [source[3 * page :], source[page : 2 * page]]
    if not (np.array_equal(arena[2 * page :], wanted[0]) and np.array_equal(arena[:page], wanted[1])):
        raise RuntimeError("the compiled save kernel placed the chunks wrong")
    if [int(v) for v in sums] != [_checksum_numpy(w.tobytes()) for w in wanted]:
        raise RuntimeError("the compiled save kernel disagrees with the numpy checksum")
    back = np.zeros(2 * page, np.uint8)
    verdicts = np.zeros(2, np.bool_)
    sums[1] ^= np.uint64(1)  # the second page's committed checksum wrong: reported bad
    target = (np.uint64(back.ctypes.data) + np.asarray([[0], [page]], np.uint64) + at).ravel()
    pages_out(words, starts, page >> 3, sums, target, host, sizes, verdicts)
    # The bad page is copied out in the same pass as it is summed (or, where it is summed first, not at all).
    if (
        verdicts.tolist() != [True, False]
        or not np.array_equal(back[:page], wanted[0])
        or not (np.array_equal(back[page:], wanted[1]) or not back[page:].any())
    ):
        raise RuntimeError("the compiled restore kernel disagrees with numpy")


def _no_prefetch(array: np.ndarray, index: int) -> None:
    pass


def _plain_store(array: np.ndarray, index: int, value: np.uint64) -> None:
    array[index] = value


def _no_drain() -> None:
    pass


def prefault(region: mmap.mmap) -> None:
    """Map every page of a shared region now, so first copies do not pay page faults."""
    advice = getattr(mmap, "MADV_POPULATE_WRITE", None)
    if advice is not None:
        try:
            region.madvise(advice)
            return
        except OSError:
            pass  # older kernels: touch one byte per page instead
    view = memoryview(region)
    try:
        for offset in range(0, len(region), mmap.PAGESIZE):
            view[offset] = view[offset]
    finally:
        view.release()


UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last one the terminating NUL


def unix_socket_path(endpoint: str) -> str | None:
    """The socket path of a ``unix://`` endpoint, or None for ``HOST:PORT``.

    Raises ValueError for a path the kernel cannot bind or connect to, before anything is allocated,
    instead of the bare ``AF_UNIX path too long`` that ``bind`` would give.
    """
    if not endpoint.startswith("unix://"):
        return None
    path = endpoint[len("unix://") :]
    if not path:
        raise ValueError(f"endpoint {endpoint!r} names no socket path")
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        raise ValueError(
            f"unix socket path is {size} bytes, over the kernel limit of {UNIX_PATH_MAX}: {path!r}; use a shorter path"
        )
    return path


AUTH_TOKEN_ENV = "ORBITKV_AUTH_TOKEN_FILE"  # clients read the manager's token from this file when given none


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The auth token in ``path`` (surrounding whitespace stripped); ValueError when it is empty."""
    with open(path, encoding="utf-8") as fh:
        token = fh.read().strip()
    if not token:
        raise ValueError(f"auth token file {os.fspath(path)!r} is empty: a token must be a non-empty line")
    return token


def lookup_work(namespaces: int, groups: Iterable[Sized]) -> int:
    """What a ``lookup`` of ``namespaces`` namespaces for the hashes of ``groups`` costs the manager, as
    its hello's ``lookup_namespaces`` bounds it: namespaces x (1 + groups + hashes)."""
    return namespaces * (1 + sum(1 + len(hashes) for hashes in groups))


def parse_size(text: str | int) -> int:
    """``2tb``, ``8gb``, ``512mb``, ``64kb``, ``100GB`` or plain bytes -> bytes (binary multiples). A
    ValueError names the text when it is not a finite positive number with one of those suffixes."""
    if isinstance(text, int):
        return text
    value = text.strip().lower()
    scales = {"tb": 1 << 40, "gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}
    suffix = next((s for s in scales if value.endswith(s)), "")
    number, scale = value[: len(value) - len(suffix)].strip(), scales.get(suffix, 1)
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with an optional kb/mb/gb/tb suffix") from None
    if not math.isfinite(amount) or amount <= 0:
        raise ValueError(f"size {text!r} must be a finite positive number")
    return int(amount * scale)
