"""Slots and write grants of a store daemon (a part of `BlockStore`): reservations for blocks
about to be written, slots leased for a client's next put, the engine grants that let only that
client's engine write them while they are pending, their expiry, abort and fencing, and the end of
taking blocks when a drain is over. See `kvstore.daemon.store` for the rules they keep."""
from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Iterable, Sequence

from transfer import TransferError

from ..errors import AllocationFailed, InvalidRequest, NodeRefused, WrongSize
from ..index.records import MAX_BLOCK_BYTES, NAME, NAME_RULE
from ..keys import fingerprint_tenant
from ..seals import ALIGN
from ..tiers.allocator import align_up
from .slot import Slot, Update

log = logging.getLogger("kvstore.daemon.store")  # the store's one logger, whichever part speaks

# A reserve that only written blocks stand in the way of waits up to this long for the verifier to
# seal them (then they can be evicted) before it is refused: on a busy host the BLAKE3 pass can lag a
# burst of large puts into a small DRAM tier.
WRITTEN_WAIT_S = 2.0
LEASE_MAX_SLOTS = 4096  # slots one lease is granted at most (a larger ask is granted this many)
LEASE_SHARE = 8  # one lease takes at most 1/LEASE_SHARE of DRAM
LEASES_SHARE = 4  # all leases together hold at most 1/LEASES_SHARE of DRAM
UNNAMED = b""  # the hash of a leased slot until a commit names its block


