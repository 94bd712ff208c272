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
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from transfer import Engine, Read, Region, TransferError, Write

from ..errors import AllocationFailed, InvalidRequest, NodeRefused, WrongSize
from ..codec import Chooser, CodecError, check_codec, decode
from ..index.records import MAX_BLOCK_BYTES, NAME, NAME_RULE, BlockRecord
from ..integrity import block_digest, block_digests, check_digests
from ..keys import fingerprint_tenant
from ..seals import ALIGN, SealTable
from ..tiers import EvictionPolicy, ExtentAllocator, make_policy
from ..tiers.allocator import align_up
from ..tiers.journal import LABEL_BYTES, Entry, TierJournal

log = logging.getLogger(__name__)
Key = tuple[str, bytes]  # (fingerprint, block hash)
Update = tuple[str, bytes, BlockRecord | None]
LOCK_SPAN = 4096  # blocks a lookup, touch or remove handles per hold of the lock: a huge one delays a put by one span
WRITTEN_MAX = 256 << 20  # bytes committed but not verified yet; past it a commit verifies at once (backpressure)
# A reserve that only written blocks stand in the way of waits up to this long for the verifier to
# seal them (then they can be evicted) before it is refused: on a busy host the BLAKE3 pass can lag a
# burst of large puts into a small DRAM tier.
WRITTEN_WAIT_S = 2.0
# Smaller commits verify at once even when asked to verify later: their pass is shorter than handing
# them to the verifier thread (paired A/B, same host: a lone 64 KiB or 1 MiB put 7-16 % slower
# handed over, 32 x 64 KiB 28 % faster).
VERIFY_LATER_MIN = 2 << 20
LEASE_MAX_SLOTS = 4096  # slots one lease is granted at most (a larger ask is granted this many)
LEASE_SHARE = 8  # one lease takes at most 1/LEASE_SHARE of DRAM
LEASES_SHARE = 4  # all leases together hold at most 1/LEASES_SHARE of DRAM
UNNAMED = b""  # the hash of a leased slot until a commit names its block
STILL_LANDING = "its bytes were still arriving when it was committed (the slot is held until they stop)"


