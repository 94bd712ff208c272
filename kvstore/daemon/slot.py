"""The records a store daemon's blocks are kept in: a `Slot` (one block's place in a tier, pending,
written or sealed) and a `Tier` (an engine region, its allocator, sealed slots and their eviction
order, and what each tenant's blocks take there)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from transfer import Region

from ..index.records import BlockRecord
from ..keys import fingerprint_tenant
from ..tiers import EvictionPolicy, ExtentAllocator, make_policy
from ..tiers.allocator import align_up

Key = tuple[str, bytes]  # (fingerprint, block hash)
Update = tuple[str, bytes, BlockRecord | None]
LOCK_SPAN = 4096  # blocks a lookup, touch or remove handles per hold of the lock: a huge one delays a put by one span


def spans(hashes: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
    """`hashes` in runs of LOCK_SPAN, each to handle under one hold of the store lock."""
    for start in range(0, len(hashes), LOCK_SPAN):
        yield hashes[start : start + LOCK_SPAN]


@dataclass
class Slot:
    key: Key
    tier: "Tier"
    offset: int
    size: int  # the block's bytes
    digest: bytes = b""  # of the block's bytes, as its writer sent it (kvstore.integrity)
    reserved_at: float = field(default_factory=time.monotonic)
    peer: str = ""  # the engine (peer id) granted writes into it while it is pending
    codec: int = 0  # kvstore.codec id of what is stored at `offset` (NVMe only; 0: the raw bytes)
    stored: int = 0  # bytes stored at `offset` when coded
    # A process on this host that maps the arena and may write this pending slot (`gone()` once it
    # has exited), for a reservation or lease asked for over the unix socket; None otherwise.
    writer: Any = None
    # When the block was first sealed on this node (monotonic; a move between tiers keeps it). Replica
    # repair asks the other nodes about a block this young before copying it: their records of it
    # may still be on their way.
    held_since: float = 0.0

    @property
    def span(self) -> int:
        """Bytes the slot takes at `offset`: its frame when coded, else the block."""
        return self.stored if self.codec else self.size

    def record(self) -> BlockRecord:
        return BlockRecord(self.tier.name, self.tier.region.id, self.offset, self.size, self.digest, self.codec,
                           self.stored if self.codec else 0)


class Tier:
    """One tier: an engine region, its allocator, sealed slots and their eviction order. `head`
    bytes at its start hold no blocks (a persistent NVMe tier's label). `tenant_bytes`: the space
    each tenant's sealed blocks take here (kept by `keep` and `let_go`, the only ways in and out)."""

    def __init__(self, name: str, region: Region, policy: str, high: float, low: float, head: int = 0) -> None:
        self.name, self.region = name, region
        self.allocator = ExtentAllocator(region.size)
        if head:
            self.allocator.take(0, head)
        self.policy: EvictionPolicy = make_policy(policy)
        self.high, self.low = high, low
        self.sealed: dict[Key, Slot] = {}
        self.tenant_bytes: dict[str, int] = {}

    def keep(self, slot: Slot) -> None:
        """`slot` becomes its block's sealed copy here (replacing any other)."""
        old = self.sealed.get(slot.key)
        if old is not None:
            self._account(old, -1)
        if not slot.held_since:
            slot.held_since = time.monotonic()
        self.sealed[slot.key] = slot
        self._account(slot, 1)

    def let_go(self, key: Key) -> Slot | None:
        """The block's sealed copy leaves this tier (the caller frees its extent)."""
        slot = self.sealed.pop(key, None)
        if slot is not None:
            self._account(slot, -1)
        return slot

    def _account(self, slot: Slot, sign: int) -> None:
        tenant = fingerprint_tenant(slot.key[0])
        if tenant:
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + sign * align_up(slot.span)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used


