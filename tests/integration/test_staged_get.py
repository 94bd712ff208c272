"""Staged reads (Client.get_many with stages): each stage is announced only once every block's bytes
of that stage have landed, so a consumer (the vLLM forward pass) can start on the first layers while
later ones still load; checksums are still verified over the whole block."""
from __future__ import annotations

import uuid

import numpy as np
from xxh3_forgery import forge, old_checksum

import kvstore
from kvstore.keys import ModelFingerprint, chain_hashes

FP = ModelFingerprint("staged", "float32", 16, 3, 1, 64, kv_layout="bytes")
STAGE = 1024  # int32 values per stage of a block


def test_each_stage_is_announced_after_its_bytes_and_before_later_ones():
    with kvstore.open(f"memory://staged-{uuid.uuid4().hex[:8]}", dram="64MiB", fingerprint=FP) as store:
        blocks = [np.arange(b * 10_000, b * 10_000 + 3 * STAGE, dtype=np.int32) for b in range(4)]
        hashes = chain_hashes(FP, list(range(4 * 16)))
        store.put_many(list(zip(hashes, blocks)))
        dest = np.zeros((4, 3, STAGE), np.int32)
        region = store.engine.register(dest, remote_access=False)
        try:
            targets = [[(region, (b * 3 + s) * STAGE * 4, STAGE * 4) for s in range(3)] for b in range(4)]
            segments_of = {0: [0], 1: [1, 2]}  # stage 1 is the last two segments of every block
            seen: list[tuple[int, bool, bool]] = []

            def on_stage(stage: int) -> None:
                here = all(np.array_equal(dest[b, j], blocks[b][j * STAGE:(j + 1) * STAGE])
                           for b in range(4) for j in segments_of[stage])
                untouched = all(not dest[b, j].any() for b in range(4) for s in range(stage + 1, 2)
                                for j in segments_of[s])
                seen.append((stage, here, untouched))

            found = store.get_many(hashes, targets, stages=[0, 1, 1], on_stage=on_stage)
        finally:
            store.engine.unregister(region)
        assert found == [True] * 4
        assert seen == [(0, True, True), (1, True, True)]
        assert all(np.array_equal(dest[b].reshape(-1), blocks[b]) for b in range(4))


def test_bytes_the_consumer_changes_after_their_stage_landed_still_verify():
    """vLLM's forward writes the new token's KV into the last loaded block once its layer has landed,
    while later layers still load: the block was verified as it landed, so it stays a hit."""
    with kvstore.open(f"memory://staged-{uuid.uuid4().hex[:8]}", dram="64MiB", fingerprint=FP) as store:
        block = np.arange(3 * STAGE, dtype=np.int32)
        (h,) = chain_hashes(FP, list(range(16)))
        store.put_many([(h, block)])
        dest = np.zeros(3 * STAGE, np.int32)
        region = store.engine.register(dest, remote_access=False)
        try:
            def overwrite(stage: int) -> None:
                dest[stage * STAGE + STAGE - 1] = -1  # "the forward" writes into the stage it may use

            found = store.get_many([h], [[(region, s * STAGE * 4, STAGE * 4) for s in range(3)]],
                                   stages=[0, 1, 2], on_stage=overwrite)
        finally:
            store.engine.unregister(region)
        assert found == [True]


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


def test_a_staged_read_of_a_second_preimage_of_the_old_checksum_is_a_miss():
    """Kills: staged (layer-by-layer) loads checked with the old seeded xxh3-64 checksum. The slot
    holds other bytes with the block's old checksum: the load still announces every stage (the
    consumer may use them), and the block is a miss."""
    with kvstore.open(f"memory://staged-{uuid.uuid4().hex[:8]}", dram="64MiB", fingerprint=FP) as store:
        block = np.arange(3 * STAGE, dtype=np.int32)
        (h,) = chain_hashes(FP, list(range(16)))
        store.put_many([(h, block)])
        arena = store.daemon.store
        (_, slot), = arena.keys()
        forged = forge(h, block.tobytes())
        assert old_checksum(h, forged) == old_checksum(h, block.tobytes())
        arena.dram.region.buffer[slot.offset : slot.offset + slot.size] = forged
        dest = np.zeros(3 * STAGE, np.int32)
        region = store.engine.register(dest, remote_access=False)
        try:
            stages: list[int] = []
            found = store.get_many([h], [[(region, s * STAGE * 4, STAGE * 4) for s in range(3)]],
                                   stages=[0, 1, 2], on_stage=stages.append)
        finally:
            store.engine.unregister(region)
        assert found == [False] and stages == [0, 1, 2]
        assert dest.tobytes() == forged  # what landed was the forgery: refused by its digest alone
