"""Block checksums: the native batch path gives exactly python-xxhash's xxh3-64 values."""
from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from kvstore import integrity
from kvstore.integrity import block_checksum, block_checksums, checksum_state

needs_native = pytest.mark.skipif(integrity._native is None, reason="native checksums not loaded")


@pytest.fixture(params=["native", "python"])
def path(request, monkeypatch):
    """Each test runs on the native path and on the Python fallback."""
    if request.param == "native" and integrity._native is None:
        pytest.skip("native checksums not loaded")
    if request.param == "python":
        monkeypatch.setattr(integrity, "_native", None)
    return request.param

# xxh3 switches code paths at 16, 128 and 240 bytes, and at its 1 KiB stripe blocks.
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 65536, (1 << 20) + 7]


def reference(block_hash: bytes, data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=int.from_bytes(block_hash[:8], "little"))


def test_equals_python_xxhash_at_every_length_and_split(path):
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


def test_a_big_batch_on_several_threads_keeps_each_block_its_own_value(path):
    rng = np.random.default_rng(3)
    hashes = [rng.bytes(16) for _ in range(24)]
    datas = [rng.integers(0, 256, (1 << 20) + i, dtype=np.uint8) for i in range(24)]  # 24 MiB: past the thread cut
    datas[5] = [memoryview(datas[5])[:1000], memoryview(datas[5])[1000:]]
    got = block_checksums(hashes, datas)
    assert got == [reference(h, b"".join(bytes(p) for p in d) if isinstance(d, list) else d.tobytes())
                   for h, d in zip(hashes, datas)]
    assert len(set(got)) == len(got)


def test_refuses_what_it_cannot_hash_as_one_block(path):
    with pytest.raises(ValueError):
        block_checksums([b"x" * 16], [np.zeros((4, 4), np.uint8)[:, :2]])  # not contiguous
    with pytest.raises(ValueError):
        block_checksums([b"x" * 16, b"y" * 16], [b"a"])  # one hash per block
    with pytest.raises(TypeError):
        block_checksums([b"x" * 16], [12345])  # not a buffer


@needs_native
def test_any_sequence_of_blocks_even_one_making_fresh_items():
    """Items a sequence creates on access are kept alive while hashed (a borrowed one was freed)."""
    class Fresh:
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> bytes:
            if not 0 <= i < 64:
                raise IndexError(i)
            return bytes([i]) * (4096 + i)

    seeds = list(range(64))
    assert integrity._native.xxh3_many(Fresh(), seeds) == \
        [xxhash.xxh3_64_intdigest(bytes([i]) * (4096 + i), seed=i) for i in seeds]
