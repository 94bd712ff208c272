"""Block records sealed by their node (kvstore.index.signatures): what a seal binds, who can check
it, and the index mirror dropping (and counting) records whose seal is not their node's, while its
bulk snapshot path still takes sealed records (tenants' included) in bulk. Each test names the
broken variant it kills; each was seen failing on it."""
from __future__ import annotations

import dataclasses
import uuid

import pytest

from kvstore.daemon.session import NodeSession
from kvstore.index import IndexMirror
from kvstore.index.mirror_tables import MirrorTables
from kvstore.index.records import BLOCK_RECORD_BYTES, MAC_BYTES, BlockRecord, Layout, NodeRecord
from kvstore.index.signatures import RecordSigner, RecordVerifier
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import Put, open_metadata

SECRET, TENANT_SECRET = b"cluster-secret-0123456789", b"acme-secret-0123456789"
FP = ModelFingerprint("m", "float16", 4, 2, 2, 64)
ACME = ModelFingerprint("m", "float16", 4, 2, 2, 64, tenant="acme")
BETA = ModelFingerprint("m", "float16", 4, 2, 2, 64, tenant="beta")
H = external_hashes([1, 2], FP)
RECORD = BlockRecord("dram", 3, 8192, 4096, bytes(range(32)))
CODED = BlockRecord("nvme", 2, 1 << 33, 1 << 20, bytes(range(1, 33)), codec=1, stored=1 << 19)


def signer(node: str = "node-a", secret: bytes = SECRET) -> RecordSigner:
    return RecordSigner(secret, "c", node, {"acme": TENANT_SECRET})


@pytest.mark.parametrize("record", [RECORD, CODED], ids=["raw", "coded"])
def test_a_seal_binds_fingerprint_hash_node_and_every_field(record):
    """Kills: a MAC that leaves out the fingerprint, the hash, the node or any field (a record moved
    to another block, node or fingerprint, or with one field changed, would still pass)."""
    raw = signer().encode(FP.digest, H[0], record)
    check = RecordVerifier(SECRET, "c").check
    assert check(FP.digest, H[0], "node-a", raw)
    assert not check(FP.digest, H[1], "node-a", raw)  # another block's key
    assert not check(FP.digest, H[0], "node-b", raw)  # another node's key (the wrong holder)
    assert not check(ACME.digest, H[0], "node-a", raw)  # another fingerprint
    assert not check(FP.digest, H[0], "node-a", signer("node-b").encode(FP.digest, H[0], record))  # node b's own seal
    fields = len(record.fields())
    for i in range(fields):  # every byte of the fields: version, tier, region, offset, size, digest (codec, stored)
        changed = bytearray(raw)
        changed[i] ^= 1
        assert not check(FP.digest, H[0], "node-a", bytes(changed)), i
    assert not check(FP.digest, H[0], "node-a", record.encode())  # unsigned: an all-zero seal
    assert not RecordVerifier(b"another-secret-012345", "c").check(FP.digest, H[0], "node-a", raw)
    assert not RecordVerifier(SECRET, "other-cluster").check(FP.digest, H[0], "node-a", raw)


def test_the_seal_survives_decoding_and_encoding_again():
    """What a client learns from a reply (a decoded record) and remembers goes back into its mirror
    byte for byte as the node published it. Kills: a seal lost on decode (the client's own puts then
    fail their check) or counted in equality (a moved record looks unchanged)."""
    raw = signer().encode(FP.digest, H[0], CODED)
    assert BlockRecord.decode(raw).encode() == raw and len(raw) == len(CODED.fields()) + MAC_BYTES
    assert signer().sign(FP.digest, H[0], CODED).encode() == raw
    assert BlockRecord.decode(raw) == CODED  # equality: the place, not the seal
    assert dataclasses.replace(CODED, offset=0) != CODED


def test_a_tenant_checks_its_own_records_with_its_own_secret_only():
    """A tenant's client lacks the cluster secret: its records carry a MAC under its own secret too.
    Kills: a tenant verifier that checks the node MAC (it would need the cluster secret), one that
    accepts another tenant's fingerprints, or a node that signs tenant records without the tenant MAC."""
    raw = signer().encode(ACME.digest, H[0], RECORD)
    assert len(raw) == BLOCK_RECORD_BYTES + MAC_BYTES
    acme = RecordVerifier(TENANT_SECRET, "c", tenant="acme")
    assert acme.check(ACME.digest, H[0], "node-a", raw)
    assert RecordVerifier(SECRET, "c").check(ACME.digest, H[0], "node-a", raw)  # the cluster's holder too
    assert not acme.check(ACME.digest, H[0], "node-b", raw)
    assert not RecordVerifier(b"beta-secret-0123456789", "c", tenant="beta").check(ACME.digest, H[0], "node-a", raw)
    assert not acme.check(FP.digest, H[0], "node-a", signer().encode(FP.digest, H[0], RECORD))  # not its own
    # A node that was not given the tenant signs its records with the node MAC only: its tenant misses.
    bare = RecordSigner(SECRET, "c", "node-a").encode(ACME.digest, H[0], RECORD)
    assert len(bare) == BLOCK_RECORD_BYTES and not acme.check(ACME.digest, H[0], "node-a", bare)
    assert acme.refused == 3


