"""Block digests: BLAKE3-256 of a block's bytes, keyed by the block's own hash.

Why BLAKE3: a digest is what a reader trusts instead of the writer, and every client holds the
cluster secret, so the digest must resist a second preimage by anyone (the seeded xxh3-64 it
replaces did not: with the seed known, another block with the same checksum took a millisecond).
BLAKE3 is collision resistant and, here, 4x the speed of SHA-256 even with the CPU's SHA
instructions (6 vs 1.4 GB/s a core on 1 MiB); the `blake3` package releases the GIL while it hashes,
so a node verifying a big commit does not stall its other requests.

Why 32 bytes: the full output, 128-bit security against collisions as well as second preimages.
A 16-byte digest would leave collisions at 2^64 work, in reach of a determined writer who wants two
different blocks to pass under one record (say, a harmless copy for an audit and another for
readers); the index pays 24 bytes a record for the difference.

Why keyed: the key is a fixed domain tag and the block's hash, so bytes that verify as one block
never verify as another (a slot reused mid-read holds another block's bytes: a miss, not a hit).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from threading import Lock
from typing import Any, Sequence

import blake3

from .errors import InvalidRequest
from .keys import HASH_BYTES

DIGEST_BYTES = 32
DIGEST_NAME = "blake3-256, keyed by 'kvstore block v2' || block hash"
_DOMAIN = b"kvstore block v2"  # with a 16-byte block hash: BLAKE3's 32-byte key
assert len(_DOMAIN) + HASH_BYTES == 32
# A batch is hashed on several threads once it is this large and its blocks are large enough that
# handing one over costs less than hashing it (64 KiB blocks: slower handed over). At most half the
# CPUs this process may use hash (the others copy, serve and run the caller): on 2 vCPUs that is one,
# where two threads hashed 32 x 1 MiB 15-20 % slower than one (paired, on a shared host).
PARALLEL_MIN_BYTES = 4 << 20
PARALLEL_BLOCK_MIN = 512 << 10
_WORKERS = min(8, len(os.sched_getaffinity(0)) // 2)
_pool: ThreadPoolExecutor | None = None
_pool_lock = Lock()


def digest_key(block_hash: bytes) -> bytes:
    """The BLAKE3 key of block `block_hash`'s digest."""
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"block hashes are {HASH_BYTES} bytes, got {len(block_hash)}")
    return _DOMAIN + bytes(block_hash)


def _bytes_of(data: Any) -> memoryview:
    """`data`'s bytes as a flat byte view (a float16 array or a 2-D tensor too), or a typed error."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"a block is a buffer, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("a block's bytes must be contiguous")
    return view if view.ndim == 1 and view.format in ("B", "b", "c") else view.cast("B")


def digest_state(block_hash: bytes) -> "blake3.blake3":
    """An incremental `block_digest`: update() with the block's bytes in order, then digest()."""
    return blake3.blake3(key=digest_key(block_hash))


def block_digest(block_hash: bytes, data: Any) -> bytes:
    """Digest of `data` (a buffer, or a list or tuple of buffers taken in order) as block `block_hash`."""
    state = digest_state(block_hash)
    for part in data if isinstance(data, (list, tuple)) else (data,):
        state.update(_bytes_of(part))
    return state.digest()


def _parallel() -> ThreadPoolExecutor:
    # Its tasks only hash (they never wait on this pool), so callers on any thread cannot deadlock it.
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="kvs-digest")
        return _pool


def block_digests(block_hashes: Sequence[bytes], datas: Sequence) -> list[bytes]:
    """`block_digest` of each (hash, data) pair; a large batch of large blocks on several threads."""
    if len(block_hashes) != len(datas):
        raise ValueError(f"{len(block_hashes)} block hashes for {len(datas)} blocks")
    if _WORKERS > 1 and len(datas) > 1:
        sizes = [sum(_bytes_of(p).nbytes for p in d) if isinstance(d, (list, tuple)) else _bytes_of(d).nbytes
                 for d in datas]
        if sum(sizes) >= PARALLEL_MIN_BYTES and min(sizes) >= PARALLEL_BLOCK_MIN:
            return list(_parallel().map(block_digest, block_hashes, datas))
    return [block_digest(h, d) for h, d in zip(block_hashes, datas)]


def check_digests(values: Sequence[Any]) -> list[bytes]:
    """Digests a request brought, as bytes; InvalidRequest unless each is DIGEST_BYTES bytes (an
    older client's 64-bit checksums are refused here, by name)."""
    out = [bytes(v) for v in values if isinstance(v, (bytes, bytearray, memoryview))]
    if len(out) != len(values) or any(len(v) != DIGEST_BYTES for v in out):
        raise InvalidRequest(f"digests: {DIGEST_BYTES} bytes each ({DIGEST_NAME}); 64-bit checksums "
                             "come from a client older than this node")
    return out
