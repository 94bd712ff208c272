"""KVStoreConnector: vLLM's KV-connector API (v1) over the kvstore cluster.

Scheduler side: for a new request it asks the index mirror how many leading full blocks of the
prompt the store holds beyond what vLLM already has, and has them loaded: inside the step when
they are few (no scheduler round trip), asynchronously otherwise and for P/D hand-offs (the
request waits in WAITING_FOR_REMOTE_KVS while others run). It plans which newly computed prompt
blocks to save. A prefill instance (kv_producer) returns transfer parameters from
request_finished; a decode instance (kv_consumer) checks them (fingerprint, block count) and
loads the prompt's blocks instead of recomputing them.

Worker side: loads run on a thread (store -> staging -> paged KV cache) and report completion
and failed block ids; saves copy each layer's blocks into staging as the forward pass produces
them and put them to the store in wait_for_save. One store block = one vLLM block, all layers.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from ...errors import FingerprintMismatch, KVStoreError
from .fingerprint import fingerprint_from_vllm
from .plan import RequestState, loadable_blocks, prompt_hashes
from .stats import KVStoreConnectorStats
from .store import store_for

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


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.kv_role = str(self._kv_transfer_config.kv_role)
        self.fingerprint = fingerprint_from_vllm(vllm_config, self._tp_rank(role), extra)
        self.store = store_for(extra)
        self.save_enabled = bool(extra.get("save", self.kv_role in ("kv_both", "kv_producer")))
        self.load_enabled = bool(extra.get("load", True))
        self.remote_wait_s = float(extra.get("remote_wait_s", 5.0))
        # Loads of up to this many blocks run inside the step (no scheduler round trip); larger ones
        # and P/D hand-offs run asynchronously while other requests keep going.
        self.sync_load_blocks = int(extra.get("sync_load_blocks", 64))
        # scheduler side
        self._requests: dict[str, RequestState] = {}
        self._matched: dict[str, tuple[int, int, bool]] = {}
        self._loads: dict[str, list[tuple[int, bytes]]] = {}
        self._sync_loads: dict[str, list[tuple[int, bytes]]] = {}
        self._loading: set[str] = set()
        self._load_plans: dict[str, set[int]] = {}  # block ids each request was told to load
        self._load_failed: set[str] = set()  # requests that must not be offered store blocks again
        self._waiting_since: dict[str, float] = {}
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._layer_offsets: list[int] = []
        self._block_bytes = 0
        self._staged: dict[bytes, tuple[np.ndarray, set[int]]] = {}
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._in_flight: set[str] = set()
        self._abandoned: set[str] = set()
        self._sent: set[str] = set()
        self._load_errors: set[int] = set()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvstore-load")
        self._stats = KVStoreConnectorStats()  # since the last get_kv_connector_stats()
        self.totals = KVStoreConnectorStats()  # since start (the demo and tests read it)

    def _count(self, **values: float) -> None:
        self._stats.add(**values)
        self.totals.add(**values)

    @staticmethod
    def _tp_rank(role: KVConnectorRole) -> int:
        if role != KVConnectorRole.WORKER:
            return 0
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no TP group (tests, single process)
            return 0

    # ============================== scheduler side ==============================
    def _state(self, request: "Request") -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            state = RequestState(prompt_hashes(self.fingerprint, prompt, getattr(request, "cache_salt", None)), len(prompt))
            self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.load_enabled or request.request_id in self._load_failed:
            return 0, False  # after a failed load, recompute rather than fail again
        state = self._state(request)
        usable = loadable_blocks(state.prompt_tokens, self.block_size)
        remote = (getattr(request, "kv_transfer_params", None) or {}).get(PARAMS_KEY)
        if remote is not None:
            if remote.get("fingerprint") != self.fingerprint.digest:
                log.error("%s", FingerprintMismatch(f"request {request.request_id} carries KV of fingerprint "
                                                    f"{remote.get('fingerprint')}, this engine is {self.fingerprint.digest}:"
                                                    " recomputing instead"))
                return 0, False
        match = self.store.mirror.match(self.fingerprint, state.hashes[:usable])
        if match.stale:
            return 0, False  # an index we cannot confirm is no reason to wait on a load
        matched = match.length
        if remote is not None and matched < min(int(remote.get("num_blocks", 0)), usable):
            started = self._waiting_since.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - started < self.remote_wait_s:
                return None, False  # the producer's blocks are still on their way: ask again later
        self._waiting_since.pop(request.request_id, None)
        external = matched * self.block_size - num_computed_tokens
        if external <= 0:
            return 0, False
        load_async = remote is not None or matched - num_computed_tokens // self.block_size > self.sync_load_blocks
        self._matched[request.request_id] = (num_computed_tokens, matched, load_async)
        return external, load_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id not in self._matched:
            return
        computed, matched, load_async = self._matched.pop(request.request_id)
        state = self._state(request)
        ids = list(blocks.get_block_ids()[0])
        first = computed // self.block_size
        if len(ids) >= matched:  # all of the request's blocks
            chosen = ids[first:matched]
        else:  # only the newly allocated ones
            chosen = ids[: matched - first]
        plan = list(zip(chosen, state.hashes[first:matched]))
        (self._loads if load_async else self._sync_loads)[request.request_id] = plan
        state.saved_blocks = max(state.saved_blocks, matched)  # loaded blocks need no saving

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        for req_id, plan in list(self._loads.items()) + list(self._sync_loads.items()):
            self._load_plans[req_id] = {block_id for block_id, _ in plan}
        meta = KVStoreMetadata(loads=self._loads, sync_loads=self._sync_loads)
        self._loading.update(self._loads)
        self._loads, self._sync_loads = {}, {}
        if not self.save_enabled:
            return meta
        stored = lambda h: self.store.mirror.contains(self.fingerprint, h)  # noqa: E731
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                prompt = list(new.prompt_token_ids or [])
                state = self._requests[new.req_id] = RequestState(prompt_hashes(self.fingerprint, prompt), len(prompt))
            state.block_ids = list(new.block_ids[0])
            saves = state.blocks_to_save(new.num_computed_tokens + scheduled.get(new.req_id, 0), self.block_size, stored)
            if saves:
                meta.saves[new.req_id] = saves
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])  # after preemption: the whole new list
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            saves = state.blocks_to_save(cached.num_computed_tokens[i] + scheduled.get(req_id, 0), self.block_size, stored)
            if saves:
                meta.saves[req_id] = saves
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
        self._matched.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._sync_loads.pop(request.request_id, None)
        self._waiting_since.pop(request.request_id, None)
        self._load_plans.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
        # A load still writing into these blocks: vLLM must not reuse them until the worker says so.
        delay = request.request_id in self._loading
        params = None
        if self.kv_role in ("kv_producer", "kv_both") and state is not None:
            params = {PARAMS_KEY: {"fingerprint": self.fingerprint.digest, "prompt_tokens": state.prompt_tokens,
                                   "num_blocks": loadable_blocks(state.prompt_tokens, self.block_size)}}
        return delay, params

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        # Registered once with the store's Transfer Engine: loads land straight in the KV cache.
        self._kv_regions = [self.store.engine.register(t, remote_access=False) if self._block_major(t) else None
                            for t in self._kv_caches.values()]
        offset = 0
        for i, (name, tensor) in enumerate(self._kv_caches.items()):
            self._layer_index[name] = i
            self._layer_offsets.append(offset)
            offset += tensor[0].numel() * tensor.element_size()
        self._layer_offsets.append(offset)
        self._block_bytes = offset

    @staticmethod
    def _block_major(t: torch.Tensor) -> bool:
        """A CPU tensor whose blocks are contiguous and back to back: blocks can be read in place."""
        return t.device.type == "cpu" and t.is_contiguous() and t.stride(0) == t[0].numel()

    def _layer_slice(self, i: int) -> slice:
        return slice(self._layer_offsets[i], self._layer_offsets[i + 1])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreMetadata):
            return
        for req_id, blocks in meta.loads.items():
            with self._lock:
                self._in_flight.add(req_id)
            self._pool.submit(self._load, req_id, blocks)
        for req_id, blocks in meta.sync_loads.items():
            self._load(req_id, blocks, report=False)  # failures surface in this step's load errors

    def _load(self, req_id: str, blocks: list[tuple[int, bytes]], report: bool = True) -> None:
        started = time.perf_counter()
        failed: set[int] = set()
        loaded = 0
        try:
            if all(r is not None for r in self._kv_regions):  # CPU KV cache: read into place
                targets = [[(region, block_id * (self._layer_offsets[i + 1] - self._layer_offsets[i]),
                             self._layer_offsets[i + 1] - self._layer_offsets[i])
                            for i, region in enumerate(self._kv_regions)] for block_id, _ in blocks]
                found = self.store.get_many([h for _, h in blocks], targets, fingerprint=self.fingerprint)
            else:  # device KV cache: through host staging
                buffers = [np.empty(self._block_bytes, np.uint8) for _ in blocks]
                found = self.store.get_many([h for _, h in blocks], buffers, fingerprint=self.fingerprint)
                for (block_id, _), ok, buf in zip(blocks, found, buffers):
                    for i, tensor in enumerate(self._kv_caches.values()):
                        if ok:
                            tensor[block_id].reshape(-1).view(torch.uint8).copy_(torch.from_numpy(buf[self._layer_slice(i)]))
            for (block_id, _), ok in zip(blocks, found):
                if ok:
                    loaded += 1
                else:
                    failed.add(block_id)
        except (KVStoreError, OSError, RuntimeError, ValueError) as exc:
            log.warning("kvstore load for %s failed: %s", req_id, exc)
            failed = {block_id for block_id, _ in blocks}
            loaded = 0
        with self._lock:
            self._load_errors |= failed
            self._count(hit_tokens=loaded * self.block_size, loaded_blocks=loaded,
                            load_bytes=loaded * self._block_bytes, load_seconds=time.perf_counter() - started,
                            load_failures=len(failed))
            if not report:
                return
            self._in_flight.discard(req_id)
            if req_id in self._abandoned:  # aborted while loading: its blocks can be freed now
                self._abandoned.discard(req_id)
                self._sent.add(req_id)
            else:
                self._received.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads finish in start_load_kv; asynchronous ones before scheduling

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreMetadata) or not meta.saves or layer_name not in self._layer_index:
            return
        i = self._layer_index[layer_name]
        part = self._layer_slice(i)
        for blocks in meta.saves.values():
            for block_id, block_hash in blocks:
                staged = self._staged.get(block_hash)
                if staged is None:
                    staged = self._staged[block_hash] = (np.empty(self._block_bytes, np.uint8), set())
                source = kv_layer[block_id].reshape(-1).view(torch.uint8)
                staged[0][part] = source.cpu().numpy() if source.device.type != "cpu" else source.numpy()
                staged[1].add(i)

    def wait_for_save(self) -> None:
        if not self._staged:
            return
        complete = [(h, buf) for h, (buf, layers) in self._staged.items() if len(layers) == len(self._kv_caches)]
        self._staged.clear()
        if not complete:
            return
        started = time.perf_counter()
        try:
            self.store.put_many(complete, fingerprint=self.fingerprint)
        except (KVStoreError, OSError, RuntimeError) as exc:  # saving is best effort: a miss later
            log.warning("kvstore save of %d blocks failed: %s", len(complete), exc)
            return
        with self._lock:
            self._count(saved_blocks=len(complete), save_bytes=len(complete) * self._block_bytes,
                        save_seconds=time.perf_counter() - started)

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
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=data) if data else KVStoreConnectorStats()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
