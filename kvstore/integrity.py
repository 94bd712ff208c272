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

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
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
# handing one over costs less than hashing it (64 KiB blocks: slower handed over). The pool has a
# thread for every CPU this process may use: BLAKE3 releases the GIL, and a reader's copy runs on
# the engine's own threads, so a read verifies as fast as the CPUs left to it allow (hashing a batch
# on one thread capped a same-host get at one core's BLAKE3 rate, a sixth of memcpy). Up to 16: a
# GPU's saves arrive at its pinned-copy rate (55 GB/s on an H200), and BLAKE3 on that host gave 5
# GB/s on one thread, 28 on 8 and 35-40 on 16.
PARALLEL_MIN_BYTES = 4 << 20
PARALLEL_BLOCK_MIN = 512 << 10
DIGEST_THREADS_ENV = "KVSTORE_DIGEST_THREADS"
MAX_DIGEST_THREADS = 16


def digest_threads() -> int:
    """Threads that hash a large batch: KVSTORE_DIGEST_THREADS where set (a positive integer), else
    one per CPU this process may use, at most MAX_DIGEST_THREADS. A value that is no positive
    integer is named in one warning and the default used (it is read at import, where raising
    would stop every command with a traceback)."""
    default = max(1, min(MAX_DIGEST_THREADS, len(os.sched_getaffinity(0))))
    value = os.environ.get(DIGEST_THREADS_ENV, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        logging.getLogger(__name__).warning("%s=%r is not a positive whole number of threads: using %d",
                                            DIGEST_THREADS_ENV, value, default)
        return default
    return int(value)


_WORKERS = digest_threads()
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


def _nbytes(data: Any) -> int:
    return sum(_bytes_of(p).nbytes for p in data) if isinstance(data, (list, tuple)) else _bytes_of(data).nbytes


def block_digests(block_hashes: Sequence[bytes], datas: Sequence) -> list[bytes]:
    """`block_digest` of each (hash, data) pair; a large batch of large blocks on several threads."""
    if len(block_hashes) != len(datas):
        raise ValueError(f"{len(block_hashes)} block hashes for {len(datas)} blocks")
    if _WORKERS > 1 and len(datas) > 1:
        sizes = [_nbytes(d) for d in datas]
        if sum(sizes) >= PARALLEL_MIN_BYTES and min(sizes) >= PARALLEL_BLOCK_MIN:
            return list(_parallel().map(block_digest, block_hashes, datas))
    return [block_digest(h, d) for h, d in zip(block_hashes, datas)]


class Digesting:
    """Digests taken while more bytes are still arriving: `add` hands blocks whose bytes have landed
    to the digest pool (or, small, takes them at once), `results` waits for every one. A reader adds
    the blocks of each wave of its copy as the wave lands, so hashing one wave overlaps copying the
    next instead of following the whole copy."""

    def __init__(self) -> None:
        self._done: dict[Any, bytes] = {}
        self._pending: list[Future] = []

    def add(self, items: Sequence[tuple[Any, bytes, Any]]) -> None:
        """(key, block hash, data) of blocks whose bytes are all there. The calling thread hashes a
        share of them itself (rather than wait idle for the pool, or spin for the next wave of its
        copy), the pool the rest."""
        if _WORKERS < 2 or sum(_nbytes(d) for _, _, d in items) < PARALLEL_BLOCK_MIN:
            self._done.update((key, block_digest(h, d)) for key, h, d in items)
            return
        # Blocks go in groups of PARALLEL_BLOCK_MIN bytes at least (one task per small block would
        # cost more to hand over than to hash), at most one group per thread.
        total = sum(_nbytes(d) for _, _, d in items)
        share = max(PARALLEL_BLOCK_MIN, -(-total // _WORKERS))
        groups: list[list[tuple[Any, bytes, Any]]] = [[]]
        size = 0
        for item in items:
            if size >= share:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += _nbytes(item[2])
        self._pending += [_parallel().submit(_group_digests, group) for group in groups[1:]]
        self._done.update(_group_digests(groups[0]))

    def results(self) -> dict[Any, bytes]:
        """{key: digest} of every block added (waits for those still being hashed)."""
        for future in self._pending:
            self._done.update(future.result())
        self._pending = []
        return self._done


def _group_digests(items: Sequence[tuple[Any, bytes, Any]]) -> list[tuple[Any, bytes]]:
    return [(key, block_digest(h, d)) for key, h, d in items]


def check_digests(values: Sequence[Any]) -> list[bytes]:
    """Digests a request brought, as bytes; InvalidRequest unless each is DIGEST_BYTES bytes (an
    older client's 64-bit checksums are refused here, by name)."""
    out = [bytes(v) for v in values if isinstance(v, (bytes, bytearray, memoryview))]
    if len(out) != len(values) or any(len(v) != DIGEST_BYTES for v in out):
        raise InvalidRequest(f"digests: {DIGEST_BYTES} bytes each ({DIGEST_NAME}); 64-bit checksums "
                             "come from a client older than this node")
    return out
