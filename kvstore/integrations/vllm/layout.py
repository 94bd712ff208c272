"""Where one vLLM block's bytes live in the paged KV cache, for any layout vLLM allocates.

vLLM hands the connector one `[B, H, N, C]` view per layer whose strides follow the resolved
KV-cache layout (LBHNC: a block's `[H, N, C]` is one run; LBNHC: permuted; BLNHC: every layer of a
block side by side; kernel-block splitting: B counts kernel blocks). A block is therefore described as byte runs
in the tensor's storage, in physical order, and copied as opaque bytes: never through `reshape`,
which silently copies a non-contiguous view. Pure torch, no vLLM import.

For the batched copy path a layer's runs are also expressed as a strided grid (`BlockGrid`): every
vLLM layout and kernel split puts a block's runs at equal spacings of equal length, so one
`[blocks, *grid, run]` view of the storage lets one tensor operation gather or scatter all of a
step's blocks of a layer. A layout whose runs do not form such a grid is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

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


@dataclass(frozen=True)
class BlockGrid:
    """One layer's block as a grid of equal runs, in physical order: block `b` starts at
    `offset + b * block_stride` bytes into the storage and holds `prod(shape)` runs of `run` bytes,
    run `(i, j, ...)` at `i * strides[0] + j * strides[1] + ...` (outermost first)."""

    offset: int
    block_stride: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    run: int

    @property
    def block_bytes(self) -> int:
        return prod(self.shape) * self.run

    def runs(self, block_id: int = 0) -> list[tuple[int, int]]:
        """(storage offset, length) of `block_id`'s runs, enumerated from the grid (physical order)."""
        starts = [self.offset + block_id * self.block_stride]
        for size, stride in zip(self.shape, self.strides):
            starts = [s + i * stride for s in starts for i in range(size)]
        return [(s, self.run) for s in starts]

    @property
    def element(self) -> int:
        """The widest element (8, 4, 2 or 1 bytes) every offset, stride and run is a multiple of:
        a typed view copies in wider words than bytes."""
        values = (self.offset, self.block_stride, self.run, *self.strides)
        return next(e for e in (8, 4, 2, 1) if all(v % e == 0 for v in values))


def block_grid(geometry: LayerGeometry, layout: str) -> BlockGrid:
    """`geometry`'s runs as a grid one tensor operation can gather (see BlockGrid); refuses, naming
    `layout`, runs that are not equally long or not equally spaced at every level."""
    lengths = {length for _, length in geometry.runs}
    offsets = [offset for offset, _ in geometry.runs]
    if len(lengths) != 1:
        raise UnsupportedKVLayout(
            f"the {layout} KV cache layout splits a block into runs of different lengths ({sorted(lengths)} bytes): "
            "the batched copy cannot gather it; use a vLLM layout (VLLM_KV_CACHE_LAYOUT=BLNHC on GPUs)")
    shape: list[int] = []
    strides: list[int] = []
    level = offsets
    while len(level) > 1:  # peel the innermost level: a run of equal steps, repeated at equal steps
        step, size = level[1] - level[0], 1
        while size < len(level) and level[size] - level[0] == size * step:
            size += 1
        if len(level) % size:
            break
        shape.insert(0, size)
        strides.insert(0, step)
        level = level[::size]
    grid = BlockGrid(offsets[0], geometry.block_stride, tuple(shape), tuple(strides), lengths.pop())
    if grid.runs() != list(geometry.runs):
        raise UnsupportedKVLayout(
            f"the {layout} KV cache layout places a block's {len(offsets)} runs at uneven strides: the batched copy "
            "cannot gather it with one operation; use a vLLM layout (VLLM_KV_CACHE_LAYOUT=BLNHC on GPUs)")
    return grid
