"""Where a get's bytes land and whether they are the block's: digests of what landed in the
caller's segments (taken wave by wave as a large read lands, on the digest pool), reads in stages (a
consumer may use a stage as soon as it lands), same-host NVMe reads straight from a node's tier file,
each block's digest taken by the worker that read it, and the same-host DRAM slots this client
verified already, whose bytes a re-read need not hash again where the operator trusts the host's
memory and processes (VerifiedSlots, KVSTORE_VERIFY=once)."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from transfer import Engine, Read, Region, UnsupportedBuffer

from ..errors import InvalidConfig
from ..index.records import BlockRecord
from ..integrity import Digesting, block_digests, digest_state
from ..seals import SealView
from .local_node import TierFile, read_block

log = logging.getLogger(__name__)

TIER_READ_DEPTH = 8  # NVMe blocks of one get read at once from a tier file
# A large read is submitted in waves of at least this many bytes (at most MAX_WAVES of them), so
# that the blocks of one wave are hashed while the next is copied.
WAVE_BYTES = 4 << 20
MAX_WAVES = 8
VERIFIED_SLOTS = 1 << 16  # same-host DRAM slots a client remembers having verified
# "every-read" (the default): every block of every read is hashed. "once": a same-host re-read of a
# DRAM slot this client verified, whose seal number still holds, is not (VerifiedSlots).
VERIFY_ENV = "KVSTORE_VERIFY"
VERIFY_MODES = ("every-read", "once")

Segments = list[tuple[Region, int, int]]  # a block's destination: (region, offset, length) in order


def landed_parts(record: BlockRecord, segments: Segments) -> list[memoryview]:
    """The views of a block's bytes where a read of `record` left them, in order."""
    parts, done = [], 0
    for region, offset, length in segments:
        take = min(length, record.size - done)
        if take <= 0:
            break
        parts.append(region.host_view()[offset : offset + take])
        done += take
    return parts


def landed_digests(hashes: Sequence[bytes], items: list[tuple[int, BlockRecord]],
                   targets: list[Segments]) -> list[tuple[int, bytes]]:
    """(index, digest) of the bytes a read left in each block's destination segments."""
    blocks = [landed_parts(record, targets[i]) for i, record in items]
    return list(zip((i for i, _ in items), block_digests([bytes(hashes[i]) for i, _ in items], blocks)))


