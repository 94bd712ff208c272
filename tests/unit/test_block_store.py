"""The daemon's BlockStore in one process: sealing, capacity, demotion, corruption, concurrency."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from xxh3_forgery import forge, old_checksum

import kvstore
from kvstore.daemon.store import BlockStore
from kvstore.errors import AllocationFailed, WrongSize
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from transfer import Engine

FP = ModelFingerprint("m", "float16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024


def content(block_hash: bytes, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(block_hash[:8], "little")).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def engine():
    with Engine("store-unit", listen=None) as e:
        yield e


def write(store: BlockStore, block_hash: bytes, data: np.ndarray, digest: bytes | None = None):
    slots, updates = store.reserve(FP.digest, [block_hash], [data.nbytes])
    token, slot = slots[0]
    if slot is None:
        return [], updates
    store.dram.region.buffer[slot.offset : slot.offset + data.nbytes] = data.tobytes()
    errors, more = store.commit(FP.digest, [token], [block_digest(block_hash, data) if digest is None else digest])
    return errors, updates + more


def test_commit_verifies_bytes_and_publishes(engine):
    store = BlockStore(engine, engine.allocate(1 << 20))
    h = external_hashes([1], FP)[0]
    errors, updates = write(store, h, content(h))
    assert errors == [""] and updates[0][2].tier == "dram"
    h2 = external_hashes([2], FP)[0]
    errors, updates = write(store, h2, content(h2), digest=bytes(32))
    assert errors[0].startswith("digest mismatch") and updates == []
    assert store.dram.used == 65536  # the refused slot went back
    again, _ = store.reserve(FP.digest, [h], [BLOCK])
    assert again == [(0, None)]  # already sealed: nothing to write
    with pytest.raises(WrongSize):
        store.reserve(FP.digest, [h2], [0])
    with pytest.raises(AllocationFailed):
        store.reserve(FP.digest, [h2], [2 << 20])
    assert store.commit(FP.digest, [999], [bytes(32)])[0] == ["unknown or expired reservation"]


def test_a_commit_under_another_fingerprint_leaves_the_reservation_to_its_owner(engine):
    store = BlockStore(engine, engine.allocate(1 << 20))
    h = external_hashes([1], FP)[0]
    data = content(h)
    (token, slot), = store.reserve(FP.digest, [h], [BLOCK])[0]
    store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = data.tobytes()
    assert store.commit("another-model", [token], [block_digest(h, data)])[0] == ["unknown or expired reservation"]
    assert store.commit(FP.digest, [token], [block_digest(h, data)])[0] == [""]
    assert store.dram.used == BLOCK


def test_a_big_commit_verifies_every_block_in_one_batch(engine, monkeypatch):
    """Each block of a batch is checked against its own digest (one bad block among many is
    refused, the rest sealed), and the digest pass leaves the store's lock free for other requests."""
    import kvstore.daemon.sealing as store_module

    lock_free_while_hashing = []

    def hashing(*args):
        other = threading.Thread(target=lambda: lock_free_while_hashing.append(_try_lock(store.lock)))
        other.start()
        other.join()
        return real(*args)

    real = store_module.block_digests
    monkeypatch.setattr(store_module, "block_digests", hashing)
    store = BlockStore(engine, engine.allocate(16 << 20))
    hashes = external_hashes(range(12), FP)
    size = 1 << 20
    slots, _ = store.reserve(FP.digest, hashes, [size] * len(hashes))
    sums = []
    for h, (_, slot) in zip(hashes, slots):
        data = content(h, size)
        store.dram.region.buffer[slot.offset : slot.offset + size] = data.tobytes()
        sums.append(block_digest(h, data))
    sums[7] = bytes([sums[7][0] ^ 1]) + sums[7][1:]
    errors, updates = store.commit(FP.digest, [token for token, _ in slots], sums)
    assert [e.startswith("digest mismatch") for e in errors] == [i == 7 for i in range(12)]
    assert len(updates) == 11 and store.dram.used == 11 * size
    assert lock_free_while_hashing == [True]
    with pytest.raises(WrongSize):  # never pops what it cannot seal
        store.commit(FP.digest, [1, 2], [bytes(32)])


