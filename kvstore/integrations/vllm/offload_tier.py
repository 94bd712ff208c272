"""kvstore as a secondary tier of vLLM's OffloadingConnector (`TieringOffloadingSpec`).

vLLM keeps offloaded chunks in a CPU tier; this tier copies them into the kvstore pool and back,
so another engine (another process, another host) finds the chunks the first one stored:

    kv_connector="OffloadingConnector", kv_connector_extra_config={
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": N,
        "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.integrations.vllm.offload_tier",
                             "metadata": "etcd://HOST:PORT"}]}

Tier settings (besides `type` and `module_path`): `metadata`, `cluster`, `secret`, `tenant`,
`tenant_secret`, `timeout` (seconds, every remote step), as the connector's (store.py);
`weight_version`, `weight_version_file`, `weights_digest` (identity.py); `cache_salt`;
`threads` (the I/O pool, default 2).

Chunks are keyed by kvstore's fingerprint of the engine, the weights' identity and the chunk
geometry (offload_keys.py): never by vLLM's OffloadKey alone. vLLM hands a tier only its
OffloadingSpec, whose config names the model path and dtype but not the rest of what decides the
KV bytes (quantization, hf_overrides, the loaded config); the tier takes the engine's VllmConfig
from its caller, vLLM's scheduler-side connector, matched by engine id, and refuses to start
without it. Deployments whose chunks it cannot prove interchangeable are refused at start-up.

All store I/O runs on a small thread pool; the scheduler's thread only looks chunks up in the
client's in-memory index mirror and collects finished jobs. A failed, missing or corrupt load is
a failed job (vLLM recomputes): the store verifies every block's digest before it is used.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ...errors import UnsupportedDeployment
from ...keys import ModelFingerprint
from .fingerprint import check_kv_scales, fingerprint_from_vllm
from .identity import weights_identity
from .offload_keys import ChunkGeometry, chunk_fingerprint, chunk_hash
from .store import store_for

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

SETTINGS = ("metadata", "cluster", "secret", "tenant", "tenant_secret", "tls_ca", "timeout", "weight_version",
            "weight_version_file", "weights_digest", "cache_salt", "threads", "dram", "disk", "disk_size",
            "trust_noncrypto_hashes")
CALLER_FRAMES = 12  # the tier is built a few calls below vLLM's connector, which holds the VllmConfig
NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


def engine_config(engine_id: str) -> Any:
    """The VllmConfig of the engine building this tier: a local of one of the callers (vLLM's
    scheduler-side OffloadingConnector), matched by its KV-transfer engine id."""
    from vllm.config import VllmConfig

    frame = sys._getframe(1)
    for _ in range(CALLER_FRAMES):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            if isinstance(value, VllmConfig) and getattr(value.kv_transfer_config, "engine_id", None) == engine_id:
                return value
        frame = frame.f_back
    raise UnsupportedDeployment(
        "KVStoreTier could not find the engine's VllmConfig among its callers (this vLLM builds secondary tiers "
        "differently): without it the tier cannot key chunks by what computed them. Use kvstore's own connector "
        "(kv_connector=KVStoreConnector) with this vLLM")


def check_supported(vllm_config: Any, spec: "OffloadingSpec") -> None:
    """Refuse deployments whose chunks the tier cannot key by everything that made their bytes."""
    parallel = spec.config.parallel
    if parallel.world_size != 1:
        raise UnsupportedDeployment(
            f"KVStoreTier keys a chunk of the CPU tier as one engine's whole KV, but this engine runs "
            f"{parallel.world_size} workers (tensor {parallel.tp_size}, pipeline {parallel.pp_size}, context "
            f"{parallel.pcp_size}/{parallel.dcp_size}): run it with tensor_parallel_size=pipeline_parallel_size=1, "
            "or use kvstore's own connector (kv_connector=KVStoreConnector), which keys each rank's blocks")
    if spec.config.canonical_layout:
        raise UnsupportedDeployment("KVStoreTier stores vLLM's direct layout only: remove canonical_layout from "
                                    "kv_connector_extra_config")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise UnsupportedDeployment(
            "vLLM's offload keys name a LoRA adapter, not its weights: KVStoreTier cannot tell an adapter retrained "
            "in place from the old one. Serve without enable_lora, or use kvstore's own connector "
            "(kv_connector=KVStoreConnector), which keys adapters by their weights")
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "is_multimodal_model", False) or getattr(model, "enable_prompt_embeds", False):
        raise UnsupportedDeployment(
            "vLLM's offload keys name a multimodal item by its identifier, which a client may supply "
            "(multi_modal_uuids) and reuse for another image, and KVStoreTier sees neither an item's content nor "
            "a prompt embedding's: serve text prompts only, or use kvstore's own connector (kv_connector=KVStoreConnector), which keys items by what the model reads")
    check_kv_scales(vllm_config)


def check_block_hashes(vllm_config: Any, settings: dict[str, Any]) -> None:
    """A chunk in the pool is named by vLLM's block hash: refuse hashes a client can collide."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo not in NON_CRYPTO_HASHES:
        return
    if settings.get("trust_noncrypto_hashes") is not True:
        # A fleet-wide pool turns one client's crafted block-hash collision into wrong KV for every
        # engine of the tenant; vLLM itself calls these hashes not collision resistant.
        raise UnsupportedDeployment(
            f"prefix_caching_hash_algo={algo} is not collision resistant, and a chunk in the pool is named by that "
            "hash: use sha256 (vLLM's default), or set trust_noncrypto_hashes=true in the tier's settings where "
            "every client is trusted")
    if os.environ.get("PYTHONHASHSEED") is None:
        log.warning("kvstore tier: prefix_caching_hash_algo=%s without PYTHONHASHSEED seeds vLLM's block hashes per "
                    "process, so no other engine finds this engine's chunks: set PYTHONHASHSEED to the same value "
                    "on every engine, or use sha256", algo)


