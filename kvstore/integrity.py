"""Block checksums: xxh3-64 of the bytes, seeded by the block's own hash, so another block's
bytes never verify even when a slot is reused mid-read.

Batches are hashed by the native module with the GIL released (python-xxhash holds it), over a few
threads when big; it calls python-xxhash's own xxh3, so both paths give the same values."""
from __future__ import annotations

import logging
import os
from typing import Sequence

import xxhash

log = logging.getLogger(__name__)

# Hashing is memory-bound: past a couple of threads they only compete for bandwidth.
THREADS = max(1, min(4, os.cpu_count() or 1))


def _load_native():
    try:
        import xxhash._xxhash as library
        from transfer import _native

        _native.xxh3_load(library.__file__)
        return _native
    except (ImportError, AttributeError, RuntimeError) as exc:
        log.info("checksums in Python (the GIL stays held): %s", exc)
        return None


_native = _load_native()


def _seed(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little")


def block_checksum(block_hash: bytes, data) -> int:
    """Checksum of `data` (a buffer, or a list or tuple of buffers taken in order) as block `block_hash`."""
    return block_checksums([block_hash], [data])[0]


def block_checksums(block_hashes: Sequence[bytes], datas: Sequence) -> list[int]:
    """`block_checksum` of each (hash, data) pair, in one native call when it can."""
    if _native is not None:
        return _native.xxh3_many(datas, [_seed(h) for h in block_hashes], THREADS)
    return [_python_checksum(h, d) for h, d in zip(block_hashes, datas, strict=True)]


def _python_checksum(block_hash: bytes, data) -> int:
    if not isinstance(data, (list, tuple)):
        return xxhash.xxh3_64_intdigest(data, seed=_seed(block_hash))
    state = checksum_state(block_hash)
    for part in data:
        state.update(part)
    return state.intdigest()


def checksum_state(block_hash: bytes) -> "xxhash.xxh3_64":
    """An incremental `block_checksum`: update() with the block's bytes in order, then intdigest()."""
    return xxhash.xxh3_64(seed=_seed(block_hash))
