"""vLLM's OffloadingConnector with its CPU tier, runnable on a CPU-only host (a benchmark peer).

vLLM 0.32's `CPUOffloadingSpec` refuses to build its worker unless the platform is a CUDA-alike or
XPU GPU ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"): its only copy
engine is a device kernel over pinned host memory. `HostOffloadingSpec` keeps everything else of
vLLM's spec as it is (its scheduler side, `CPUOffloadingManager` with LRU eviction, its sizing of
the CPU tier from `cpu_bytes_to_use`, the connector around it) and swaps only that copy engine for
the one a CPU host has: page copies between the engine's KV tensors and a host tensor, done on the
submitting thread.

What that changes against vLLM on a GPU. Loads: on a CPU host the "device" KV cache is itself host
memory, so a load is a host memcpy (about 3 GB/s a core here, row by row) where a GPU pays a PCIe
copy and the request waits for it either way: warm TTFTs against this peer favour it, and a ratio
of kvstore's warm TTFT to its understates kvstore's margin. Stores: they run synchronously on the
engine's thread, where a GPU overlaps them with the forward on a stream of their own, so a
first-sight TTFT with this peer carries a save cost vLLM on a GPU would mostly hide; the benchmark
judges no target on the peer's first sight.

Use: `kv_connector="OffloadingConnector"`, `kv_connector_extra_config={"spec_name":
"HostOffloadingSpec", "spec_module_path": "benchmarks.offloading_peer", "cpu_bytes_to_use": N}`.

`HostTieringOffloadingSpec` does the same for vLLM's tiered spec (`TieringOffloadingSpec`: the CPU
tier plus `secondary_tiers`, e.g. kvstore's tier), whose CPU tier is a shared memory region the
scheduler's secondary tiers read and write: the same copy engine, with that region as its memory.
Use `"spec_name": "HostTieringOffloadingSpec"` and the tiered spec's own keys.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """vLLM's CPU-tier worker with host page copies in place of its device kernel. The engine's KV
    tensors and the tier's host tensors are laid out as vLLM's direct layout: one tier row holds
    `blocks_per_chunk` engine pages. `totals` (per process): bytes and seconds of loads and stores,
    read by the benchmark as it reads kvstore's connector totals."""

    totals = {"load_bytes": 0, "load_seconds": 0.0, "store_bytes": 0, "store_seconds": 0.0}

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 tiers: list[np.ndarray] | None = None) -> None:
        """`tiers`: the tier's memory, one (num_chunks, blocks_per_chunk * page) array per KV tensor
        (any row stride: vLLM's shared offload region interleaves tensors within a row); default,
        host tensors of this worker's own."""
        self.blocks_per_chunk = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        # numpy views: a row copy is a memcpy (3.3 GB/s here), where torch's int8 row indexing ran
        # at 0.3 GB/s and would have made this peer slower than vLLM's CPU tier can be.
        self.engine: list[np.ndarray] = []
        self.tier: list[np.ndarray] = []  # (chunks * blocks_per_chunk, page): one engine page a row
        self._pages: list[np.ndarray] = []  # the same memory as (chunk, page in chunk, byte)
        self._keep: list[torch.Tensor] = []
        for i, t in enumerate(kv_caches.tensors):
            page = t.page_size_bytes
            engine = t.tensor.view(torch.int8).view(-1, page)
            self._keep.append(engine)
            self.engine.append(engine.numpy())
            if tiers is None:
                tier = torch.zeros((num_chunks * blocks_per_chunk, page), dtype=torch.int8)
                self._keep.append(tier)
                self.tier.append(tier.numpy())
                self._pages.append(self.tier[-1].reshape(num_chunks, blocks_per_chunk, page))
            else:
                given = tiers[i]
                assert given.shape == (num_chunks, blocks_per_chunk * page), (given.shape, page)
                self.tier.append(given)
                self._pages.append(np.lib.stride_tricks.as_strided(
                    given, (num_chunks, blocks_per_chunk, page), (given.strides[0], page, 1)))
        self.finished: list[TransferResult] = []

    def _tier_rows(self, chunks: np.ndarray, skip: int, count: int) -> list[tuple[int, int]]:
        """(chunk, page within the chunk) of each engine page, in order."""
        return [(int(c), j) for c in chunks for j in range(self.blocks_per_chunk)][skip:skip + count]

    def _copy(self, job_id: int, engine_spec: GPULoadStoreSpec, tier_spec: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(tier_spec, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        engine_ids, chunks = np.asarray(engine_spec.block_ids), np.asarray(tier_spec.block_ids)
        e_off = c_off = moved = 0
        for group, (size, first) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices)):
            if size == 0:
                continue
            skip = first % self.blocks_per_chunk
            n_chunks = -(-(size + skip) // self.blocks_per_chunk)
            e_rows = engine_ids[e_off:e_off + size].tolist()
            t_rows = self._tier_rows(chunks[c_off:c_off + n_chunks], skip, size)
            for ref in self.refs[group]:
                engine, pages, width = self.engine[ref.tensor_idx], self._pages[ref.tensor_idx], ref.page_size_bytes
                if store:
                    for a, (c, j) in zip(e_rows, t_rows):
                        pages[c, j, :width] = engine[a, :width]
                else:
                    for a, (c, j) in zip(e_rows, t_rows):
                        engine[a, :width] = pages[c, j, :width]
                moved += size * width
            e_off, c_off = e_off + size, c_off + n_chunks
        seconds = time.perf_counter() - started
        side = "store" if store else "load"
        self.totals[f"{side}_bytes"] += moved
        self.totals[f"{side}_seconds"] += seconds
        self.finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved, transfer_time=seconds))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Every copy ended when it was submitted."""


class HostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec whose worker copies with the host (see the module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


class HostTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiered offloading spec whose worker copies with the host into the spec's shared
    offload region (the memory its scheduler-side secondary tiers see as `primary_kv_view`)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            if self.config.canonical_layout:
                raise ValueError("HostTieringOffloadingSpec copies vLLM's direct layout only: remove canonical_layout")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            self._region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                               kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                               cpu_page_size=self.cpu_page_size_per_worker)
            # The region's file in /dev/shm outlives the process unless removed: vLLM's worker removes it
            # at its shutdown, which a process that just exits never reaches. Both sides have mapped it
            # by then; the mappings stay.
            atexit.register(_remove_file, self._region.mmap_path)
            tiers = [self._region.create_next_worker_view(t.page_size_bytes * self.blocks_per_chunk).numpy()
                     for t in kv_caches.tensors]
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, tiers=tiers)
        return self._worker


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
