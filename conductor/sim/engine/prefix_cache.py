"""A paged KV cache with vLLM v1's prefix caching (vllm/v1/core/block_pool.py), as bookkeeping.

Blocks have a reference count and, once full, a hash. A request's hit is the longest run of its
leading block hashes present in the cache, capped so at least one prompt token is computed
(`find_longest_cache_hit(hashes, num_tokens - 1)`: whole blocks only). Free blocks wait in an LRU
queue and keep their hash until reused: a hit on a free block takes it back out of the queue.
Allocation takes the queue's head; a block that still had a hash is evicted then (BlockRemoved).
A request frees its blocks in reverse, so its tail blocks are evicted before its head. Every
newly cached full block is a BlockStored; `reset()` is AllBlocksCleared."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass
class CacheEvents:
    """What changed since the last `take()`: as vLLM's BlockPool queues them, in order."""

    # ("stored", hashes, parent, token ids, first block's extra keys) | ("removed", [hash]) | ("cleared",)
    items: list[tuple] = field(default_factory=list)

    def take(self) -> list[tuple]:
        out, self.items = self.items, []
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, dict[int, None]] = {}  # hash -> the blocks holding it (first one serves hits)
        self.enable_caching = enable_caching
        self.events = CacheEvents()
        self.evicted = 0  # cached blocks reused for other data (their prefix lost here)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks) if self.blocks else 0.0

    def longest_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Block ids of the leading hashes cached (at most `max_blocks`), not yet referenced."""
        if not self.enable_caching:
            return []
        out = []
        for h in hashes[:max_blocks]:
            holders = self.cached.get(h)
            if not holders:
                break
            out.append(next(iter(holders)))
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take cached blocks for a request (out of the free queue if they were free)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free.pop(block_id, None)
            block.ref_cnt += 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks from the LRU head (evicting their old hashes); raises if too few."""
        if n > len(self.free):
            raise MemoryError(f"{n} blocks wanted, {len(self.free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evicted: one BlockRemoved per block, as vLLM emits them
                self.evicted += 1
                holders = self.cached.get(block.block_hash)
                if holders is not None and holders.pop(block_id, 0) is None:
                    if not holders:
                        del self.cached[block.block_hash]
                    self.events.items.append(("removed", [block.block_hash]))
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """A request's blocks, freed in reverse order (its tail is evicted first)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block_id] = None

    def cache_full(self, block_ids: Sequence[int], hashes: Sequence[bytes], start: int, end: int,
                   parent: bytes | None, tokens: Sequence[int] = (), first_extra: tuple | None = None) -> None:
        """Blocks `start:end` of a request just became full: give them their hashes (a hash may be
        held by several blocks, as in vLLM; hits use the first)."""
        if not self.enable_caching or end <= start:
            return
        for i in range(start, end):
            block = self.blocks[block_ids[i]]
            block.block_hash = hashes[i]
            self.cached.setdefault(hashes[i], {})[block.block_id] = None
        self.events.items.append(("stored", list(hashes[start:end]), parent, list(tokens),
                                  first_extra if start == 0 else None))

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache): refused while a block is in use."""
        if any(b.ref_cnt for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.free = OrderedDict((i, None) for i in range(len(self.blocks)))
        self.events.items.append(("cleared",))
        return True
