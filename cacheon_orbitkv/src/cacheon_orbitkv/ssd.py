"""The SSD tier: one data file and an append-only msgpack index beside it (``<file>.index``).

A demotion writes a page's bytes with ``pwrite`` and only then appends its index record, so a
manager killed at any point restarts with an index that names only pages whose bytes were fully
handed to the kernel; both files are flushed to disk every half second and at close. A torn final
index record is dropped at restart. Every read is checked against the stored checksum; a mismatch
is reported, never served.

The index starts with a header record, ``["orbitkv-ssd", <format version>, <checksum name>]``. An
index without it (written before format versions) or with another one names pages whose
checksums this manager cannot verify: the tier starts empty instead (one warning names the path and
both formats), truncating the index and reusing the data file. The data file is ``flock``ed for
the tier's life, so a second manager on the same path stops at start (``SSDInUse``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import msgpack

from .extents import ExtentAllocator, ExtentError
from .wire import CHECKSUM_NAME, checksum

log = logging.getLogger(__name__)

Key = tuple[str, int, bytes]

SSD_FORMAT_NAME = "orbitkv-ssd"
SSD_FORMAT_VERSION = 2  # 1: headerless records of sum64 pages without tags
SSD_FORMAT: tuple[str, int, str] = (SSD_FORMAT_NAME, SSD_FORMAT_VERSION, CHECKSUM_NAME)


class SSDInUse(RuntimeError):
    """Another running manager holds the SSD tier's lock."""


@attrs.frozen(slots=True)
class SSDEntry:
    """Where a page lives in the data file and what its bytes must check to."""

    offset: int
    length: int
    checksum: int
    tag: str = ""


def _pack(record: list[Any]) -> bytes:
    packed: bytes = msgpack.packb(record, use_bin_type=True)
    return packed


def _put_record(key: Key, entry: SSDEntry) -> bytes:
    ns, group, digest = key
    return _pack(["put", ns, group, digest, entry.offset, entry.length, entry.checksum, entry.tag])


def _parse(record: Any) -> tuple[Key, SSDEntry | None]:
    """``(key, entry)`` of a put record, ``(key, None)`` of a delete; ValueError for anything this
    format does not write."""
    if not isinstance(record, list) or not record:
        raise ValueError(f"index record {record!r:.80} is not a list")
    op = record[0]
    if op == "put" and len(record) == 8:
        _, ns, group, digest, offset, length, crc, tag = record
        numbers = (offset, length, crc, group)
        typed = isinstance(ns, str) and isinstance(digest, bytes) and isinstance(tag, str)
        if typed and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers):
            return (ns, group, digest), SSDEntry(offset, length, crc, tag)
    elif op == "del" and len(record) == 4:
        _, ns, group, digest = record
        if isinstance(ns, str) and isinstance(group, int) and isinstance(digest, bytes):
            return (ns, group, digest), None
    raise ValueError(f"index record {record!r:.80} is malformed")


def _describe(header: Any) -> str:
    if isinstance(header, list) and len(header) == 3 and header[0] == SSD_FORMAT_NAME:
        return f"format {header[1]!r} with checksum {header[2]!r}"
    return "no format header (format 1, sum64 checksums)"


