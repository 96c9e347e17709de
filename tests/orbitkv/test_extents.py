"""The extent allocator behind the arena and the SSD file: no byte owned twice, no stray free."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cacheon_orbitkv.extents import ExtentAllocator, ExtentError

BLOCK = 4096


def test_a_free_that_overlaps_a_free_extent_or_leaves_the_capacity_is_refused_unchanged():
    a = ExtentAllocator(16 * BLOCK, BLOCK)
    first = a.allocate(3 * BLOCK)
    second = a.allocate(BLOCK)
    assert (first, second) == (0, 3 * BLOCK)
    a.free(first, 3 * BLOCK)
    before = (a.free_extents(), a.free_bytes)
    for offset, length, rule in (
        (0, BLOCK, "overlaps a free extent"),  # freed twice
        (2 * BLOCK, 2 * BLOCK, "overlaps a free extent"),  # straddles a free and a used extent
        (5 * BLOCK, BLOCK, "overlaps a free extent"),  # never allocated
        (16 * BLOCK, BLOCK, "inside the capacity of 65536 bytes"),
        (-BLOCK, BLOCK, "inside the capacity"),
        (3 * BLOCK + 1, 10, "4096-byte aligned"),
    ):
        with pytest.raises(ExtentError, match=rule):
            a.free(offset, length)
        assert (a.free_extents(), a.free_bytes) == before
    a.free(second, BLOCK)
    assert a.free_extents() == [(0, 16 * BLOCK)] and a.free_bytes == 16 * BLOCK


ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(1, 5 * BLOCK)),
        st.tuples(st.just("free"), st.integers(0, 40)),
        st.tuples(st.just("stray"), st.integers(0, 20 * BLOCK)),
    ),
    max_size=60,
)


@given(ops)
def test_owned_and_free_extents_always_partition_the_capacity(steps):
    a = ExtentAllocator(20 * BLOCK, BLOCK)
    owned: dict[int, int] = {}
    for op, value in steps:
        if op == "allocate":
            offset = a.allocate(value)
            if offset is not None:
                owned[offset] = a.rounded(value)
        elif op == "free" and owned:
            offset = sorted(owned)[value % len(owned)]
            a.free(offset, owned.pop(offset))
        elif op == "stray":
            offset = value - value % BLOCK
            if not any(o <= offset < o + n for o, n in owned.items()):
                before = a.free_extents()
                with pytest.raises(ExtentError):
                    a.free(offset, BLOCK)
                assert a.free_extents() == before
        spans = sorted([*owned.items(), *a.free_extents()])
        position = 0
        for start, size in spans:  # disjoint, no gap, nothing past the end
            assert start == position and size > 0
            position += size
        assert position == a.capacity
        assert a.free_bytes == a.capacity - sum(owned.values())
