"""First-fit extent allocation over a byte range (the DRAM arena and the SSD file), with coalescing."""

from __future__ import annotations

import bisect


class ExtentError(ValueError):
    """An extent handed back (or taken) that the allocator does not hold as used: outside the
    capacity, not block-aligned, or overlapping a free extent. Raised before any state changes."""


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

    def free_extents(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free extent, by offset."""
        return [(start, self._lengths[start]) for start in self._starts]

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
        if i < 0 or offset % self.block:
            raise ExtentError(f"extent [{offset}, {offset + size}) is not free")
        start = self._starts[i]
        have = self._lengths[start]
        if offset + size > start + have:
            raise ExtentError(f"extent [{offset}, {offset + size}) is not free")
        del self._starts[i]
        del self._lengths[start]
        for piece_start, piece_len in ((start, offset - start), (offset + size, start + have - offset - size)):
            if piece_len > 0:
                bisect.insort(self._starts, piece_start)
                self._lengths[piece_start] = piece_len
        self.free_bytes -= size

    def free(self, offset: int, length: int) -> None:
        """Hand back a used extent. A double free or a stray one would let two owners share bytes,
        so anything that is not wholly used (inside the capacity, aligned, overlapping no free
        extent) raises ``ExtentError`` and changes nothing."""
        size = self.rounded(max(length, 1))
        start, end = offset, offset + size
        if offset < 0 or offset % self.block or end > self.capacity:
            raise ExtentError(
                f"extent [{start}, {end}) is not a used extent: it must be {self.block}-byte aligned "
                f"and lie inside the capacity of {self.capacity} bytes"
            )
        i = bisect.bisect_left(self._starts, offset)
        after = self._starts[i] if i < len(self._starts) else None
        before = self._starts[i - 1] if i > 0 else None
        if (after is not None and after < end) or (before is not None and before + self._lengths[before] > start):
            raise ExtentError(f"extent [{start}, {end}) overlaps a free extent: freed twice, or never allocated")
        # Coalesce with the following and the preceding free extents.
        if after == end:
            end += self._lengths.pop(after)
            del self._starts[i]
        if before is not None and before + self._lengths[before] == start:
            start = before
            del self._starts[i - 1]
            i -= 1
        self._starts.insert(i, start)
        self._lengths[start] = end - start
        self.free_bytes += size
