"""Digests taken as a read lands (kvstore.integrity.Digesting): blocks added wave by wave, hashed
partly on the calling thread and partly on the digest pool, come back each under its own key and
equal to hashing them one at a time, whatever the pool's size and the blocks' sizes."""
from __future__ import annotations

import os

import pytest

from kvstore import integrity
from kvstore.integrity import Digesting, block_digest


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_each_block_gets_its_own_digest_whatever_the_grouping(monkeypatch, workers):
    """Kills: a grouping that pairs a digest with another block's key (a block would then verify
    against another's digest), drops the caller's share or a pool task's, or hashes a part twice."""
    monkeypatch.setattr(integrity, "_WORKERS", workers)
    sizes = [64 << 10] * 9 + [1 << 20] * 5 + [4096, 700 << 10]
    blocks = [(k, os.urandom(16), os.urandom(size)) for k, size in enumerate(sizes)]
    digesting = Digesting()
    for start in range(0, len(blocks), 5):  # in waves, as a read lands
        digesting.add(blocks[start : start + 5])
    digesting.add([])
    got = digesting.results()
    assert got == {k: block_digest(h, data) for k, h, data in blocks}
    parts = [(k, h, [data[:1000], data[1000:]]) for k, h, data in blocks[:3]]  # a block in segments
    again = Digesting()
    again.add(parts)
    assert again.results() == {k: block_digest(h, data) for k, h, data in blocks[:3]}
