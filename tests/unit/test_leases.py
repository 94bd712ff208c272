"""Leased slots in one process: slots for a client's next put, taken from free space only, named by
the commit that fills them, held and expired like reservations."""
from __future__ import annotations

import time

import pytest

from kvstore.daemon.store import LEASE_MAX_SLOTS, BlockStore
from kvstore.errors import InvalidRequest, NodeRefused, WrongSize
from kvstore.integrity import block_digest
from kvstore.keys import external_hashes

from .test_block_store import BLOCK, FP, content, engine  # noqa: F401 - engine is a fixture


def fill(store: BlockStore, leased, hashes) -> list[int]:
    """Write each block into its leased slot; the digests to commit."""
    for (_, slot), h in zip(leased, hashes):
        store.dram.region.buffer[slot.offset : slot.offset + slot.size] = content(h, slot.size).tobytes()
    return [block_digest(h, content(h, slot.size)) for (_, slot), h in zip(leased, hashes)]


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
        store.commit(FP.digest, [leased[0][0], reserved[0][0]], sums + [bytes(32)])
    with pytest.raises(InvalidRequest):  # a reserved slot named as another block
        store.commit(FP.digest, [leased[0][0], reserved[0][0]], sums + [0], hashes=[h, other])
    # Nothing was taken: the leased slot still commits, under its hash.
    assert store.commit(FP.digest, [leased[0][0]], sums, hashes=[h])[0] == [""]
    assert store.commit("another-model", [reserved[0][0]], [bytes(32)],
                        hashes=[other])[0] == ["unknown or expired reservation"]


def test_a_leased_slot_for_a_block_held_already_is_given_back(engine):
    store = BlockStore(engine, engine.allocate(4 << 20))
    h = external_hashes([5], FP)[0]
    seal(store, [h])
    before = store.dram.used
    leased = store.lease(FP.digest, BLOCK, 1)
    fresh: list = []
    errors, updates = store.commit(FP.digest, [leased[0][0]], fill(store, leased, [h]), hashes=[h], fresh=fresh)
    assert errors == [""] and not updates and fresh == [False]  # theirs is kept; nothing new here
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
    assert len(store.lease(FP.digest, BLOCK, LEASE_MAX_SLOTS + 1)) == (4 << 20) // 8 // BLOCK  # granted short
    with pytest.raises(WrongSize):
        store.lease(FP.digest, 0, 1)
    with pytest.raises(WrongSize):
        store.lease(FP.digest, (64 << 20) + 1, 1)
    with pytest.raises(InvalidRequest):
        store.lease(FP.digest, BLOCK, -1)
    with pytest.raises(InvalidRequest):
        store.lease("bad/fingerprint", BLOCK, 1)


def test_all_leases_together_hold_at_most_a_quarter_of_dram(engine):
    store = BlockStore(engine, engine.allocate(64 * BLOCK))
    granted = [len(store.lease(FP.digest, BLOCK, 8)) for _ in range(4)]
    assert granted == [8, 8, 0, 0] and store.dram.used == 16 * BLOCK
    store.abort([t for t, _ in store.lease(FP.digest, BLOCK, 0)])  # (a lease of none is no lease)
    h = external_hashes([3], FP)
    reserved, _ = store.reserve(FP.digest, h, [BLOCK])  # reservations are not leases: still taken
    assert reserved[0][1] is not None


def test_a_token_named_twice_in_one_commit_is_refused_and_nothing_is_taken(engine):
    """A repeated token once left its slot neither pending nor sealed: never freed."""
    store = BlockStore(engine, engine.allocate(4 << 20))
    leased = store.lease(FP.digest, BLOCK, 1)
    h = external_hashes([4], FP)
    sums = fill(store, leased, h)
    with pytest.raises(InvalidRequest):
        store.commit(FP.digest, [leased[0][0]] * 2, sums * 2, hashes=h * 2)
    fresh: list = []
    assert store.commit(FP.digest, [leased[0][0]], sums, hashes=h, fresh=fresh)[0] == [""] and fresh == [True]
    assert store.dram.used == BLOCK


def test_leases_expire_and_abort_like_reservations(engine):
    store = BlockStore(engine, engine.allocate(4 << 20), reservation_timeout=0.05)
    aborted, expiring = store.lease(FP.digest, BLOCK, 2), store.lease(FP.digest, BLOCK, 2)
    store.abort([t for t, _ in aborted])
    assert store.dram.used == 2 * BLOCK
    time.sleep(0.1)
    store.lease(FP.digest, BLOCK, 1)  # any lease or reserve reclaims expired slots first
    assert store.dram.used == BLOCK
    h = external_hashes([9], FP)
    assert store.commit(FP.digest, [expiring[0][0]], [bytes(32)], hashes=h)[0] == ["unknown or expired reservation"]


def test_a_block_committed_into_a_leased_slot_during_a_drain_is_drained_too():
    """A drain looks again after its pass: a put under way when it began (its slots leased or
    reserved before) that lands during the pass is not left behind on the drained node."""
    import kvstore

    with kvstore.open("memory://", dram="16MiB", fingerprint=FP) as embedded:
        daemon, store = embedded.daemon, embedded.daemon.store
        early, late = external_hashes([1, 2], FP)
        seal(store, [early])
        leased = store.lease(FP.digest, BLOCK, 1)  # granted before the drain
        sums = fill(store, leased, [late])
        steps = daemon.drain(move=False)
        assert next(steps).total == 1  # the drain's first look: the early block only
        assert store.commit(FP.digest, [leased[0][0]], sums, hashes=[late], verify=True)[0] == [""]
        last = list(steps)[-1]
        assert last.done and last.total == 2 and last.dropped == 2
        assert store.keys() == []