def geometry_of(vllm_config: Any, spec: "OffloadingSpec", chunk_bytes: int) -> ChunkGeometry:
    return ChunkGeometry(
        chunk_bytes=int(chunk_bytes), blocks_per_chunk=int(spec.config.cache.blocks_per_chunk),
        tokens_per_block=tuple(int(g.tokens_per_block) for g in spec.config.groups),
        group_layers=tuple(tuple(g.layer_names) for g in spec.config.groups),
        worker_kv_bytes_per_block=int(spec.config.worker_kv_bytes_per_block),
        hash_algo=str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")))


class ChunkMover:
    """Chunks between vLLM's CPU tier (`rows`: one row a chunk) and the pool, one job per call,
    on the tier's threads. A job that fails in any way is a failed job, never an exception."""

    def __init__(self, client: Any, fingerprint: ModelFingerprint, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.strides != (rows.shape[1], 1):
            raise UnsupportedDeployment(f"KVStoreTier expects the CPU tier as rows of whole chunks, got shape "
                                        f"{rows.shape} strides {rows.strides}")
        self.client, self.fingerprint, self.rows, self.row = client, fingerprint, rows, int(rows.shape[1])
        # Loads land straight in the CPU tier: registered once, read into by (offset, length).
        self.region = client.engine.register(rows, remote_access=False)
        self._lock = threading.Lock()
        # What moved (read by tests and benchmarks); the tier adds its lookups.
        self.totals = {"lookups": 0, "hits": 0, "stored": 0, "already_held": 0, "loaded": 0, "failed_loads": 0,
                       "failed_stores": 0}

    def key_hash(self, key: OffloadKey) -> bytes:
        return chunk_hash(self.fingerprint, key)

    def run(self, job: TransferJob) -> JobResult:
        started = time.monotonic()
        try:
            result = self.load(job) if job.is_promotion else self.store(job)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed job: vLLM recomputes or keeps its copy
            log.warning("kvstore tier: %s job %d failed: %s", "load" if job.is_promotion else "store", job.job_id, exc)
            result = JobResult(job_id=job.job_id, success=False)
            with self._lock:
                self.totals["failed_loads" if job.is_promotion else "failed_stores"] += len(job.keys)
        result.transfer_time = time.monotonic() - started
        return result

    def store(self, job: TransferJob) -> JobResult:
        keys, chunks = list(job.keys), [int(c) for c in job.chunk_ids]
        items = [(h, self.rows[c]) for h, c in zip(map(self.key_hash, keys), chunks)
                 if not self.client.contains(h, self.fingerprint)]
        results = self.client.put_batch(items, self.fingerprint) if items else []
        failed = [r for r in results if not r.ok]
        with self._lock:
            self.totals["stored"] += len(results) - len(failed)
            self.totals["already_held"] += len(keys) - len(items)
            self.totals["failed_stores"] += len(failed)
        if failed:
            log.warning("kvstore tier: %d of %d chunks not stored: %s", len(failed), len(items), failed[0])
        return JobResult(job_id=job.job_id, success=not failed, transfer_bytes=(len(items) - len(failed)) * self.row)

    def load(self, job: TransferJob) -> JobResult:
        keys, chunks = list(job.keys), [int(c) for c in job.chunk_ids]
        outs = [[(self.region, c * self.row, self.row)] for c in chunks]
        found = self.client.get_many([self.key_hash(k) for k in keys], outs, self.fingerprint)
        loaded = [k for k, ok in zip(keys, found) if ok]
        with self._lock:
            self.totals["loaded"] += len(loaded)
            self.totals["failed_loads"] += len(keys) - len(loaded)
        return JobResult(job_id=job.job_id, success=len(loaded) == len(keys), successful_keys=loaded or None,
                         transfer_bytes=len(loaded) * self.row)

    def close(self) -> None:
        try:
            self.client.engine.unregister(self.region)
        except Exception as exc:  # noqa: BLE001 - the client closed first (interpreter exit)
            log.debug("kvstore tier: unregistering the CPU tier: %s", exc)


class KVStoreTier(SecondaryTierManager):
    """Chunks of vLLM's CPU tier in the kvstore pool (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.CPU  # the pool's DRAM (its NVMe behind it), over the network

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: "BackpressureDetector | None" = None, locality: str | None = None,
                 **settings: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise UnsupportedDeployment(f"KVStoreTier does not know the setting(s) {', '.join(unknown)}: "
                                        f"it takes {', '.join(SETTINGS)}")
        self.locality = Locality(locality) if locality else Locality.REMOTE
        vllm_config = engine_config(offloading_spec.config.engine_id)
        check_supported(vllm_config, offloading_spec)
        check_block_hashes(vllm_config, settings)
        self._vllm_config, self._settings = vllm_config, settings
        self._base = fingerprint_from_vllm(vllm_config, 0, settings, 0)
        self._geometry = geometry_of(vllm_config, offloading_spec, self.block_size_bytes)
        self.weights = weights_identity(vllm_config, settings)
        self.fingerprint: ModelFingerprint = chunk_fingerprint(self._base, self.weights, self._geometry)
        self.timeout = float(settings.get("timeout", 5.0))
        self.client = store_for({**settings, "timeout": self.timeout})
        self.mover = ChunkMover(self.client, self.fingerprint, np.asarray(primary_kv_view).view(np.uint8))
        self.totals = self.mover.totals
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(settings.get("threads", 2))),
                                        thread_name_prefix="kvstore-tier")
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._finished: list[JobResult] = []
        log.info("kvstore tier: chunks of %d bytes under fingerprint %s", self.block_size_bytes,
                 self.fingerprint.digest)

    # --- the scheduler's calls (cheap, non-blocking) -------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            found = self.client.contains(self.mover.key_hash(key), self.fingerprint)
        except Exception as exc:  # noqa: BLE001 - a closed client is a miss: vLLM computes instead
            log.debug("kvstore tier lookup failed: %s", exc)
            return LookupResult.MISS
        self.totals["lookups"] += 1  # the scheduler's thread only
        self.totals["hits"] += int(found)
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        """Jobs running or results not yet collected: the engine keeps stepping until it has them."""
        with self._lock:
            return bool(self._pending or self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Every job ends (each of its remote steps is bounded by the client's timeout); then the
        weights' identity is read again. vLLM drains its tiers only in `reset_cache`
        (`reset_prefix_cache(reset_connector=True)`), which follows an in-place weight update, and
        keeps what secondary tiers hold: chunks computed with the old weights must not be found
        under the new ones."""
        with self._lock:
            pending = set(self._pending)
        wait(pending)
        self.reset_identity()

    def reset_identity(self) -> None:
        """Key chunks from now on by the weights' identity as it is now (weight files,
        `weight_version_file`, KVSTORE_WEIGHT_VERSION, `weight_version`); where none of it changed,
        the weights may have changed in memory only, so by a nonce shared with no other process
        (as the connector's reset_cache)."""
        import secrets

        weights = weights_identity(self._vllm_config, self._settings)
        if weights == self.weights:
            log.warning("kvstore tier: reset with no new weight version (weight_version_file, KVSTORE_WEIGHT_VERSION) "
                        "and the same weight files: chunks from now on are keyed to this process")
            weights = f"nonce {secrets.token_hex(16)}"
        self.weights = weights
        self.fingerprint = self.mover.fingerprint = chunk_fingerprint(self._base, weights, self._geometry)

    def shutdown(self) -> None:
        # Queued jobs are dropped (vLLM recomputes what they would have loaded); only running ones
        # touch the CPU tier's memory, and each remote step of theirs has the client's timeout.
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.mover.close()

    # --- the pool's work -----------------------------------------------------------------------
    def _submit(self, job: TransferJob) -> None:
        future = self._pool.submit(self._run, job)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _run(self, job: TransferJob) -> None:
        result = self.mover.run(job)
        with self._lock:
            self._finished.append(result)
