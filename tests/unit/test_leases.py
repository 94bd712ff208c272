"""Leased slots in one process: slots for a client's next put, taken from free space only, named by
the commit that fills them, held and expired like reservations."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.daemon.store import LEASE_MAX_SLOTS, BlockStore
from kvstore.errors import InvalidRequest, WrongSize
from kvstore.integrity import block_checksum
from kvstore.keys import ModelFingerprint, external_hashes
from transfer import Engine

FP = ModelFingerprint("m", "float16", 16, 2, 2, 64)
BLOCK = 64 * 1024


def content(block_hash: bytes, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(block_hash[:8], "little")).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def engine():
    with Engine("lease-unit", listen=None) as e:
        yield e


def fill(store: BlockStore, leased, hashes) -> list[int]:
    """Write each block into its leased slot; the checksums to commit."""
    for (_, slot), h in zip(leased, hashes):
        store.dram.region.buffer[slot.offset : slot.offset + slot.size] = content(h, slot.size).tobytes()
    return [block_checksum(h, content(h, slot.size)) for (_, slot), h in zip(leased, hashes)]


def seal(store: BlockStore, hashes) -> None:
    slots, _ = store.reserve(FP.digest, hashes, [BLOCK] * len(hashes))
    store.commit(FP.digest, [t for t, _ in slots], fill(store, slots, hashes))


def test_leased_slots_are_named_by_the_commit_that_fills_them(engine):
    store = BlockStore(engine, engine.allocate(4 << 20))
    leased = store.lease(FP.digest, BLOCK, 3)
    assert len(leased) == 3 and store.dram.used == 3 * BLOCK
    hashes = external_hashes(range(3), FP)
    errors, updates = store.commit(FP.digest, [t for t, _ in leased], fill(store, leased, hashes), hashes=hashes)
    assert errors == ["", "", ""] and [h for _, h, _ in updates] == hashes
    assert all(store.read_block((FP.digest, h)) == content(h).tobytes() for h in hashes)
    assert store.dram.used == 3 * BLOCK  # the slots became the blocks


def test_a_commit_that_misnames_slots_takes_nothing(engine):
    store = BlockStore(engine, engine.allocate(4 << 20))
    leased = store.lease(FP.digest, BLOCK, 1)
    reserved, _ = store.reserve(FP.digest, external_hashes([7], FP), [BLOCK])
    h, other = external_hashes([1, 2], FP)
    sums = fill(store, leased, [h])
    with pytest.raises(InvalidRequest):  # a leased slot committed without its block's hash
        store.commit(FP.digest, [leased[0][0], reserved[0][0]], sums + [0])
    with pytest.raises(InvalidRequest):  # a reserved slot named as another block
        store.commit(FP.digest, [leased[0][0], reserved[0][0]], sums + [0], hashes=[h, other])
    # Nothing was taken: the leased slot still commits, under its hash.
    assert store.commit(FP.digest, [leased[0][0]], sums, hashes=[h])[0] == [""]
    assert store.commit("another-model", [reserved[0][0]], [0], hashes=[other])[0] == ["unknown or expired reservation"]


def test_a_leased_slot_for_a_block_held_already_is_given_back(engine):
    store = BlockStore(engine, engine.allocate(4 << 20))
    h = external_hashes([5], FP)[0]
    seal(store, [h])
    before = store.dram.used
    leased = store.lease(FP.digest, BLOCK, 1)
    errors, updates = store.commit(FP.digest, [leased[0][0]], fill(store, leased, [h]), hashes=[h])
    assert errors == [""] and not updates  # theirs is kept; nothing new to publish
    assert store.dram.used == before


def test_a_lease_never_evicts_and_stops_at_the_high_watermark(engine):
    store = BlockStore(engine, engine.allocate(64 * BLOCK), high=0.75, low=0.5)
    held = external_hashes(range(40), FP)
    seal(store, held)  # 40 of 64 slots
    leased = store.lease(FP.digest, BLOCK, 8)  # an eighth of DRAM at most: 8 slots
    assert len(leased) == 8 and store.dram.used == 48 * BLOCK  # the high watermark exactly
    assert store.lease(FP.digest, BLOCK, 8) == []  # past it: none, rather than evict
    assert all(store.find((FP.digest, h)) is not None for h in held)


def test_a_lease_is_bounded_and_bad_requests_are_refused(engine):
    store = BlockStore(engine, engine.allocate(4 << 20))
    assert len(store.lease(FP.digest, BLOCK, LEASE_MAX_SLOTS)) == (4 << 20) // 8 // BLOCK
    with pytest.raises(WrongSize):
        store.lease(FP.digest, 0, 1)
    with pytest.raises(WrongSize):
        store.lease(FP.digest, (64 << 20) + 1, 1)
    with pytest.raises(InvalidRequest):
        store.lease(FP.digest, BLOCK, LEASE_MAX_SLOTS + 1)
    with pytest.raises(InvalidRequest):
        store.lease("bad/fingerprint", BLOCK, 1)


def test_leases_expire_and_abort_like_reservations(engine):
    store = BlockStore(engine, engine.allocate(4 << 20), reservation_timeout=0.05)
    aborted, expiring = store.lease(FP.digest, BLOCK, 2), store.lease(FP.digest, BLOCK, 2)
    store.abort([t for t, _ in aborted])
    assert store.dram.used == 2 * BLOCK
    time.sleep(0.1)
    store.lease(FP.digest, BLOCK, 0)  # any lease or reserve reclaims expired slots
    assert store.dram.used == 0
    h = external_hashes([9], FP)
    assert store.commit(FP.digest, [expiring[0][0]], [0], hashes=h)[0] == ["unknown or expired reservation"]
