"""Block checksums: xxh3-64 of the bytes, seeded by the block's own hash, so another block's
bytes never verify even when a slot is reused mid-read."""
from __future__ import annotations

import xxhash


def block_checksum(block_hash: bytes, data) -> int:
    """Checksum of `data` (any buffer) as the content of block `block_hash`."""
    return xxhash.xxh3_64_intdigest(data, seed=int.from_bytes(block_hash[:8], "little"))
