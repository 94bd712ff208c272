"""KVStoreConnector: vLLM's KV-connector API (v1) over the kvstore cluster, hybrid models included.

Scheduler side: for a new request it asks the index mirror how many leading blocks of the prompt
every rank's store holds beyond what vLLM already has (full blocks, then the prompt's trailing
partial block, saved once the prompt was computed), and has them loaded: inside the step
when they are few, asynchronously otherwise and for P/D hand-offs (the request waits in
WAITING_FOR_REMOTE_KVS while others run). It plans which newly computed prompt blocks to save. A
prefill instance returns transfer parameters for successful prefills that asked for a remote
decode; a decode instance checks them (fingerprint, token ids, MAC) and loads the prompt's blocks,
its worker waiting on the index mirror's watch for blocks still on their way.

Hybrid models (SupportsHMA): every KV cache group (full attention, sliding window, MLA) is a key
namespace of its own. A prefix counts as stored only when every group can serve it: full groups
all its blocks, sliding-window groups the blocks inside the window vLLM keeps (the others are null
in its block table, and are neither loaded nor saved). With several groups, loads are
asynchronous: vLLM takes a failed load of such a model only per request (failed_recving).

Worker side: loads run on a thread (store -> paged KV cache, in place on the CPU); saves copy each
layer's blocks into staging as the forward pass produces them, and a bounded background writer
puts them to the store, off the step. One store block = one vLLM block of one group, all of this
rank's layers of that group.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               SupportsHMA)

from ...errors import FingerprintMismatch, UnsupportedDeployment, UnsupportedKVLayout
from .events import StoreEvents
from .fingerprint import (all_rank_fingerprints, chain_fingerprint, check_kv_scales, fingerprint_from_vllm,
                          group_fingerprints, layout_name, required_layout, resolved_layout, uses_mla)
from .groups import FULL, NULL_BLOCK, SLIDING, SUPPORTED, CacheGroup, check_groups
from .handoff import PARAMS_KEY, SeenIds, handoff_key, make_params, wait_budget
from .handoff_wait import HandoffWaiter, PendingHandoff
from .kv_cache_io import KVCacheIO
from .layer_progress import LayerProgress
from .parallel import check_context_parallel, check_hybrid_pipeline, world, worker_ranks
from .plan import GroupBlock, RequestState, common_prefix, loadable_blocks, loadable_tokens, longest_servable
from .identity import AdapterIdentities, weights_identity
from .request_keys import KeySources, request_keys
from .stats import KVStoreConnectorStats, KVStorePromMetrics
from .store import check_deployment, is_private, store_for
from .writer import SaveBatch, SaveWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from ...keys import ModelFingerprint
    from .kv_batch import BatchedKV, SaveStep

log = logging.getLogger(__name__)
CANCELLED_STAGING_KEPT = 8  # staging of timed-out loads kept alive: a late transfer lands there, never freed memory


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to load and to save, as (group, block id, key)."""

    loads: dict[str, list[GroupBlock]] = field(default_factory=dict)  # asynchronous
    sync_loads: dict[str, list[GroupBlock]] = field(default_factory=dict)  # before this forward
    saves: dict[str, list[GroupBlock]] = field(default_factory=dict)
    load_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens each load provides
    handoffs: set[str] = field(default_factory=set)  # saves a decode instance waits for
    remote_waits: dict[str, float] = field(default_factory=dict)  # P/D loads: seconds to wait for blocks


