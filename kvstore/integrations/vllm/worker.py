"""The connector's worker side (vLLM's model runner): loads run on a thread (store -> paged KV cache,
in place on the CPU, through registered staging on a device); saves copy each layer's blocks as the
forward pass produces them, and a bounded background writer puts them to the store, off the step.
One store block = one vLLM block of one group, all of this rank's layers of that group.

With several KV cache groups loads are asynchronous: vLLM takes a failed load of such a model only
per request (failed_recving). P/D hand-offs whose blocks are still being written wait on one waiter
thread (handoff_wait.py), never on the load pool.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ...errors import UnsupportedDeployment, UnsupportedKVLayout
from .fingerprint import layout_name, resolved_layout
from .handoff_wait import HandoffWaiter, PendingHandoff
from .kv_cache_io import KVCacheIO
from .layer_progress import LayerProgress
from .plan import GroupBlock
from .settings import ConnectorSettings, ConnectorSide
from .stats import KVStoreConnectorStats
from .step_plan import KVStoreMetadata
from .writer import SaveBatch, SaveWriter

if TYPE_CHECKING:
    from .kv_batch import BatchedKV, SaveStep

log = logging.getLogger(__name__)
CANCELLED_STAGING_KEPT = 8  # staging of timed-out loads kept alive: a late transfer lands there, never freed memory


@dataclass
class LayerLoad:
    """This step's layer-by-layer load: its thread, its progress and every block it fills."""

    future: Future
    progress: LayerProgress
    block_ids: set[int]


