"""What each engine holds in its own prefix cache, as block hashes of our chain.

Fed two ways: the prompts the gateway itself sent there (an approximation, bounded LRU, like
vllm-router's cache_aware tree) and, when the engine publishes them, vLLM's KV-cache events
(`BlockStored`/`BlockRemoved`/`AllBlocksCleared`), which make it exact."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class PrefixTracker:
    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self.capacity = capacity_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def _table(self, engine: str) -> OrderedDict:
        return self._blocks.setdefault(engine, OrderedDict())

    def add(self, engine: str, hashes: Sequence[bytes]) -> None:
        table = self._table(engine)
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def remove(self, engine: str, hashes: Sequence[bytes]) -> None:
        table = self._table(engine)
        for h in hashes:
            table.pop(h, None)

    def clear(self, engine: str) -> None:
        self._table(engine).clear()

    def prefix_blocks(self, engine: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` the engine holds (a chain: the first miss ends the prefix)."""
        table = self._blocks.get(engine)
        if not table:
            return 0
        n = 0
        for h in hashes:
            if h not in table:
                break
            table.move_to_end(h)
            n += 1
        return n