def _spans(hashes: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
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


class BlockStore:
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

    def _unverified_bytes(self, aligned: bool = False) -> int:
        """Bytes of blocks committed but not verified yet (written or being verified); `aligned`:
        the space their slots take."""
        return sum(align_up(slot.size) if aligned else slot.size
                   for slots in (self._written, self._verifying) for slot in slots.values())

    def _room(self) -> int:
        """DRAM that new slots may take (lock held): all of it but what puts in flight, written
        blocks and fenced slots hold, none of which evicting can free."""
        return self.dram.capacity - sum(align_up(slot.size) for slots in (self._pending, self._written,
                                                                        self._verifying)
                                        for slot in slots.values()) \
            - sum(align_up(slot.size) for _, slot in self._fenced)

    def _held(self, key: Key) -> Slot | None:
        """The block's slot, sealed or written (awaiting or under verification)."""
        return self.find(key) or self._written.get(key) or self._verifying.get(key)

    def records(self, fingerprint: str, hashes: Sequence[bytes]) -> list[BlockRecord | None]:
        """Where this node holds each block now (None where it does not)."""
        out: list[BlockRecord | None] = []
        for span in _spans(hashes):
            with self.lock:
                slots = [self.find((fingerprint, bytes(h))) for h in span]  # never an unverified one
                out.extend(None if s is None else s.record() for s in slots)
        return out

    # --- writes -------------------------------------------------------------------------------
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

    def stop_taking(self, timeout: float) -> bool:
        """Refuse every reserve, lease and commit from now on (a drain's last look), once the
        commits verifying off the lock now have sealed; whether they did within `timeout`."""
        with self.lock:
            self.taking_blocks = False
            return self._commits_quiet.wait_for(lambda: not self._verifying_commits, timeout)

    def _check_taking(self) -> None:
        if not self.taking_blocks:
            raise NodeRefused("this node was drained: it takes no blocks (put them on another node)")

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

    def put_inline(self, fingerprint: str, hashes: Sequence[bytes], payloads: Sequence, digests: Sequence[bytes],
                   verify: bool = True, repair: bool = False
                   ) -> tuple[list[str], list[BlockRecord | None], list[Update], int]:
        """Reserve (`repair` as for reserve), copy in and commit (`verify` as for commit) blocks whose
        bytes came with the request, in one call. Returns what `commit_reserved` does, with the
        reserve's updates too."""
        if not (len(hashes) == len(payloads) == len(digests)):
            raise WrongSize(f"{len(hashes)} hashes, {len(payloads)} payloads, {len(digests)} digests")
        slots, updates = self.reserve(fingerprint, hashes, [len(p) for p in payloads], repair=repair)
        arena = self.dram.region.buffer
        for (_, slot), payload in zip(slots, payloads):
            if slot is not None:
                arena[slot.offset : slot.offset + slot.size] = payload
        errors, records, sealed, stored = self.commit_reserved(fingerprint, hashes, slots, digests, verify)
        return errors, records, updates + sealed, stored

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

    # --- write grants (lock held) -----------------------------------------------------------
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

    # --- space --------------------------------------------------------------------------------
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

    def _number(self, slot: Slot) -> None:
        """A DRAM slot whose bytes were verified just now is sealed: give it a seal number, unless
        it lies on tainted units (lock held)."""
        first, last = slot.offset // ALIGN, (slot.offset + max(slot.size, 1) - 1) // ALIGN
        if self._tainted.find(1, first, last + 1) >= 0:
            self.seals.cleared(slot.offset)
        else:
            self.seals.sealed(slot.offset)

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
        self._seal_nvme(Slot(slot.key, nvme, offset, slot.size, slot.digest), updates)
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
        moved = Slot(slot.key, dram, offset, slot.size, slot.digest)
        dram.keep(moved)
        self._number(moved)  # its bytes were checked on the way up
        dram.policy.insert(slot.key)
        updates.append((slot.key[0], slot.key[1], moved.record()))
        self._count("promotions")

    # --- reads and removal ----------------------------------------------------------------------
    def _touch(self, key: Key) -> Slot | None:
        slot = self.find(key)
        if slot is not None:
            slot.tier.policy.touch(key)
        return slot

    def touch(self, fingerprint: str, hashes: Sequence[bytes], corrupt: Sequence[bytes] = ()) -> list[Update]:
        """Record client hits (promoting NVMe hits) and check blocks a client found corrupt."""
        updates: list[Update] = []
        for span in _spans(hashes):
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

    def remove(self, fingerprint: str, hashes: Sequence[bytes]) -> tuple[int, list[Update]]:
        updates: list[Update] = []
        for span in _spans(hashes):
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

    # --- a persistent NVMe tier: restore, persist, journal -----------------------------------------
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

    # --- --disk-codec: NVMe blocks coded in the background -----------------------------------------
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
                new = Slot(slot.key, nvme, offset, slot.size, slot.digest, codec=codec, stored=len(frame))
                nvme.keep(new)  # its place in the eviction order stays
                if self.journal is not None:  # the new place first: the old one is superseded by it
                    self.journal.put(slot.key[0], slot.key[1], offset, slot.size, len(frame), codec, slot.digest)
                nvme.allocator.release(slot.offset, slot.size)
                updates.append((slot.key[0], slot.key[1], new.record()))
                self._count("disk_codec_coded_blocks")
                self._count("disk_codec_saved_bytes", align_up(slot.size) - align_up(len(frame)))
        with self.lock:
            return updates, len(self._uncoded)

    def tenant_usage(self) -> list[tuple[str, str, int, int | None]]:
        """(tenant, tier, bytes its sealed blocks take, its share in bytes or None) of every tenant
        with a share or with blocks here."""
        with self.lock:
            return [(tenant, tier.name, tier.tenant_bytes.get(tenant, 0),
                     None if tenant not in self.shares else int(self.shares[tenant] * tier.capacity))
                    for tier in self.tiers for tenant in sorted(self.shares.keys() | tier.tenant_bytes.keys())]

    def all_records(self) -> list[Update]:
        """Every sealed block as an update (republishing after a lost lease)."""
        with self.lock:
            return [(k[0], k[1], s.record()) for tier in self.tiers for k, s in tier.sealed.items()]


def _still_landing(errors: list[str], landing: list[int]) -> list[str]:
    for i in landing:
        errors[i] = STILL_LANDING
    return errors


def _new_token(pending: dict) -> int:
    """An unguessable reservation token: a client that could guess another's could abort or commit
    it while that client's bytes are still arriving, and they would land in space given to others."""
    while True:
        token = secrets.randbits(63) or 1
        if token not in pending:
            return token
