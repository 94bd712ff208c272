"""The worker's view of vLLM's paged KV cache as store blocks.

A store block is one vLLM block of one KV cache group: each of the group's layers' bytes in
physical order (see layout.py), layer after layer. On the CPU the cache's storage is registered
with the Transfer Engine once, and loads land in place (one op per layer run); device caches go
through host staging, copied into byte views of the device storage (never into a reshaped copy).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from transfer import Engine, Region, TransferError

from .layout import LayerGeometry, layer_geometry, storage_bytes


class KVCacheIO:
    """Block-granular reads and writes of the registered KV cache tensors, per KV cache group."""

    def __init__(self, engine: Engine, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                 groups: Sequence[Sequence[str]], kernel_ratios: dict[str, int] | None = None,
                 staged: bool | None = None) -> None:
        """`groups`: each group's layer names (those this worker holds); `kernel_ratios`: kernel
        blocks per scheduler block of each layer (vLLM's backends decide); `staged` forces host
        staging (device caches always stage; tests exercise that path on the CPU)."""
        ratios = kernel_ratios or {}
        self.names = [name for group in groups for name in group if name in kv_caches]
        self.layer_index = {name: i for i, name in enumerate(self.names)}
        tensors = [kv_caches[name] for name in self.names]
        self.geometry: list[LayerGeometry] = [layer_geometry(t, num_blocks, ratios.get(name, 1))
                                              for name, t in zip(self.names, tensors)]
        self.on_host = all(t.device.type == "cpu" for t in tensors) and not staged
        self.num_blocks = num_blocks
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self._engine = engine
        self._storage: dict[int, torch.Tensor] = {}
        for tensor, geometry in zip(tensors, self.geometry):
            self._storage.setdefault(geometry.storage_key, storage_bytes(tensor))
        # Registered once: loads read straight into the cache (CPU only; devices use staging).
        self._regions: dict[int, Region] = ({key: engine.register(flat, remote_access=False)
                                              for key, flat in self._storage.items()} if self.on_host else {})
        self._host = {key: flat.numpy() for key, flat in self._storage.items()} if self.on_host else {}
        # Per group: its layers (indexes into names), each layer's offset in the group's block.
        self.group_layers: list[list[int]] = [[self.layer_index[n] for n in group if n in self.layer_index]
                                              for group in groups]
        self.group_of = {layer: g for g, layers in enumerate(self.group_layers) for layer in layers}
        self.layer_offset: dict[int, int] = {}
        self.block_bytes: list[int] = []
        for layers in self.group_layers:
            done = 0
            for layer in layers:
                self.layer_offset[layer] = done
                done += self.geometry[layer].block_bytes
            self.block_bytes.append(done)
        # The layer of each segment of a group's block target list (the same for every block).
        self.segment_layers = [[layer for layer in layers for _ in self.geometry[layer].runs]
                               for layers in self.group_layers]

    def storage(self, layer: int) -> torch.Tensor:
        """The flat uint8 view of the storage holding `layer` (on the cache's device)."""
        return self._storage[self.geometry[layer].storage_key]

    def targets(self, group: int, block_id: int) -> list[tuple[Region, int, int]]:
        """Where a block's bytes go, layer after layer: (region, offset, length) segments."""
        out = []
        for layer in self.group_layers[group]:
            geometry = self.geometry[layer]
            region = self._regions[geometry.storage_key]
            out.extend((region, offset, length) for offset, length in geometry.segments(block_id))
        return out

    def write_layer(self, layer: int, block_id: int, data: np.ndarray) -> None:
        """Copy one layer of one block (its part of the group's block bytes `data`) into the cache."""
        geometry = self.geometry[layer]
        flat = self._storage[geometry.storage_key]
        source = torch.from_numpy(data)
        done = self.layer_offset[layer]
        for offset, length in geometry.segments(block_id):
            flat[offset : offset + length].copy_(source[done : done + length], non_blocking=False)
            done += length

    def write_block(self, group: int, block_id: int, data: np.ndarray) -> None:
        """Copy one block's bytes (as stored) into the cache."""
        for layer in self.group_layers[group]:
            self.write_layer(layer, block_id, data)

    def stage_layer(self, layer: int, block_id: int, out: np.ndarray) -> None:
        """Copy one layer of one block into its part of `out` (a whole block's staging buffer)."""
        geometry = self.geometry[layer]
        done = self.layer_offset[layer]
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
