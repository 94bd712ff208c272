"""Where one vLLM block's bytes live in the paged KV cache, for any layout vLLM allocates.

vLLM hands the connector one `[B, H, N, C]` view per layer whose strides follow the resolved
KV-cache layout (LBHNC: a block's `[H, N, C]` is one run; LBNHC: permuted; BLNHC: every layer of a
block side by side; kernel-block splitting: B counts kernel blocks). A block is therefore described as byte runs
in the tensor's storage, in physical order, and copied as opaque bytes: never through `reshape`,
which silently copies a non-contiguous view. Pure torch, no vLLM import.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UnsupportedKVLayout

# More runs than this per block and layer means a layout that scatters each token: refuse it.
MAX_RUNS_PER_BLOCK = 64


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's cache: which storage holds it and the byte runs of block 0 (relative)."""

    storage_key: int  # data_ptr of the backing storage (layers may share one allocation)
    block_stride: int  # bytes between consecutive scheduler blocks
    runs: tuple[tuple[int, int], ...]  # (offset from the storage start for block 0, length)

    @property
    def block_bytes(self) -> int:
        return sum(length for _, length in self.runs)

    def segments(self, block_id: int) -> list[tuple[int, int]]:
        """(storage offset, length) of `block_id`'s bytes, in physical order."""
        base = block_id * self.block_stride
        return [(base + offset, length) for offset, length in self.runs]


def _dense_runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """Byte runs (offset from the storage start, length) covering `view`, in physical order."""
    element = view.element_size()
    dims = sorted(((st, sz) for st, sz in zip(view.stride(), view.shape) if sz > 1), reverse=True)
    # Merge the innermost dimensions that are dense in memory into one run.
    run = 1
    while dims and dims[-1][0] == run:
        run *= dims.pop()[1]
    starts = [view.storage_offset()]
    for stride, size in dims:  # outer dimensions, largest stride first
        starts = [s + i * stride for s in starts for i in range(size)]
        if len(starts) > MAX_RUNS_PER_BLOCK:
            raise UnsupportedKVLayout(
                f"a KV cache block of shape {tuple(view.shape)} and strides {view.stride()} is scattered over more "
                f"than {MAX_RUNS_PER_BLOCK} runs; use a block-outer layout (VLLM_KV_CACHE_LAYOUT=BLNHC)")
    return [(s * element, run * element) for s in sorted(starts)]


def layer_geometry(tensor: torch.Tensor, num_blocks: int, kernel_ratio: int = 1) -> LayerGeometry:
    """Describe `tensor`'s blocks as byte runs; refuse layouts that cannot be copied safely.

    vLLM hands every layer's cache as a logical `[kernel blocks, heads, tokens, channels]` view
    (vllm.v1.worker.utils.allocate_kv_cache): blocks are dimension 0, never guessed from sizes.
    `kernel_ratio` is how many kernel blocks make one scheduler block, from the attention
    backend's kernel block size (the connector asks vLLM, see KVStoreConnector._kernel_ratios)."""
    if kernel_ratio < 1 or tensor.dim() < 2 or tensor.shape[0] != num_blocks * kernel_ratio:
        raise UnsupportedKVLayout(
            f"KV cache tensor of shape {tuple(tensor.shape)} does not hold {num_blocks} blocks of {kernel_ratio} "
            "kernel block(s) along dimension 0, as vLLM lays caches out: refusing to guess where blocks are")
    runs: list[tuple[int, int]] = []
    for kernel_block in range(kernel_ratio):  # one scheduler block = `kernel_ratio` kernel blocks
        runs += _dense_runs(tensor.select(0, kernel_block))
    merged: list[tuple[int, int]] = []
    for offset, length in sorted(runs):
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((offset, length))
    covered = sum(length for _, length in merged)
    expected = tensor.numel() // tensor.shape[0] * kernel_ratio * tensor.element_size()
    if covered != expected:
        raise UnsupportedKVLayout(f"KV cache tensor of shape {tuple(tensor.shape)} overlaps itself "
                                  f"(strides {tensor.stride()})")
    block_stride = tensor.stride(0) * kernel_ratio * tensor.element_size()
    return LayerGeometry(tensor.untyped_storage().data_ptr(), block_stride, tuple(merged))


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over `tensor`'s whole storage (same device, no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.set_(tensor.untyped_storage())
