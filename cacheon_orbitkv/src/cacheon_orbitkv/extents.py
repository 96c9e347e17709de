"""First-fit extent allocation over a byte range (the DRAM arena and the SSD file), with coalescing."""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Allocates ``[offset, offset + length)`` extents rounded up to ``block`` bytes."""

    def __init__(self, capacity: int, block: int = 4096) -> None:
        self.block = block
        self.capacity = capacity - capacity % block
        self._starts: list[int] = [0] if self.capacity else []
        self._lengths: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self.free_bytes = self.capacity

    def rounded(self, length: int) -> int:
        return -(-length // self.block) * self.block

    def allocate(self, length: int) -> int | None:
        """The offset of a free extent of ``length`` bytes (rounded), or None when none fits."""
        size = self.rounded(max(length, 1))
        for start in self._starts:
            have = self._lengths[start]
            if have >= size:
                i = bisect.bisect_left(self._starts, start)
                del self._starts[i]
                del self._lengths[start]
                if have > size:
                    self._starts.insert(i, start + size)
                    self._lengths[start + size] = have - size
                self.free_bytes -= size
                return start
        return None

    def take(self, offset: int, length: int) -> None:
        """Mark a known extent used (replaying a persisted index); it must lie inside a free extent."""
        size = self.rounded(max(length, 1))
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            raise ValueError(f"extent [{offset}, {offset + size}) is not free")
        start = self._starts[i]
        have = self._lengths[start]
        if offset + size > start + have:
            raise ValueError(f"extent [{offset}, {offset + size}) is not free")
        del self._starts[i]
        del self._lengths[start]
        for piece_start, piece_len in ((start, offset - start), (offset + size, start + have - offset - size)):
            if piece_len > 0:
                bisect.insort(self._starts, piece_start)
                self._lengths[piece_start] = piece_len
        self.free_bytes -= size

    def free(self, offset: int, length: int) -> None:
        size = self.rounded(max(length, 1))
        i = bisect.bisect_left(self._starts, offset)
        start, end = offset, offset + size
        # Coalesce with the following and the preceding free extents.
        if i < len(self._starts) and self._starts[i] == end:
            end += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            start = self._starts[i - 1]
            del self._starts[i - 1]
            i -= 1
        self._starts.insert(i, start)
        self._lengths[start] = end - start
        self.free_bytes += size
