"""Eviction policies behind one small interface (the SGLang radix-cache idea: the tier owns the
data, the policy only orders keys)."""
from __future__ import annotations

import abc
import heapq
import itertools
from collections import OrderedDict
from typing import Hashable, Iterator


class EvictionPolicy(abc.ABC):
    """Orders a tier's evictable keys; the tier calls these under its own lock."""

    name: str

    @abc.abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Keys in the order they should go; the tier may skip some (pinned) and stop early."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self._order))


class LFUPolicy(EvictionPolicy):
    """Least frequently used first (ties: least recently used), with a lazy-deletion heap."""

    name = "lfu"

    def __init__(self) -> None:
        self._counts: dict[Hashable, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, Hashable]] = []
        self._clock = itertools.count()

    def _push(self, key: Hashable, count: int) -> None:
        stamp = next(self._clock)
        self._counts[key] = (count, stamp)
        heapq.heappush(self._heap, (count, stamp, key))
        if len(self._heap) > 4 * len(self._counts) + 64:  # drop stale entries now and then
            self._heap = [(c, s, k) for k, (c, s) in self._counts.items()]
            heapq.heapify(self._heap)

    def insert(self, key: Hashable) -> None:
        self._push(key, 1)

    def touch(self, key: Hashable) -> None:
        if key in self._counts:
            self._push(key, self._counts[key][0] + 1)

    def remove(self, key: Hashable) -> None:
        self._counts.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        for count, stamp, key in sorted(self._heap):
            if self._counts.get(key) == (count, stamp):
                yield key


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None
