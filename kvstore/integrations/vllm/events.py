"""KV-cache events for routers (llm-d, Dynamo, our conductor): BlockStored once a block the
connector saved is in the store's index, BlockRemoved when a lookup finds an announced block gone.

Events carry our block hashes (16 bytes), the block's tokens and its parent, medium "STORAGE",
and, as vLLM's own events do, the KV cache group (`group_idx`) with its spec kind and window: a
hybrid model's groups are announced separately, each when its block landed.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from .groups import CacheGroup
from .plan import GroupBlock, RequestState

MEDIUM = "STORAGE"
MAX_TRACKED = 100_000  # announced blocks remembered for BlockRemoved (oldest forgotten first)

Announced = tuple[int, bytes]  # (group, block hash)


class StoreEvents:
    """Scheduler-side bookkeeping of which blocks were announced to routers."""

    def __init__(self, block_size: int, groups: Sequence[CacheGroup]) -> None:
        self.block_size = block_size
        self.groups = list(groups)
        self._pending: dict[Announced, tuple[bytes | None, list[int]]] = {}  # saved, not yet seen in the index
        self._announced: OrderedDict[Announced, None] = OrderedDict()
        self._removed: list[Announced] = []

    def saving(self, state: RequestState, saves: list[GroupBlock]) -> None:
        position = {h: i for i, h in enumerate(state.hashes)}
        for group, _, block_hash in saves:
            i = position.get(block_hash)
            if i is None or (group, block_hash) in self._announced:
                continue
            parent = state.hashes[i - 1] if i > 0 else None
            self._pending[group, block_hash] = (parent, state.tokens[i * self.block_size:(i + 1) * self.block_size])

    def check_missing(self, group: int, hashes: list[bytes]) -> None:
        """Blocks of `group` a lookup did not find: announced ones were evicted or lost."""
        for block_hash in hashes:
            if (group, block_hash) in self._announced:
                del self._announced[group, block_hash]
                self._removed.append((group, block_hash))

    def take(self, contains: Any) -> list[Any]:
        """The events since the last call; `contains(group, hash)` asks the index."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        events: list[Any] = []
        removed: dict[int, list[bytes]] = {}
        for group, block_hash in self._removed:
            removed.setdefault(group, []).append(block_hash)
        for group, hashes in removed.items():
            events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=group))
        self._removed = []
        landed = [key for key in self._pending if contains(*key)]
        for group, block_hash in landed:
            parent, tokens = self._pending.pop((group, block_hash))
            spec = self.groups[group]
            events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=parent, token_ids=tokens,
                                      block_size=self.block_size, lora_id=None, medium=MEDIUM, lora_name=None,
                                      group_idx=group, kv_cache_spec_kind=spec.kind,
                                      kv_cache_spec_sliding_window=spec.window))
            self._announced[group, block_hash] = None
        while len(self._announced) > MAX_TRACKED:
            self._announced.popitem(last=False)
        if len(self._pending) > MAX_TRACKED:  # saves that never landed (dropped or failed)
            for key in list(self._pending)[: len(self._pending) - MAX_TRACKED]:
                del self._pending[key]
        return events
