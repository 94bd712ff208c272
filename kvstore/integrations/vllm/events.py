"""KV-cache events for routers (llm-d, Dynamo, our conductor): BlockStored once a block the
connector saved is in the store's index, BlockRemoved when a lookup finds an announced block gone.

Events carry our block hashes (16 bytes), the block's tokens and its parent, medium "STORAGE".
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .plan import RequestState

MEDIUM = "STORAGE"
MAX_TRACKED = 100_000  # announced blocks remembered for BlockRemoved (oldest forgotten first)


class StoreEvents:
    """Scheduler-side bookkeeping of which blocks were announced to routers."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pending: dict[bytes, tuple[bytes | None, list[int]]] = {}  # saved, not yet seen in the index
        self._announced: OrderedDict[bytes, None] = OrderedDict()
        self._removed: list[bytes] = []

    def saving(self, state: RequestState, saves: list[tuple[int, bytes]]) -> None:
        position = {h: i for i, h in enumerate(state.hashes)}
        for _, block_hash in saves:
            i = position.get(block_hash)
            if i is None or block_hash in self._announced:
                continue
            parent = state.hashes[i - 1] if i > 0 else None
            self._pending[block_hash] = (parent, state.tokens[i * self.block_size:(i + 1) * self.block_size])

    def check_missing(self, hashes: list[bytes]) -> None:
        """Blocks a lookup did not find: announced ones were evicted or lost."""
        for block_hash in hashes:
            if block_hash in self._announced:
                del self._announced[block_hash]
                self._removed.append(block_hash)

    def take(self, mirror: Any, fingerprint: Any) -> list[Any]:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        events: list[Any] = []
        if self._removed:
            events.append(BlockRemoved(block_hashes=list(self._removed), medium=MEDIUM))
            self._removed = []
        landed = [h for h in self._pending if mirror.contains(fingerprint, h)]
        for block_hash in landed:
            parent, tokens = self._pending.pop(block_hash)
            events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=parent, token_ids=tokens,
                                      block_size=self.block_size, lora_id=None, medium=MEDIUM, lora_name=None))
            self._announced[block_hash] = None
        while len(self._announced) > MAX_TRACKED:
            self._announced.popitem(last=False)
        if len(self._pending) > MAX_TRACKED:  # saves that never landed (dropped or failed)
            for block_hash in list(self._pending)[: len(self._pending) - MAX_TRACKED]:
                del self._pending[block_hash]
        return events
