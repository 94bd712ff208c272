"""Verifying reads, against real etcd and a daemon in its own process. By default every read is
hashed, re-reads included: a slot rewritten in place after a client verified it is a miss for that
client too. With KVSTORE_VERIFY=once (kvstore.seals, kvstore.client.reads.VerifiedSlots) a
same-host re-read of a DRAM slot this client verified, whose seal number has not moved, is not
hashed again; every other read is, and a slot freed and reused since (for another block, or for
the same one) is never trusted, so it can never return another block's bytes."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes
from tests_support import until
from transfer import Write

FP = ModelFingerprint("verified-reads", "float16", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "verified-reads-secret"
BLOCK = 256 << 10


def content(h: bytes, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little") + seed).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def node(etcd_server, spawn_daemon):
    """(daemon, cluster name): one node, a DRAM tier of 4 MiB."""
    name = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("verified-node", etcd_server.url, name, secret=SECRET, dram="4MiB")
    return daemon, name


def client(etcd_server, cluster: str, transport: str = "auto") -> Client:
    c = Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport, publish="sync")
    assert c.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    return c


@pytest.fixture
def once(monkeypatch):
    monkeypatch.setenv("KVSTORE_VERIFY", "once")


def test_by_default_a_slot_rewritten_in_place_after_a_verified_read_is_a_miss(etcd_server, node):
    """Kills: re-reads trusted by default. A reader verified block A; a process of the node's user
    (here: another client, through its engine into the mapped arena) rewrites A's slot in place,
    which no seal number shows: the reader's next get is a miss, never those bytes."""
    daemon, cluster = node
    a = external_hashes([7], FP)[0]
    with client(etcd_server, cluster) as reader, client(etcd_server, cluster) as other:
        reader.put(a, content(a))
        out = np.zeros(BLOCK, np.uint8)
        assert reader.get(a, out) and reader.get(a, out) and reader.stats["reads_unhashed"] == 0
        record = reader.mirror.lookup(FP, a)[daemon.name]
        assert other.mirror.wait_until(lambda m: m.contains(FP, a), 10)
        scratch = other.engine.register(content(a, seed=1), remote_access=False)
        try:
            other.engine.transfer([Write(scratch, 0, other.links.node(daemon.name).peer.region(record.region),
                                         record.offset, BLOCK)])
        finally:
            other.engine.unregister(scratch)
        assert reader.get(a, np.zeros(BLOCK, np.uint8)) is False


def test_a_re_read_of_a_slot_this_client_verified_is_not_hashed_again(etcd_server, node, once):
    """Kills (KVSTORE_VERIFY=once): a re-read that hashes every block again (the cost this removes),
    and one that trusts a slot on its first read (the putter's, or another client's: only this
    client's own check counts)."""
    daemon, cluster = node
    hashes = external_hashes(range(8), FP)
    with client(etcd_server, cluster) as putter, client(etcd_server, cluster) as reader:
        putter.put_many([(h, content(h)) for h in hashes])
        assert reader.mirror.wait_until(lambda m: all(m.contains(FP, h) for h in hashes), 10)
        outs = [np.zeros(BLOCK, np.uint8) for _ in hashes]
        assert all(putter.get_many(hashes, outs)) and putter.stats["reads_unhashed"] == 0  # never checked by it
        assert all(reader.get_many(hashes, outs)) and reader.stats["reads_unhashed"] == 0  # its first read
        outs = [np.zeros(BLOCK, np.uint8) for _ in hashes]
        assert all(reader.get_many(hashes, outs)) and reader.stats["reads_unhashed"] == len(hashes)
        assert all(np.array_equal(o, content(h)) for o, h in zip(outs, hashes))
    with client(etcd_server, cluster, transport="tcp") as remote:  # over TCP: hashed, every time
        assert remote.mirror.wait_until(lambda m: all(m.contains(FP, h) for h in hashes), 10)
        for _ in range(2):
            assert all(remote.get_many(hashes, [np.zeros(BLOCK, np.uint8) for _ in hashes]))
        assert remote.stats["reads_unhashed"] == 0


@pytest.mark.parametrize("again", ["another block", "the same block"])
def test_a_slot_freed_and_reused_since_it_was_verified_is_hashed_again(etcd_server, node, once, again):
    """Kills (KVSTORE_VERIFY=once): a re-read that trusts a slot it verified once without checking that the slot was not
    freed since (a remembered offset, not a seal number). The reader verified block A; A is removed
    and its slot goes to `again`; the reader's mirror still lists A there (the node's news is late):
    another block's bytes are a miss, never A's; A put back into the same slot is hashed (a new
    sealing), and a hit."""
    daemon, cluster = node
    a, b = external_hashes([100, 101], FP)
    with client(etcd_server, cluster) as writer, client(etcd_server, cluster) as reader:
        writer.put(a, content(a))
        assert reader.mirror.wait_until(lambda m: m.contains(FP, a), 10)
        out = np.zeros(BLOCK, np.uint8)
        assert reader.get(a, out) and reader.get(a, out) and reader.stats["reads_unhashed"] == 1
        stale = reader.mirror.lookup(FP, a)
        assert writer.remove([a]) == 1
        newcomer = b if again == "another block" else a
        writer.put(newcomer, content(newcomer))
        moved = writer.mirror.lookup(FP, newcomer)[daemon.name]
        assert (moved.region, moved.offset) == (stale[daemon.name].region, stale[daemon.name].offset)  # its slot
        assert until(lambda: reader.mirror.contains(FP, newcomer), 10)
        real_lookup = reader.mirror.lookup
        reader.mirror.lookup = lambda fp, h, *checked: stale if bytes(h) == a else real_lookup(fp, h, *checked)  # late news
        before = reader.stats["reads_unhashed"]
        out = np.zeros(BLOCK, np.uint8)
        if again == "another block":
            assert reader.get(a, out) is False  # B's bytes under A's record: a miss
        else:
            assert reader.get(a, out) and np.array_equal(out, content(a))
        assert reader.stats["reads_unhashed"] == before  # hashed, not trusted
