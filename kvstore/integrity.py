"""Block checksums: xxh3-64 of the bytes, seeded by the block's own hash, so another block's
bytes never verify even when a slot is reused mid-read."""
from __future__ import annotations

import xxhash


def block_checksum(block_hash: bytes, data) -> int:
    """Checksum of `data` (a buffer, or a list of buffers taken in order) as block `block_hash`."""
    if not isinstance(data, list):
        return xxhash.xxh3_64_intdigest(data, seed=int.from_bytes(block_hash[:8], "little"))
    state = checksum_state(block_hash)
    for part in data:
        state.update(part)
    return state.intdigest()


def checksum_state(block_hash: bytes) -> "xxhash.xxh3_64":
    """An incremental `block_checksum`: update() with the block's bytes in order, then intdigest()."""
    return xxhash.xxh3_64(seed=int.from_bytes(block_hash[:8], "little"))
