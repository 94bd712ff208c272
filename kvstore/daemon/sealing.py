"""Sealing and verification of a store daemon's blocks (a part of `BlockStore`): commits that check
each block's bytes against the digest its writer sent and seal those that match (or take them as
written, to be verified by `seal_written` before anything lists them), inline puts, seal numbers
for same-host readers, and checks of a sealed block's bytes."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

from ..errors import InvalidRequest, WrongSize
from ..index.records import BlockRecord
from ..integrity import block_digest, block_digests, check_digests
from ..seals import ALIGN
from ..tiers.allocator import align_up
from .grants import UNNAMED
from .slot import Key, Slot, Update

WRITTEN_MAX = 256 << 20  # bytes committed but not verified yet; past it a commit verifies at once (backpressure)
# Smaller commits verify at once even when asked to verify later: their pass is shorter than handing
# them to the verifier thread (paired A/B, same host: a lone 64 KiB or 1 MiB put 7-16 % slower
# handed over, 32 x 64 KiB 28 % faster).
VERIFY_LATER_MIN = 2 << 20
STILL_LANDING = "its bytes were still arriving when it was committed (the slot is held until they stop)"


class Sealing:
    """BlockStore's commits, verification and sealing."""

    def _unverified_bytes(self, aligned: bool = False) -> int:
        """Bytes of blocks committed but not verified yet (written or being verified); `aligned`:
        the space their slots take."""
        return sum(align_up(slot.size) if aligned else slot.size
                   for slots in (self._written, self._verifying) for slot in slots.values())

    def commit_and_lease(self, fingerprint: str, tokens: Sequence[int], digests: Sequence[bytes], *,
                         lease_size: int, lease_count: int, records: list, fresh: list, verify: bool,
                         hashes: Sequence[bytes] | None, peer: str = "", writer: Any = None,
                         named: list | None = None) -> tuple[list[str], list[Update], list[tuple[int, Slot]]]:
        """`commit`, then `lease` slots for the put after it (a commit's lease request is checked
        before anything is committed, so a bad one takes nothing): (errors, updates, leased)."""
        self._check_lease(lease_size, lease_count)
        errors, updates = self.commit(fingerprint, tokens, digests, records, verify, hashes, fresh, named)
        return errors, updates, self.lease(fingerprint, lease_size, lease_count, peer, writer)

    def commit(self, fingerprint: str, tokens: Sequence[int], digests: Sequence[bytes],
               records: list | None = None, verify: bool = True,
               hashes: Sequence[bytes] | None = None, fresh: list | None = None,
               named: list | None = None) -> tuple[list[str], list[Update]]:
        """Seal reserved slots whose bytes match their digest; '' where sealed, else the reason.
        `records`, when given, gets each block's record here (None where not stored), and `named`
        each one's block hash (b"" where none: what a reply signs them as); `fresh` whether each
        block is new here ('' also answers a block another writer stored first).
        `verify=False`: take the client's digests now and verify later (`seal_written`), unless
        the blocks are fewer than VERIFY_LATER_MIN bytes or WRITTEN_MAX bytes already wait; '' then
        means written, and no updates come back for them. `hashes` (one per token) name the blocks
        written into leased slots; a reserved slot's must be the block it was reserved for."""
        if len(tokens) != len(digests) or (hashes is not None and len(hashes) != len(tokens)):
            raise WrongSize(f"{len(tokens)} tokens but {len(digests)} digests"
                            + ("" if hashes is None else f" and {len(hashes)} hashes"))
        if hashes is not None and any(len(h) != 16 for h in hashes):
            raise InvalidRequest("hashes: every hash is 16 bytes")
        digests = check_digests(digests)  # before anything is taken: a bad one would be sealed into no record
        if len(set(tokens)) != len(tokens):
            raise InvalidRequest("a token is committed at most once per commit")
        errors: list[str] = []
        out = records if records is not None else []
        with self.lock:
            if not self.taking_blocks:  # refused below; its writes are over (a commit follows them): slots back
                self.abort([t for t in tokens if t in self._pending and self._pending[t].key[0] == fingerprint])
            self._check_taking()
            # Popped, a slot is ours alone: expiry and eviction never see it, so its bytes can be
            # verified without the lock (blake3 releases the GIL as well).
            # A reservation made under another fingerprint is not this caller's: it stays pending.
            found = [self._pending.get(token) for token in tokens]
            found = [slot if slot is not None and slot.key[0] == fingerprint else None for slot in found]
            names = [None] * len(tokens) if hashes is None else [bytes(h) for h in hashes]
            for slot, name in zip(found, names):
                if slot is not None and not (name if slot.key[1] == UNNAMED else name in (None, slot.key[1])):
                    raise InvalidRequest("a leased slot is committed with the hash of its block, a reserved "
                                         "one with none or its own")  # before anything is taken
            slots = []
            landing = []  # slots a write of their peer still lands in: not verifiable, fenced
            for i, (token, slot, name) in enumerate(zip(tokens, found, names)):
                if slot is not None:
                    del self._pending[token]
                    if not self._ungrant(slot):
                        landing.append(i)
                        slot = None
                    elif slot.key[1] == UNNAMED:
                        slot.key = (fingerprint, name)
                slots.append(slot)
            if named is not None:
                named.extend(b"" if slot is None else slot.key[1] for slot in slots)
            mine = [slot for slot in slots if slot is not None]
            size = sum(slot.size for slot in mine)
            if not verify and VERIFY_LATER_MIN <= size and self._unverified_bytes() + size <= WRITTEN_MAX:
                self._seal([(slot, digest, None) for slot, digest in zip(slots, digests)], errors, out, fresh)
                self._has_written.notify_all()
                return _still_landing(errors, landing), []
            self._verifying_commits += 1
        try:
            try:
                actual = self._digests(mine)
            except BaseException:
                with self.lock:
                    for slot in mine:
                        self.dram.allocator.release(slot.offset, slot.size)
                raise
            with self.lock:
                updates = self._seal([(slot, digest, next(actual) if slot is not None else b"")
                                      for slot, digest in zip(slots, digests)], errors, out, fresh)
                return _still_landing(errors, landing), updates
        finally:
            with self.lock:
                self._verifying_commits -= 1
                self._commits_quiet.notify_all()

    def _digests(self, slots: list[Slot]) -> Iterator[bytes]:
        """The digests of DRAM slots' bytes as they are now (call without the lock)."""
        arena = self.dram.region.buffer
        return iter(block_digests([slot.key[1] for slot in slots],
                                    [arena[slot.offset : slot.offset + slot.size] for slot in slots]))

    def _seal(self, checked: list[tuple[Slot | None, bytes, bytes | None]], errors: list[str], out: list,
              fresh: list | None = None) -> list[Update]:
        """Seal each (slot, expected digest, digest of its bytes) that matches, or, where the
        bytes' digest is None (not checked yet), leave the slot written for seal_written (lock held).
        `fresh` gets whether each block is new here."""
        updates: list[Update] = []
        fresh = fresh if fresh is not None else []
        for slot, digest, landed in checked:
            fresh.append(False)
            if slot is None:
                errors.append("unknown or expired reservation")
                out.append(None)
                continue
            theirs = self.find(slot.key) if landed is not None else self._held(slot.key)
            if theirs is not None:  # another writer got there first (or a leased slot's block was here): keep theirs
                self.dram.allocator.release(slot.offset, slot.size)
                self._touch(slot.key)
                errors.append("")
                out.append(theirs.record())
                continue
            if landed is None:
                slot.digest = digest
                self._written[slot.key] = slot
                errors.append("")
                out.append(slot.record())
                fresh[-1] = True
                continue
            if landed != digest:
                self.dram.allocator.release(slot.offset, slot.size)
                self._count("corrupt_writes")
                errors.append("digest mismatch: the bytes that arrived are not the bytes sent")
                out.append(None)
                continue
            slot.digest = digest
            self.dram.keep(slot)
            self._number(slot)  # verified just now (`landed`)
            self.dram.policy.insert(slot.key)
            self._unwrite(slot.key)  # a verified copy wins over an unverified one: one copy per key
            updates.append((slot.key[0], slot.key[1], slot.record()))
            errors.append("")
            out.append(slot.record())
            fresh[-1] = True
        return updates

    def _unwrite(self, key: Key) -> bool:
        """Drop a written block's claim on `key` (lock held): a written slot is freed here, one being
        verified by its verifier. Whether there was one."""
        slot = self._written.pop(key, None)
        if slot is not None:
            self.dram.allocator.release(slot.offset, slot.size)
            return True
        return self._verifying.pop(key, None) is not None

    def wait_written(self, timeout: float) -> bool:
        """Wait up to `timeout` for committed blocks awaiting verification; whether there are any."""
        with self.lock:
            return self._has_written.wait_for(lambda: bool(self._written), timeout)

    def seal_written(self) -> list[Update]:
        """Verify every block committed with `verify=False` so far, in commit order: seal those
        whose bytes match (their index updates come back), drop the others (`corrupt_writes`)."""
        with self.lock:
            batch, self._written = list(self._written.values()), {}
            # Being verified, a slot is still held (reserve and records see it); a removal takes it
            # out of `_verifying`, and its slot is freed below instead of sealed.
            self._verifying.update((slot.key, slot) for slot in batch)
        if not batch:
            return []
        try:
            actual = self._digests(batch)
        except BaseException:
            with self.lock:
                for slot in batch:
                    if self._verifying.get(slot.key) is slot:
                        del self._verifying[slot.key]
                    self.dram.allocator.release(slot.offset, slot.size)
                self._verified.notify_all()
            raise
        with self.lock:
            checked = []
            for slot, landed in zip(batch, actual):
                if self._verifying.get(slot.key) is slot:
                    del self._verifying[slot.key]
                    checked.append((slot, slot.digest, landed))
                else:  # removed while it was being verified
                    self.dram.allocator.release(slot.offset, slot.size)
            updates = self._seal(checked, [], [])
            self._verified.notify_all()  # sealed blocks can be evicted: a waiting reserve may fit now
            return updates

    def commit_reserved(self, fingerprint: str, hashes: Sequence[bytes], slots: list[tuple[int, Slot | None]],
                        digests: Sequence[bytes], verify: bool) -> tuple[list[str], list[BlockRecord | None],
                                                                          list[Update], int]:
        """Commit the slots `reserve` gave for `hashes`, their bytes written (a block it found held
        here already gets its record). Returns (error or '' per block, record per block (None where
        not stored), index updates, how many blocks are new here)."""
        todo = [i for i, (_, slot) in enumerate(slots) if slot is not None]
        got: list = []
        fresh: list = []
        errors, updates = self.commit(fingerprint, [slots[i][0] for i in todo], [digests[i] for i in todo], got,
                                      verify, fresh=fresh)
        all_errors = [""] * len(hashes)
        records: list[BlockRecord | None] = [None] * len(hashes)
        for i, error, record in zip(todo, errors, got):
            all_errors[i], records[i] = error, record
        held = [i for i, (_, slot) in enumerate(slots) if slot is None]
        for i, record in zip(held, self.records(fingerprint, [hashes[i] for i in held])):
            records[i] = record
        return all_errors, records, updates, sum(fresh)

    def _number(self, slot: Slot) -> None:
        """A DRAM slot whose bytes were verified just now is sealed: give it a seal number, unless
        it lies on tainted units (lock held)."""
        first, last = slot.offset // ALIGN, (slot.offset + max(slot.size, 1) - 1) // ALIGN
        if self._tainted.find(1, first, last + 1) >= 0:
            self.seals.cleared(slot.offset)
        else:
            self.seals.sealed(slot.offset)

    def _slot_bytes(self, slot: Slot) -> bytes | None:
        """A copy of a slot's bytes (decoded when coded), wherever it lives; None when its frame
        does not decode (call with the lock held)."""
        if slot.tier is self.dram:
            return bytes(self.dram.region.buffer[slot.offset : slot.offset + slot.size])
        return self._raw_bytes(slot, self._read_nvme(slot.offset, slot.span))

    def _verify(self, slot: Slot) -> bool:
        data = self._slot_bytes(slot)
        return data is not None and block_digest(slot.key[1], data) == slot.digest

    def read_block(self, key: Key) -> bytes | None:
        """A copy of a sealed block's bytes, checked against its digest (None if gone or corrupt)."""
        with self.lock:
            slot = self.find(key)
            if slot is None:
                return None
            data = self._slot_bytes(slot)
            return data if data is not None and block_digest(key[1], data) == slot.digest else None


def _still_landing(errors: list[str], landing: list[int]) -> list[str]:
    for i in landing:
        errors[i] = STILL_LANDING
    return errors
