"""KVStoreConnector: vLLM's KV-connector API (v1) over the kvstore cluster.

Scheduler side: for a new request it asks the index mirror how many leading blocks of the prompt
every rank's store holds beyond what vLLM already has (full blocks, then the prompt's trailing
partial block, saved once the prompt was computed), and has them loaded: inside the step
when they are few, asynchronously otherwise and for P/D hand-offs (the request waits in
WAITING_FOR_REMOTE_KVS while others run). It plans which newly computed prompt blocks to save. A
prefill instance returns transfer parameters for successful prefills that asked for a remote
decode; a decode instance checks them (fingerprint, token ids) and loads the prompt's blocks,
its worker waiting on the index mirror's watch for blocks still on their way.

Worker side: loads run on a thread (store -> paged KV cache, in place on the CPU); saves copy each
layer's blocks into staging as the forward pass produces them, and a bounded background writer
puts them to the store, off the step. One store block = one vLLM block, all of this rank's layers.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from ...errors import FingerprintMismatch, KVStoreError, UnsupportedDeployment, UnsupportedKVLayout
from ...keys import ModelFingerprint
from .events import StoreEvents
from .fingerprint import all_rank_fingerprints, fingerprint_from_vllm, required_layout, uses_mla
from .kv_cache_io import KVCacheIO
from .layer_progress import LayerProgress
from .plan import RequestState, common_prefix, loadable_blocks, loadable_tokens
from .request_keys import request_keys
from .stats import KVStoreConnectorStats, KVStorePromMetrics
from .store import check_deployment, store_for
from .writer import SaveBatch, SaveWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
PARAMS_KEY = "kvstore"


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to load and to save, as (block id, hash)."""

    loads: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)  # asynchronous
    sync_loads: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)  # before this forward
    saves: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    load_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens each load provides
    handoffs: set[str] = field(default_factory=set)  # saves a decode instance waits for
    remote_waits: dict[str, float] = field(default_factory=dict)  # P/D loads: seconds to wait for blocks


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.kv_role = str(self._kv_transfer_config.kv_role)
        parallel = vllm_config.parallel_config
        world = int(getattr(parallel, "tensor_parallel_size", 1)) * int(getattr(parallel, "pipeline_parallel_size", 1))
        check_deployment(extra, world, self.kv_role)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise UnsupportedDeployment(
                f"kvstore stores one KV cache group, this model has {len(groups)} (hybrid memory: sliding-window or "
                "mamba layers); start vLLM with --disable-hybrid-kv-cache-manager")
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._mla = uses_mla(vllm_config)
        tp_rank, pp_rank = self._ranks(role)
        self.fingerprint = fingerprint_from_vllm(vllm_config, tp_rank, extra, pp_rank)
        # MLA's latent cache is identical on every TP rank: rank 0 stores the one copy.
        self._saves_here = not (self._mla and tp_rank > 0)
        self._rank_fingerprints = all_rank_fingerprints(vllm_config, extra)
        self._required_layout = required_layout(vllm_config)
        self._vllm_config = vllm_config
        self.store = store_for(extra)
        self.save_enabled = bool(extra.get("save", self.kv_role in ("kv_both", "kv_producer")))
        self.load_enabled = bool(extra.get("load", True))
        self.remote_wait_s = float(extra.get("remote_wait_s", 5.0))
        # Loads of up to this many blocks run inside the step (no scheduler round trip); larger ones
        # and P/D hand-offs run asynchronously while other requests keep going.
        self.sync_load_blocks = int(extra.get("sync_load_blocks", 64))
        # In-step loads of at least this many blocks (0: never) go layer by layer on a thread: each
        # layer's attention waits only for its own layer (wait_for_layer_load) while later layers
        # load. Off by default: on CPU caches the copy competes with the forward for the same cores
        # (measured no gain on 2 vCPUs, BENCHMARKS.md); device caches load through host staging.
        self.layerwise_load_blocks = int(extra.get("layerwise_load_blocks", 0))
        # The prompt's trailing partial block is saved too, so the same prompt again (a retry, a P/D
        # decode) recomputes one token instead of up to block_size - 1.
        self.partial_blocks = bool(extra.get("partial_blocks", True))
        self._epoch = 0  # bumped by reset_cache: blocks saved before are never matched again
        # scheduler side
        self._requests: dict[str, RequestState] = {}
        self._matched: dict[str, tuple[int, int, int, bool]] = {}  # computed tokens, blocks, tokens, async
        self._load_tokens: dict[str, int] = {}
        self._loads: dict[str, list[tuple[int, bytes]]] = {}
        self._sync_loads: dict[str, list[tuple[int, bytes]]] = {}
        self._remote_waits: dict[str, float] = {}
        self._loading: set[str] = set()
        self._load_plans: dict[str, set[int]] = {}  # block ids each request was told to load
        self._load_failed: set[str] = set()  # requests that must not be offered store blocks again
        self._events = StoreEvents(self.block_size)
        # worker side
        self._io: KVCacheIO | None = None
        self._staged: dict[bytes, tuple[np.ndarray, set[int], bool]] = {}
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._in_flight: set[str] = set()
        self._abandoned: set[str] = set()
        self._sent: set[str] = set()
        self._load_errors: set[int] = set()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvstore-load")
        self._layer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-layer-load")
        self._layer_load: tuple[Future, LayerProgress] | None = None  # this step's layer-by-layer load
        self._writer: SaveWriter | None = None
        self._save_queue_bytes = int(float(extra.get("save_queue_mib", 256)) * (1 << 20))
        self._stats = KVStoreConnectorStats()  # since the last get_kv_connector_stats()
        self.totals = KVStoreConnectorStats()  # since start (the demo and tests read it)

    def _count(self, **values: float) -> None:
        with self._lock:
            self._stats.add(**values)
            self.totals.add(**values)

    @staticmethod
    def _ranks(role: KVConnectorRole) -> tuple[int, int]:
        """(tensor rank, pipeline rank) of this worker; the scheduler speaks for rank (0, 0)."""
        if role != KVConnectorRole.WORKER:
            return 0, 0
        try:
            from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
        except Exception:  # noqa: BLE001 - no parallel groups (tests, single process)
            return 0, 0

    # ============================== class-level hooks ==============================
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return required_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # save_kv_layer runs per layer: a full CUDA graph would replay the forward without it.
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=data) if data else KVStoreConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ============================== scheduler side ==============================
    def _state(self, request: "Request") -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            remote = self._remote_params(request)
            tokens = prompt
            if remote is not None and remote.get("prompt_token_ids") is not None:
                # Hash exactly what the prefill hashed, as far as it agrees with this prompt.
                tokens = common_prefix(prompt, list(remote["prompt_token_ids"]))
            full, tail = request_keys(self._chain_fingerprint(), request, tokens)
            # A partial block is only worth a key when it gives a token beyond the full blocks, and
            # in P/D only when this prompt is exactly the one the prefill saved.
            if not self.partial_blocks or tokens != prompt or len(prompt) % self.block_size < 2:
                tail = None
            state = RequestState(full, len(prompt), tokens=prompt, tail=tail)
            state.handoff = bool((getattr(request, "kv_transfer_params", None) or {}).get("do_remote_decode"))
            self._requests[request.request_id] = state
        return state

    def _chain_fingerprint(self) -> ModelFingerprint:
        if not self._epoch:
            return self.fingerprint
        from dataclasses import replace

        return replace(self.fingerprint, cache_salt=f"{self.fingerprint.cache_salt}#epoch{self._epoch}")

    @staticmethod
    def _remote_params(request: "Request") -> dict | None:
        return (getattr(request, "kv_transfer_params", None) or {}).get(PARAMS_KEY)

    def _stored_prefix(self, hashes: list[bytes]) -> int | None:
        """Leading blocks every rank's store holds; None when the index cannot be trusted now."""
        length = len(hashes)
        for fingerprint in self._rank_fingerprints:
            match = self.store.mirror.match(fingerprint, hashes[:length])
            if match.stale:
                return None
            length = min(length, match.length)
            if not length:
                break
        return length

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)  # also when loading is off: saves need the request's keys
        if not self.load_enabled or request.request_id in self._load_failed:
            return 0, False  # after a failed load, recompute rather than fail again
        usable = state.load_blocks(self.block_size)
        keys = state.keys
        remote = self._remote_params(request)
        if remote is not None:
            if remote.get("fingerprint") != self.fingerprint.digest:
                log.error("%s", FingerprintMismatch(f"request {request.request_id} carries KV of fingerprint "
                                                    f"{remote.get('fingerprint')}, this engine is {self.fingerprint.digest}:"
                                                    " recomputing instead"))
                return 0, False
            # The producer promised these tokens; the worker waits on the index for blocks still in flight.
            promised = int(remote.get("num_tokens", int(remote.get("num_blocks", 0)) * self.block_size))
            matched = min(-(-promised // self.block_size), usable)
            matched_tokens = min(promised, matched * self.block_size)
            self._remote_waits[request.request_id] = self.remote_wait_s
        else:
            stored = self._stored_prefix(keys[:usable])
            if stored is None:
                return 0, False  # an index we cannot confirm is no reason to wait on a load
            self._events.check_missing(keys[stored:usable])
            matched = stored
            matched_tokens = matched * self.block_size
        matched_tokens = min(matched_tokens, loadable_tokens(state.prompt_tokens))
        external = matched_tokens - num_computed_tokens
        if external <= 0:
            self._remote_waits.pop(request.request_id, None)
            return 0, False
        load_async = remote is not None or matched - num_computed_tokens // self.block_size > self.sync_load_blocks
        self._matched[request.request_id] = (num_computed_tokens, matched, external, load_async)
        return external, load_async

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens == 0:
            return {}
        # A P/D hand-off is KV from a peer; otherwise it comes from the store pool (DRAM or NVMe).
        source = CacheHitSource.P2P if self._remote_params(request) is not None else CacheHitSource.HOST
        return {source: num_external_tokens}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id not in self._matched:
            return
        computed, matched, tokens, load_async = self._matched.pop(request.request_id)
        state = self._state(request)
        ids = list(blocks.get_block_ids()[0])
        first = computed // self.block_size
        if len(ids) >= matched:  # all of the request's blocks
            chosen = ids[first:matched]
        else:  # only the newly allocated ones
            chosen = ids[: matched - first]
        plan = list(zip(chosen, state.keys[first:matched]))
        (self._loads if load_async else self._sync_loads)[request.request_id] = plan
        self._load_tokens[request.request_id] = tokens
        state.saved_blocks = max(state.saved_blocks, matched)  # loaded blocks need no saving

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        for req_id, plan in list(self._loads.items()) + list(self._sync_loads.items()):
            self._load_plans[req_id] = {block_id for block_id, _ in plan}
        meta = KVStoreMetadata(loads=self._loads, sync_loads=self._sync_loads, load_tokens=self._load_tokens,
                               remote_waits={r: w for r, w in self._remote_waits.items() if r in self._loads})
        self._load_tokens = {}
        self._loading.update(self._loads)
        for req_id in self._loads:
            self._remote_waits.pop(req_id, None)
        self._loads, self._sync_loads = {}, {}
        if not self.save_enabled:
            return meta
        stored = lambda h: self.store.mirror.contains(self.fingerprint, h)  # noqa: E731
        scheduled = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, list[int] | None, int, bool]] = []
        for new in scheduler_output.scheduled_new_reqs:
            progress.append((new.req_id, list(new.block_ids[0]), new.num_computed_tokens, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids  # after preemption: the whole new list
            progress.append((req_id, None if new_ids is None else list(new_ids[0]), cached.num_computed_tokens[i],
                             resumed))
        for req_id, block_ids, computed, replace_ids in progress:
            state = self._requests.get(req_id)
            if state is None:
                continue  # never seen by get_num_new_matched_tokens: no keys to save it under
            if block_ids is not None:
                state.block_ids = block_ids if replace_ids else state.block_ids + block_ids
            saves = state.blocks_to_save(computed + scheduled.get(req_id, 0), self.block_size, stored)
            if saves:
                meta.saves[req_id] = saves
                self._events.saving(state, saves)
                if state.handoff:
                    meta.handoffs.add(req_id)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if invalid:
            for req_id, plan in self._load_plans.items():
                if plan & invalid:
                    self._load_failed.add(req_id)
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(req_id)
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            self._loading.discard(req_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        for table in (self._matched, self._loads, self._sync_loads, self._remote_waits, self._load_plans,
                      self._load_tokens):
            table.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
        # A load still writing into these blocks: vLLM must not reuse them until the worker says so.
        delay = request.request_id in self._loading
        params = None
        if state is not None and state.handoff and self.save_enabled and self._prefill_succeeded(request):
            # num_blocks: full blocks (what earlier decoders read); num_tokens: the partial block's too.
            params = {PARAMS_KEY: {"fingerprint": self.fingerprint.digest, "prompt_token_ids": state.tokens,
                                   "num_blocks": min(loadable_blocks(state.prompt_tokens, self.block_size),
                                                     len(state.hashes)),
                                   "num_tokens": min(loadable_tokens(state.prompt_tokens),
                                                     len(state.keys) * self.block_size)}}
        return delay, params

    @staticmethod
    def _prefill_succeeded(request: "Request") -> bool:
        from vllm.v1.request import RequestStatus

        # A remote-decode prefill ends at its max_tokens (usually 1); an abort or error promises nothing.
        return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

    def take_events(self) -> Iterable[Any]:
        return self._events.take(self.store.mirror, self.fingerprint)

    def reset_cache(self) -> bool:
        # After an in-place weight update the stored KV is stale: start a new key chain.
        self._epoch += 1
        self._requests.clear()
        return True

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        resolved = getattr(self._vllm_config.cache_config, "kv_cache_layout", None)
        if self._required_layout and resolved and str(resolved) != self._required_layout \
                and "kv_layout" not in (self._kv_transfer_config.kv_connector_extra_config or {}):
            raise UnsupportedKVLayout(
                f"vLLM chose the {resolved} KV cache layout, not {self._required_layout} which kvstore keys its "
                f"blocks under; set VLLM_KV_CACHE_LAYOUT={self._required_layout}, or name the layout in "
                f"kv_connector_extra_config.kv_layout (every engine sharing blocks must use the same)")
        self._io = KVCacheIO(self.store.engine, kv_caches, self._num_blocks)
        self._writer = SaveWriter(lambda blocks: self.store.put_many(blocks, fingerprint=self.fingerprint),
                                  self._save_queue_bytes, self._saved, handoff_wait_s=self.remote_wait_s)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreMetadata):
            return
        for req_id, blocks in meta.loads.items():
            with self._lock:
                self._in_flight.add(req_id)
            self._pool.submit(self._load, req_id, blocks, meta.load_tokens.get(req_id), True,
                              meta.remote_waits.get(req_id, 0.0))
        self._end_layer_load()  # never two in flight
        in_step = sum(len(blocks) for blocks in meta.sync_loads.values())
        io = self._io
        if self.layerwise_load_blocks and in_step >= self.layerwise_load_blocks and io is not None and io.on_host \
                and len(io.names) > 1:
            self._start_layer_load(meta, len(io.names))
            return
        for req_id, blocks in meta.sync_loads.items():
            # failures surface in this step's load errors
            self._load(req_id, blocks, meta.load_tokens.get(req_id), report=False)

    def _start_layer_load(self, meta: KVStoreMetadata, layers: int) -> None:
        """Start this step's in-step loads layer by layer on the layer-load thread."""
        # vLLM writes a layer's new-token KV before that layer waits for its load: a block the load
        # fills only partly (the new tokens go into it) is loaded now, before the forward.
        shared = [plan[-1] for req_id, plan in meta.sync_loads.items()
                  if plan and meta.load_tokens.get(req_id, 0) % self.block_size]
        failed = self._read_or_fail(shared, "in-step") if shared else set()
        progress = LayerProgress(self.store.timeout * (layers + 1))
        future = self._layer_pool.submit(self._load_layers, dict(meta.sync_loads), meta.load_tokens, progress,
                                         {block_id for block_id, _ in shared}, failed)
        self._layer_load = (future, progress)

    def _wait_for_blocks(self, hashes: list[bytes], seconds: float) -> None:
        """P/D: block on the index mirror's watch until the producer's blocks are published."""
        mirror, fingerprint = self.store.mirror, self.fingerprint
        mirror.wait_until(lambda m: all(m.contains(fingerprint, h) for h in hashes), seconds)

    def _read(self, blocks: list[tuple[int, bytes]], progress: LayerProgress | None = None) -> set[int]:
        """Read blocks from the store into the KV cache; the block ids that could not be loaded."""
        io = self._io
        if io is None:
            raise UnsupportedDeployment("no KV cache registered")
        hashes = [h for _, h in blocks]
        if io.on_host:  # read straight into the KV cache
            staged = {"stages": io.segment_layers, "on_stage": progress.landed} if progress is not None else {}
            found = self.store.get_many(hashes, [io.targets(block_id) for block_id, _ in blocks],
                                        fingerprint=self.fingerprint, **staged)
        else:  # device KV cache: through host staging
            buffers = [np.empty(io.block_bytes, np.uint8) for _ in blocks]
            found = self.store.get_many(hashes, buffers, fingerprint=self.fingerprint)
            for (block_id, _), ok, buf in zip(blocks, found, buffers):
                if ok:
                    io.write_block(block_id, buf)
        return {block_id for (block_id, _), ok in zip(blocks, found) if not ok}

    def _read_or_fail(self, blocks: list[tuple[int, bytes]], what: str, progress: LayerProgress | None = None,
                      wait_s: float = 0.0) -> set[int]:
        """`_read` (after waiting up to `wait_s` for P/D blocks still being published), with an error
        failing every block: a failed load is a recompute, never a crash."""
        try:
            if wait_s > 0:
                self._wait_for_blocks([h for _, h in blocks], wait_s)
            return self._read(blocks, progress)
        except (KVStoreError, OSError, RuntimeError, ValueError) as exc:
            log.warning("kvstore load (%s) of %d blocks failed: %s", what, len(blocks), exc)
            return {block_id for block_id, _ in blocks}

    def _load(self, req_id: str, blocks: list[tuple[int, bytes]], tokens: int | None = None, report: bool = True,
              wait_s: float = 0.0) -> None:
        started = time.perf_counter()
        failed = self._read_or_fail(blocks, req_id, wait_s=wait_s)
        self._account({req_id: blocks}, {req_id: tokens} if tokens is not None else {}, failed,
                      time.perf_counter() - started)
        with self._lock:
            if not report:
                return
            self._in_flight.discard(req_id)
            if req_id in self._abandoned:  # aborted while loading: its blocks can be freed now
                self._abandoned.discard(req_id)
                self._sent.add(req_id)
            else:
                self._received.add(req_id)

    def _load_layers(self, loads: dict[str, list[tuple[int, bytes]]], tokens: dict[str, int],
                     progress: LayerProgress, loaded: set[int], failed_before: set[int]) -> None:
        """This step's in-step loads as one read, layer after layer (on the layer-load thread);
        `loaded` blocks were read before the forward (`failed_before` of them failed)."""
        started = time.perf_counter()
        blocks = [block for plan in loads.values() for block in plan if block[0] not in loaded]
        try:
            failed = self._read_or_fail(blocks, "layer by layer", progress) | failed_before
        finally:
            progress.end()
        self._account(loads, tokens, failed, time.perf_counter() - started)

    def _account(self, loads: dict[str, list[tuple[int, bytes]]], tokens: dict[str, int], failed: set[int],
                 seconds: float) -> None:
        """Count loaded blocks and tokens; failed blocks become this step's load errors."""
        hit_tokens = loaded = 0
        for req_id, plan in loads.items():
            ok = sum(1 for block_id, _ in plan if block_id not in failed)
            loaded += ok
            whole = ok == len(plan) and req_id in tokens
            hit_tokens += tokens[req_id] if whole else ok * self.block_size
        block_bytes = self._io.block_bytes if self._io is not None else 0
        self._count(hit_tokens=hit_tokens, loaded_blocks=loaded, load_bytes=loaded * block_bytes,
                    load_seconds=seconds, load_failures=len(failed))
        with self._lock:
            self._load_errors |= failed

    def _end_layer_load(self) -> None:
        """Wait for this step's layer-by-layer load to end (its errors are then recorded)."""
        if self._layer_load is None:
            return
        future, progress = self._layer_load
        self._layer_load = None
        try:
            future.result(timeout=progress.timeout)
        except Exception as exc:  # noqa: BLE001 - a load that cannot end in time is a failed load
            log.error("kvstore layer-by-layer load did not end in %.0f s: %s", progress.timeout, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Only in-step layer-by-layer loads are still running here; the others ended before the forward.
        if self._layer_load is None or self._io is None:
            return
        layer = self._io.layer_index.get(layer_name)
        if layer is not None:
            self._count(layer_wait_seconds=self._layer_load[1].wait(layer))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        io = self._io
        if not isinstance(meta, KVStoreMetadata) or not meta.saves or io is None or not self._saves_here:
            return
        layer = io.layer_index.get(layer_name)
        if layer is None:
            return
        for req_id, blocks in meta.saves.items():
            handoff = req_id in meta.handoffs
            for block_id, block_hash in blocks:
                staged = self._staged.get(block_hash)
                if staged is None:
                    staged = self._staged[block_hash] = (np.empty(io.block_bytes, np.uint8), set(), handoff)
                io.stage_layer(layer, block_id, staged[0])
                staged[1].add(layer)

    def wait_for_save(self) -> None:
        self._end_layer_load()  # the forward is over: this step's load errors must be known now
        if not self._staged or self._io is None or self._writer is None:
            return
        layers = len(self._io.names)
        batches: dict[bool, list[tuple[bytes, np.ndarray]]] = {True: [], False: []}
        for block_hash, (buf, done, handoff) in self._staged.items():
            if len(done) == layers:
                batches[handoff].append((block_hash, buf))
        self._staged.clear()
        for handoff, blocks in batches.items():
            if blocks and not self._writer.submit(SaveBatch(blocks, handoff)):
                self._count(dropped_blocks=len(blocks))

    def _saved(self, batch: SaveBatch, seconds: float, error: Exception | None) -> None:
        if error is not None:
            self._count(save_failures=len(batch.blocks))
            return
        self._count(saved_blocks=len(batch.blocks), save_bytes=batch.nbytes, save_seconds=seconds)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            for req_id in finished_req_ids:
                if req_id in self._in_flight:
                    self._abandoned.add(req_id)
                elif req_id in self._received:  # finished before vLLM saw the load complete
                    self._received.discard(req_id)
                    self._sent.add(req_id)
            received, self._received = self._received, set()
            sent, self._sent = self._sent, set()
        return (sent or None), (received or None)

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
        self._pool.shutdown(wait=True)
        self._layer_pool.shutdown(wait=True)
        if self._io is not None:
            self._io.close()