@dataclass
class LayerLoad:
    """This step's layer-by-layer load: its thread, its progress and every block it fills."""

    future: Future
    progress: LayerProgress
    block_ids: set[int]


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        self.block_size = int(vllm_config.cache_config.block_size)
        self.kv_role = str(self._kv_transfer_config.kv_role)
        tp, pp, dcp, pcp = world(vllm_config.parallel_config)
        check_context_parallel(dcp, pcp)
        check_deployment(extra, tp * pp, self.kv_role)
        check_kv_scales(vllm_config)
        self.groups = self._cache_groups(kv_cache_config)
        check_hybrid_pipeline(len(self.groups), pp)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self._mla = uses_mla(vllm_config)
        tp_rank, pp_rank = (0, 0) if role != KVConnectorRole.WORKER else worker_ranks(tp, pp)
        self.fingerprint = fingerprint_from_vllm(vllm_config, tp_rank, extra, pp_rank)
        self.group_fingerprints = group_fingerprints(self.fingerprint, self.groups)
        # MLA's latent cache is identical on every TP rank: rank 0 stores the one copy.
        self._saves_here = not (self._mla and tp_rank > 0)
        self._rank_group_fingerprints = [group_fingerprints(fp, self.groups)
                                         for fp in all_rank_fingerprints(vllm_config, extra)]
        self._vllm_config = vllm_config
        self.store = store_for(extra)
        self._private_store = is_private(extra)
        self._process_local = bool(extra.get("process_local"))
        self._handoff_key = handoff_key(extra, self._private_store)
        self.save_enabled = bool(extra.get("save", self.kv_role in ("kv_both", "kv_producer")))
        self.load_enabled = bool(extra.get("load", True))
        self.remote_wait_s = float(extra.get("remote_wait_s", 5.0))
        multi = len(self.groups) > 1
        # Loads of up to this many blocks run inside the step (no scheduler round trip); larger ones
        # and P/D hand-offs run asynchronously while other requests keep going. With several KV cache
        # groups every load is asynchronous: vLLM can take an in-step load's failure per block only
        # for one group, and a failure must always be reported.
        self.sync_load_blocks = -1 if multi else int(extra.get("sync_load_blocks", 64))
        # In-step loads of at least this many blocks (0: never) go layer by layer on a thread: each
        # layer's attention waits only for its own layer (wait_for_layer_load) while later layers
        # load. Off by default: on CPU caches the copy competes with the forward for the same cores
        # (measured no gain on 2 vCPUs, BENCHMARKS.md); device caches load through host staging.
        self.layerwise_load_blocks = 0 if multi else int(extra.get("layerwise_load_blocks", 0))
        # How long a layer's attention waits for its layer-by-layer load before the step's loads are
        # failed (default: the store's timeout per layer, plus one).
        self.layer_load_timeout_s = extra.get("layer_load_timeout_s")
        # The prompt's trailing partial block is saved too, so the same prompt again (a retry, a P/D
        # decode) recomputes one token instead of up to block_size - 1.
        self.partial_blocks = bool(extra.get("partial_blocks", True))
        # Keys chain from the identity of the weights this engine runs (their digest and the named
        # version): reset_cache (weights updated in place) starts a new chain. Adapters and
        # multimodal items are keyed by their content (request_keys.KeySources).
        self._sources = KeySources(AdapterIdentities(str(extra.get("weights_digest", "sampled"))),
                                   trust_mm_identifiers=bool(extra.get("trust_multimodal_identifiers", False)))
        self.weights = weights_identity(vllm_config, extra) if role != KVConnectorRole.WORKER else "worker"
        self._chain = chain_fingerprint(self.fingerprint, self.weights)
        if self.kv_role in ("kv_both", "kv_producer") and self._handoff_key is None and role != KVConnectorRole.WORKER:
            log.warning("kvstore: no secret in kv_connector_extra_config: P/D hand-off parameters are unsigned, so "
                        "decode engines load only blocks already stored and never wait for ones still being written")
        self._handoffs_withheld_logged = False
        self._seen_handoffs = SeenIds()  # one-time ids of hand-off parameters already waited for
        self.refused_handoffs = 0  # parameters not signed for their request (or replayed): no wait
        # scheduler side
        self._requests: dict[str, RequestState] = {}
        self._matched: dict[str, tuple[int, int, int, bool]] = {}  # computed tokens, blocks, tokens, async
        self._load_tokens: dict[str, int] = {}
        self._loads: dict[str, list[GroupBlock]] = {}
        self._sync_loads: dict[str, list[GroupBlock]] = {}
        self._remote_waits: dict[str, float] = {}
        self._loading: set[str] = set()
        self._load_plans: dict[str, set[int]] = {}  # block ids each request was told to load
        self._load_failed: set[str] = set()  # requests that must not be offered store blocks again
        self._events = StoreEvents(self.block_size, self.groups)
        # worker side
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
        self._save_queue_bytes = int(float(extra.get("save_queue_mib", 256)) * (1 << 20))
        self._stats = KVStoreConnectorStats()  # since the last get_kv_connector_stats()
        self.totals = KVStoreConnectorStats()  # since start (the demo and tests read it)

    @property
    def chain(self) -> "ModelFingerprint":
        """The fingerprint this engine's block keys chain from (its weights' identity in it)."""
        return self._chain

    def _count(self, **values: float) -> None:
        with self._lock:
            self._stats.add(**values)
            self.totals.add(**values)

    def _cache_groups(self, kv_cache_config: Any) -> list[CacheGroup]:
        """vLLM's KV cache groups, each classified by vLLM's own spec kind; unsupported ones refused."""
        if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
            return [CacheGroup(0, FULL, (), self.block_size)]
        from vllm.v1.kv_cache_interface import (get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window,
                                                iter_layer_specs)

        transfer = set(getattr(kv_cache_config, "transfer_group_ids", range(len(kv_cache_config.kv_cache_groups))))
        groups, unsupported = [], {}
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            kind = get_kv_cache_spec_kind(spec).value
            if kind not in SUPPORTED:
                unsupported[index] = kind
            elif index not in transfer:
                unsupported[index] = f"{kind} excluded from KV transfer"
            window = get_kv_cache_spec_sliding_window(spec) if kind == SLIDING else None
            retained = max((int(getattr(s, "extra_retained_tokens", 0) or 0) for s in iter_layer_specs(spec)),
                           default=0)
            groups.append(CacheGroup(index, kind, tuple(group.layer_names), int(spec.block_size), window, retained))
        check_groups(groups, unsupported, self.block_size)
        return groups

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
            full, tail = request_keys(self._chain, request, tokens, self._sources)
            # A partial block is only worth a key when it gives a token beyond the full blocks, and
            # in P/D only when this prompt is exactly the one the prefill saved.
            if not self.partial_blocks or tokens != prompt or len(prompt) % self.block_size < 2:
                tail = None
            state = RequestState(full, len(prompt), tokens=prompt, tail=tail)
            state.handoff = bool((getattr(request, "kv_transfer_params", None) or {}).get("do_remote_decode"))
            self._requests[request.request_id] = state
        return state

    @staticmethod
    def _remote_params(request: "Request") -> dict | None:
        params = (getattr(request, "kv_transfer_params", None) or {}).get(PARAMS_KEY)
        return params if isinstance(params, dict) else None

    def _servable(self, state: RequestState, first: int, usable: int) -> int | None:
        """Leading blocks (beyond the `first` vLLM has) that every rank's store holds for every
        group; None when the index cannot be trusted now."""
        mirror, keys = self.store.mirror, state.keys
        if mirror.stale:
            return None
        upper = usable
        for rank, fingerprints in enumerate(self._rank_group_fingerprints):
            for group in self.groups:
                if group.window is not None:
                    continue
                match = mirror.match(fingerprints[group.index], keys[:usable])
                if match.stale:
                    return None
                if rank == 0:
                    self._events.check_missing(group.index, keys[match.length:usable])
                upper = min(upper, match.length)
        sliding = [g for g in self.groups if g.window is not None]

        def window_stored(k: int) -> bool:  # every kept block of every sliding-window group, on every rank
            tokens = min(k * self.block_size, loadable_tokens(state.prompt_tokens))
            for group in sliding:
                for i in range(max(first, group.first_kept_block(tokens)), k):
                    if not all(mirror.contains(fps[group.index], keys[i]) for fps in self._rank_group_fingerprints):
                        return False
            return True

        return longest_servable(first, upper, window_stored) if sliding else upper

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)  # also when loading is off: saves need the request's keys
        if not self.load_enabled or request.request_id in self._load_failed:
            return 0, False  # after a failed load, recompute rather than fail again
        usable = state.load_blocks(self.block_size)
        first = num_computed_tokens // self.block_size
        remote = self._remote_params(request)
        wait = 0.0
        if remote is not None:
            if remote.get("fingerprint") != self._chain.digest:
                log.error("%s", FingerprintMismatch(f"request {request.request_id} carries KV of fingerprint "
                                                    f"{remote.get('fingerprint')}, this engine is {self._chain.digest}:"
                                                    " recomputing instead"))
                return 0, False
            # Only parameters this deployment's prefill signed, for this very request, once, may make
            # the worker wait for blocks.
            promised = int(remote.get("num_tokens", int(remote.get("num_blocks", 0)) * self.block_size))
            count = -(-promised // self.block_size)
            last_key = state.keys[count - 1] if 0 < count <= len(state.keys) else None
            wait = wait_budget(remote, self._handoff_key, self.remote_wait_s, last_key, self._seen_handoffs)
            if wait <= 0:
                self.refused_handoffs += 1
                log.debug("kvstore: request %s carries hand-off parameters this deployment did not sign for it "
                          "(or already used): loading only what is stored", request.request_id)
        if wait > 0:
            # The producer promised these tokens; the worker waits on the index for blocks still in flight.
            matched = min(-(-promised // self.block_size), usable)
            matched_tokens = min(promised, matched * self.block_size)
            stored = self._servable(state, first, usable)
            if stored is not None and stored >= matched:
                wait = 0.0  # all published already: an ordinary load, inside the step when it is small
            else:
                self._remote_waits[request.request_id] = wait
        else:
            stored = self._servable(state, first, usable)
            if stored is None:
                return 0, False  # an index we cannot confirm is no reason to wait on a load
            matched = stored
            matched_tokens = matched * self.block_size
        matched_tokens = min(matched_tokens, loadable_tokens(state.prompt_tokens))
        external = matched_tokens - num_computed_tokens
        if external <= 0:
            self._remote_waits.pop(request.request_id, None)
            return 0, False
        # A hand-off whose blocks may still be on their way waits off the step; the rest load inside
        # the step when few (no scheduler round trip, no thread hop), else asynchronously.
        load_async = wait > 0 or self.sync_load_blocks < 0 or matched - first > self.sync_load_blocks
        self._matched[request.request_id] = (num_computed_tokens, matched, external, load_async)
        return external, load_async

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens == 0:
            return {}
        if self._remote_params(request) is not None:  # a P/D hand-off: KV from a peer
            return {CacheHitSource.P2P: num_external_tokens}
        # From the pool: a block no node holds in DRAM comes from an NVMe tier (DISK), else HOST.
        # Asked right after the load was planned (update_state_after_alloc), from that plan.
        rid = request.request_id
        plan = self._loads.get(rid) or self._sync_loads.get(rid) or []
        if not plan:
            return {CacheHitSource.HOST: num_external_tokens}
        group = plan[0][0]
        keys = list(dict.fromkeys(key for g, _, key in plan if g == group))
        mirror, fingerprint = self.store.mirror, self.group_fingerprints[group]
        disk = 0
        for i, key in enumerate(keys):
            replicas = mirror.lookup(fingerprint, key)
            if replicas and all(record.tier == "nvme" for record in replicas.values()):
                disk += self.block_size if i < len(keys) - 1 else num_external_tokens - self.block_size * i
        disk = max(0, min(disk, num_external_tokens))
        sources = {CacheHitSource.DISK: disk, CacheHitSource.HOST: num_external_tokens - disk}
        return {source: tokens for source, tokens in sources.items() if tokens}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id not in self._matched:
            return
        computed, matched, tokens, load_async = self._matched.pop(request.request_id)
        state = self._state(request)
        first = computed // self.block_size
        # Every block of every group in the loaded range that vLLM holds (not null): a block left
        # out would be cached by vLLM as computed without its KV. A sliding-window group's blocks
        # outside the window are null.
        plan = [(group.index, table[i], state.keys[i])
                for group, table in zip(self.groups, blocks.get_block_ids())
                for i in range(first, min(matched, len(table))) if table[i] != NULL_BLOCK]
        (self._loads if load_async else self._sync_loads)[request.request_id] = plan
        self._load_tokens[request.request_id] = tokens
        state.saved_blocks = max(state.saved_blocks, matched)  # loaded blocks need no saving

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        for req_id, plan in list(self._loads.items()) + list(self._sync_loads.items()):
            self._load_plans[req_id] = {block_id for _, block_id, _ in plan}
        meta = KVStoreMetadata(loads=self._loads, sync_loads=self._sync_loads, load_tokens=self._load_tokens,
                               remote_waits={r: w for r, w in self._remote_waits.items() if r in self._loads})
        self._load_tokens = {}
        self._loading.update(self._loads)
        for req_id in self._loads:
            self._remote_waits.pop(req_id, None)
        self._loads, self._sync_loads = {}, {}
        if not self.save_enabled:
            return meta
        mirror, fingerprints = self.store.mirror, self.group_fingerprints
        stored = lambda group, h: mirror.contains(fingerprints[group], h)  # noqa: E731
        scheduled = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, Any, int, bool]] = []
        for new in scheduler_output.scheduled_new_reqs:
            progress.append((new.req_id, new.block_ids, new.num_computed_tokens, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids  # after preemption: the whole new table
            progress.append((req_id, cached.new_block_ids[i], cached.num_computed_tokens[i], resumed))
        for req_id, block_ids, computed, replace_ids in progress:
            state = self._requests.get(req_id)
            if state is None:
                continue  # never seen by get_num_new_matched_tokens: no keys to save it under
            if block_ids is not None:
                state.update_block_ids(block_ids, replace_ids)
            saves = state.blocks_to_save(computed + scheduled.get(req_id, 0), self.block_size, stored)
            if saves:
                meta.saves[req_id] = saves
                self._events.saving(state, saves)
                if state.handoff:
                    meta.handoffs.add(req_id)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        if invalid or failed:
            for req_id, plan in self._load_plans.items():
                if req_id in failed or plan & invalid:
                    self._load_failed.add(req_id)
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(req_id)
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            self._loading.discard(req_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        for table in (self._matched, self._loads, self._sync_loads, self._remote_waits, self._load_plans,
                      self._load_tokens):
            table.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
        # A load still writing into these blocks: vLLM must not reuse them until the worker says so.
        delay = request.request_id in self._loading
        params = None
        if state is not None and state.handoff and self.save_enabled and self._prefill_succeeded(request):
            params = self._handoff_params(state)
        return delay, params

    def _handoff_params(self, state: RequestState) -> dict[str, Any] | None:
        """The parameters a remote decode loads this prefill's blocks with; None where no decode
        can reach the store (a process-private store not shared in this process)."""
        if self._private_store and not self._process_local:
            if not self._handoffs_withheld_logged:
                self._handoffs_withheld_logged = True
                log.warning("kvstore: a remote decode was asked for, but metadata=%r is private to this process: no "
                            "hand-off parameters returned (set metadata to etcd://HOST:PORT, or process_local: true "
                            "when the decode engine shares this process)", self._extra.get("metadata", "embedded"))
            return None
        # num_blocks: full blocks (what earlier decoders read); num_tokens: the partial block's too.
        num_tokens = min(loadable_tokens(state.prompt_tokens), len(state.keys) * self.block_size)
        count = -(-num_tokens // self.block_size)
        return make_params(self._handoff_key, self._chain.digest, state.tokens,
                           min(loadable_blocks(state.prompt_tokens, self.block_size), len(state.hashes)),
                           num_tokens, state.keys[count - 1] if count else None)

    @staticmethod
    def _prefill_succeeded(request: "Request") -> bool:
        from vllm.v1.request import RequestStatus

        # A remote-decode prefill ends at its max_tokens (usually 1); an abort or error promises nothing.
        return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

    def take_events(self) -> Iterable[Any]:
        mirror, fingerprints = self.store.mirror, self.group_fingerprints
        return self._events.take(lambda group, h: mirror.contains(fingerprints[group], h))

    def reset_cache(self, weight_version: str | None = None) -> bool:
        """After an in-place weight update the stored KV is stale. vLLM calls this with no argument
        (`reset_prefix_cache(reset_connector=True)`): the new weights' identity is read now, from
        the weight files and the configured version (`weight_version_file`, KVSTORE_WEIGHT_VERSION,
        `weight_version`). Where neither changed, the weights may have changed in memory only: the
        new chain is random, shared with no other process."""
        import secrets

        # A version the caller names overrides every configured source.
        weights = weights_identity(self._vllm_config, self._extra, version=weight_version or None)
        if not weight_version and weights == self.weights:
            log.warning("kvstore: the connector's cache was reset with no new weight version (weight_version_file, "
                        "KVSTORE_WEIGHT_VERSION) and the same weight files: KV from now on is keyed to this process")
            weights = f"nonce {secrets.token_hex(16)}"
        self.weights = weights
        self._chain = chain_fingerprint(self.fingerprint, self.weights)
        self._requests.clear()
        return True

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        resolved = resolved_layout(self._vllm_config)
        named = layout_name(self._vllm_config, self._extra)
        if "kv_layout" not in self._extra and resolved and self.fingerprint.kv_layout != named:
            raise UnsupportedKVLayout(
                f"vLLM resolved the {resolved} KV cache layout, but this engine's blocks are keyed as "
                f"{self.fingerprint.kv_layout}: the scheduler and this worker would disagree on every block's bytes; "
                f"set VLLM_KV_CACHE_LAYOUT={resolved} on every process of the engine")
        if not self._num_blocks:
            raise UnsupportedKVLayout("vLLM gave this worker no KVCacheConfig (its block count and groups): kvstore "
                                      "needs vLLM 0.32's connector API to know where each block is")
        tables = [[name for name in group.layers if name in kv_caches] for group in self.groups]
        self._io = KVCacheIO(self.store.engine, kv_caches, self._num_blocks, tables, self._kernel_ratios(kv_caches))
        if self._extra.get("batched_copy", True):
            from .kv_batch import open_batched, staging_blocks

            capacity = staging_blocks(self._vllm_config, self.block_size, self._num_blocks, self._extra)
            self._batch = open_batched(self._io, self.store.engine, capacity, resolved or self.fingerprint.kv_layout,
                                       save=self.save_enabled and self._saves_here, load=self.load_enabled,
                                       layer_loads=bool(self.layerwise_load_blocks))
            if self._batch is None:
                self._count(staging_fallbacks=1)
        self._writer = SaveWriter(lambda batch: self.store.put_many(batch.blocks,
                                                                    fingerprint=self.group_fingerprints[batch.group]),
                                  self._save_queue_bytes, self._saved, handoff_wait_s=self.remote_wait_s)

    def _kernel_ratios(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, int]:
        """Kernel blocks per scheduler block of each layer, as vLLM's attention backends decide
        (vllm.v1.worker.utils.prepare_kernel_block_sizes): never guessed from tensor sizes."""
        config = self._kv_cache_config
        if config is None or not getattr(config, "kv_cache_groups", None):
            return {}
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.v1.worker.utils import prepare_kernel_block_sizes

        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase, list(kv_caches))
        missing = [name for name in kv_caches if name not in layers]
        if missing:
            raise UnsupportedKVLayout(
                f"layer {missing[0]} has a KV cache but no attention layer in vLLM's forward context: its attention "
                "backend decides how blocks split into kernel blocks, which kvstore does not guess")
        attn_groups = [[SimpleNamespace(backend=layers[name].get_attn_backend(), kv_cache_spec=group.kv_cache_spec)
                        for name in group.layer_names if name in layers] for group in config.kv_cache_groups]
        sizes = prepare_kernel_block_sizes(config, attn_groups)
        return {name: group.block_size // size for group, size in zip(self.groups, sizes) for name in group.layers}

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        io = self._io
        if not isinstance(meta, KVStoreMetadata) or not meta.saves or io is None or not self._saves_here:
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