def test_a_put_under_way_is_refused_after_the_drains_last_look():
    """A commit that came after the drain's last look would leave its block on a node about to go:
    it is refused (its client puts the blocks elsewhere, its slot is freed) until the node takes
    puts again."""
    import kvstore

    with kvstore.open("memory://", dram="16MiB", fingerprint=FP) as embedded:
        daemon, store = embedded.daemon, embedded.daemon.store
        late = external_hashes([3], FP)
        leased = store.lease(FP.digest, BLOCK, 1)  # granted before the drain, written after it
        sums = fill(store, leased, late)
        assert list(daemon.drain(move=False))[-1].done
        with pytest.raises(NodeRefused):
            store.commit(FP.digest, [leased[0][0]], sums, hashes=late)
        with pytest.raises(NodeRefused):
            store.reserve(FP.digest, late, [BLOCK])
        assert store.lease(FP.digest, BLOCK, 1) == [] and store.keys() == []
        assert store.dram.used == 0  # the refused commit gave its slot back
        daemon.set_draining(False)  # taking puts again
        # The client places puts by the node records its mirror has heard of (a watch, not at once).
        assert embedded.mirror.wait_until(lambda m: not any(n.draining for n in m.nodes.values()), 5)
        assert embedded.put(late[0], content(late[0])) == 1


def test_the_drains_last_look_waits_for_a_commit_still_verifying(engine, monkeypatch):
    """A commit verifies its bytes off the lock: stop_taking waits until it has sealed, so the
    drain's last look sees its block."""
    import threading

    import kvstore.daemon.sealing as store_module

    store = BlockStore(engine, engine.allocate(4 << 20))
    h = external_hashes([6], FP)
    slots, _ = store.reserve(FP.digest, h, [BLOCK])
    sums = fill(store, slots, h)
    hashing, release = threading.Event(), threading.Event()
    real = store_module.block_digests

    def slow(*args):
        hashing.set()
        release.wait(5)
        return real(*args)

    monkeypatch.setattr(store_module, "block_digests", slow)
    committing = threading.Thread(target=store.commit, args=(FP.digest, [slots[0][0]], sums))
    committing.start()
    assert hashing.wait(5)
    assert not store.stop_taking(0.05)  # still verifying: not quiet yet
    release.set()
    assert store.stop_taking(5)
    assert [key for key, _ in store.keys()] == [(FP.digest, h[0])]  # sealed before stop_taking returned
    committing.join(5)


def test_a_block_the_drain_handled_and_a_put_under_way_brought_back_is_drained_again():
    """The drain removes each block it handles: one that a put under way (its slot leased before
    the drain) stores again afterwards is found by a later look, not left behind as handled."""
    import kvstore

    with kvstore.open("memory://", dram="16MiB", fingerprint=FP) as embedded:
        daemon, store = embedded.daemon, embedded.daemon.store
        h = external_hashes([1], FP)
        seal(store, h)
        leased = store.lease(FP.digest, BLOCK, 1)
        sums = fill(store, leased, h)
        steps = daemon.drain(move=False)
        assert next(steps).total == 1 and next(steps).dropped == 1
        assert store.commit(FP.digest, [leased[0][0]], sums, hashes=h)[0] == [""]  # the same block, again
        last = list(steps)[-1]
        assert last.done and last.dropped == 2 and store.keys() == []


def test_taking_puts_again_during_a_drain_calls_it_off():
    """`policy --accept-puts yes` while a drain runs: the node is serving again, and the drain's
    last look does not then refuse everything behind the operator's back."""
    import kvstore

    with kvstore.open("memory://", dram="16MiB", fingerprint=FP) as embedded:
        daemon, store = embedded.daemon, embedded.daemon.store
        seal(store, external_hashes([1], FP))
        steps = daemon.drain(move=False)
        next(steps)
        daemon.set_draining(False)
        assert not any(step.done for step in steps)  # called off
        h = external_hashes([2], FP)[0]
        assert not daemon.draining and store.taking_blocks
        assert embedded.mirror.wait_until(lambda m: not any(n.draining for n in m.nodes.values()), 5)
        assert embedded.put(h, content(h)) == 1


def test_a_refused_commit_gives_its_slots_back(engine):
    """An inline put whose commit is refused (the drain's last look came while its bytes were
    copied in) frees its reservation at once: the node stays refusing, so no later reserve would
    have expired it."""
    store = BlockStore(engine, engine.allocate(4 << 20))
    h = external_hashes([1], FP)
    slots, _ = store.reserve(FP.digest, h, [BLOCK])
    _, slot = slots[0]
    store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = content(h[0]).tobytes()
    assert store.stop_taking(1)  # a drain between the reserve and the commit
    with pytest.raises(NodeRefused):
        store.commit_reserved(FP.digest, h, slots, [block_digest(h[0], content(h[0]))], True)
    assert store.dram.used == 0


def test_a_commit_that_fails_while_sealing_does_not_keep_a_drain_waiting(engine, monkeypatch):
    store = BlockStore(engine, engine.allocate(4 << 20))
    h = external_hashes([1], FP)
    slots, _ = store.reserve(FP.digest, h, [BLOCK])
    sums = fill(store, slots, h)

    def broken(*args, **kwargs):
        raise RuntimeError("sealing failed")

    monkeypatch.setattr(store, "_seal", broken)
    with pytest.raises(RuntimeError):
        store.commit(FP.digest, [slots[0][0]], sums)
    assert store.stop_taking(0.1)