class SlotGrants:
    """BlockStore's slots and write grants (lock held where a method says so)."""

    def _room(self) -> int:
        """DRAM that new slots may take (lock held): all of it but what puts in flight, written
        blocks and fenced slots hold, none of which evicting can free."""
        return self.dram.capacity - sum(align_up(slot.size) for slots in (self._pending, self._written,
                                                                        self._verifying)
                                        for slot in slots.values()) \
            - sum(align_up(slot.size) for _, slot in self._fenced)

    def reserve(self, fingerprint: str, hashes: Sequence[bytes], sizes: Sequence[int], peer: str = "",
                repair: bool = False, writer: Any = None) -> tuple[list[tuple[int, Slot | None]], list[Update]]:
        """A (token, slot) per block to write; token 0 and slot None where it is already sealed here.
        `peer`: the client engine's peer id, granted writes into the new slots while they are pending.
        `repair`: the blocks are repair copies (another node's replicas): they take free space, or
        room made by demoting or by evicting blocks another live node holds, never a sole copy's."""
        if len(hashes) != len(sizes):
            raise WrongSize(f"{len(hashes)} hashes but {len(sizes)} sizes")
        if not isinstance(fingerprint, str) or not NAME.fullmatch(fingerprint):
            raise InvalidRequest(f"fingerprint {str(fingerprint)[:80]!r} must be {NAME_RULE}")
        for size in sizes:
            if not 0 < size <= MAX_BLOCK_BYTES:
                raise WrongSize(f"block size {size} outside 1..{MAX_BLOCK_BYTES}")
        out: list[tuple[int, Slot | None]] = []
        updates: list[Update] = []
        tenant = fingerprint_tenant(fingerprint)
        with self.lock:
            self._expire_reservations()
            self._check_taking()
            # What the new slots take (4 KiB each at least), beside what puts in flight and written
            # blocks hold: evicting cannot free those. Blocks held here already take nothing (looked up
            # only when it matters).
            room = self._room()
            need = sum(align_up(size) for size in sizes)
            if need > room:
                need = sum(align_up(size) for h, size in zip(hashes, sizes)
                           if self._held((fingerprint, bytes(h))) is None)
            if room < need <= room + self._unverified_bytes(aligned=True):  # the verifier's to free
                self._verified.wait_for(lambda: self._room() >= need or not self._unverified_bytes(), WRITTEN_WAIT_S)
                self._check_taking()  # the lock was let go meanwhile: a drain may have ended puts
                room = self._room()
            if need > room:  # could never fit: refuse before evicting anything
                self._count("allocation_failures_dram")
                raise AllocationFailed(f"{need} bytes of slots cannot fit in {self.dram.capacity} bytes of DRAM "
                                       f"({self.dram.capacity - room} held by puts in flight)")
            for block_hash, size in zip(hashes, sizes):
                key = (fingerprint, bytes(block_hash))
                if self._held(key) is not None:
                    self._touch(key)
                    out.append((0, None))
                    continue
                # A repair copy takes free room (or room made by demoting), never a dropped block:
                # one that evicted another replica would only make the next repair, without end.
                offset = self._allocate(self.dram, size, updates, keep_sole=repair, never_drop=repair, tenant=tenant)
                if offset is None:
                    for token, slot in out:  # all or nothing
                        if slot is not None:
                            self._pending.pop(token, None)
                            self.dram.allocator.release(slot.offset, slot.size)
                    self._count("allocation_failures_dram")
                    if repair:
                        self._count("repair_copies_refused")
                        raise AllocationFailed(f"no free room for a {size}-byte repair copy (a repair copy never "
                                               "evicts a block)", updates)
                    within = " (the rest is held by tenants within their capacity shares)" if self.shares else ""
                    raise AllocationFailed(f"no room for a {size}-byte block in {self.dram.capacity} bytes of DRAM"
                                           f"{within}", updates)
                slot = Slot(key, self.dram, offset, size, writer=None if peer else writer)
                token = _new_token(self._pending)
                self._pending[token] = slot
                out.append((token, slot))
            for _, slot in out:
                if slot is not None:
                    self._grant(slot, peer)
        return out, updates

    @staticmethod
    def _check_lease(size: int, count: int) -> None:
        """Refuse a lease request that could never be granted."""
        if count < 0:
            raise InvalidRequest(f"a lease of {count} slots")
        if count and not 0 < size <= MAX_BLOCK_BYTES:
            raise WrongSize(f"block size {size} outside 1..{MAX_BLOCK_BYTES}")

    def lease(self, fingerprint: str, size: int, count: int, peer: str = "", writer: Any = None
              ) -> list[tuple[int, Slot]]:
        """Up to `count` slots of `size` bytes for blocks not named yet (a client's next put:
        written before their commit names them, saving that put its reserve), as (token, slot).
        Taken from free space below the high watermark only, so a lease never evicts, and within
        a share of DRAM per lease and for all leases together: it may come back short or empty.
        Held, expired and granted to `peer` like reservations."""
        if not isinstance(fingerprint, str) or not NAME.fullmatch(fingerprint):
            raise InvalidRequest(f"fingerprint {str(fingerprint)[:80]!r} must be {NAME_RULE}")
        self._check_lease(size, count)
        if not count:
            return []
        tier, out, need = self.dram, [], align_up(size)
        with self.lock:
            self._expire_reservations()
            if not self.taking_blocks:
                return []
            leased = sum(align_up(slot.size) for slot in self._pending.values() if slot.key[1] == UNNAMED)
            count = min(count, LEASE_MAX_SLOTS, tier.capacity // LEASE_SHARE // need,
                        max(0, tier.capacity // LEASES_SHARE - leased) // need)
            for _ in range(count):
                if tier.used + need > tier.high * tier.capacity:
                    break
                offset = tier.allocator.allocate(size)
                if offset is None:
                    break
                token = _new_token(self._pending)
                self._pending[token] = Slot((fingerprint, UNNAMED), tier, offset, size,
                                            writer=None if peer else writer)
                self._grant(self._pending[token], peer)
                out.append((token, self._pending[token]))
            self._count("leased_slots", len(out))
        return out

    def stop_taking(self, timeout: float) -> bool:
        """Refuse every reserve, lease and commit from now on (a drain's last look), once the
        commits verifying off the lock now have sealed; whether they did within `timeout`."""
        with self.lock:
            self.taking_blocks = False
            return self._commits_quiet.wait_for(lambda: not self._verifying_commits, timeout)

    def _check_taking(self) -> None:
        if not self.taking_blocks:
            raise NodeRefused("this node was drained: it takes no blocks (put them on another node)")

    def abort(self, tokens: Iterable[int]) -> None:
        with self.lock:
            for token in tokens:
                slot = self._pending.pop(token, None)
                if slot is not None:
                    self._free_unsealed(slot)

    def _expire_reservations(self) -> None:
        cutoff = time.monotonic() - self.reservation_timeout
        for token in [t for t, s in self._pending.items() if s.reserved_at < cutoff]:
            self._expired(self._pending.pop(token))
        if any(writer is not None and writer.gone() for writer, _, _ in self._taints):
            # A writer that has exited writes no more: its units may be trusted again (once resealed).
            self._taints = [t for t in self._taints if t[0] is None or not t[0].gone()]
            self._tainted = bytearray(self.seals.units)
            for _, first, last in self._taints:
                self._tainted[first : last + 1] = b"\1" * (last + 1 - first)
        if self._fenced:  # space held back for writes that were still landing: back once they stopped
            still = []
            for peer, slot in self._fenced:
                if self.engine.landing(peer, slot.tier.region, slot.offset, slot.size):
                    still.append((peer, slot))
                else:
                    slot.tier.allocator.release(slot.offset, slot.size)
            self._fenced = still

    def _grant(self, slot: Slot, peer: str) -> None:
        """Let the engine `peer` write `slot` while it is pending (the DRAM region takes remote writes
        only where granted; a region that takes them from anyone needs no grant)."""
        if not peer or slot.tier.region.remote_writes != "granted":
            return
        try:
            self.engine.grant(peer, slot.tier.region, slot.offset, slot.size)
        except TransferError as exc:  # a grant left behind would be a bug: its client's write is refused
            log.error("cannot grant a %d-byte slot at %d to %s: %s", slot.size, slot.offset, peer, exc)
            return
        slot.peer = peer

    def _ungrant(self, slot: Slot) -> bool:
        """Revoke `slot`'s grant as it leaves the pending set. False when a write of its peer still
        lands in it: the slot is fenced (its space back only once that write is over)."""
        if not slot.peer:
            return True
        peer, slot.peer = slot.peer, ""
        if self.engine.revoke(peer, slot.tier.region, slot.offset, slot.size):
            return True
        self._count("fenced_slots")
        self._fenced.append((peer, slot))
        return False

    def _expired(self, slot: Slot) -> None:
        """A pending slot whose reservation or lease ran out (lock held). A same-host writer maps the
        arena and writes without a grant: its write may still land, after this extent went to another
        block that was verified and sealed, where no seal number would show it (kvstore.seals). So
        the extent's units are tainted until that writer's process has exited (for good when the
        writer is not known); its space goes back now (a reader that hashes sees any late bytes)."""
        if not slot.peer and slot.tier is self.dram:
            first, last = slot.offset // ALIGN, (slot.offset + slot.size - 1) // ALIGN
            self._taints.append((slot.writer, first, last))
            self._tainted[first : last + 1] = b"\1" * (last + 1 - first)
            self._count("tainted_units", last + 1 - first)
        self._free_unsealed(slot)  # granted: the engine's revoke fences a write still landing

    def _free_unsealed(self, slot: Slot) -> None:
        """A pending slot given up (aborted, expired): its space back, once no granted write lands in it."""
        if self._ungrant(slot):
            self.dram.allocator.release(slot.offset, slot.size)


def _new_token(pending: dict) -> int:
    """An unguessable reservation token: a client that could guess another's could abort or commit
    it while that client's bytes are still arriving, and they would land in space given to others."""
    while True:
        token = secrets.randbits(63) or 1
        if token not in pending:
            return token
