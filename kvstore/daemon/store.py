"""A daemon's blocks: a DRAM tier (shared-memory arena) and an optional NVMe tier (preallocated
file), reservations for blocks being written, sealing with digest verification, and watermark
eviction that demotes DRAM victims to NVMe and promotes NVMe hits back.

A commit either verifies its blocks' bytes at once, or (`verify=False`) answers first and leaves
them *written*: held in place, in no tier's index or eviction order, until `seal_written` verifies
them and returns their index updates. So nothing is published, evicted or demoted unverified.

Every method returns the index updates it implies — (fingerprint, hash, record or None) — for the
daemon to publish; nothing here talks to the metadata service. One lock guards everything but the
digest passes, which run on slots no one else can reach (popped from the pending or written set).

Write grants: a slot reserved or leased for a client that named its engine's peer id is granted to
that engine (Engine.grant), and only while the slot is pending: its commit, abort or expiry revokes
the grant before anything else happens to the slot. Remote writes into the DRAM tier land nowhere
else (the daemon registers it remote_writes="granted"; the NVMe tier takes none). A slot whose
revoke finds a write still landing is fenced: its commit fails, and its space goes back only once
the native side says that write is over, so late bytes never land on someone else's block.

Tenants' capacity shares (`shares`, from the tenants file): each tier counts the space each
tenant's sealed blocks take. Room for a block is never made by evicting (demoting or dropping)
the blocks of another tenant that holds no more than its share of the tier; a tenant over its
share makes room from its own blocks first. So one tenant filling a node evicts its own blocks,
and those of tenants over their shares or without one (and the cluster's own), never those of a
tenant within its share.

The store is one object under one lock, written in parts by role: `grants` (slots: reservations,
leases, write grants, expiry), `sealing` (commits, verification, sealing), `tiering` (eviction,
demotion, promotion) and `tier_upkeep` (a persistent NVMe tier's restore, persist, disk codec);
`slot` holds the records they share. This class is their face: lookups, hits, reads and removal.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

from transfer import Engine, Region

from ..codec import Chooser, check_codec
from ..index.records import MAX_BLOCK_BYTES, BlockRecord
from ..seals import SealTable
from ..tiers.journal import LABEL_BYTES, TierJournal
from .grants import LEASE_MAX_SLOTS, LEASE_SHARE, LEASES_SHARE, UNNAMED, WRITTEN_WAIT_S, SlotGrants
from .sealing import STILL_LANDING, VERIFY_LATER_MIN, WRITTEN_MAX, Sealing
from .slot import LOCK_SPAN, Key, Slot, Tier, Update, spans
from .tier_upkeep import TierUpkeep
from .tiering import Tiering

# Re-exported: what the daemon's other parts and tools import from here.
__all__ = ["BlockStore", "Key", "LEASE_MAX_SLOTS", "LEASE_SHARE", "LEASES_SHARE", "LOCK_SPAN", "MAX_BLOCK_BYTES",
           "STILL_LANDING", "Slot", "Tier", "UNNAMED", "Update", "VERIFY_LATER_MIN", "WRITTEN_MAX", "WRITTEN_WAIT_S"]


class BlockStore(SlotGrants, Sealing, Tiering, TierUpkeep):
    """See module docstring."""

    def __init__(self, engine: Engine, dram: Region, nvme: Region | None = None, *, policy: str = "lru",
                 high: float = 0.95, low: float = 0.85, reservation_timeout: float = 30.0,
                 counters: dict[str, float] | None = None, promote: bool = True, journal: TierJournal | None = None,
                 disk_codec: str | None = None, shares: dict[str, float] | None = None) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError(f"watermarks need 0 < low <= high <= 1, got low={low} high={high}")
        self.engine = engine
        # Tenant -> its share of each tier's capacity (`kvstore serve --tenants`, capacity=): room for
        # one tenant's block is never made by evicting the blocks of another within its share.
        self.shares = {name: share for name, share in (shares or {}).items() if share}
        self.dram = Tier("dram", dram, policy, high, low)
        # A journalled (persistent) tier keeps its label in its first 4 KiB.
        self.nvme = Tier("nvme", nvme, policy, high, low, LABEL_BYTES if journal else 0) if nvme is not None else None
        self.reservation_timeout = reservation_timeout
        self.promote = promote  # move NVMe blocks back to DRAM when clients hit them
        self.counters = counters if counters is not None else {}
        self.journal = journal  # told every change of the NVMe tier's blocks (a persistent tier)
        if journal is not None:
            journal.snapshot = self._journal_snapshot
        # Whether another live node holds a block (fingerprint, hash), from the repairer's index
        # mirror (None: not known, as with one replica): eviction drops such blocks first, and a
        # repair copy may evict only those (kvstore.daemon.repair, `reserve(repair=True)`).
        self.replicated: Callable[[str, bytes], bool] | None = None
        # NVMe blocks a restarted tier's journal lists, held but not verified yet (in journal order),
        # and those being verified now (kvstore.daemon.tierwork): neither is published or evicted.
        self._restoring: OrderedDict[Key, Slot] = OrderedDict()
        self._checking: dict[Key, Slot] = {}
        # --disk-codec: NVMe blocks are coded in the background after their demotion (tierwork),
        # oldest first; a raw block waits here for its turn.
        self.disk_codec = check_codec(disk_codec)
        self._chooser = Chooser() if self.disk_codec else None
        self._uncoded: OrderedDict[Key, Slot] = OrderedDict()
        self._wire_chooser = Chooser()  # codes DRAM blocks read over the wire with a codec
        self.tier_work = threading.Event()  # restore or coding work arrived (tierwork's thread waits on it)
        self._pending: dict[int, Slot] = {}
        self._fenced: list[tuple[str, Slot]] = []  # (peer, slot): revoked while that peer's write still landed
        # The seal table (kvstore.seals): which verified sealing each DRAM slot holds, for same-host
        # readers. The units of a pending slot that expired while a same-host writer may still write
        # it are tainted (no slot sealed over them is numbered, so re-readers hash it) until that
        # writer's process is gone, for good where the writer is not known. Its space goes back at once.
        self.seals = SealTable(dram.size)
        self._taints: list[tuple[Any, int, int]] = []  # (writer or None, first unit, last unit)
        self._tainted = bytearray(self.seals.units)
        self._written: dict[Key, Slot] = {}  # committed, to be verified by seal_written (in order)
        self._verifying: dict[Key, Slot] = {}  # taken by seal_written, being verified now
        self.lock = threading.RLock()
        self._has_written = threading.Condition(self.lock)
        self._verified = threading.Condition(self.lock)  # seal_written finished a batch
        # False once a drain has emptied the node: a put reserved before it must not land after it.
        self.taking_blocks = True
        self._verifying_commits = 0  # commits between taking their slots and sealing them
        self._commits_quiet = threading.Condition(self.lock)

    @property
    def tiers(self) -> list[Tier]:
        return [self.dram] + ([self.nvme] if self.nvme else [])

    def _count(self, name: str, by: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def find(self, key: Key) -> Slot | None:
        for tier in self.tiers:
            slot = tier.sealed.get(key)
            if slot is not None:
                return slot
        return None

    def _held(self, key: Key) -> Slot | None:
        """The block's slot, sealed or written (awaiting or under verification)."""
        return self.find(key) or self._written.get(key) or self._verifying.get(key)

    def records(self, fingerprint: str, hashes: Sequence[bytes]) -> list[BlockRecord | None]:
        """Where this node holds each block now (None where it does not)."""
        out: list[BlockRecord | None] = []
        for span in spans(hashes):
            with self.lock:
                slots = [self.find((fingerprint, bytes(h))) for h in span]  # never an unverified one
                out.extend(None if s is None else s.record() for s in slots)
        return out

    def _touch(self, key: Key) -> Slot | None:
        slot = self.find(key)
        if slot is not None:
            slot.tier.policy.touch(key)
        return slot

    def touch(self, fingerprint: str, hashes: Sequence[bytes], corrupt: Sequence[bytes] = ()) -> list[Update]:
        """Record client hits (promoting NVMe hits) and check blocks a client found corrupt."""
        updates: list[Update] = []
        for span in spans(hashes):
            with self.lock:
                for block_hash in span:
                    slot = self._touch((fingerprint, bytes(block_hash)))
                    if slot is None:
                        continue
                    self._count(f"hits_{slot.tier.name}")
                    if slot.tier is self.nvme and self.promote:
                        self._promote(slot, updates)
        with self.lock:
            for block_hash in corrupt:
                slot = self.find((fingerprint, bytes(block_hash)))
                self._count("client_reported_corrupt")
                if slot is not None and not self._verify(slot):
                    self._drop(slot)
                    self._count(f"corrupt_blocks_{slot.tier.name}")
                    updates.append((fingerprint, bytes(block_hash), None))
        return updates

    def read_stored(self, key: Key, codec: str | None) -> tuple[BlockRecord, bytes] | None:
        """A sealed block as a reader over TCP asked for it (the wire's `read`): its record and the
        bytes to send, coded with `codec` when that gains (an NVMe block coded already goes as it
        lies). None when not held here. Not checked: the reader verifies the digest after decoding."""
        with self.lock:
            slot = self.find(key)
            if slot is None:
                return None
            data = bytes(self.dram.region.buffer[slot.offset : slot.offset + slot.size]) \
                if slot.tier is self.dram else None
            record = slot.record()
        if data is None:  # off the lock: an extent reused meanwhile gives bytes that fail the reader's digest
            data = self._read_nvme(record.offset, record.span)
        if record.codec or codec is None:
            return record, data
        chooser = self._chooser or self._wire_chooser
        coded, frame = chooser.encode(key[0], data)
        if frame is None:
            return record, data
        return BlockRecord(record.tier, record.region, record.offset, record.size, record.digest, coded,
                           len(frame)), frame

    def keys(self, fingerprint: str | None = None) -> list[tuple[Key, Slot]]:
        """Sealed blocks (of one fingerprint), sorted by (fingerprint, hash)."""
        with self.lock:
            found = [(k, s) for tier in self.tiers for k, s in tier.sealed.items()
                     if fingerprint is None or k[0] == fingerprint]
        return sorted(found, key=lambda item: item[0])

    def sealed(self, keys: Sequence[Key]) -> list[tuple[Key, Slot]]:
        """Those of `keys` held sealed here, with their slots, sorted."""
        with self.lock:
            found = [(key, slot) for key in keys if (slot := self.find(key)) is not None]
        return sorted(found, key=lambda item: item[0])

    def remove(self, fingerprint: str, hashes: Sequence[bytes]) -> tuple[int, list[Update]]:
        updates: list[Update] = []
        for span in spans(hashes):
            with self.lock:
                for block_hash in span:
                    key = (fingerprint, bytes(block_hash))
                    slot = self.find(key)
                    if slot is not None:
                        self._drop(slot)
                    unwritten = self._unwrite(key)
                    self._unrestore(key)  # not listed yet, but must not come back after its removal
                    if slot is not None or unwritten:
                        updates.append((fingerprint, bytes(block_hash), None))
        return len(updates), updates

    def all_records(self) -> list[Update]:
        """Every sealed block as an update (republishing after a lost lease)."""
        with self.lock:
            return [(k[0], k[1], s.record()) for tier in self.tiers for k, s in tier.sealed.items()]
