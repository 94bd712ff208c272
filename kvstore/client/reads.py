"""Where a get's bytes land and whether they are the block's: digests of what landed in the
caller's segments, reads in stages (a consumer may use a stage as soon as it lands), and same-host
NVMe reads straight from a node's tier file, each block's digest taken by the worker that read it."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from transfer import Engine, Read, Region, UnsupportedBuffer

from ..index.records import BlockRecord
from ..integrity import block_digests, digest_state
from .local_node import TierFile, read_block

log = logging.getLogger(__name__)

TIER_READ_DEPTH = 8  # NVMe blocks of one get read at once from a tier file

Segments = list[tuple[Region, int, int]]  # a block's destination: (region, offset, length) in order


def landed_digests(hashes: Sequence[bytes], items: list[tuple[int, BlockRecord]],
                   targets: list[Segments]) -> list[tuple[int, bytes]]:
    """(index, digest) of the bytes a read left in each block's destination segments."""
    blocks = []
    for i, record in items:
        parts, done = [], 0
        for region, offset, length in targets[i]:
            take = min(length, record.size - done)
            if take <= 0:
                break
            parts.append(region.host_view()[offset : offset + take])
            done += take
        blocks.append(parts)
    return list(zip((i for i, _ in items), block_digests([bytes(hashes[i]) for i, _ in items], blocks)))


def read_in_stages(engine: Engine, timeout: float, ops: list[Read], owners: list[int], op_stages: list[int],
                   on_stage: Callable[[int], None], hashes: Sequence[bytes],
                   checked: dict[int, bytes]) -> tuple[list, list[int]]:
    """Run `ops` one stage after another, hashing what landed before telling `on_stage`;
    (results, owners) in the order run, each block's digest into `checked`."""
    results, ordered = [], []
    states: dict[int, Any] = {}
    by_stage: dict[int, list[int]] = {}
    for k, stage in enumerate(op_stages):
        by_stage.setdefault(stage, []).append(k)
    for stage, chosen in sorted(by_stage.items()):
        landed = engine.submit([ops[k] for k in chosen]).wait(timeout, raise_on_error=False)
        for k, result in zip(chosen, landed):
            op, i = ops[k], owners[k]
            state = states.get(i)
            if state is None:
                state = states[i] = digest_state(bytes(hashes[i]))
            if result.ok:  # a failed op fails its block anyway
                state.update(op.local.host_view()[op.local_offset : op.local_offset + op.length])
        results.extend(landed)
        ordered.extend(owners[k] for k in chosen)
        on_stage(stage)
    checked.update((i, state.digest()) for i, state in states.items())
    return results, ordered


class TierReads:
    """Reads NVMe blocks from same-host nodes' tier fds, several at once (its workers start on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def read(self, tier: TierFile, items: list[tuple[int, BlockRecord]], targets: list[Segments],
             hashes: Sequence[bytes]) -> dict[int, bytes]:
        """{index: digest of what landed} for the blocks read whole. Each worker hashes its block as
        soon as it lands, so hashing overlaps the other workers' reads instead of following them
        all. The digest is also what makes these reads safe while the node evicts and reuses an
        extent: another block's bytes (or a half-written slot) never match this block's digest."""
        def one(item: tuple[int, BlockRecord]) -> bytes | None:
            i, record = item
            try:
                if not read_block(tier, record, targets[i]):
                    return None
                return landed_digests(hashes, [item], targets)[0][1]
            except (OSError, UnsupportedBuffer, ValueError) as exc:
                log.debug("tier read of block %d failed: %s", i, exc)
                return None

        with self._lock:
            if self._pool is None and len(items) > 1 and not self._closed:
                self._pool = ThreadPoolExecutor(TIER_READ_DEPTH, thread_name_prefix="kvs-tier")
            pool = self._pool
        sums = list(pool.map(one, items)) if pool is not None and len(items) > 1 else [one(item) for item in items]
        return {i: digest for (i, _), digest in zip(items, sums) if digest is not None}

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)
