"""The seal table (kvstore.seals) as the daemon's BlockStore keeps it: a verified DRAM slot gets a
number never given before, the number is gone before the slot's extent can be handed out again,
and an extent a same-host writer may still write after its reservation expired is never sealed with
a number (held back until the writer has gone, or tainted when the writer is not known)."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvstore.daemon.store import BlockStore
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.seals import SealView
from transfer import Engine

FP = ModelFingerprint("seals", "float16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024


def content(block_hash: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(block_hash[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def engine():
    with Engine("seals-unit", listen=None) as e:
        yield e


class Writer:
    """A same-host writer whose process is alive until `exit()`."""

    def __init__(self) -> None:
        self.exited = False

    def gone(self) -> bool:
        return self.exited


def put(store: BlockStore, block_hash: bytes, writer=None) -> int:
    """Reserve, write and commit one block; its slot's offset."""
    (token, slot), = store.reserve(FP.digest, [block_hash], [BLOCK], writer=writer)[0]
    store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = content(block_hash).tobytes()
    assert store.commit(FP.digest, [token], [block_digest(block_hash, content(block_hash))])[0] == [""]
    return slot.offset


def expire(store: BlockStore) -> None:
    """Every pending reservation runs out now."""
    with store.lock:
        for slot in store._pending.values():
            slot.reserved_at = float("-inf")
        store._expire_reservations()


def view(store: BlockStore) -> SealView:
    fd = store.seals.reader_fd()
    try:
        return SealView(fd, store.dram.region.id, store.dram.region.size)
    finally:
        os.close(fd)


def test_a_slot_freed_loses_its_number_and_a_new_sealing_gets_a_new_one(engine):
    """Kills: a number left in place when the slot is removed, evicted or demoted (a reader would
    trust the next block sealed there), and numbers given twice."""
    store = BlockStore(engine, engine.allocate(4 * BLOCK), engine.allocate(16 * BLOCK), high=1.0, low=0.5)
    seen = view(store)
    a, b = external_hashes([1, 2], FP)
    at = put(store, a)
    first = seen.number(at)
    assert first
    store.remove(FP.digest, [a])
    assert seen.number(at) == 0
    assert put(store, b) == at and seen.number(at) not in (0, first)  # the same extent, a new sealing
    store.remove(FP.digest, [b])
    assert put(store, a) == at and seen.number(at) not in (0, first)  # the same block again: new as well
    others = external_hashes(range(10, 14), FP)
    for h in others:  # DRAM holds four: the oldest is demoted to NVMe
        put(store, h)
    assert store.find((FP.digest, a)).tier.name == "nvme" and seen.number(at) != 0  # another block's slot now
    assert store.dram.sealed[(FP.digest, others[-1])].offset == at


def test_a_client_cannot_write_the_table(engine):
    """Kills: a table handed out writable (a client could forge the number of a slot it rewrote)."""
    store = BlockStore(engine, engine.allocate(4 * BLOCK))
    fd = store.seals.reader_fd()
    again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the same file opened for writing: sealed
    try:
        with pytest.raises(OSError):
            os.pwrite(fd, b"\1" * 8, 16)
        with pytest.raises(OSError):
            os.pwrite(again, b"\1" * 8, 16)
        with pytest.raises(OSError):
            mmap.mmap(again, os.fstat(again).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.close(again)


def test_a_slot_sealed_where_an_expired_same_host_write_may_land_is_not_numbered(engine):
    """Kills: an expired reservation of a same-host writer (which maps the arena and may still be
    copying into it) whose extent goes to another block sealed with a number a re-reader would
    trust while the late bytes land; and a taint kept after that writer's process exited."""
    store = BlockStore(engine, engine.allocate(4 * BLOCK))
    seen = view(store)
    a, b, c, d = external_hashes([1, 2, 3, 4], FP)
    writer = Writer()
    (_, slot), = store.reserve(FP.digest, [a], [BLOCK], writer=writer)[0]
    held = slot.offset
    expire(store)
    assert store.dram.used == 0  # its space back at once
    assert put(store, b) == held and seen.number(held) == 0  # sealed, verified, never trusted
    writer.exited = True
    store.remove(FP.digest, [b])
    expire(store)  # (the store looks at its writers when it looks at its reservations)
    assert put(store, c) == held and seen.number(held) != 0  # the writer is gone: numbered again
    (_, slot), = store.reserve(FP.digest, [d], [BLOCK])[0]  # no writer known (a gRPC reserve, say)
    unknown = slot.offset
    expire(store)
    assert store.counters["tainted_units"] == 2 * BLOCK // 4096
    e = external_hashes([5], FP)[0]
    at = put(store, e)
    assert at == unknown and seen.number(at) == 0  # for good


def test_clients_hash_every_read_unless_told_to_trust_the_host(monkeypatch):
    """Kills: re-reads trusted by default, and a setting misspelt into the default silently."""
    from kvstore.client.reads import VerifiedSlots
    from kvstore.errors import InvalidConfig

    monkeypatch.delenv("KVSTORE_VERIFY", raising=False)
    assert not VerifiedSlots().enabled
    monkeypatch.setenv("KVSTORE_VERIFY", "once")
    assert VerifiedSlots().enabled
    monkeypatch.setenv("KVSTORE_VERIFY", "onse")
    with pytest.raises(InvalidConfig, match="KVSTORE_VERIFY='onse': one of every-read, once"):
        VerifiedSlots()


def test_a_same_host_writer_is_gone_only_once_its_process_has_exited():
    """Kills: a quarantine released while the putting process still lives (it may still be copying
    into the extent), or never released after it exited (its DRAM lost for good)."""
    import socket
    import subprocess
    import sys

    from kvstore.daemon.local import SameHostWriter
    from tests_support import until

    ours, theirs = socket.socketpair(socket.AF_UNIX)
    try:
        assert not SameHostWriter.of(ours).gone()  # this very process, alive
    finally:
        ours.close()
        theirs.close()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    writer = SameHostWriter(os.pidfd_open(child.pid))
    assert not writer.gone()
    child.stdin.close()
    child.wait(10)
    assert until(writer.gone, 5)
