"""The SSD tier: one data file and an append-only msgpack index beside it (``<file>.index``).

A demotion writes a page's bytes with ``pwrite`` and only then appends its index record, so a
manager killed at any point restarts with an index that names only pages whose bytes were fully
handed to the kernel; both files are flushed to disk every half second and at close. A torn final
index record is dropped at restart. Every read is checked against the stored checksum; a mismatch
is reported, never served.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import msgpack

from .extents import ExtentAllocator
from .wire import checksum

Key = tuple[str, int, bytes]


class SSDTier:
    def __init__(self, path: str | os.PathLike[str], capacity: int, block: int = 4096) -> None:
        self.path = Path(path)
        self.index_path = self.path.with_name(self.path.name + ".index")
        self.capacity = capacity
        self.allocator = ExtentAllocator(capacity, block)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, max(os.fstat(self._fd).st_size, self.allocator.capacity))
        self._index_lock = threading.Lock()
        # key -> (offset, length, checksum)
        self.entries: dict[Key, tuple[int, int, int]] = {}
        self._replay()
        self._index = open(self.index_path, "ab")  # noqa: SIM115 (held for the tier's life)
        self._dirty = False

    def _replay(self) -> None:
        if not self.index_path.exists():
            return
        with open(self.index_path, "rb") as fh:
            unpacker = msgpack.Unpacker(fh, raw=False, strict_map_key=False)
            try:
                for record in unpacker:
                    op, ns, group, digest, offset, length, crc = record
                    key = (ns, group, bytes(digest))
                    if op == "put":
                        if key in self.entries:
                            self.allocator.free(*self.entries[key][:2])
                        self.allocator.take(offset, length)
                        self.entries[key] = (offset, length, crc)
                    elif op == "del" and key in self.entries:
                        self.allocator.free(*self.entries.pop(key)[:2])
            except (msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackValueError, ValueError):
                pass  # a torn final record (killed mid-append) names no page: stop there
        # Rewrite the index compactly, dropping any torn tail.
        tmp = self.index_path.with_name(self.index_path.name + ".tmp")
        with open(tmp, "wb") as out:
            for (ns, group, digest), (offset, length, crc) in self.entries.items():
                out.write(msgpack.packb(["put", ns, group, digest, offset, length, crc], use_bin_type=True))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.index_path)

    def allocate(self, length: int) -> int | None:
        return self.allocator.allocate(length)

    def write(self, pages: Iterable[tuple[Key, int, memoryview | bytes, int]]) -> int:
        """Write ``(key, offset, payload, checksum)`` pages, then index them durably; returns bytes written."""
        records = []
        written = 0
        for key, offset, payload, crc in pages:
            os.pwrite(self._fd, payload, offset)
            written += len(payload)
            records.append((key, offset, len(payload), crc))
        with self._index_lock:
            for (ns, group, digest), offset, length, crc in records:
                self._index.write(msgpack.packb(["put", ns, group, digest, offset, length, crc], use_bin_type=True))
                self.entries[(ns, group, digest)] = (offset, length, crc)
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

    def read_into(self, entry: tuple[int, int, int], target: memoryview) -> bool:
        """Read an index entry's bytes into ``target``; False when they fail its checksum.

        Runs in I/O threads: it touches only the file and ``target``, never the index or allocator.
        """
        offset, length, crc = entry
        done = os.preadv(self._fd, [target[:length]], offset)
        return done == length and checksum(target[:length]) == crc

    def read_run(self, items: list[tuple[tuple[int, int, int], int]], arena: mmap.mmap) -> list[bool]:
        """Read pages contiguous on SSD with one ``preadv`` scattered into their arena extents.

        ``items`` are ``(entry, arena_offset)`` sorted by SSD offset; the block padding between
        pages goes to a scratch buffer. Returns each page's checksum verdict. Runs in I/O threads.
        """
        view = memoryview(arena)
        buffers: list[memoryview | bytearray] = []
        try:
            for i, ((offset, length, _), arena_offset) in enumerate(items):
                buffers.append(view[arena_offset : arena_offset + length])
                if i + 1 < len(items):
                    gap = items[i + 1][0][0] - offset - length
                    if gap:
                        buffers.append(bytearray(gap))
            expected = items[-1][0][0] + items[-1][0][1] - items[0][0][0]
            done = os.preadv(self._fd, buffers, items[0][0][0])
            if done != expected:
                return [False] * len(items)
            return [checksum(view[a : a + length]) == crc for (_, length, crc), a in items]
        finally:
            for buf in buffers:
                if isinstance(buf, memoryview):
                    buf.release()
            view.release()

    def read(self, entry: tuple[int, int, int]) -> bytes | None:
        """The bytes of an index entry, or None when they fail its checksum (the caller drops the page).

        Runs in I/O threads: it touches only the file, never the index or the allocator.
        """
        offset, length, crc = entry
        data = os.pread(self._fd, length, offset)
        if len(data) != length or checksum(data) != crc:
            return None
        return data

    def delete(self, key: Key) -> None:
        with self._index_lock:
            entry = self.entries.pop(key, None)
            if entry is None:
                return
            ns, group, digest = key
            self._index.write(msgpack.packb(["del", ns, group, digest, 0, 0, 0], use_bin_type=True))
            self._index.flush()
        self.allocator.free(entry[0], entry[1])

    def close(self) -> None:
        self.sync()
        self._index.close()
        os.close(self._fd)
