"""Background work on a store daemon's NVMe tier (a part of `BlockStore`): a persistent tier's blocks
restored from its journal and verified before they are listed, DRAM blocks persisted on a graceful
stop, the journal's snapshot, and blocks coded with the disk codec after their demotion."""
from __future__ import annotations

import logging
import time
from typing import Sequence

from transfer import TransferError, Write

from ..integrity import block_digest, block_digests
from ..tiers.allocator import align_up
from ..tiers.journal import Entry
from .slot import Key, Slot, Update

log = logging.getLogger("kvstore.daemon.store")  # the store's one logger, whichever part speaks


class TierUpkeep:
    """BlockStore's restore, persist and disk-codec work on the NVMe tier."""

    def restore(self, entries: Sequence[Entry]) -> int:
        """Hold the extents of the blocks a restarted tier's journal lists (oldest first), to be
        verified by `verify_restored` before anything lists them; returns how many are held."""
        nvme = self.nvme
        held = 0
        with self.lock:
            for e in entries:
                key = (e.fingerprint, e.block_hash)
                if key in self._restoring or not nvme.allocator.take(e.offset, e.stored):
                    self._count("journal_dropped_entries")
                    continue
                self._restoring[key] = Slot(key, nvme, e.offset, e.size, e.digest, codec=e.codec,
                                            stored=e.stored if e.codec else 0)
                held += 1
            self.counters["restore_pending"] = self.restoring
        if held:
            self.tier_work.set()
        return held

    @property
    def restoring(self) -> int:
        """Blocks of a restarted tier not verified yet."""
        return len(self._restoring) + len(self._checking)

    def _unrestore(self, key: Key) -> None:
        """Forget a block still to be restored (lock held): its extent back, the journal told."""
        slot = self._restoring.pop(key, None)
        if slot is None:
            slot = self._checking.pop(key, None)  # its verifier finds it gone and frees its extent
            if slot is not None and self.journal is not None:
                self.journal.delete(key[0], key[1], slot.offset)
            return
        self.nvme.allocator.release(slot.offset, slot.span)
        self.counters["restore_pending"] = self.restoring
        if self.journal is not None:
            self.journal.delete(key[0], key[1], slot.offset)

    def verify_restored(self, max_blocks: int = 64, max_bytes: int = 32 << 20) -> tuple[list[Update], int]:
        """Verify the next restored blocks (their digest over the bytes on disk, decoded when coded)
        and seal those that pass, in journal order; drop those that fail (`restore_corrupt_blocks`)
        or that this node holds again already. Returns (index updates, blocks left to verify)."""
        with self.lock:
            batch, size = [], 0
            while self._restoring and len(batch) < max_blocks and (not batch or size < max_bytes):
                key, slot = self._restoring.popitem(last=False)
                self._checking[key] = slot
                batch.append(slot)
                size += slot.span
        if not batch:
            return [], self.restoring
        raws: list[bytes | None] = []
        for slot in batch:
            try:
                raws.append(self._raw_bytes(slot, self._read_nvme(slot.offset, slot.span)))
            except TransferError:
                self._count("io_errors")
                raws.append(None)
        good = [i for i, raw in enumerate(raws) if raw is not None]
        sums = dict(zip(good, block_digests([batch[i].key[1] for i in good], [raws[i] for i in good])))
        updates: list[Update] = []
        with self.lock:
            for i, slot in enumerate(batch):
                if self._checking.get(slot.key) is not slot:  # removed meanwhile
                    self.nvme.allocator.release(slot.offset, slot.span)
                    continue
                del self._checking[slot.key]
                if sums.get(i) != slot.digest:
                    self._count("restore_corrupt_blocks")
                    log.debug("restored block %s of %s fails its digest on disk: dropped", slot.key[1].hex(),
                              slot.key[0])
                elif self._held(slot.key) is not None:
                    self._count("restore_superseded")  # put again since the start: that copy stands
                else:
                    self._seal_nvme(slot, updates)
                    self._count("restored_blocks")
                    continue
                self.nvme.allocator.release(slot.offset, slot.span)
                if self.journal is not None:
                    self.journal.delete(slot.key[0], slot.key[1], slot.offset)
            self.counters["restore_pending"] = self.restoring
            return updates, self.restoring

    def persist(self, budget_s: float, keep_sole: bool = False) -> tuple[int, int]:
        """Demote DRAM blocks to the NVMe tier, most recently used first, for at most `budget_s`
        seconds (a graceful stop with --persist-on-stop): NVMe makes room by evicting one block at
        a time, never a block no other live node holds when `keep_sole`. Returns (moved, left)."""
        if self.nvme is None:
            return 0, len(self.dram.sealed)
        deadline = time.monotonic() + budget_s
        with self.lock:
            order = list(self.dram.policy.victims())[::-1]
        moved = 0
        for start in range(0, len(order), 64):
            if time.monotonic() > deadline:
                break
            updates: list[Update] = []  # not published: the node is leaving (its lease goes with them)
            with self.lock:
                for key in order[start : start + 64]:
                    slot = self.dram.sealed.get(key)
                    if slot is not None and self._demote(slot, updates, keep_sole, batch=False):
                        moved += 1
        with self.lock:
            return moved, len(self.dram.sealed)

    def _journal_snapshot(self) -> list[Entry]:
        """Every block the NVMe tier holds, for a journal compaction: those still to be restored
        first, then the sealed ones in eviction order (a restart restores that order)."""
        with self.lock:
            slots = list(self._restoring.values()) + list(self._checking.values())
            slots += [self.nvme.sealed[k] for k in self.nvme.policy.victims() if k in self.nvme.sealed]
            return [Entry(s.key[0], s.key[1], s.offset, s.size, s.span, s.codec, s.digest) for s in slots]

    @property
    def uncoded(self) -> int:
        """NVMe blocks waiting to be coded."""
        return len(self._uncoded)

    def code_some(self, max_blocks: int = 32, max_bytes: int = 16 << 20) -> tuple[list[Update], int]:
        """Code the oldest raw NVMe blocks with the disk codec, each into a new extent taken from free
        space only, swapped for its raw copy if that is still the block's NVMe copy (the raw extent is
        then freed). A block its codec gains too little on stays raw. Returns (updates, left)."""
        with self.lock:
            batch, size = [], 0
            while self._uncoded and len(batch) < max_blocks and (not batch or size < max_bytes):
                _, slot = self._uncoded.popitem(last=False)
                batch.append(slot)
                size += slot.size
        if not batch:
            return [], 0
        coded: list[tuple[Slot, int, bytes]] = []
        for slot in batch:
            # Read, checked and coded off the lock: a slot still sealed when we come back was never
            # freed meanwhile (a freed slot never comes back), so these were its bytes.
            try:
                data = self._read_nvme(slot.offset, slot.size)
            except TransferError:
                self._count("io_errors")
                continue
            if block_digest(slot.key[1], data) != slot.digest:
                continue  # left to a reader's report and the node's re-check (touch)
            codec, frame = self._chooser.encode(slot.key[0], data)
            if frame is None:
                self._count("disk_codec_raw_blocks")
                continue
            coded.append((slot, codec, frame))
        updates: list[Update] = []
        nvme = self.nvme
        for slot, codec, frame in coded:
            with self.lock:
                if nvme.sealed.get(slot.key) is not slot:
                    continue
                offset = nvme.allocator.allocate(len(frame))  # free space only: coding never evicts
            if offset is None:
                continue
            try:
                scratch = self.engine.register(bytearray(frame), remote_access=False)
                try:
                    self.engine.transfer([Write(scratch, 0, nvme.region, offset, len(frame))])
                finally:
                    self.engine.unregister(scratch)
            except TransferError:
                with self.lock:
                    nvme.allocator.release(offset, len(frame))
                self._count("io_errors")
                continue
            with self.lock:
                if nvme.sealed.get(slot.key) is not slot:
                    nvme.allocator.release(offset, len(frame))
                    continue
                new = Slot(slot.key, nvme, offset, slot.size, slot.digest, codec=codec, stored=len(frame),
                           held_since=slot.held_since)
                nvme.keep(new)  # its place in the eviction order stays
                if self.journal is not None:  # the new place first: the old one is superseded by it
                    self.journal.put(slot.key[0], slot.key[1], offset, slot.size, len(frame), codec, slot.digest)
                nvme.allocator.release(slot.offset, slot.size)
                updates.append((slot.key[0], slot.key[1], new.record()))
                self._count("disk_codec_coded_blocks")
                self._count("disk_codec_saved_bytes", align_up(slot.size) - align_up(len(frame)))
        with self.lock:
            return updates, len(self._uncoded)