def _try_lock(lock) -> bool:
    if not lock.acquire(timeout=1):
        return False
    lock.release()
    return True


def test_three_times_capacity_never_exceeds_any_tier(engine, tmp_path):
    dram, disk = 1 << 20, 2 << 20
    store = BlockStore(engine, engine.allocate(dram), engine.register_file(tmp_path / "t", disk))
    hashes = external_hashes(range(3 * (dram + disk) // BLOCK), FP)
    deleted = 0
    for h in hashes:
        errors, updates = write(store, h, content(h))
        assert errors == [""]
        assert store.dram.used <= dram and store.nvme.used <= disk
        deleted += sum(1 for u in updates if u[2] is None)
    assert store.counters["demotions"] > 0 and store.counters["evictions_nvme"] > 0
    held = len(store.dram.sealed) + len(store.nvme.sealed)
    assert held + deleted == len(hashes)  # every block is either held or was unpublished
    for tier in store.tiers:  # what is held is intact
        for (fp, h), slot in tier.sealed.items():
            assert store._verify(slot)


def test_corrupt_nvme_block_is_dropped_on_promotion(engine, tmp_path):
    path = tmp_path / "tier"
    store = BlockStore(engine, engine.allocate(256 * 1024), engine.register_file(path, 1 << 20), high=1.0, low=0.5)
    hashes = external_hashes(range(8), FP)
    for h in hashes:
        write(store, h, content(h))
    victim = next(iter(store.nvme.sealed.values()))
    with open(path, "r+b") as f:
        f.seek(victim.offset + 100)
        f.write(b"\xff" * 16)
    store.remove(FP.digest, [h for h in hashes if (FP.digest, h) in store.dram.sealed])  # make room to promote
    updates = store.touch(FP.digest, [victim.key[1]])
    assert updates == [(FP.digest, victim.key[1], None)]
    assert store.find(victim.key) is None and store.counters["corrupt_blocks_nvme"] == 1
    healthy = next(iter(store.nvme.sealed.values()))
    updates = store.touch(FP.digest, [healthy.key[1]])
    assert updates[-1][2].tier == "dram" and store.counters["promotions"] == 1


def test_a_second_preimage_of_the_old_checksum_is_caught_on_every_node_side_path(engine, tmp_path):
    """Kills: node-side checks with the old seeded xxh3-64 checksum. Bytes with the old checksum of
    the block they replace (a commit's landed bytes, a sealed DRAM copy, an NVMe copy) are refused at
    commit, never handed to a drain or repair (read_block), dropped when a client reports them, and
    dropped instead of promoted."""
    path = tmp_path / "tier"
    store = BlockStore(engine, engine.allocate(256 * 1024), engine.register_file(path, 1 << 20), high=1.0, low=0.5)
    h = external_hashes([77], FP)[0]
    forged = forge(h, content(h).tobytes())
    assert old_checksum(h, forged) == old_checksum(h, content(h).tobytes())
    errors, updates = write(store, h, np.frombuffer(forged, np.uint8), digest=block_digest(h, content(h)))
    assert errors[0].startswith("digest mismatch") and updates == [] and store.counters["corrupt_writes"] == 1
    hashes = external_hashes(range(8), FP)
    for each in hashes:
        write(store, each, content(each))
    in_dram = next(s for k, s in store.dram.sealed.items())
    victim = in_dram.key[1]
    store.dram.region.buffer[in_dram.offset : in_dram.offset + BLOCK] = forge(victim, content(victim).tobytes())
    assert store.read_block((FP.digest, victim)) is None  # what drain and repair copy elsewhere
    assert store.touch(FP.digest, [], corrupt=[victim]) == [(FP.digest, victim, None)]
    on_nvme = next(iter(store.nvme.sealed.values()))
    with open(path, "r+b") as f:
        f.seek(on_nvme.offset)
        f.write(forge(on_nvme.key[1], content(on_nvme.key[1]).tobytes()))
    assert store.read_block(on_nvme.key) is None
    store.remove(FP.digest, [k[1] for k in list(store.dram.sealed)])  # make room to promote
    assert store.touch(FP.digest, [on_nvme.key[1]]) == [(FP.digest, on_nvme.key[1], None)]
    assert store.find(on_nvme.key) is None and store.counters["corrupt_blocks_nvme"] == 1


def test_reads_never_return_another_blocks_bytes_under_churn():
    """Writers, readers and eviction over a 16-slot arena: every byte a get returns is checked."""
    with kvstore.open(dram=16 * BLOCK, fingerprint=FP) as store:
        hashes = external_hashes(range(400), FP)
        stop = threading.Event()
        bad, hits, errors = [], [0], []

        def writer(offset: int) -> None:
            try:
                for h in hashes[offset::2]:
                    store.put(h, content(h))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            out = np.zeros(BLOCK, np.uint8)
            try:
                while not stop.is_set():
                    h = hashes[int(rng.integers(0, len(hashes)))]
                    if store.get(h, out):
                        hits[0] += 1
                        if not np.array_equal(out, content(h)):
                            bad.append(h)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        readers = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
        writers = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for t in readers + writers:
            t.start()
        for t in writers:
            t.join(120)
        stop.set()
        for t in readers:
            t.join(30)
        assert not errors, errors[:3]
        assert bad == []
        assert hits[0] > 0 and store.daemon.store.counters.get("evictions_dram", 0) > 300


def test_stale_locations_of_reused_slots_never_verify():
    """A reader whose index lags reads slots that now hold other blocks: every such read is refused."""
    with kvstore.open(dram=16 * BLOCK, fingerprint=FP) as store:
        first = external_hashes(range(12), FP)  # fits under the high watermark
        for h in first:
            store.put(h, content(h))
        assert store.mirror.wait_until(lambda m: m.block_count == 12)
        stale = [(h, store.mirror.lookup(FP, h)) for h in first]  # what a lagging mirror would say
        for h in external_hashes(range(12, 200), FP):  # churn: every early slot is reused many times
            store.put(h, content(h))
        buffers = [store.engine.register(bytearray(BLOCK), remote_access=False) for _ in first]
        refused = 0
        for i, (h, replicas) in enumerate(stale):
            (name, record), = replicas.items()
            good = store.reads.nodes.read_from(name, [h], [(0, record)], [[(buffers[i], 0, BLOCK)]])
            if good:
                assert bytes(buffers[i].buffer) == content(h).tobytes()
            else:
                refused += 1
        assert refused == len(first)  # the first 12 blocks were all evicted: no stale read may pass


def test_huge_lookups_touches_and_removes_take_the_lock_a_span_at_a_time(engine):
    """A request naming many blocks lets puts in between: each hold of the store lock covers at most
    LOCK_SPAN of its blocks, and the answer is the same as in one go."""
    import kvstore.daemon.store as store_module

    class CountingLock:
        def __init__(self, lock):
            self.lock, self.holds = lock, 0

        def __enter__(self):
            self.lock.acquire()
            self.holds += 1

        def __exit__(self, *exc):
            self.lock.release()

    store = BlockStore(engine, engine.allocate(1 << 20))
    held = external_hashes(range(3), FP)
    slots, _ = store.reserve(FP.digest, held, [4096] * 3)
    for h, (_, slot) in zip(held, slots):
        store.dram.region.buffer[slot.offset : slot.offset + 4096] = content(h, 4096).tobytes()
    store.commit(FP.digest, [t for t, _ in slots], [block_digest(h, content(h, 4096)) for h in held])
    many = external_hashes(range(100, 100 + 3 * store_module.LOCK_SPAN), FP) + held
    store.lock = counting = CountingLock(store.lock)
    records = store.records(FP.digest, many)
    assert counting.holds == 4 and [r is not None for r in records] == [False] * (len(many) - 3) + [True] * 3
    counting.holds = 0
    store.touch(FP.digest, many)
    assert counting.holds == 4 + 1 and store.counters["hits_dram"] == 3  # (+1: the corrupt reports)
    counting.holds = 0
    assert store.remove(FP.digest, many)[0] == 3 and counting.holds == 4
