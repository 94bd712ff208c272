"""Records forged in etcd against a real cluster: a real etcd, two daemons in their own processes,
readers in this one. The attacker can write etcd (it holds etcd's credentials, as any pod that may
reach it did) but has no kvstore secret: it knows the bytes of some stored blocks and computes
their digests (keyed by the block hash alone, a public function), and rewrites block records to
point a block at them: on the same node at another offset, under another node's key (a node that
does not hold the block), and with the block's real holder's record deleted so a reader must go to
the wrong holder. A reader, fresh (the forgeries come in its snapshot) or already running (they
come by its watch), as the cluster secret's holder or as a tenant, never gets those bytes: each
get is a miss, and the records it dropped are counted.

Kills (each seen failing): readers that trust any record in the index (no seal checked: every case
here returned the other block's bytes), and a check against a seal that does not bind the node
(the genuine record of one holder moved under another's key).
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.index.records import BlockRecord, Layout
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import Put, open_metadata

SECRET = "forged-records-cluster-secret"
TENANT_SECRET = "forged-records-acme-secret-0123"
FP = ModelFingerprint("forged-records", "float16", 16, 2, 2, 64, kv_layout="bytes")
ACME = ModelFingerprint("forged-records", "float16", 16, 2, 2, 64, kv_layout="bytes", tenant="acme")
BLOCK = 64 << 10


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def cluster(etcd_server, spawn_daemon, tmp_path):
    """(cluster name, an honest client of the cluster secret): two nodes given tenant acme."""
    tenants = tmp_path / "tenants"
    tenants.write_text(f"acme {TENANT_SECRET}\n")
    tenants.chmod(0o600)
    name = uuid.uuid4().hex[:8]
    for node in ("node-a", "node-b"):
        spawn_daemon(node, etcd_server.url, name, secret=SECRET, extra=["--tenants", str(tenants)])
    with Client(etcd_server.url, cluster=name, secret=SECRET) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        yield name, client


def reader(etcd_server, cluster_name: str, tenant: bool) -> Client:
    client = Client(etcd_server.url, cluster=cluster_name, secret=TENANT_SECRET if tenant else SECRET,
                    tenant="acme" if tenant else None)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
    return client


def etcd_write(url: str, puts: list[tuple[str, bytes]], deletes: list[str] = ()) -> int:
    """What a writer with etcd's credentials and no kvstore secret does: plain puts and deletes."""
    async def run() -> int:
        metadata = open_metadata(url)
        try:
            for key in deletes:
                await metadata.delete(key)
            return await metadata.put_many([Put(k.encode(), v) for k, v in puts])
        finally:
            await metadata.close()

    return asyncio.run(run())


def forged(record: BlockRecord, h: bytes, data: np.ndarray) -> bytes:
    """`record`'s place, with a digest computed for block `h` over `data` (which lies there)."""
    return dataclasses.replace(record, digest=block_digest(h, data), seal=b"").encode()


def gets_no_other_bytes(client: Client, fingerprint, h: bytes, others: list[np.ndarray]) -> bool:
    out = np.zeros(BLOCK, np.uint8)
    hit = client.get(h, out, fingerprint)
    assert not any(np.array_equal(out, o) for o in others), "a reader got another block's bytes"
    return not hit


@pytest.mark.parametrize("as_tenant", [False, True], ids=["cluster-reader", "tenant-reader"])
def test_a_writer_to_etcd_without_the_secret_causes_misses_never_other_bytes(etcd_server, cluster, as_tenant):
    cluster_name, client = cluster
    fp = ACME if as_tenant else FP
    layout = Layout(cluster_name)
    # Stored honestly: the victim and a neighbour on node a, another block on node b.
    victim, neighbour, elsewhere, unstored, moved = external_hashes(range(5), fp)
    assert client.put_many([(victim, content(victim)), (neighbour, content(neighbour)), (moved, content(moved))],
                           fp, exclude={"node-b"}) == 3
    assert client.put_many([(elsewhere, content(elsewhere))], fp, exclude={"node-a"}) == 1
    assert client.mirror.wait_until(lambda m: all(m.lookup(fp, h) for h in (victim, neighbour, moved))
                                    and "node-b" in m.lookup(fp, elsewhere), 15)
    at_a = client.mirror.lookup(fp, neighbour)["node-a"]
    at_b = client.mirror.lookup(fp, elsewhere)["node-b"]
    genuine = client.mirror.lookup(fp, moved)["node-a"].encode()  # node a's sealed record of `moved`
    key = lambda h, node: layout.block_key(fp.digest, h, node)  # noqa: E731
    others = [content(neighbour), content(elsewhere)]

    with reader(etcd_server, cluster_name, as_tenant) as live:  # learns the forgeries by its watch
        assert live.mirror.wait_until(lambda m: m.contains(fp, victim) and m.contains(fp, moved), 15)
        revision = etcd_write(etcd_server.url, [
            # node a's own key of the victim, at the neighbour's offset, with a digest computed for it
            (key(victim, "node-a"), forged(at_a, victim, content(neighbour))),
            # a block no node holds, under node b's key, pointing at node b's other block
            (key(unstored, "node-b"), forged(at_b, unstored, content(elsewhere))),
            # the wrong holder: node b named for `moved` (node a's genuine record, node b's key)
            (key(moved, "node-b"), genuine)],
            deletes=[key(moved, "node-a")])
        assert live.mirror.wait_for_revision(revision, 15)
        with reader(etcd_server, cluster_name, as_tenant) as fresh:  # the forgeries in its snapshot
            for who in (live, fresh):
                assert who.mirror.contains(fp, unstored) and set(who.mirror.lookup(fp, moved)) == {"node-b"}
                for h in (victim, unstored, moved):
                    assert gets_no_other_bytes(who, fp, h, others + [content(moved)] * (h != moved)), h.hex()
                assert who.stats["refused_records"] == 3 and who.mirror.refused_records >= 3
            out = np.zeros(BLOCK, np.uint8)
            assert fresh.get(neighbour, out, fp) and np.array_equal(out, content(neighbour))  # the rest still reads

    # The wrong holder, the other way: node b's record of `elsewhere` under node a's key, at a place
    # that holds, on node a, a block whose digest the writer computed. Bytes of node a are never read.
    revision = etcd_write(etcd_server.url, [(key(elsewhere, "node-a"), forged(at_a, elsewhere, content(neighbour)))],
                          deletes=[key(elsewhere, "node-b")])
    with reader(etcd_server, cluster_name, as_tenant) as fresh:
        assert fresh.mirror.revision >= revision
        assert set(fresh.mirror.lookup(fp, elsewhere)) == {"node-a"}
        assert gets_no_other_bytes(fresh, fp, elsewhere, [content(neighbour)])
        assert fresh.stats["refused_records"] == 1
