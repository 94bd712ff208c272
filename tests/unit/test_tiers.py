"""Allocator and eviction policies."""
from __future__ import annotations

import random

import pytest

from kvstore.tiers import ExtentAllocator, LFUPolicy, LRUPolicy, make_policy


def test_allocator_never_exceeds_capacity_and_coalesces():
    alloc = ExtentAllocator(1 << 20)
    rng = random.Random(0)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            alloc.release(offset, live.pop(offset))
        else:
            size = rng.choice([1, 4096, 5000, 65536, 200_000])
            offset = alloc.allocate(size)
            if offset is not None:
                assert offset % 4096 == 0 and offset + size <= alloc.capacity
                assert all(offset + size <= o or o + s <= offset for o, s in live.items())  # no overlap
                live[offset] = size
        assert 0 <= alloc.used <= alloc.capacity
    for offset, size in live.items():
        alloc.release(offset, size)
    assert alloc.used == 0 and alloc.allocate(1 << 20) == 0  # fully merged again


def test_allocator_refuses_double_free_and_bad_sizes():
    alloc = ExtentAllocator(64 * 1024)
    offset = alloc.allocate(4096)
    alloc.release(offset, 4096)
    with pytest.raises(ValueError):
        alloc.release(offset, 4096)
    with pytest.raises(ValueError):
        alloc.allocate(0)
    assert alloc.allocate(128 * 1024) is None


def test_lru_and_lfu_orders():
    lru = LRUPolicy()
    for key in "abcd":
        lru.insert(key)
    lru.touch("a")
    lru.remove("c")
    assert list(lru.victims()) == ["b", "d", "a"]
    lfu = LFUPolicy()
    for key in "abcd":
        lfu.insert(key)
    for key in "aab":
        lfu.touch(key)
    lfu.remove("d")
    assert list(lfu.victims()) == ["c", "b", "a"]
    with pytest.raises(ValueError):
        make_policy("random")
