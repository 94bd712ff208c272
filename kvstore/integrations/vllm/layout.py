"""Where one vLLM block's bytes live in the paged KV cache, for any layout vLLM allocates.

vLLM hands the connector one tensor per layer whose strides follow the KV-cache layout (CPU:
`[B, H, N, 2C]`, block-major; GPU `LBNHC`: a block's `[H, N, C]` view is permuted; FlashAttention's
`[2, B, N, H, C]`: K and V of a block are two runs). A block is therefore described as byte runs
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


def block_dim(tensor: torch.Tensor, num_blocks: int | None) -> tuple[int, int]:
    """(dimension indexing blocks, kernel blocks per scheduler block).

    The first dimension whose size is `num_blocks` (vLLM's logical shapes put blocks before
    heads, tokens and channels), else the first that is a whole multiple of it (the attention
    kernel splits each scheduler block into smaller kernel blocks)."""
    if num_blocks is None:
        return 0, 1
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim, 1
    for dim, size in enumerate(tensor.shape):
        if size > num_blocks and size % num_blocks == 0:
            return dim, size // num_blocks
    raise UnsupportedKVLayout(f"KV cache tensor of shape {tuple(tensor.shape)} has no dimension of "
                              f"{num_blocks} blocks (or a multiple of it)")


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


def layer_geometry(tensor: torch.Tensor, num_blocks: int | None) -> LayerGeometry:
    """Describe `tensor`'s blocks as byte runs; refuse layouts that cannot be copied safely."""
    dim, ratio = block_dim(tensor, num_blocks)
    runs: list[tuple[int, int]] = []
    for kernel_block in range(ratio):  # one scheduler block = `ratio` kernel blocks
        runs += _dense_runs(tensor.select(dim, kernel_block))
    merged: list[tuple[int, int]] = []
    for offset, length in sorted(runs):
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((offset, length))
    covered = sum(length for _, length in merged)
    expected = tensor.numel() // tensor.shape[dim] * ratio * tensor.element_size()
    if covered != expected:
        raise UnsupportedKVLayout(f"KV cache tensor of shape {tuple(tensor.shape)} overlaps itself "
                                  f"(strides {tensor.stride()})")
    block_stride = tensor.stride(dim) * ratio * tensor.element_size()
    return LayerGeometry(tensor.untyped_storage().data_ptr(), block_stride, tuple(merged))


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over `tensor`'s whole storage (same device, no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.set_(tensor.untyped_storage())
