"""Block digests: BLAKE3-256 keyed by the block's hash, the same whole, in parts and streamed, and
out of reach of the second preimages that the old seeded xxh3-64 checksum let anyone compute."""
from __future__ import annotations

import os
import random

import blake3
import numpy as np
import pytest
from xxh3_forgery import forge, old_checksum

from kvstore import integrity
from kvstore.errors import InvalidRequest
from kvstore.integrity import DIGEST_BYTES, block_digest, block_digests, check_digests, digest_state

# BLAKE3 compresses 64-byte blocks into 1 KiB chunks and a tree of chunks: lengths around both.
LENGTHS = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3073, 65536, (1 << 20) + 7]


def reference(block_hash: bytes, data: bytes) -> bytes:
    return blake3.blake3(data, key=b"kvstore block v2" + block_hash).digest()


def test_whole_parts_and_streaming_agree_at_every_length_and_split():
    rng = random.Random(7)
    for n in LENGTHS:
        data, block_hash = rng.randbytes(n), rng.randbytes(16)
        cuts = sorted(rng.randrange(n + 1) for _ in range(3))
        parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        want = reference(block_hash, data)
        assert len(want) == DIGEST_BYTES == 32
        assert block_digest(block_hash, data) == want, n
        assert block_digest(block_hash, parts) == want, n
        assert block_digest(block_hash, tuple(parts)) == want, n
        state = digest_state(block_hash)
        state.update(data)
        assert state.digest() == want


def test_each_block_is_keyed_by_its_own_hash_and_any_buffer_is_its_bytes():
    rng = np.random.default_rng(3)
    hashes = [rng.bytes(16) for _ in range(8)]
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    sums = block_digests(hashes, [data] * len(hashes))
    assert sums == [reference(h, data.tobytes()) for h in hashes] and len(set(sums)) == len(sums)
    # A float16 tensor and a 2-D array are their bytes, as the client and the node see them.
    assert block_digest(hashes[0], data.view(np.float16)) == sums[0]
    assert block_digest(hashes[0], data.reshape(64, 64)) == sums[0]


def test_a_large_batch_hashed_on_several_threads_equals_one_at_a_time(monkeypatch):
    monkeypatch.setattr(integrity, "_WORKERS", 4)
    hashes = [os.urandom(16) for _ in range(9)]
    blocks = [os.urandom(1 << 20) for _ in range(9)]
    assert block_digests(hashes, blocks) == [reference(h, b) for h, b in zip(hashes, blocks)]
    assert block_digests(hashes[:2], [[b[:100], b[100:]] for b in blocks[:2]]) == \
        [reference(h, b) for h, b in zip(hashes[:2], blocks[:2])]


def test_refuses_what_it_cannot_hash_as_one_block():
    with pytest.raises(ValueError):
        block_digests([b"x" * 16], [np.zeros((4, 4), np.uint8)[:, :2]])  # not contiguous
    with pytest.raises(ValueError):
        block_digests([b"x" * 16, b"y" * 16], [b"a"])  # one hash per block
    with pytest.raises(TypeError):
        block_digests([b"x" * 16], [12345])  # not a buffer
    with pytest.raises(ValueError):
        block_digest(b"short", b"a")  # block hashes are 16 bytes


def test_a_node_takes_only_full_digests():
    """Kills: a node that still takes 64-bit checksums (an older client's) as digests."""
    assert check_digests([b"\1" * 32, bytearray(32)]) == [b"\1" * 32, bytes(32)]
    for bad in ([12345], [b"\1" * 8], [b"\1" * 33], ["00" * 32]):
        with pytest.raises(InvalidRequest, match="32 bytes"):
            check_digests(bad)


@pytest.mark.parametrize("size", [241, 1337, 4096, 64 << 10, 1 << 20])
def test_a_second_preimage_of_the_old_checksum_is_refused(size):
    """Kills: digests that are the old seeded xxh3-64 (or any checksum whose seed is the block's
    hash): other bytes with the victim's old checksum, computed in about a millisecond, are a
    different BLAKE3 digest."""
    block_hash, data = os.urandom(16), os.urandom(size)
    forged = forge(block_hash, data)
    assert forged != data and len(forged) == size
    assert old_checksum(block_hash, forged) == old_checksum(block_hash, data)  # the old check passes it
    assert block_digest(block_hash, forged) != block_digest(block_hash, data)  # the new one does not


def test_digest_threads_come_from_the_environment_or_the_cpus(monkeypatch, caplog):
    """KVSTORE_DIGEST_THREADS sets the digest pool's size; a value that is no positive integer is
    named in a warning and the default (a thread a CPU, up to 16) used, never a traceback at
    import."""
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv(integrity.DIGEST_THREADS_ENV, raising=False)
    assert integrity.digest_threads() == max(1, min(integrity.MAX_DIGEST_THREADS, cpus))
    monkeypatch.setenv(integrity.DIGEST_THREADS_ENV, "5")
    assert integrity.digest_threads() == 5
    for bad in ("0", "-2", "many", "1.5"):
        monkeypatch.setenv(integrity.DIGEST_THREADS_ENV, bad)
        with caplog.at_level("WARNING", logger="kvstore.integrity"):
            assert integrity.digest_threads() == max(1, min(integrity.MAX_DIGEST_THREADS, cpus))
        assert integrity.DIGEST_THREADS_ENV in caplog.text and repr(bad) in caplog.text
        caplog.clear()
