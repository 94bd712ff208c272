"""The connector's scheduler side (vLLM's scheduler process): for a new request, how many leading
blocks of its prompt every rank's store holds beyond what vLLM already has, loaded inside the step
when they are few and asynchronously otherwise; which newly computed prompt blocks to save; the P/D
hand-off parameters a prefill returns and a decode checks (fingerprint, token ids, MAC).

Hybrid models: every KV cache group (full attention, sliding window, MLA) is a key namespace of its
own. A prefix counts as stored only when every group can serve it: full groups all its blocks,
sliding-window groups the blocks inside the window vLLM keeps (the others are null in its block
table, and are neither loaded nor saved).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...errors import FingerprintMismatch
from ...prefix import loadable_blocks, loadable_tokens
from .events import StoreEvents
from .fingerprint import chain_fingerprint
from .groups import NULL_BLOCK
from .handoff import PARAMS_KEY, SeenIds, make_params, wait_budget
from .hits import HITS_KEY, RequestHits
from .identity import AdapterIdentities, weights_identity
from .plan import GroupBlock, RequestState, common_prefix, longest_servable
from .request_keys import KeySources, request_keys
from .settings import ConnectorSettings, ConnectorSide
from .step_plan import KVStoreMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from ...keys import ModelFingerprint

log = logging.getLogger(__name__)


class KVStoreScheduler(ConnectorSide):
    """The scheduler side of one engine's connector (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings) -> None:
        super().__init__(settings)
        extra = settings.extra
        # Keys chain from the identity of the weights this engine runs (their digest and the named
        # version): reset_cache (weights updated in place) starts a new chain. Adapters and
        # multimodal items are keyed by their content (request_keys.KeySources).
        self._sources = KeySources(AdapterIdentities(str(extra.get("weights_digest", "sampled"))),
                                   trust_mm_identifiers=bool(extra.get("trust_multimodal_identifiers", False)))
        self.weights = weights_identity(settings.vllm_config, extra)
        self._chain = chain_fingerprint(self.fingerprint, self.weights)
        if self.kv_role in ("kv_both", "kv_producer") and self.handoff_key is None:
            log.warning("kvstore: no secret in kv_connector_extra_config: P/D hand-off parameters are unsigned, so "
                        "decode engines load only blocks already stored and never wait for ones still being written")
        self._handoffs_withheld_logged = False
        self._seen_handoffs = SeenIds()  # one-time ids of hand-off parameters already waited for
        self.refused_handoffs = 0  # parameters not signed for their request (or replayed): no wait
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
        self._hits = RequestHits()  # where each request's cached tokens came from (its answer says)

    @property
    def chain(self) -> "ModelFingerprint":
        """The fingerprint this engine's block keys chain from (its weights' identity in it)."""
        return self._chain

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
        for rank, fingerprints in enumerate(self.rank_group_fingerprints):
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
                    if not all(mirror.contains(fps[group.index], keys[i]) for fps in self.rank_group_fingerprints):
                        return False
            return True

        return longest_servable(first, upper, window_stored) if sliding else upper

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)  # also when loading is off: saves need the request's keys
        self._hits.looked_up(request.request_id, num_computed_tokens)
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
            wait = wait_budget(remote, self.handoff_key, self.remote_wait_s, last_key, self._seen_handoffs)
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
        return self._hit_sources(request, num_external_tokens)

    def _hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
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
        preempted = int(getattr(request, "num_preemptions", 0) or 0) > 0
        self._hits.admitted(request.request_id, preempted)
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
        if not preempted:  # recorded here, not when vLLM asks: it asks only while it keeps statistics
            sources = self._hit_sources(request, num_external_tokens)
            self._hits.sources(request.request_id, {source.value: n for source, n in sources.items()})

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
        hits = self._hits.finished(request.request_id)
        if hits is not None:  # in the answer: where its cached prompt tokens came from (hits.py)
            params = {**(params or {}), HITS_KEY: hits}
        return delay, params

    def _handoff_params(self, state: RequestState) -> dict[str, Any] | None:
        """The parameters a remote decode loads this prefill's blocks with; None where no decode
        can reach the store (a process-private store not shared in this process)."""
        if self.private_store and not self.process_local:
            if not self._handoffs_withheld_logged:
                self._handoffs_withheld_logged = True
                log.warning("kvstore: a remote decode was asked for, but metadata=%r is private to this process: no "
                            "hand-off parameters returned (set metadata to etcd://HOST:PORT, or process_local: true "
                            "when the decode engine shares this process)", self.extra.get("metadata", "embedded"))
            return None
        # num_blocks: full blocks (what earlier decoders read); num_tokens: the partial block's too.
        num_tokens = min(loadable_tokens(state.prompt_tokens), len(state.keys) * self.block_size)
        count = -(-num_tokens // self.block_size)
        return make_params(self.handoff_key, self._chain.digest, state.tokens,
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
        weights = weights_identity(self.vllm_config, self.extra, version=weight_version or None)
        if not weight_version and weights == self.weights:
            log.warning("kvstore: the connector's cache was reset with no new weight version (weight_version_file, "
                        "KVSTORE_WEIGHT_VERSION) and the same weight files: KV from now on is keyed to this process")
            weights = f"nonce {secrets.token_hex(16)}"
        self.weights = weights
        self._chain = chain_fingerprint(self.fingerprint, self.weights)
        self._requests.clear()
        return True
