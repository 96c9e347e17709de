"""The control-plane protocol: length-prefixed msgpack frames, never pickle.

A frame is a 4-byte big-endian length and a msgpack map. Requests are ``{"id", "op", "args"}``;
replies ``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "error": {"type", "message"}}``.
The first request on a connection must be ``hello`` with the protocol version (and ``token`` when
the manager requires one). Payload bytes never
cross the socket: pages live in the shared arena, and frames carry offsets, lengths and checksums.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import threading
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 2
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024


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
    """
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


def parse_size(text: str | int) -> int:
    """``8gb``, ``512mb``, ``64kb``, ``100GB`` or plain bytes -> bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    value = text.strip().lower()
    scales = {"gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}
    suffix = next((s for s in scales if value.endswith(s)), "")
    number, scale = value[: len(value) - len(suffix)].strip(), scales.get(suffix, 1)
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with an optional kb/mb/gb suffix") from None
    if amount <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(amount * scale)
