"""The worker's view of vLLM's paged KV cache as store blocks.

A store block is one vLLM block of every layer, each layer's bytes in physical order (see
layout.py). On the CPU the cache's storage is registered with the Transfer Engine once, and loads
land in place (one op per layer run); device caches go through host staging, copied into byte
views of the device storage (never into a reshaped copy).
"""
from __future__ import annotations

import numpy as np
import torch

from transfer import Engine, Region, TransferError

from .layout import LayerGeometry, layer_geometry, storage_bytes


class KVCacheIO:
    """Block-granular reads and writes of the registered KV cache tensors."""

    def __init__(self, engine: Engine, kv_caches: dict[str, torch.Tensor], num_blocks: int | None) -> None:
        self.names = list(kv_caches)
        tensors = list(kv_caches.values())
        self.geometry: list[LayerGeometry] = [layer_geometry(t, num_blocks) for t in tensors]
        self.on_host = all(t.device.type == "cpu" for t in tensors)
        self._engine = engine
        self._storage: dict[int, torch.Tensor] = {}
        for tensor, geometry in zip(tensors, self.geometry):
            self._storage.setdefault(geometry.storage_key, storage_bytes(tensor))
        # Registered once: loads read straight into the cache (CPU only; devices use staging).
        self._regions: dict[int, Region] = ({key: engine.register(flat, remote_access=False)
                                              for key, flat in self._storage.items()} if self.on_host else {})
        self._host = {key: flat.numpy() for key, flat in self._storage.items()} if self.on_host else {}
        offsets = [0]
        for geometry in self.geometry:
            offsets.append(offsets[-1] + geometry.block_bytes)
        self.layer_offsets = offsets
        self.block_bytes = offsets[-1]
        self.layer_index = {name: i for i, name in enumerate(self.names)}
        # The layer of each segment of a block's target list (the same for every block).
        self.segment_layers = [layer for layer, g in enumerate(self.geometry) for _ in g.runs]

    def targets(self, block_id: int) -> list[tuple[Region, int, int]]:
        """Where a block's bytes go, layer after layer: (region, offset, length) segments."""
        out = []
        for geometry in self.geometry:
            region = self._regions[geometry.storage_key]
            out.extend((region, offset, length) for offset, length in geometry.segments(block_id))
        return out

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        """Copy one block's bytes (as stored) into the cache."""
        source = torch.from_numpy(data)
        done = 0
        for geometry in self.geometry:
            flat = self._storage[geometry.storage_key]
            for offset, length in geometry.segments(block_id):
                flat[offset : offset + length].copy_(source[done : done + length], non_blocking=False)
                done += length

    def stage_layer(self, layer: int, block_id: int, out: np.ndarray) -> None:
        """Copy one layer of one block into its part of `out` (a whole block's staging buffer)."""
        geometry = self.geometry[layer]
        done = self.layer_offsets[layer]
        if self.on_host:
            memory = self._host[geometry.storage_key]
            for offset, length in geometry.segments(block_id):
                out[done : done + length] = memory[offset : offset + length]
                done += length
            return
        flat = self._storage[geometry.storage_key]
        for offset, length in geometry.segments(block_id):
            out[done : done + length] = flat[offset : offset + length].cpu().numpy()
            done += length

    def close(self) -> None:
        for region in self._regions.values():
            try:
                self._engine.unregister(region)
            except TransferError:  # the store's engine closed first (interpreter exit): nothing to undo
                pass
        self._regions.clear()
