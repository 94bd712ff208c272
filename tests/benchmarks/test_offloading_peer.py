"""The OffloadingConnector peer's host copy engine (benchmarks/offloading_peer.py) moves the pages
vLLM's transfer specs name, as vLLM's device kernel would: the peer's warm TTFT is only a fair
yardstick if its loads put back exactly what its stores took.

Kills: a copy that ignores the offset into the first chunk (`block_indices` not a multiple of the
chunk), one that copies only the first group's layers, and one that swaps source and destination."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")


def make_worker(blocks_per_chunk: int, groups: int = 1):
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from benchmarks.offloading_peer import HostCopyWorker

    page = 64
    tensors = [CanonicalKVCacheTensor(tensor=torch.randint(-100, 100, (16, page), dtype=torch.int8),
                                      page_size_bytes=page) for _ in range(2 * groups)]
    refs = [[CanonicalKVCacheRef(tensor_idx=2 * g + k, page_size_bytes=page) for k in range(2)] for g in range(groups)]
    return HostCopyWorker(CanonicalKVCaches(tensors=tensors, group_data_refs=refs), blocks_per_chunk, num_chunks=8)


@pytest.mark.parametrize("blocks_per_chunk, first_block", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_pages_come_back_where_they_are_asked(blocks_per_chunk: int, first_block: int) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    worker = make_worker(blocks_per_chunk, groups=2)
    engine_blocks = [[3, 7, 1], [9, 4, 12]]  # per group, logical blocks first_block.. of one request
    before = [t.copy() for t in worker.engine]
    chunks_per_group = -(-(3 + first_block % blocks_per_chunk) // blocks_per_chunk)
    chunks = [[2, 5, 6, 7][:chunks_per_group], [0, 1, 3, 4][:chunks_per_group]]
    gpu = GPULoadStoreSpec(engine_blocks[0] + engine_blocks[1], group_sizes=[3, 3],
                           block_indices=[first_block, first_block])
    cpu = CPULoadStoreSpec(chunks[0] + chunks[1])
    assert worker.submit_store(1, gpu, cpu)
    skip = first_block % blocks_per_chunk
    for g in range(2):  # vLLM's tier layout: block first_block sits `skip` pages into its chunk
        rows = [c * blocks_per_chunk + j for c in chunks[g] for j in range(blocks_per_chunk)][skip:skip + 3]
        for k in range(2):
            np.testing.assert_array_equal(worker.tier[2 * g + k][rows], before[2 * g + k][engine_blocks[g]])
    for t in worker.engine:
        t[:] = 0  # the engine's pages reused by others
    back = [[10, 11, 13], [14, 15, 2]]
    assert worker.submit_load(2, cpu, GPULoadStoreSpec(back[0] + back[1], group_sizes=[3, 3],
                                                       block_indices=[first_block, first_block]))
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
    for g in range(2):
        for k in range(2):
            t = 2 * g + k
            np.testing.assert_array_equal(worker.engine[t][back[g]], before[t][engine_blocks[g]])
