"""Forged blocks against a real cluster (etcd, daemons in their own processes): other bytes with a
block's old checksum (seeded xxh3-64, a second preimage computed here in about a millisecond)
brought on every path where they once passed. Each test names the variant it kills.

- put: what arrives at the node after an on-path relay (no secret) swapped a put's raw attachment
  for the forgery: the authenticated frame with the original's digest, then the forged bytes;
  likewise a gRPC Put, and bytes written into a reserved slot before the commit that names them.
- get: a client holding only the cluster secret rewrites another client's sealed block in the
  node's DRAM through the Transfer Engine (the same host's mapped arena; over TCP write grants now
  refuse it: tests/integration/test_write_grants.py), or the block's copy in the NVMe tier file
  (read on the same host and over TCP): a fresh reader's get is a miss, never those bytes.
"""
from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
from tests_support import until
from xxh3_forgery import forge, old_checksum

from kvstore import Client
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import connect
from kvstore_testing.node_status import node_counters
from transfer import Read, TransferError, Write

FP = ModelFingerprint("forged", "float16", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "forged-blocks-secret"
BLOCK = 64 << 10


def content(h: bytes, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def forgery(h: bytes, size: int = BLOCK) -> bytes:
    forged = forge(h, content(h, size).tobytes())
    assert old_checksum(h, forged) == old_checksum(h, content(h, size).tobytes())  # the old check passes it
    return forged


def counters(daemon) -> dict[str, float]:
    return node_counters(daemon.control)


def misses(reader: Client, h: bytes, size: int = BLOCK) -> bool:
    """A fresh reader's get of `h` is a miss (what a hit would have returned is never used)."""
    return reader.get(h, np.zeros(size, np.uint8)) is False


@pytest.fixture
def cluster(etcd_server, spawn_daemon):
    """(daemon, its cluster name, an honest client that knows the node)."""
    name = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("victim-node", etcd_server.url, name, secret=SECRET)
    with Client(etcd_server.url, cluster=name, fingerprint=FP, secret=SECRET) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        yield daemon, name, client


def reader(etcd_server, cluster_name: str, transport: str = "auto") -> Client:
    client = Client(etcd_server.url, cluster=cluster_name, fingerprint=FP, secret=SECRET, transport=transport)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    return client


@pytest.mark.parametrize("wire", ["unix", "tcp"])
@pytest.mark.parametrize("size", [BLOCK, 3 << 20], ids=["checked-before-the-answer", "checked-after-the-answer"])
def test_a_put_whose_attachment_was_swapped_for_a_second_preimage_is_refused(etcd_server, cluster, wire, size):
    """Kills: a node that verifies put bytes with the old checksum (a relay on the TCP wire, no
    secret needed, swapped the raw attachment and the node sealed and published it). Small puts
    are refused in the answer; large ones, answered first, are dropped by the verifier, never
    published; no reader ever gets them."""
    daemon, name, client = cluster
    h = external_hashes([1 if size == BLOCK else 2], FP)[0]
    forged = forgery(h, size)
    link = client.links.local(daemon.name) if wire == "unix" else client.links.wire(daemon.name)
    frames = connect(link.address, SECRET.encode(), "relayed", 5.0)
    try:
        frames.send({"op": "put", "fp": FP.digest, "hashes": [h.hex()], "sizes": [size],
                     "digests": [block_digest(h, content(h, size)).hex()], "sync": False}, [forged])
        reply = frames.recv(10.0)
    finally:
        frames.sock.close()
    assert reply["ok"], reply
    if size == BLOCK:
        assert reply["errors"][0].startswith("digest mismatch") and not reply["records"][0]
    assert until(lambda: counters(daemon).get("corrupt_writes", 0) == 1)
    time.sleep(0.3)  # past a publish batch: nothing shows up late either
    with reader(etcd_server, name) as fresh:
        assert not fresh.contains(h) and misses(fresh, h, size)
    assert client.put(h, content(h, size)) == 1  # the honest block still goes in, and reads back
    with reader(etcd_server, name) as fresh:
        out = np.zeros(size, np.uint8)
        assert fresh.mirror.wait_until(lambda m: m.contains(FP, h), 15)
        assert fresh.get(h, out) and np.array_equal(out, content(h, size))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_reserved_slot_written_with_a_second_preimage_does_not_commit(etcd_server, cluster, transport):
    """Kills: the old checksum on the two-step put (reserve, write with the engine, commit): bytes
    written into the slot (by a relay, or any writer of the arena) with the original's old
    checksum are refused at the commit."""
    daemon, name, _ = cluster
    h = external_hashes([4], FP)[0]
    with reader(etcd_server, name, transport) as writer:
        link = writer.links.control(daemon.name)
        peer = {"peer": writer.engine.peer_id} if transport == "tcp" else {}  # granted the slot, as a client is
        slots, _ = link.call({"op": "reserve", "fp": FP.digest, "hashes": [h.hex()], "sizes": [BLOCK], **peer})
        token, region, offset, _ = slots["slots"][0]
        source = writer.engine.register(np.frombuffer(forgery(h), np.uint8).copy(), remote_access=False)
        try:
            writer.engine.transfer([Write(source, 0, writer.links.node(daemon.name).peer.region(region), offset, BLOCK)])
        finally:
            writer.engine.unregister(source)
        commit, _ = link.call({"op": "commit", "fp": FP.digest, "tokens": [token],
                               "digests": [block_digest(h, content(h)).hex()], "sync": True})
    assert commit["errors"][0].startswith("digest mismatch")
    with reader(etcd_server, name) as fresh:
        assert not fresh.contains(h) and misses(fresh, h)


def rewrite(attacker: Client, node: str, record, data: bytes) -> bool:
    """Write `data` over a sealed block's bytes through the engine; whether they landed (read back)."""
    scratch = attacker.engine.register(np.frombuffer(data, np.uint8).copy(), remote_access=False)
    back = attacker.engine.register(np.zeros(len(data), np.uint8), remote_access=False)
    try:
        remote = attacker.links.node(node).peer.region(record.region)
        try:
            attacker.engine.transfer([Write(scratch, 0, remote, record.offset, len(data))])
        except TransferError:
            return False
        attacker.engine.transfer([Read(back, 0, remote, record.offset, len(data))])
        return bytes(back.host_view()) == data
    finally:
        attacker.engine.unregister(scratch)
        attacker.engine.unregister(back)


def test_a_block_rewritten_in_dram_through_the_engine_is_a_miss(etcd_server, cluster):
    """Kills: gets checked with the old checksum. Another tenant on the same host (the cluster
    secret and the node's uid, nothing more) rewrites a sealed block in the node's mapped DRAM with
    a second preimage of its old checksum, through the engine: a fresh reader's get is a miss, and
    the node, told, drops the copy. (Over TCP, write grants refuse such a rewrite.)"""
    transport = "auto"
    daemon, name, victim = cluster
    h = external_hashes([5], FP)[0]
    assert victim.put(h, content(h)) == 1
    record = victim.mirror.lookup(FP, h)[daemon.name]
    with reader(etcd_server, name, transport) as attacker:
        if not rewrite(attacker, daemon.name, record, forgery(h)):
            out = np.zeros(BLOCK, np.uint8)  # the engine refused the write: the block stayed whole
            assert victim.get(h, out) and np.array_equal(out, content(h))
            pytest.skip("the engine refused the rewrite: the NVMe-tier test still brings a forgery to a get")
    with reader(etcd_server, name, transport) as fresh:
        assert fresh.mirror.wait_until(lambda m: m.contains(FP, h), 15)
        assert misses(fresh, h)
    assert until(lambda: counters(daemon).get("corrupt_blocks_dram", 0) == 1)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_block_rewritten_in_the_nvme_tier_is_a_miss(etcd_server, spawn_daemon, tmp_path, transport):
    """Kills: NVMe reads checked with the old checksum, the same host's straight from the tier
    file (auto) and the node's over TCP: the tier file's copy of a block is replaced with a second
    preimage of its old checksum; a fresh reader's get is a miss."""
    name = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("nvme-victim", etcd_server.url, name, secret=SECRET, dram="1MiB", disk="4MiB",
                          extra=["--no-promote", "--keep-disk"])
    with reader(etcd_server, name) as victim:
        hashes = external_hashes(range(100, 140), FP)  # 2.5 MiB into 1 MiB of DRAM: most go to NVMe
        for h in hashes:
            victim.put(h, content(h))

        def on_nvme() -> list[bytes]:
            return [h for h in hashes if (r := victim.mirror.lookup(FP, h).get(daemon.name)) and r.tier == "nvme"]

        assert victim.mirror.wait_until(lambda m: len(on_nvme()) >= 4, 10)
        target, other = on_nvme()[:2]
        record = victim.mirror.lookup(FP, target)[daemon.name]
        fd = os.open(tmp_path / f"nvme-{daemon.name}" / f"{daemon.name}.tier", os.O_WRONLY)
        try:
            assert os.pwrite(fd, forgery(target), record.offset) == BLOCK
            os.fsync(fd)
        finally:
            os.close(fd)
        with reader(etcd_server, name, transport) as fresh:
            assert fresh.mirror.wait_until(lambda m: m.contains(FP, target) and m.contains(FP, other), 15)
            assert misses(fresh, target)
            if transport == "auto":
                assert fresh.stats["nvme_fd_reads"] == 1  # read through the fd, refused by its digest
            out = np.zeros(BLOCK, np.uint8)
            assert fresh.get(other, out) and np.array_equal(out, content(other))  # the tier still serves
        assert until(lambda: counters(daemon).get("corrupt_blocks_nvme", 0) == 1)  # told, the node drops it
