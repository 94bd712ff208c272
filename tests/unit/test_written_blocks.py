"""Commits answered before their digest pass (`verify=False`): the blocks stay *written* (held,
unlisted, unevictable, unpublished) until `seal_written` verifies them; bad bytes never get sealed."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvstore.daemon.grants as grants_module
import kvstore.daemon.sealing as store_module
from kvstore.daemon.store import BlockStore
from kvstore.errors import AllocationFailed
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from transfer import Engine

FP = ModelFingerprint("m", "float16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024


def content(block_hash: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(block_hash[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture(autouse=True)
def verify_small_commits_later(monkeypatch):
    monkeypatch.setattr(store_module, "VERIFY_LATER_MIN", 0)  # these tests' blocks are 64 KiB


@pytest.fixture
def store():
    with Engine("written-unit", listen=None) as engine:
        yield BlockStore(engine, engine.allocate(4 * BLOCK))


def write_later(store: BlockStore, ids: list[int], wrong: bool = False) -> tuple[list[bytes], list, list[str], list]:
    """Reserve, write and commit blocks `ids` with verify=False: (hashes, records, errors, updates)."""
    hashes = external_hashes(ids, FP)
    slots, _ = store.reserve(FP.digest, hashes, [BLOCK] * len(hashes))
    for h, (_, slot) in zip(hashes, slots):
        store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = content(h).tobytes()
    digests = [bytes(32) if wrong else block_digest(h, content(h)) for h in hashes]
    records: list = []
    errors, updates = store.commit(FP.digest, [t for t, _ in slots], digests, records, verify=False)
    return hashes, records, errors, updates


def test_a_written_block_is_held_but_unpublished_and_unlisted_until_verified(store):
    (h,), (record,), errors, updates = write_later(store, [1])
    assert errors == [""] and updates == [] and record.tier == "dram"
    assert store.keys() == [] and store.all_records() == []  # nothing lists or republishes it yet
    assert store.records(FP.digest, [h]) == [None]  # nor answers a Lookup with it
    assert store.reserve(FP.digest, [h], [BLOCK])[0] == [(0, None)]  # but it is held: no second copy
    sealed = store.seal_written()
    assert sealed == [(FP.digest, h, record)]
    assert [k for k, _ in store.keys()] == [(FP.digest, h)]
    assert store.read_block((FP.digest, h)) == content(h).tobytes()
    assert store.seal_written() == []


def test_a_written_block_whose_bytes_do_not_match_is_dropped_when_verified(store):
    (h,), _, errors, updates = write_later(store, [1], wrong=True)
    assert errors == [""] and updates == []  # answered before the pass: the pass decides
    assert store.seal_written() == []
    assert store.counters["corrupt_writes"] == 1
    assert store.records(FP.digest, [h]) == [None] and store.dram.used == 0


def test_a_block_removed_before_or_while_it_is_verified_is_never_sealed(store, monkeypatch):
    (h,), _, _, _ = write_later(store, [1])
    assert store.remove(FP.digest, [h])[0] == 1 and store.dram.used == 0
    assert store.seal_written() == []

    (h2,), _, _, _ = write_later(store, [2])
    digests = store._digests

    def removed_meanwhile(slots):
        assert store.remove(FP.digest, [h2])[0] == 1
        return digests(slots)

    monkeypatch.setattr(store, "_digests", removed_meanwhile)
    assert store.seal_written() == []
    assert store.records(FP.digest, [h2]) == [None] and store.dram.used == 0 and store.keys() == []


def test_written_blocks_are_never_evicted_before_they_are_verified(store):
    store = BlockStore(store.engine, store.engine.allocate(8 * BLOCK))
    sealed = external_hashes([9], FP)
    (token, slot), = store.reserve(FP.digest, sealed, [BLOCK])[0]
    store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = content(sealed[0]).tobytes()
    store.commit(FP.digest, [token], [block_digest(sealed[0], content(sealed[0]))])
    hashes, _, _, _ = write_later(store, [1, 2, 3, 4, 5])  # 6 of the 8 slots taken
    grants_module.WRITTEN_WAIT_S, wait = 0.05, grants_module.WRITTEN_WAIT_S  # no verifier runs here
    try:
        with pytest.raises(AllocationFailed):  # evicting cannot free written blocks: refused
            store.reserve(FP.digest, external_hashes([6, 7, 8, 10], FP), [BLOCK] * 4)
    finally:
        grants_module.WRITTEN_WAIT_S = wait
    assert store.read_block((FP.digest, sealed[0])) is not None  # and nothing was evicted for it
    assert [u[1] for u in store.seal_written()] == hashes
    assert all(store.read_block((FP.digest, h)) == content(h).tobytes() for h in hashes)


def test_a_reserve_that_only_written_blocks_stand_in_the_way_of_waits_for_the_verifier(store, monkeypatch):
    """Kills: a reserve refused at once while the verifier lags (a busy host's digest pass behind a
    burst of large puts into a small DRAM tier): it waits for the seal, then evicts and fits."""
    monkeypatch.setattr(grants_module, "WRITTEN_WAIT_S", 30.0)  # a loaded machine may start the sealer late
    hashes, _, _, _ = write_later(store, [1, 2, 3, 4])  # all 4 slots written, none evictable yet
    sealer = threading.Timer(0.2, store.seal_written)
    started = time.monotonic()  # before the timer starts: it fires 0.2 s after this at the earliest
    sealer.start()
    try:
        slots, updates = store.reserve(FP.digest, external_hashes([5], FP), [BLOCK])
    finally:
        sealer.join()
    # it waited for the seal, and was woken by it (not by its own 30 s wait running out)
    assert slots[0][1] is not None and 0.2 <= time.monotonic() - started < grants_module.WRITTEN_WAIT_S
    assert updates and all(u[1] in hashes and u[2] is None for u in updates)  # sealed blocks made room


def test_past_the_written_bound_a_commit_verifies_at_once(store, monkeypatch):
    monkeypatch.setattr(store_module, "WRITTEN_MAX", BLOCK)
    (h1,), _, _, first = write_later(store, [1])
    (h2,), _, _, second = write_later(store, [2])
    assert first == [] and [u[1] for u in second] == [h2]  # the second found the bound full
    assert [u[1] for u in store.seal_written()] == [h1]


def test_a_verified_commit_still_seals_at_once(store):
    h = external_hashes([1], FP)[0]
    (token, slot), = store.reserve(FP.digest, [h], [BLOCK])[0]
    store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = content(h).tobytes()
    errors, updates = store.commit(FP.digest, [token], [block_digest(h, content(h))])
    assert errors == [""] and [u[1] for u in updates] == [h]
    assert store.seal_written() == []


def test_a_verified_copy_of_a_block_retires_its_unverified_one(store):
    """Two puts of one block in flight at once, one verified at once: one copy stays, and a
    removal then leaves nothing for the verifier to bring back."""
    h = external_hashes([1], FP)[0]
    (t1, s1), (t2, s2) = store.reserve(FP.digest, [h], [BLOCK])[0] + store.reserve(FP.digest, [external_hashes([2], FP)[0]], [BLOCK])[0]
    s2.key = s1.key  # a second reservation of the same block (as two clients racing would hold)
    for slot in (s1, s2):
        store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = content(h).tobytes()
    digest = block_digest(h, content(h))
    assert store.commit(FP.digest, [t1], [digest], verify=False) == ([""], [])
    assert [u[1] for u in store.commit(FP.digest, [t2], [digest])[1]] == [h]
    assert store.dram.used == BLOCK  # the written copy went when the verified one was sealed
    assert store.remove(FP.digest, [h])[0] == 1
    assert store.seal_written() == [] and store.dram.used == 0 and store.keys() == []


def test_a_digest_pass_that_fails_frees_its_blocks(store, monkeypatch):
    (h,), _, _, _ = write_later(store, [1])

    def broken(slots):
        raise OSError("arena gone")

    monkeypatch.setattr(store, "_digests", broken)
    with pytest.raises(OSError):
        store.seal_written()
    assert store.dram.used == 0 and store.reserve(FP.digest, [h], [BLOCK])[0][0][1] is not None


def test_a_small_commit_verifies_at_once_even_when_asked_to_verify_later(store, monkeypatch):
    monkeypatch.setattr(store_module, "VERIFY_LATER_MIN", 2 * BLOCK)
    (h,), _, errors, updates = write_later(store, [1], wrong=True)
    assert errors[0].startswith("digest mismatch") and updates == []
    hashes, _, errors, updates = write_later(store, [2, 3])  # 2 blocks: at the bound, verified later
    assert errors == ["", ""] and updates == [] and [u[1] for u in store.seal_written()] == hashes