class KVStoreWorker(ConnectorSide):
    """The worker side of one engine's connector (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings) -> None:
        super().__init__(settings)
        self._io: KVCacheIO | None = None
        self._staged: dict[tuple[int, bytes], tuple[np.ndarray, set[int], bool]] = {}
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._failed_recving: set[str] = set()  # asynchronous loads that failed (several groups: per request)
        self._in_flight: set[str] = set()
        self._abandoned: set[str] = set()
        self._sent: set[str] = set()
        self._load_errors: set[int] = set()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvstore-load")
        self._handoffs = HandoffWaiter(self.store.mirror, self.group_fingerprints, self._release_handoff)
        self._layer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-layer-load")
        self._layer_load: LayerLoad | None = None  # this step's layer-by-layer load
        self._cancelled_staging: deque[np.ndarray] = deque(maxlen=CANCELLED_STAGING_KEPT)
        self._writer: SaveWriter | None = None
        # The batched copy path (kv_batch.py; None: block by block) and this step's saves through it.
        self._batch: "BatchedKV | None" = None
        self._save_step: "SaveStep | None" = None
        self._save_step_meta: KVStoreMetadata | None = None
        self._save_overflow: set[tuple[int, bytes]] = set()  # this step's saves that go block by block
        self._stats = KVStoreConnectorStats()  # since the last get_kv_connector_stats()
        self.totals = KVStoreConnectorStats()  # since start (the demo and tests read it)

    def _count(self, **values: float) -> None:
        with self._lock:
            self._stats.add(**values)
            self.totals.add(**values)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        resolved = resolved_layout(self.vllm_config)
        named = layout_name(self.vllm_config, self.extra)
        if "kv_layout" not in self.extra and resolved and self.fingerprint.kv_layout != named:
            raise UnsupportedKVLayout(
                f"vLLM resolved the {resolved} KV cache layout, but this engine's blocks are keyed as "
                f"{self.fingerprint.kv_layout}: the scheduler and this worker would disagree on every block's bytes; "
                f"set VLLM_KV_CACHE_LAYOUT={resolved} on every process of the engine")
        if not self.num_blocks:
            raise UnsupportedKVLayout("vLLM gave this worker no KVCacheConfig (its block count and groups): kvstore "
                                      "needs vLLM 0.32's connector API to know where each block is")
        tables = [[name for name in group.layers if name in kv_caches] for group in self.groups]
        self._io = KVCacheIO(self.store.engine, kv_caches, self.num_blocks, tables, self._kernel_ratios(kv_caches))
        if self.extra.get("batched_copy", True):
            from .kv_batch import open_batched, staging_blocks

            capacity = staging_blocks(self.vllm_config, self.block_size, self.num_blocks, self.extra)
            self._batch = open_batched(self._io, self.store.engine, capacity, resolved or self.fingerprint.kv_layout,
                                       save=self.save_enabled and self.saves_here, load=self.load_enabled,
                                       layer_loads=bool(self.layerwise_load_blocks))
            if self._batch is None:
                self._count(staging_fallbacks=1)
        self._writer = SaveWriter(lambda batch: self.store.put_many(batch.blocks,
                                                                    fingerprint=self.group_fingerprints[batch.group]),
                                  self.save_queue_bytes, self._saved, handoff_wait_s=self.remote_wait_s)

    def _kernel_ratios(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, int]:
        """Kernel blocks per scheduler block of each layer, as vLLM's attention backends decide
        (vllm.v1.worker.utils.prepare_kernel_block_sizes): never guessed from tensor sizes."""
        config = self.kv_cache_config
        if config is None or not getattr(config, "kv_cache_groups", None):
            return {}
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.v1.worker.utils import prepare_kernel_block_sizes

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase, list(kv_caches))
        missing = [name for name in kv_caches if name not in layers]
        if missing:
            raise UnsupportedKVLayout(
                f"layer {missing[0]} has a KV cache but no attention layer in vLLM's forward context: its attention "
                "backend decides how blocks split into kernel blocks, which kvstore does not guess")
        attn_groups = [[SimpleNamespace(backend=layers[name].get_attn_backend(), kv_cache_spec=group.kv_cache_spec)
                        for name in group.layer_names if name in layers] for group in config.kv_cache_groups]
        sizes = prepare_kernel_block_sizes(config, attn_groups)
        return {name: group.block_size // size for group, size in zip(self.groups, sizes) for name in group.layers}

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreMetadata):
            return
        for req_id, blocks in meta.loads.items():
            with self._lock:
                self._in_flight.add(req_id)
            wait = meta.remote_waits.get(req_id, 0.0)
            if wait > 0:  # a P/D hand-off whose blocks may still be on their way: waits off the pool
                self._handoffs.add(req_id, blocks, wait, meta.load_tokens.get(req_id))
            else:
                self._pool.submit(self._load, req_id, blocks, meta.load_tokens.get(req_id), True)
        self._end_layer_load()  # never two in flight
        in_step = sum(len(blocks) for blocks in meta.sync_loads.values())
        io = self._io
        if self.layerwise_load_blocks and in_step >= self.layerwise_load_blocks and io is not None \
                and len(io.names) > 1:
            self._start_layer_load(meta)
            return
        for req_id, blocks in meta.sync_loads.items():
            # failures surface in this step's load errors
            self._load(req_id, blocks, meta.load_tokens.get(req_id), report=False)

    def _start_layer_load(self, meta: KVStoreMetadata) -> None:
        """Start this step's in-step loads layer by layer on the layer-load thread."""
        # vLLM writes a layer's new-token KV before that layer waits for its load: a block the load
        # fills only partly (the new tokens go into it) is loaded now, before the forward.
        shared = [plan[-1] for req_id, plan in meta.sync_loads.items()
                  if plan and meta.load_tokens.get(req_id, 0) % self.block_size]
        failed = self._read_or_fail(shared, "in-step") if shared else set()
        assert self._io is not None
        timeout = self.layer_load_timeout_s
        layers = len(self._io.names)
        progress = LayerProgress(float(timeout) if timeout is not None else self.store.timeout * (layers + 1))
        shared_ids = {block_id for _, block_id, _ in shared}
        block_ids = {block_id for plan in meta.sync_loads.values() for _, block_id, _ in plan}
        future = self._layer_pool.submit(self._load_layers, dict(meta.sync_loads), dict(meta.load_tokens), progress,
                                         shared_ids, failed)
        self._layer_load = LayerLoad(future, progress, block_ids)

    def _release_handoff(self, pending: PendingHandoff) -> None:
        """A hand-off's blocks are published (or its wait is over): load what is there."""
        self._count(handoff_wait_seconds=time.monotonic() - pending.started)
        self._pool.submit(self._load, pending.req_id, pending.blocks, pending.tokens, True)

    def _read(self, blocks: list[GroupBlock]) -> set[int]:
        """Read blocks from the store into the KV cache; the block ids that could not be loaded."""
        io = self._io
        if io is None:
            raise UnsupportedDeployment("no KV cache registered")
        failed: set[int] = set()
        for group in sorted({g for g, _, _ in blocks}):
            chosen = [(block_id, h) for g, block_id, h in blocks if g == group]
            hashes = [h for _, h in chosen]
            fingerprint = self.group_fingerprints[group]
            if io.on_host:  # read straight into the KV cache
                found = self.store.get_many(hashes, [io.targets(group, block_id) for block_id, _ in chosen],
                                            fingerprint=fingerprint)
            elif self._batch is not None and self._batch.load_pool is not None:
                # device KV cache: into registered staging, then one copy and one scatter per layer
                found = self._batch.load(
                    group, [block_id for block_id, _ in chosen],
                    lambda start, end, targets, hashes=hashes, fingerprint=fingerprint: self.store.get_many(
                        hashes[start:end], targets, fingerprint=fingerprint), self.store.timeout)
            else:  # device KV cache, block by block: through host staging
                buffers = [np.empty(io.block_bytes[group], np.uint8) for _ in chosen]
                found = self.store.get_many(hashes, buffers, fingerprint=fingerprint)
                for (block_id, _), ok, buf in zip(chosen, found, buffers):
                    if ok:
                        io.write_block(group, block_id, buf)
            failed |= {block_id for (block_id, _), ok in zip(chosen, found) if not ok}
        return failed

    def _read_or_fail(self, blocks: list[GroupBlock], what: str) -> set[int]:
        """`_read`, with any error failing every block: a failed load is a recompute, never a crash
        or a hang."""
        try:
            return self._read(blocks)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the blocks did not load
            log.warning("kvstore load (%s) of %d blocks failed: %s: %s", what, len(blocks), type(exc).__name__, exc)
            return {block_id for _, block_id, _ in blocks}

    def _load(self, req_id: str, blocks: list[GroupBlock], tokens: int | None = None, report: bool = True) -> None:
        """Load one request's blocks; an asynchronous load reports its end however it ends."""
        started = time.perf_counter()
        try:
            failed = self._read_or_fail(blocks, req_id)
            self._account({req_id: blocks}, {req_id: tokens} if tokens is not None else {}, failed,
                          time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - bookkeeping failed: take nothing as loaded
            log.error("kvstore load of request %s failed: %s: %s", req_id, type(exc).__name__, exc)
            self._record_failure({req_id: blocks}, {block_id for _, block_id, _ in blocks})
        finally:
            if report:
                self._finish_load(req_id)

    def _finish_load(self, req_id: str) -> None:
        """An asynchronous load ended (whatever happened): vLLM hears of it at the next step."""
        with self._lock:
            self._in_flight.discard(req_id)
            if req_id in self._abandoned:  # aborted while loading: its blocks can be freed now
                self._abandoned.discard(req_id)
                self._failed_recving.discard(req_id)
                self._sent.add(req_id)
            else:
                self._received.add(req_id)

    def _load_layers(self, loads: dict[str, list[GroupBlock]], tokens: dict[str, int], progress: LayerProgress,
                     loaded: set[int], failed_before: set[int]) -> None:
        """This step's in-step loads, layer after layer (on the layer-load thread), through host
        staging: each layer is copied into the cache as it lands, fenced by `progress`, so a load
        cancelled by its deadline never writes into the cache afterwards. `loaded` blocks were read
        before the forward (`failed_before` of them failed)."""
        started = time.perf_counter()
        blocks = [block for plan in loads.values() for block in plan if block[1] not in loaded]
        failed = set(failed_before)
        try:
            failed |= self._read_layers(blocks, progress)
        except Exception as exc:  # noqa: BLE001 - every block of the load failed
            log.warning("kvstore layer-by-layer load of %d blocks failed: %s: %s", len(blocks), type(exc).__name__, exc)
            failed |= {block_id for _, block_id, _ in blocks}
        finally:
            progress.end()
        self._account(loads, tokens, failed, time.perf_counter() - started, progress=progress)

    def _read_layers(self, blocks: list[GroupBlock], progress: LayerProgress) -> set[int]:
        io = self._io
        assert io is not None
        failed: set[int] = set()
        for group in sorted({g for g, _, _ in blocks}):
            chosen = [(block_id, h) for g, block_id, h in blocks if g == group]
            lease = self._batch.layer_load(group, [block_id for block_id, _ in chosen]) if self._batch else None
            if lease is not None:  # registered staging, layer-major: one scatter per layer as it lands

                def scatter(layer: int, lease=lease) -> None:
                    progress.write(lambda: lease.scatter_layer(layer))
                    progress.landed(layer)

                try:
                    found = self.store.get_many([h for _, h in chosen], lease.targets,
                                                fingerprint=self.group_fingerprints[group], stages=lease.layers,
                                                on_stage=scatter)
                finally:
                    if progress.cancelled:  # a transfer given up on may still land: into staging kept alive
                        self._cancelled_staging.append(lease.slot.host)
                    lease.close(cancelled=progress.cancelled)
                failed |= {block_id for (block_id, _), ok in zip(chosen, found) if not ok}
                continue
            size = io.block_bytes[group]
            staging = np.empty(len(chosen) * size, np.uint8)
            region = self.store.engine.register(staging, remote_access=False)
            layers = io.group_layers[group]
            targets = [[(region, j * size + io.layer_offset[layer], io.geometry[layer].block_bytes) for layer in layers]
                       for j in range(len(chosen))]

            def landed(layer: int, chosen: list = chosen, staging: np.ndarray = staging, size: int = size) -> None:
                def copy() -> None:
                    for j, (block_id, _) in enumerate(chosen):
                        io.write_layer(layer, block_id, staging[j * size:(j + 1) * size])
                progress.write(copy)
                progress.landed(layer)

            try:
                found = self.store.get_many([h for _, h in chosen], targets, fingerprint=self.group_fingerprints[group],
                                            stages=layers, on_stage=landed)
            finally:
                if progress.cancelled:  # a transfer given up on may still land: into staging kept alive
                    self._cancelled_staging.append(staging)
                else:
                    self.store.engine.unregister(region)
            failed |= {block_id for (block_id, _), ok in zip(chosen, found) if not ok}
        return failed

    def _account(self, loads: dict[str, list[GroupBlock]], tokens: dict[str, int], failed: set[int],
                 seconds: float, progress: LayerProgress | None = None) -> None:
        """Count loaded blocks and tokens; report the failed blocks."""
        hit_tokens = loaded = loaded_bytes = 0
        io = self._io
        for req_id, plan in loads.items():
            ok = [(g, b) for g, b, _ in plan if b not in failed]
            loaded += len(ok)
            loaded_bytes += sum(io.block_bytes[g] for g, _ in ok) if io is not None else 0
            whole = len(ok) == len(plan) and req_id in tokens
            hit_tokens += tokens[req_id] if whole else (len(ok) * self.block_size if len(self.groups) == 1 else 0)
        self._count(hit_tokens=hit_tokens, loaded_blocks=loaded, load_bytes=loaded_bytes, load_seconds=seconds)
        self._record_failure(loads, failed, progress)

    def _record_failure(self, loads: dict[str, list[GroupBlock]], failed: set[int],
                        progress: LayerProgress | None = None) -> None:
        """Failed blocks become load errors vLLM recomputes: per block with one KV cache group, per
        request (failed_recving, asynchronous loads only) with several. A cancelled layer-by-layer
        load reported its blocks when it was cancelled: its thread reports nothing later."""
        if not failed:
            return
        with self._lock:
            if progress is not None and progress.cancelled:
                return
            if len(self.groups) > 1:
                self._failed_recving.update(r for r, plan in loads.items() if any(b in failed for _, b, _ in plan))
            else:
                self._load_errors |= failed
            self._stats.add(load_failures=len(failed))
            self.totals.add(load_failures=len(failed))

    def _fail_layer_load(self, load: LayerLoad, why: str) -> None:
        """The forward read KV that has not landed: stop the load's writes, fail its blocks."""
        if load.progress.cancelled:
            return
        load.progress.cancel()
        log.error("kvstore layer-by-layer load failed (%s): its %d blocks are recomputed", why, len(load.block_ids))
        with self._lock:
            self._load_errors |= load.block_ids
            self._stats.add(load_failures=len(load.block_ids))
            self.totals.add(load_failures=len(load.block_ids))

    def _end_layer_load(self) -> None:
        """Wait for this step's layer-by-layer load to end (its errors are then recorded)."""
        load, self._layer_load = self._layer_load, None
        if load is None:
            return
        try:
            load.future.result(timeout=load.progress.timeout)
        except Exception as exc:  # noqa: BLE001 - a load that cannot end in time is a failed load
            self._fail_layer_load(load, f"did not end in {load.progress.timeout:.0f} s: {type(exc).__name__}")

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Only in-step layer-by-layer loads are still running here; the others ended before the forward.
        load, io = self._layer_load, self._io
        if load is None or io is None:
            return
        layer = io.layer_index.get(layer_name)
        if layer is None:
            return
        landed, waited = load.progress.wait(layer)
        self._count(layer_wait_seconds=waited)
        if not landed:
            self._fail_layer_load(load, f"layer {layer_name} not loaded after {waited:.1f} s")

    def save_kv_layer(self, meta: Any, layer_name: str) -> None:
        io = self._io
        if not isinstance(meta, KVStoreMetadata) or not meta.saves or io is None or not self.saves_here:
            return
        layer = io.layer_index.get(layer_name)
        if layer is None:
            return
        batch = self._batch
        if batch is not None:
            if self._save_step_meta is not meta:  # the step's first layer: place its saves in a slot
                if self._save_step is not None:  # (a step whose wait_for_save never came)
                    self._save_step.abandon()
                planned: dict[tuple[int, bytes], tuple[int, int, bytes, bool]] = {}
                for req_id, blocks in meta.saves.items():
                    handoff = req_id in meta.handoffs
                    for g, block_id, block_hash in blocks:
                        known = planned.get((g, block_hash))
                        planned[g, block_hash] = known[:3] + (known[3] or handoff,) if known else \
                            (g, block_id, block_hash, handoff)
                self._save_step, overflow = batch.begin_save(list(planned.values()))
                self._save_step_meta = meta
                self._save_overflow = {(g, h) for g, _, h, _ in overflow}
            if self._save_step is not None:  # every block of the step, this layer: one gather
                self._save_step.gather_layer(layer)
            if not self._save_overflow:
                return
        group = io.group_of[layer]
        for req_id, blocks in meta.saves.items():
            handoff = req_id in meta.handoffs
            for g, block_id, block_hash in blocks:
                if g != group or (batch is not None and (g, block_hash) not in self._save_overflow):
                    continue
                staged = self._staged.get((g, block_hash))
                if staged is None:
                    staged = self._staged[g, block_hash] = (np.empty(io.block_bytes[g], np.uint8), set(), handoff)
                io.stage_layer(layer, block_id, staged[0])
                staged[1].add(layer)

    def wait_for_save(self) -> None:
        self._end_layer_load()  # the forward is over: this step's load errors must be known now
        step, self._save_step, self._save_step_meta, self._save_overflow = self._save_step, None, None, set()
        if step is not None and self._writer is not None:
            for save in step.finish():  # views of the step's slot; its device copy still running
                if not self._writer.submit(save):
                    self._count(dropped_blocks=len(save.blocks))
        if not self._staged or self._io is None or self._writer is None:
            return
        batches: dict[tuple[int, bool], list[tuple[bytes, np.ndarray]]] = {}
        for (group, block_hash), (buf, done, handoff) in self._staged.items():
            if len(done) == len(self._io.group_layers[group]):
                batches.setdefault((group, handoff), []).append((block_hash, buf))
        self._staged.clear()
        for (group, handoff), blocks in batches.items():
            if not self._writer.submit(SaveBatch(blocks, handoff, group)):
                self._count(dropped_blocks=len(blocks))

    def _saved(self, batch: SaveBatch, seconds: float, error: Exception | None) -> None:
        if error is not None:
            self._count(save_failures=len(batch.blocks))
            return
        self._count(saved_blocks=len(batch.blocks), save_bytes=batch.nbytes, save_seconds=seconds)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # A hand-off still waiting for its blocks has not started loading: it ends now.
        for req_id in finished_req_ids:
            if self._handoffs.cancel(req_id):
                with self._lock:
                    self._in_flight.discard(req_id)
                    self._sent.add(req_id)
        with self._lock:
            for req_id in finished_req_ids:
                if req_id in self._in_flight:
                    self._abandoned.add(req_id)
                elif req_id in self._received:  # finished before vLLM saw the load complete
                    self._received.discard(req_id)
                    self._failed_recving.discard(req_id)
                    self._sent.add(req_id)
            received, self._received = self._received, set()
            sent, self._sent = self._sent, set()
        return (sent or None), (received or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, receiving = self.get_finished(finished_req_ids)
        receiving = set(receiving or ())
        with self._lock:
            failed = self._failed_recving & receiving
            self._failed_recving -= failed
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=receiving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._end_layer_load()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    def flush_saves(self, timeout: float = 30.0) -> bool:
        """Wait until every save handed to the background writer is stored (tests, shutdown)."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._end_layer_load()
        self._handoffs.close()
        self._pool.shutdown(wait=True)
        self._layer_pool.shutdown(wait=True)
        if self._io is not None:
            self._io.close()
