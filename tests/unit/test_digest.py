"""Digests the engine takes while it copies (a write's source bytes, a read's landed bytes): the
same as python-xxhash's xxh3 of those bytes."""
from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from transfer import Engine, InvalidOp, Read, Write, _native, digest

# xxh3 switches code paths at 16, 128 and 240 bytes and at its 1 KiB stripes; the engine hashes
# 64 KiB chunks as it copies.
LENGTHS = [1, 3, 16, 17, 128, 129, 240, 241, 1023, 1025, 65535, 65536, 65537, (1 << 20) + 7, (5 << 20) + 3]


def reference(data, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(bytes(data), seed=seed)


def test_native_xxh3_is_python_xxhash_s():
    assert digest.AVAILABLE  # python-xxhash's wheel exports its xxh3 calls on this platform
    rng = random.Random(5)
    for n in LENGTHS:
        data, seed = rng.randbytes(n), rng.getrandbits(64)
        assert _native.xxh3(data, seed) == reference(data, seed), n


@pytest.fixture
def engine():
    with Engine("digests", listen=None) as e:
        yield e


@pytest.mark.parametrize("op_kind", ["write", "read"])
def test_engine_digests_local_copies_inline_and_on_workers(engine, op_kind):
    """Each op's digest is of its local bytes: a write's source, a read's destination (what landed),
    for batches small enough to copy in submit() and large ones copied by the worker pool."""
    rng = np.random.default_rng(9)
    arena = engine.allocate(16 << 20)
    arena.host_view()[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
    for lengths in ([1, 4097, 65537], [1 << 20] * 5 + [(5 << 20) + 3]):
        seeds = [int(s) for s in rng.integers(0, 2**63, len(lengths))]
        buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
        regions = [engine.register(b) for b in buffers]
        offsets = np.cumsum([0, *lengths[:-1]]).tolist()
        if op_kind == "write":
            ops = [Write(r, 0, arena, off, n) for r, off, n in zip(regions, offsets, lengths)]
        else:
            ops = [Read(r, 0, arena, off, n) for r, off, n in zip(regions, offsets, lengths)]
        batch = engine.submit(ops, digest_seeds=seeds)
        batch.wait(10)
        got = batch.digests()
        for buffer, off, n, seed, value in zip(buffers, offsets, lengths, seeds, got):
            assert bytes(arena.host_view()[off : off + n]) == buffer.tobytes()  # the copy happened
            assert value == reference(buffer, seed)


def test_engine_refuses_digests_it_cannot_take(engine, tmp_path):
    source = engine.register(np.ones(4096, np.uint8))
    arena = engine.allocate(8192)
    with pytest.raises(InvalidOp):
        engine.submit([Write(source, 0, arena, 0, 4096)], digest_seeds=[1, 2])  # one seed per op
    tier = engine.register_file(tmp_path / "tier", 8192)
    batch = engine.submit([Write(source, 0, tier, 0, 4096)], digest_seeds=[1])  # files: no digest on the way
    with pytest.raises(InvalidOp):
        batch.wait(5)
    plain = engine.submit([Write(source, 0, arena, 0, 4096)])
    plain.wait(5)
    with pytest.raises(RuntimeError):
        plain.digests()  # submitted without seeds