class VerifiedSlots:
    """Same-host DRAM slots whose bytes this client verified, with the seal number (kvstore.seals)
    each held then. With KVSTORE_VERIFY=once, a re-read that finds the same number before and after
    its copy skips the hash.

    Why that is safe: numbers are never reused and a slot's number is cleared before its extent can
    be handed out again, so an unchanged number means the slot was never freed between this
    client's check and the end of the copy: no write of a put (or a promotion) can have landed in
    it, and a slot that an expired same-host write could still reach is never numbered
    (kvstore.seals). Its bytes are then the ones this client hashed and found to be the block's.
    A slot evicted and reused
    meanwhile, for another block or the same one, has another number (or none): it is hashed, and
    another block's bytes are a miss as before. A number is remembered only when it was the same
    before and after the verified copy (a reseal during the copy is never trusted later).

    What it cannot see (kvstore.seals), and why it is not the default: bytes changed in place after
    this client's first read, by a process of the daemon's user (which maps the arena to put, and
    may write any slot of it, or the arena's file through /proc) or by a flipped bit. Only a hash
    sees those, and the store promises that a get never returns bytes other than the block's. Where
    the host's memory and its processes are trusted, "once" makes re-reads cost a copy."""

    def __init__(self, limit: int = VERIFIED_SLOTS, mode: str | None = None) -> None:
        if mode is None:
            mode = os.environ.get(VERIFY_ENV) or VERIFY_MODES[0]
        if mode not in VERIFY_MODES:
            raise InvalidConfig(f"{VERIFY_ENV}={mode[:40]!r}: one of {', '.join(VERIFY_MODES)}")
        self.enabled = mode == "once"
        self._limit = limit
        self._slots: OrderedDict[tuple[int, int, int], tuple[int, int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(view: SealView, record: BlockRecord) -> tuple[int, int, int]:
        return view.incarnation, record.region, record.offset

    def trusted(self, view: SealView, record: BlockRecord, number: int) -> bool:
        """Whether this client verified `record`'s slot under seal `number` (read just before the copy)."""
        if not number or not self.enabled:
            return False
        with self._lock:
            return self._slots.get(self._key(view, record)) == (number, record.size, record.digest)

    def remember(self, view: SealView, record: BlockRecord, number: int) -> None:
        """`record`'s slot verified under seal `number` (the same before and after the copy)."""
        if not number or not self.enabled:
            return
        key = self._key(view, record)
        with self._lock:
            self._slots[key] = (number, record.size, record.digest)
            self._slots.move_to_end(key)
            while len(self._slots) > self._limit:
                self._slots.popitem(last=False)


def read_in_waves(engine: Engine, deadline: float, ops: list[Read], owners: list[int],
                  records: dict[int, BlockRecord], hashes: Sequence[bytes], targets: list[Segments],
                  skip: set[int], on_submitted: Callable[[], None] | None = None) -> tuple[list, list[int], dict]:
    """Run `ops` (grouped by block, in block order) in waves, hashing each wave's blocks (but those
    in `skip`) on the digest pool while later waves are copied. `on_submitted` runs once every wave
    is under way (other reads overlap them there). Returns (results, their owners, {index: digest})."""
    total = sum(op.length for op in ops)
    if all(i in skip for i in owners):  # nothing to hash: one batch (each wave's wait would poll)
        batch = engine.submit(ops)
        if on_submitted is not None:
            on_submitted()
        return batch.wait(max(0.0, deadline - time.monotonic()), raise_on_error=False), list(owners), {}
    wave_bytes = max(WAVE_BYTES, total // MAX_WAVES + 1)
    waves: list[list[int]] = [[]]
    size = 0
    for k, op in enumerate(ops):
        if size >= wave_bytes and owners[k] != owners[k - 1]:  # a block's ops stay in one wave
            waves.append([])
            size = 0
        waves[-1].append(k)
        size += op.length
    batches = [(wave, engine.submit([ops[k] for k in wave])) for wave in waves if wave]
    if on_submitted is not None:
        on_submitted()
    digesting = Digesting()
    results, ordered = [], []
    for wave, batch in batches:
        landed = batch.wait(max(0.0, deadline - time.monotonic()), raise_on_error=False)
        results.extend(landed)
        ordered.extend(owners[k] for k in wave)
        failed = {owners[k] for k, result in zip(wave, landed) if not result.ok}
        blocks = list(dict.fromkeys(owners[k] for k in wave))
        digesting.add([(i, bytes(hashes[i]), landed_parts(records[i], targets[i]))
                       for i in blocks if i not in failed and i not in skip])
    return results, ordered, digesting.results()


def read_in_stages(engine: Engine, timeout: float, ops: list[Read], owners: list[int], op_stages: list[int],
                   on_stage: Callable[[int], None], hashes: Sequence[bytes],
                   checked: dict[int, bytes], skip: set[int] = frozenset()) -> tuple[list, list[int]]:
    """Run `ops` one stage after another, hashing what landed (but blocks in `skip`) before telling
    `on_stage`; (results, owners) in the order run, each hashed block's digest into `checked`."""
    results, ordered = [], []
    states: dict[int, Any] = {}
    by_stage: dict[int, list[int]] = {}
    for k, stage in enumerate(op_stages):
        by_stage.setdefault(stage, []).append(k)
    for stage, chosen in sorted(by_stage.items()):
        landed = engine.submit([ops[k] for k in chosen]).wait(timeout, raise_on_error=False)
        for k, result in zip(chosen, landed):
            op, i = ops[k], owners[k]
            if i in skip:
                continue
            state = states.get(i)
            if state is None:
                state = states[i] = digest_state(bytes(hashes[i]))
            if result.ok:  # a failed op fails its block anyway
                state.update(op.local.host_view()[op.local_offset : op.local_offset + op.length])
        results.extend(landed)
        ordered.extend(owners[k] for k in chosen)
        on_stage(stage)
    checked.update((i, state.digest()) for i, state in states.items())
    return results, ordered


class TierReads:
    """Reads NVMe blocks from same-host nodes' tier fds, several at once (its workers start on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def read(self, tier: TierFile, items: list[tuple[int, BlockRecord]], targets: list[Segments],
             hashes: Sequence[bytes]) -> dict[int, bytes]:
        """{index: digest of what landed} for the blocks read whole. Each worker hashes its block as
        soon as it lands, so hashing overlaps the other workers' reads instead of following them
        all. The digest is also what makes these reads safe while the node evicts and reuses an
        extent: another block's bytes (or a half-written slot) never match this block's digest."""
        def one(item: tuple[int, BlockRecord]) -> bytes | None:
            i, record = item
            try:
                if not read_block(tier, record, targets[i]):
                    return None
                return landed_digests(hashes, [item], targets)[0][1]
            except (OSError, UnsupportedBuffer, ValueError) as exc:
                log.debug("tier read of block %d failed: %s", i, exc)
                return None

        with self._lock:
            if self._pool is None and len(items) > 1 and not self._closed:
                self._pool = ThreadPoolExecutor(TIER_READ_DEPTH, thread_name_prefix="kvs-tier")
            pool = self._pool
        sums = list(pool.map(one, items)) if pool is not None and len(items) > 1 else [one(item) for item in items]
        return {i: digest for (i, _), digest in zip(items, sums) if digest is not None}

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)
