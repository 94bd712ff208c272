"""Tiering of a store daemon's blocks (a part of `BlockStore`): room made in a tier by watermark
eviction (tenants' capacity shares and replicated blocks first), DRAM victims demoted to NVMe, NVMe
hits promoted back and checked on the way, blocks dropped, and the eviction policy changed at run time."""
from __future__ import annotations

from typing import Callable

from transfer import Read, TransferError, Write

from ..codec import CodecError, decode
from ..integrity import block_digest
from ..keys import fingerprint_tenant
from ..tiers import make_policy
from ..tiers.allocator import align_up
from .slot import Key, Slot, Tier, Update


class Tiering:
    """BlockStore's eviction, demotion and promotion (lock held)."""

    def _allocate(self, tier: Tier, size: int, updates: list[Update], keep_sole: bool = False,
                  batch: bool = True, never_drop: bool = False, tenant: str = "") -> int | None:
        """Room for `size` bytes of a block of `tenant` ("" : the cluster's own) in `tier`, evicting
        down to the low watermark when above the high one (`batch`; else one block at a time, only
        as needed). `keep_sole`: evict (drop) only blocks another live node holds; demoting stays
        allowed (it loses nothing). `never_drop`: drop nothing at all, only demote. With tenants'
        capacity shares, what may make room is decided by `_share_rules`."""
        if size > tier.capacity:
            return None  # evicting would lose everything and still not fit
        sole: set[Key] = set()  # blocks found to be the last copy, asked about once per allocation
        rules = self._share_rules(tier, tenant, size)

        def evict(enough, limit: int | None = None) -> int:
            evicted = 0
            for eligible in rules:
                evicted += self._evict(tier, enough, updates, None if limit is None else limit - evicted,
                                       keep_sole=keep_sole, sole=sole, never_drop=never_drop, eligible=eligible)
                if enough() or (limit is not None and evicted >= limit):
                    break
            return evicted

        if batch and tier.used + size > tier.high * tier.capacity:
            evict(lambda: tier.used + size <= tier.low * tier.capacity)
        offset = tier.allocator.allocate(size)
        while offset is None and evict(lambda: True, limit=1):
            offset = tier.allocator.allocate(size)
        return offset

    def _share_rules(self, tier: Tier, tenant: str, size: int) -> list[Callable[[Key, Slot], bool] | None]:
        """Which blocks may make room for `size` bytes of `tenant`'s in `tier`, pass by pass: with no
        capacity shares, any (one pass, no check). With shares: a tenant over its share (this block
        counted) evicts its own blocks first; then any block but those of another tenant that holds
        no more than its share (evicting one would take it below)."""
        shares = self.shares
        if not shares:
            return [None]
        capacity = tier.capacity
        held = tier.tenant_bytes

        def allowed(key: Key, slot: Slot) -> bool:
            owner = fingerprint_tenant(key[0])
            share = shares.get(owner) if owner and owner != tenant else None
            return share is None or held.get(owner, 0) - align_up(slot.span) >= share * capacity

        share = shares.get(tenant) if tenant else None
        if share is not None and held.get(tenant, 0) + align_up(size) > share * capacity:
            return [lambda key, slot: fingerprint_tenant(key[0]) == tenant, allowed]
        return [allowed]

    def _replicated(self, key: Key) -> bool:
        """Whether another live node holds the block (False when not known)."""
        try:
            return self.replicated is not None and bool(self.replicated(*key))
        except Exception:  # noqa: BLE001 - a mirror in trouble knows nothing: treat it as the last copy
            return False

    def _evict(self, tier: Tier, enough, updates: list[Update], limit: int | None = None,
               keep_sole: bool = False, sole: set[Key] | None = None, never_drop: bool = False,
               eligible: Callable[[Key, Slot], bool] | None = None) -> int:
        """Evict `tier`'s blocks in its policy's order until `enough()` (or `limit` blocks), only
        those `eligible` (all when None). DRAM blocks are demoted to NVMe where it can take them; a
        block that would be dropped goes first if another live node holds it: only when those do
        not make enough room are the sole copies dropped, in policy order, and never with
        `keep_sole`; with `never_drop`, nothing is dropped (only demoted)."""
        evicted = 0
        sole = set() if sole is None else sole
        demoting = tier is self.dram and self.nvme is not None
        rounds = (True,) if keep_sole else (True, False) if self.replicated is not None else (False,)
        for replicated_only in rounds:
            for key in tier.policy.victims():
                if enough() or (limit is not None and evicted >= limit):
                    return evicted
                slot = tier.sealed.get(key)
                if slot is None:
                    tier.policy.remove(key)
                    continue
                if eligible is not None and not eligible(key, slot):
                    continue
                if demoting and self._demote(slot, updates, keep_sole, never_drop=never_drop):
                    self._count(f"evictions_{tier.name}")
                    evicted += 1
                    continue
                if never_drop:
                    continue
                if replicated_only and (key in sole or not self._replicated(key)):
                    sole.add(key)
                    continue  # the last copy in the cluster: only if nothing else makes room
                self._drop(slot)
                updates.append((key[0], key[1], None))
                self._count(f"evictions_{tier.name}")
                if not replicated_only and self.replicated is not None:
                    self._count("sole_copies_evicted")
                evicted += 1
            if enough():
                break
        return evicted

    def _drop(self, slot: Slot) -> None:
        tier = slot.tier
        if tier is self.dram:  # before the extent can be handed out again (kvstore.seals)
            self.seals.cleared(slot.offset)
        tier.let_go(slot.key)
        tier.policy.remove(slot.key)
        tier.allocator.release(slot.offset, slot.span)
        if tier is self.nvme:
            self._uncoded.pop(slot.key, None)
            if self.journal is not None:
                self.journal.delete(slot.key[0], slot.key[1], slot.offset)

    def _seal_nvme(self, slot: Slot, updates: list[Update]) -> None:
        """`slot` (its bytes on the NVMe tier, checked) becomes the block's NVMe copy (lock held)."""
        nvme = self.nvme
        nvme.keep(slot)
        nvme.policy.insert(slot.key)
        if self.journal is not None:
            self.journal.put(slot.key[0], slot.key[1], slot.offset, slot.size, slot.span, slot.codec, slot.digest)
        if self._chooser is not None and not slot.codec:
            self._uncoded[slot.key] = slot
            self.tier_work.set()
        updates.append((slot.key[0], slot.key[1], slot.record()))

    def _demote(self, slot: Slot, updates: list[Update], keep_sole: bool = False, batch: bool = True,
                never_drop: bool = False) -> bool:
        """Copy a sealed DRAM block to NVMe, then drop its DRAM copy; False (nothing changed) when
        NVMe has no room for it (as `_allocate` makes room) or the copy failed."""
        nvme = self.nvme
        offset = self._allocate(nvme, slot.size, updates, keep_sole, batch, never_drop, fingerprint_tenant(slot.key[0]))
        if offset is None:
            return False
        try:
            self.engine.transfer([Write(slot.tier.region, slot.offset, nvme.region, offset, slot.size)])
        except TransferError:
            nvme.allocator.release(offset, slot.size)
            self._count("io_errors")
            return False
        self._drop(slot)
        self._seal_nvme(Slot(slot.key, nvme, offset, slot.size, slot.digest, held_since=slot.held_since), updates)
        self._count("demotions")
        return True

    def _read_nvme(self, offset: int, size: int) -> bytes:
        """A copy of `size` bytes of the NVMe tier at `offset` (through the engine; no lock needed)."""
        scratch = self.engine.register(bytearray(size), remote_access=False)
        try:
            self.engine.transfer([Read(scratch, 0, self.nvme.region, offset, size)])
            return bytes(scratch.buffer)
        finally:
            self.engine.unregister(scratch)

    def _raw_bytes(self, slot: Slot, stored: bytes) -> bytes | None:
        """A slot's raw bytes from what it stores (decoded when coded); None when that does not decode."""
        if not slot.codec:
            return stored
        try:
            return bytes(decode(stored, slot.codec, slot.size))
        except CodecError:
            return None

    def _promote(self, slot: Slot, updates: list[Update]) -> None:
        """Move an NVMe block that was hit back to DRAM, checking its bytes on the way. Only into
        free DRAM: a promotion never pushes other blocks down."""
        dram = self.dram
        if dram.used + slot.size > dram.high * dram.capacity:
            return
        offset = dram.allocator.allocate(slot.size)
        if offset is None:
            return
        view = dram.region.buffer[offset : offset + slot.size]
        try:
            if slot.codec:
                raw = self._raw_bytes(slot, self._read_nvme(slot.offset, slot.span))
                if raw is not None:
                    view[:] = raw
            else:
                raw = b""
                self.engine.transfer([Read(dram.region, offset, slot.tier.region, slot.offset, slot.size)])
        except TransferError:
            dram.allocator.release(offset, slot.size)
            self._count("io_errors")
            return
        self._drop(slot)
        if raw is None or block_digest(slot.key[1], view) != slot.digest:
            dram.allocator.release(offset, slot.size)
            self._count("corrupt_blocks_nvme")
            updates.append((slot.key[0], slot.key[1], None))
            return
        moved = Slot(slot.key, dram, offset, slot.size, slot.digest, held_since=slot.held_since)
        dram.keep(moved)
        self._number(moved)  # its bytes were checked on the way up
        dram.policy.insert(slot.key)
        updates.append((slot.key[0], slot.key[1], moved.record()))
        self._count("promotions")

    def set_policy(self, name: str | None, high: float | None, low: float | None) -> None:
        """Change the eviction policy and watermarks at run time (keeps every block)."""
        with self.lock:
            new_high = high if high else self.dram.high
            new_low = low if low else self.dram.low
            if not 0 < new_low <= new_high <= 1:
                raise ValueError(f"watermarks need 0 < low <= high <= 1, got low={new_low} high={new_high}")
            policies = {t.name: make_policy(name) for t in self.tiers} if name else None
            for tier in self.tiers:
                tier.high, tier.low = new_high, new_low
                if policies:
                    tier.policy = policies[tier.name]
                    for key in tier.sealed:  # old order is lost; every block starts equal
                        tier.policy.insert(key)

    def tenant_usage(self) -> list[tuple[str, str, int, int | None]]:
        """(tenant, tier, bytes its sealed blocks take, its share in bytes or None) of every tenant
        with a share or with blocks here."""
        with self.lock:
            return [(tenant, tier.name, tier.tenant_bytes.get(tenant, 0),
                     None if tenant not in self.shares else int(self.shares[tenant] * tier.capacity))
                    for tier in self.tiers for tenant in sorted(self.shares.keys() | tier.tenant_bytes.keys())]
