"""The chunk I/O of kvstore's tier of vLLM's OffloadingConnector (offload_tier.ChunkMover) against a
real in-process store: a load puts back exactly the bytes stored into the CPU-tier rows vLLM
names, and a chunk it cannot read is a failed key (vLLM recomputes it), never reported loaded."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

import kvstore  # noqa: E402
from kvstore.integrations.vllm.offload_keys import chunk_fingerprint  # noqa: E402
from kvstore.integrations.vllm.offload_tier import ChunkMover  # noqa: E402
from tests.unit.test_offload_keys import BASE, GEOMETRY, WEIGHTS  # noqa: E402

ROW = 8192  # bytes per chunk
KEYS = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(3)]  # vLLM's OffloadKeys


def job(job_id: int, keys: list[bytes], chunks: list[int], load: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64), is_promotion=load,
                       req_context=ReqContext(req_id=f"r{job_id}"))


@pytest.fixture
def store():
    with kvstore.open("memory://", dram="16MiB") as s:
        yield s


def mover(store, rows: np.ndarray | None = None) -> ChunkMover:
    fp = chunk_fingerprint(BASE, WEIGHTS, dataclasses.replace(GEOMETRY, chunk_bytes=ROW))
    return ChunkMover(store, fp, np.zeros((8, ROW), np.uint8) if rows is None else rows)


def test_chunks_come_back_into_the_rows_vllm_names(store):
    """Chunks stored from rows 2 and 5 and loaded (in the other order) into rows 0 and 7 of
    another engine's CPU tier land byte for byte where asked, and nowhere else. Kills: a load
    that lands in another row than the job's chunk id, or pairs keys with the wrong chunks."""
    first = np.random.default_rng(0).integers(0, 256, (8, ROW), dtype=np.uint8)
    stored = mover(store, first).run(job(1, KEYS[:2], [2, 5], load=False))
    assert stored.success
    second = mover(store)
    loaded = second.run(job(2, [KEYS[1], KEYS[0]], [0, 7], load=True))
    assert loaded.success and loaded.transfer_bytes == 2 * ROW
    np.testing.assert_array_equal(second.rows[0], first[5])
    np.testing.assert_array_equal(second.rows[7], first[2])
    assert not second.rows[1:7].any()


def test_a_chunk_the_store_does_not_hold_fails_its_key_only(store):
    """A job asking for a held and a missing chunk reports the held one loaded and the job failed:
    vLLM recomputes the missing one. Kills: a load that reports success for keys it did not read
    (vLLM would use whatever the row held before)."""
    rows = np.random.default_rng(1).integers(0, 256, (8, ROW), dtype=np.uint8)
    assert mover(store, rows).run(job(1, KEYS[:1], [3], load=False)).success
    result = mover(store).run(job(2, KEYS[:2], [0, 1], load=True))
    assert not result.success and list(result.successful_keys) == [KEYS[0]]


def test_a_block_of_another_size_under_the_key_is_not_loaded(store):
    """A block under the chunk's key that is not a whole chunk (a writer with another geometry)
    is a miss, never a partly filled row. Kills: a load that takes a block of any size into the
    start of the row (Client.get_into) and calls it loaded."""
    m = mover(store)
    store.put(m.key_hash(KEYS[0]), np.full(ROW // 2, 7, np.uint8), m.fingerprint)
    result = m.run(job(1, KEYS[:1], [4], load=True))
    assert not result.success and not result.successful_keys
    assert not m.rows[4].any()


def test_a_store_that_fails_fails_the_job_not_the_tier(store):
    """With the client gone (closed, or every node unreachable) a load and a store each come
    back as a failed job. Kills: an exception that escapes the tier's thread, so that vLLM never
    hears of the job and the request waits for it forever."""
    m = mover(store)
    store.close()
    for load in (True, False):
        result = m.run(job(1, KEYS[:1], [0], load=load))
        assert result.job_id == 1 and not result.success