class SSDTier:
    def __init__(self, path: str | os.PathLike[str], capacity: int, block: int = 4096) -> None:
        self.path = Path(path)
        self.index_path = self.path.with_name(self.path.name + ".index")
        self.capacity = capacity
        self.allocator = ExtentAllocator(capacity, block)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # Held for the tier's life: two managers appending to one index would each hand out
            # extents the other uses.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise SSDInUse(
                f"SSD tier {self.path} is locked by another running cache manager; "
                "give each manager its own --ssd-cache-path"
            ) from None
        try:
            os.ftruncate(self._fd, max(os.fstat(self._fd).st_size, self.allocator.capacity))
            self._index_lock = threading.Lock()
            # Least recently used first: the order pages leave the tier when it is full.
            self.entries: OrderedDict[Key, SSDEntry] = OrderedDict()
            self._replay()
            self._index = open(self.index_path, "ab")  # noqa: SIM115 (held for the tier's life)
        except BaseException:
            os.close(self._fd)
            raise
        self._dirty = False

    def _replay(self) -> None:
        if self.index_path.exists() and self.index_path.stat().st_size:
            with open(self.index_path, "rb") as fh:
                unpacker = msgpack.Unpacker(fh, raw=False, strict_map_key=False)
                try:
                    header = next(unpacker, None)
                except (ValueError, msgpack.exceptions.UnpackException):
                    header = None
                if header != list(SSD_FORMAT):
                    log.warning(
                        "SSD tier %s: its index %s has %s, this manager reads format %d with checksum %r: "
                        "starting with the SSD tier empty (the index is rewritten, the data file reused)",
                        self.path,
                        self.index_path,
                        _describe(header),
                        SSD_FORMAT_VERSION,
                        CHECKSUM_NAME,
                    )
                else:
                    self._replay_records(unpacker)
        # Rewrite the index compactly, with the header, dropping any torn tail.
        tmp = self.index_path.with_name(self.index_path.name + ".tmp")
        with open(tmp, "wb") as out:
            out.write(_pack(list(SSD_FORMAT)))
            for key, entry in self.entries.items():
                out.write(_put_record(key, entry))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.index_path)

    def _replay_records(self, unpacker: msgpack.Unpacker) -> None:
        outside = 0
        try:
            for record in unpacker:
                key, entry = _parse(record)
                old = self.entries.pop(key, None)
                if old is not None:
                    self.allocator.free(old.offset, old.length)
                if entry is not None:
                    try:
                        self.allocator.take(entry.offset, entry.length)
                    except ExtentError:
                        outside += 1  # a tier reopened with a smaller capacity
                        continue
                    self.entries[key] = entry
        except (ValueError, msgpack.exceptions.UnpackException):
            pass  # a torn final record (killed mid-append) names no page: stop there
        if outside:
            log.warning(
                "SSD tier %s: %d pages lie past its capacity of %d bytes (or overlap another); dropped",
                self.path,
                outside,
                self.allocator.capacity,
            )

    def allocate(self, length: int) -> int | None:
        return self.allocator.allocate(length)

    def touch(self, key: Key) -> None:
        """Mark a page recently used (read): the tier drops least recently used pages first."""
        if key in self.entries:
            self.entries.move_to_end(key)

    def write(self, pages: Iterable[tuple[Key, SSDEntry, memoryview | bytes]]) -> int:
        """Write ``(key, entry, payload)`` pages, then index them; returns bytes written.

        An OSError while writing bytes indexes nothing (the caller still owns the extents)."""
        records = []
        written = 0
        for key, entry, payload in pages:
            done = os.pwrite(self._fd, payload, entry.offset)
            if done != len(payload):
                raise OSError(f"short write of a page to {self.path}: {done} of {len(payload)} bytes")
            written += done
            records.append((key, entry))
        with self._index_lock:
            for key, entry in records:
                self._index.write(_put_record(key, entry))
                self.entries[key] = entry
            self._index.flush()
            self._dirty = True
        return written

    def sync(self) -> None:
        """Flush data, then index, to disk. Between flushes a power loss may leave index records whose
        bytes never reached the disk: their checksums fail on read and they are served as misses."""
        if not self._dirty:
            return
        self._dirty = False
        os.fdatasync(self._fd)
        with self._index_lock:
            os.fsync(self._index.fileno())

    def read_run(self, items: list[tuple[SSDEntry, int]], arena: mmap.mmap) -> list[bool]:
        """Read pages contiguous on SSD with one ``preadv`` scattered into their arena extents.

        ``items`` are ``(entry, arena_offset)`` sorted by SSD offset; the block padding between
        pages goes to a scratch buffer. Returns each page's checksum verdict. Runs in I/O threads:
        it touches only the file and the given extents, never the index or the allocator.
        """
        view = memoryview(arena)
        buffers: list[memoryview | bytearray] = []
        try:
            for i, (entry, arena_offset) in enumerate(items):
                buffers.append(view[arena_offset : arena_offset + entry.length])
                if i + 1 < len(items):
                    gap = items[i + 1][0].offset - entry.offset - entry.length
                    if gap:
                        buffers.append(bytearray(gap))
            first, last = items[0][0], items[-1][0]
            done = os.preadv(self._fd, buffers, first.offset)
            if done != last.offset + last.length - first.offset:
                return [False] * len(items)
            return [checksum(view[a : a + e.length]) == e.checksum for e, a in items]
        finally:
            for buf in buffers:
                if isinstance(buf, memoryview):
                    buf.release()
            view.release()

    def read(self, entry: SSDEntry) -> bytes | None:
        """The bytes of an index entry, or None when they fail its checksum (the caller drops the page).

        Runs in I/O threads: it touches only the file, never the index or the allocator.
        """
        data = os.pread(self._fd, entry.length, entry.offset)
        if len(data) != entry.length or checksum(data) != entry.checksum:
            return None
        return data

    def delete(self, key: Key) -> None:
        with self._index_lock:
            entry = self.entries.pop(key, None)
            if entry is None:
                return
            ns, group, digest = key
            self._index.write(_pack(["del", ns, group, digest]))
            self._index.flush()
            self._dirty = True
        self.allocator.free(entry.offset, entry.length)

    def close(self) -> None:
        self.sync()
        self._index.close()
        os.close(self._fd)
