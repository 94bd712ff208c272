"""Staged reads (Client.get_many with stages): each stage is announced only once every block's bytes
of that stage have landed, so a consumer (the vLLM forward pass) can start on the first layers while
later ones still load; checksums are still verified over the whole block."""
from __future__ import annotations

import uuid

import numpy as np

import kvstore
from kvstore.keys import ModelFingerprint, chain_hashes

FP = ModelFingerprint("staged", "float32", 16, 3, 1, 64)
STAGE = 1024  # int32 values per stage of a block


def test_each_stage_is_announced_after_its_bytes_and_before_later_ones():
    with kvstore.open(f"memory://staged-{uuid.uuid4().hex[:8]}", dram="64MiB", fingerprint=FP) as store:
        blocks = [np.arange(b * 10_000, b * 10_000 + 3 * STAGE, dtype=np.int32) for b in range(4)]
        hashes = chain_hashes(FP, list(range(4 * 16)))
        store.put_many(list(zip(hashes, blocks)))
        dest = np.zeros((4, 3, STAGE), np.int32)
        region = store.engine.register(dest, remote_access=False)
        try:
            # Segment j of every block is stage 2 - j: the last segment is read first.
            targets = [[(region, (b * 3 + s) * STAGE * 4, STAGE * 4) for s in range(3)] for b in range(4)]
            seen: list[tuple[int, bool, bool]] = []

            def on_stage(stage: int) -> None:
                segment = 2 - stage
                here = all(np.array_equal(dest[b, segment], blocks[b][segment * STAGE:(segment + 1) * STAGE])
                           for b in range(4))
                later = [2 - s for s in range(stage + 1, 3)]
                untouched = all(not dest[b, s].any() for b in range(4) for s in later)
                seen.append((stage, here, untouched))

            found = store.get_many(hashes, targets, stages=[2, 1, 0], on_stage=on_stage)
        finally:
            store.engine.unregister(region)
        assert found == [True] * 4
        assert seen == [(0, True, True), (1, True, True), (2, True, True)]
        assert all(np.array_equal(dest[b].reshape(-1), blocks[b]) for b in range(4))


def test_a_staged_read_of_a_rotten_block_is_a_miss():
    with kvstore.open(f"memory://staged-{uuid.uuid4().hex[:8]}", dram="64MiB", fingerprint=FP) as store:
        block = np.arange(3 * STAGE, dtype=np.int32)
        (h,) = chain_hashes(FP, list(range(16)))
        store.put_many([(h, block)])
        arena = store.daemon.store
        for _, slot in arena.keys():  # the bytes rot under the index
            arena.dram.region.buffer[slot.offset : slot.offset + 64] = bytes(64)
        dest = np.zeros(3 * STAGE, np.int32)
        region = store.engine.register(dest, remote_access=False)
        try:
            stages: list[int] = []
            found = store.get_many([h], [[(region, s * STAGE * 4, STAGE * 4) for s in range(3)]],
                                   stages=[0, 1, 2], on_stage=stages.append)
        finally:
            store.engine.unregister(region)
        assert found == [False] and stages == [0, 1, 2]