def test_an_insecure_cluster_signs_with_a_key_anyone_derives():
    raw = RecordSigner(b"", "c", "n").encode(FP.digest, H[0], RECORD)
    assert RecordVerifier(b"", "c").check(FP.digest, H[0], "n", raw)


async def test_the_mirror_drops_and_counts_records_whose_seal_is_not_their_nodes():
    """Kills: a mirror lookup that hands a reader every record (an etcd writer's included); and a
    lookup without a verifier that drops records (routing and counting need none)."""
    url, layout = f"memory://{uuid.uuid4().hex[:10]}", Layout("c")
    metadata = open_metadata(url)
    session = NodeSession(metadata, layout, NodeRecord("node-a", "a:1"), ttl=30, signer=signer())
    await session.start()
    await session.publish(FP.digest, [(H[0], RECORD)])
    forged = dataclasses.replace(RECORD, offset=0, digest=bytes(32))
    await metadata.put_many([Put(layout.block_key(FP.digest, H[1], "node-a").encode(), forged.encode()),
                             Put(layout.block_key(FP.digest, H[0], "node-b").encode(),  # node a's seal, b's key
                                 signer().encode(FP.digest, H[0], RECORD))])
    verifier = RecordVerifier(SECRET, "c")
    with IndexMirror(url, "c") as mirror:
        assert mirror.wait_loaded(5)
        assert mirror.lookup(FP, H[0], verifier) == {"node-a": RECORD}
        assert mirror.lookup(FP, H[1], verifier) == {}
        assert mirror.refused_records == 2 and verifier.refused == 2
        assert set(mirror.lookup(FP, H[0])) == {"node-a", "node-b"} and mirror.lookup(FP, H[1]) == {"node-a": forged}
        assert mirror.match(FP, H).length == 2  # counted, unchecked: a forged record costs a miss there
        # A client's own put: the reply's record, remembered, is the published one (the watch's echo
        # changes nothing) and passes.
        raw = signer().encode(FP.digest, H[1], RECORD)
        mirror.remember(FP, H[1], "node-a", BlockRecord.decode(raw))
        assert mirror.lookup(FP, H[1], verifier) == {"node-a": RECORD}
    await session.close()


@pytest.mark.parametrize("fingerprint", [FP, ACME], ids=["cluster", "tenant"])
async def test_sealed_records_load_in_bulk(fingerprint, monkeypatch):
    """The snapshot's bulk path takes pages of sealed records of one size (the common one, and a
    tenant's, 16 bytes longer). Kills: a bulk path still sized for unsigned records (every page
    through the one-key path: a snapshot several times slower)."""
    slow: list[int] = []  # block records that took the one-key path
    real = MirrorTables.apply_slowly

    def counted(self, snap, keys, values):
        slow.append(sum(b"/blocks/" in k for k in keys))
        return real(self, snap, keys, values)

    monkeypatch.setattr(MirrorTables, "apply_slowly", counted)
    url, layout = f"memory://{uuid.uuid4().hex[:10]}", Layout("c")
    session = NodeSession(open_metadata(url), layout, NodeRecord("node-a", "a:1"), ttl=30, signer=signer())
    await session.start()
    hashes = external_hashes(range(3000), fingerprint)
    await session.publish(fingerprint.digest, [(h, dataclasses.replace(RECORD, offset=i * 4096))
                                               for i, h in enumerate(hashes)])
    verifier = RecordVerifier(TENANT_SECRET, "c", "acme") if fingerprint.tenant else RecordVerifier(SECRET, "c")
    with IndexMirror(url, "c") as mirror:
        assert mirror.wait_loaded(5)
        assert mirror.block_count == 3000 and sum(slow) == 0 and mirror.malformed == 0
        assert mirror.lookup(fingerprint, hashes[7], verifier) == {"node-a": dataclasses.replace(RECORD, offset=7 * 4096)}
    await session.close()
