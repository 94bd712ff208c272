"""Block checksums: xxh3-64 seeded by the block's hash, the same whole or in parts."""
from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from kvstore.integrity import block_checksum, block_checksums, checksum_state

# xxh3 switches code paths at 16, 128 and 240 bytes, and at its 1 KiB stripe blocks.
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 65536, (1 << 20) + 7]


def reference(block_hash: bytes, data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=int.from_bytes(block_hash[:8], "little"))


def test_whole_parts_and_streaming_agree_at_every_length_and_split():
    rng = random.Random(7)
    for n in LENGTHS:
        data, block_hash = rng.randbytes(n), rng.randbytes(16)
        cuts = sorted(rng.randrange(n + 1) for _ in range(3))
        parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        want = reference(block_hash, data)
        assert block_checksum(block_hash, data) == want, n
        assert block_checksum(block_hash, parts) == want, n
        assert block_checksum(block_hash, tuple(parts)) == want, n
        state = checksum_state(block_hash)
        state.update(data)
        assert state.intdigest() == want


def test_each_block_is_seeded_by_its_own_hash():
    rng = np.random.default_rng(3)
    hashes = [rng.bytes(16) for _ in range(8)]
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    sums = block_checksums(hashes, [data] * len(hashes))
    assert sums == [reference(h, data.tobytes()) for h in hashes] and len(set(sums)) == len(sums)


def test_refuses_what_it_cannot_hash_as_one_block():
    with pytest.raises(ValueError):
        block_checksums([b"x" * 16], [np.zeros((4, 4), np.uint8)[:, :2]])  # not contiguous
    with pytest.raises(ValueError):
        block_checksums([b"x" * 16, b"y" * 16], [b"a"])  # one hash per block
    with pytest.raises(TypeError):
        block_checksums([b"x" * 16], [12345])  # not a buffer
