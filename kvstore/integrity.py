"""Block checksums: xxh3-64 of the bytes, seeded by the block's own hash, so another block's
bytes never verify even when a slot is reused mid-read. python-xxhash releases the GIL while it
hashes, so a node verifying a big commit does not stall its other requests."""
from __future__ import annotations

from typing import Sequence

import xxhash


def _seed(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little")


def checksum_seeds(block_hashes: Sequence[bytes]) -> list[int]:
    """The xxh3 seed of each block's checksum: engine copies take checksums on the way with these
    (`Engine.submit(..., digest_seeds=...)`)."""
    return [_seed(h) for h in block_hashes]


def block_checksum(block_hash: bytes, data) -> int:
    """Checksum of `data` (a buffer, or a list or tuple of buffers taken in order) as block `block_hash`."""
    if not isinstance(data, (list, tuple)):
        return xxhash.xxh3_64_intdigest(data, seed=_seed(block_hash))
    state = checksum_state(block_hash)
    for part in data:
        state.update(part)
    return state.intdigest()


def block_checksums(block_hashes: Sequence[bytes], datas: Sequence) -> list[int]:
    """`block_checksum` of each (hash, data) pair."""
    return [block_checksum(h, d) for h, d in zip(block_hashes, datas, strict=True)]


def checksum_state(block_hash: bytes) -> "xxhash.xxh3_64":
    """An incremental `block_checksum`: update() with the block's bytes in order, then intdigest()."""
    return xxhash.xxh3_64(seed=_seed(block_hash))
