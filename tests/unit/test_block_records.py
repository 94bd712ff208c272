"""Block records, version 4: the 32-byte BLAKE3 digest in a 50-byte record's fields, then the
node's seal (16 bytes; 32 for a tenant's). A version-1 record (26 bytes, a 64-bit xxh3 checksum
anyone can forge a match for) and the unsigned versions 2 and 3 are refused wherever they turn up,
never read as if they were version 4."""
from __future__ import annotations

import struct
import uuid

import pytest

from kvstore.daemon.session import NodeSession
from kvstore.errors import InvalidRecord
from kvstore.index import IndexMirror
from kvstore.index.records import BLOCK_RECORD_BYTES, BLOCK_RECORD_VERSION, BlockRecord, Layout, NodeRecord
from kvstore.keys import ModelFingerprint, chain_hashes
from kvstore.metadata import Put, open_metadata

FP = ModelFingerprint("m", "float16", 4, 2, 2, 64)
HASHES = chain_hashes(FP, list(range(4 * 6)))
DIGEST = bytes(range(32))


def version1(tier: int = 0, region: int = 3, offset: int = 4096, size: int = 4096, checksum: int = 99) -> bytes:
    """A record as nodes wrote it before BLAKE3: version, tier, region, offset, size, xxh3-64."""
    return struct.pack("<BBIQIQ", 1, tier, region, offset, size, checksum)


def test_a_record_carries_its_whole_digest_then_its_seal():
    record = BlockRecord("nvme", 3, 1 << 40, 4096, DIGEST)
    raw = record.encode()
    assert len(raw) == BLOCK_RECORD_BYTES == 66 and raw[0] == BLOCK_RECORD_VERSION == 4
    assert BlockRecord.decode(raw) == record and raw[:50].endswith(DIGEST) and raw[50:] == bytes(16)  # unsigned


def test_an_unsigned_record_of_the_previous_version_is_refused_by_its_version():
    """Kills: a decoder that reads a version-2 record (no seal, any etcd writer's) as version 4."""
    unsigned = struct.pack("<BBIQI32s", 2, 0, 3, 4096, 4096, DIGEST)
    for raw in (unsigned, unsigned + bytes(16)):
        with pytest.raises(InvalidRecord, match="version 2 not understood"):
            BlockRecord.decode(raw)


@pytest.mark.parametrize("raw", [version1(), version1() + bytes(24), bytes([1]) + bytes(49)],
                         ids=["v1-as-written", "v1-padded-to-v2-size", "v2-size-version-1"])
def test_a_version_1_record_is_refused_by_its_version_not_misread(raw):
    """Kills: a decoder that reads any record of the right size (or the first 26 bytes) whatever
    its version byte says: an old checksum would be taken for the start of a digest."""
    with pytest.raises(InvalidRecord, match="version 1 not understood"):
        BlockRecord.decode(raw)


@pytest.mark.parametrize("raw", [BlockRecord("dram", 1, 0, 1, DIGEST).encode()[:26], b"",
                                 BlockRecord("dram", 1, 0, 1, DIGEST).encode() + b"\0",
                                 bytes([4, 7]) + bytes(64)],
                         ids=["v4-truncated", "empty", "v4-long", "unknown-tier"])
def test_a_version_4_record_of_the_wrong_size_or_tier_is_refused(raw):
    with pytest.raises(InvalidRecord):
        BlockRecord.decode(raw)


@pytest.mark.parametrize("digest", [99, b"\1" * 8, b"\1" * 33, "00" * 32],
                         ids=["int-checksum", "8-bytes", "33-bytes", "hex-string"])
def test_a_record_without_a_full_digest_cannot_be_written(digest):
    """Kills: a node that publishes a 64-bit checksum (or a short digest) in a record."""
    with pytest.raises(InvalidRecord, match="32 bytes"):
        BlockRecord("dram", 1, 0, 4096, digest).encode()


async def test_the_mirror_lists_no_block_an_older_node_recorded():
    """An index an older node wrote (version-1 records), at start-up (the bulk load) and after
    (the watch): none of those blocks is listed, and every good record still is."""
    url, layout = f"memory://{uuid.uuid4().hex[:10]}", Layout("c")
    metadata = open_metadata(url)
    session = NodeSession(metadata, layout, NodeRecord("new", "new:1"), segment="{}", ttl=30)
    await session.start()
    old = [Put(layout.block_key(FP.digest, h, "old").encode(), version1(offset=i * 4096))
           for i, h in enumerate(HASHES[:3])]
    await metadata.put_many(old)
    await session.publish(FP.digest, [(h, BlockRecord("dram", 3, 0, 4096, DIGEST)) for h in HASHES[3:4]])
    with IndexMirror(url, "c") as mirror:
        assert not any(mirror.contains(FP, h) for h in HASHES[:3]) and mirror.contains(FP, HASHES[3])
        assert mirror.malformed == 3
        later = [Put(layout.block_key(FP.digest, h, "old").encode(), version1()) for h in HASHES[4:6]]
        await metadata.put_many(later)
        revision = await session.publish(FP.digest, [(HASHES[0], BlockRecord("nvme", 3, 0, 4096, DIGEST))])
        assert mirror.wait_for_revision(revision)
        assert not any(mirror.contains(FP, h) for h in HASHES[4:6])
        assert mirror.lookup(FP, HASHES[0]) == {"new": BlockRecord("nvme", 3, 0, 4096, DIGEST)}
    await session.close()


def test_a_record_claiming_more_bytes_than_a_block_can_hold_is_refused():
    """A forged record names the sizes a reader allocates (and decodes a coded frame into) before
    it can check the bytes' digest. Kills: a decode that takes any u32 size (a 2 MiB lz4 frame
    claiming 512 MiB grew a reader's memory before its digest failed)."""
    from kvstore.index.records import CODED_RECORD_VERSION, MAX_BLOCK_BYTES, _CODED

    assert BlockRecord.decode(BlockRecord("dram", 1, 0, MAX_BLOCK_BYTES, DIGEST).encode()).size == MAX_BLOCK_BYTES
    huge = struct.pack("<BBIQI32s", BLOCK_RECORD_VERSION, 0, 1, 0, 512 << 20, DIGEST) + bytes(16)
    with pytest.raises(InvalidRecord, match="at most"):
        BlockRecord.decode(huge)
    swollen = _CODED.pack(CODED_RECORD_VERSION, 1, 1, 4096, 1 << 20, DIGEST, 1, (1 << 20) + 4096) + bytes(16)
    with pytest.raises(InvalidRecord, match="smaller than the block"):
        BlockRecord.decode(swollen)
    coded = _CODED.pack(CODED_RECORD_VERSION, 1, 1, 4096, 1 << 20, DIGEST, 1, 1 << 19) + bytes(16)
    assert BlockRecord.decode(coded).stored == 1 << 19
