"""KVStoreConnector: vLLM's KV-connector API (v1) over the kvstore cluster, hybrid models included.

A thin face, as vLLM's own connectors are: vLLM makes one per role, and each delegates to its side.
- The scheduler side (scheduler.py, KVStoreScheduler): which leading prompt blocks every rank's
  store holds and how to load them, which computed blocks to save, the P/D hand-off parameters.
- The worker side (worker.py, KVStoreWorker): the loads and saves themselves, between the store and
  vLLM's paged KV cache, and what vLLM hears of them.
Both read the same settings (settings.py), checked at start-up; what the scheduler tells the worker
each step is a KVStoreMetadata (step_plan.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               SupportsHMA)

from .fingerprint import required_layout
from .scheduler import KVStoreScheduler
from .settings import connector_settings
from .stats import KVStoreConnectorStats, KVStorePromMetrics
from .step_plan import KVStoreMetadata
from .worker import KVStoreWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreMetadata"]


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = connector_settings(vllm_config, self._kv_transfer_config, kv_cache_config, role)
        self.scheduler_side = KVStoreScheduler(settings) if role == KVConnectorRole.SCHEDULER else None
        self.worker_side = KVStoreWorker(settings) if role == KVConnectorRole.WORKER else None

    # The side's own state (its settings, counters, tables) reads and writes through the connector
    # vLLM made, as tests, the demo and tools hold it; the face's own methods stay its own.
    def __getattr__(self, name: str) -> Any:
        side = self.__dict__.get("worker_side") or self.__dict__.get("scheduler_side")
        if side is None:
            raise AttributeError(name)
        return getattr(side, name)

    def __setattr__(self, name: str, value: Any) -> None:
        side = self.__dict__.get("worker_side") or self.__dict__.get("scheduler_side")
        if side is not None and name not in self.__dict__ and not hasattr(type(self), name) and hasattr(side, name):
            setattr(side, name, value)
        else:
            super().__setattr__(name, value)

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
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        return self.scheduler_side.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished_all_groups(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return self.scheduler_side.take_events() if self.scheduler_side is not None else ()

    def reset_cache(self, weight_version: str | None = None) -> bool:
        return self.scheduler_side.reset_cache(weight_version) if self.scheduler_side is not None else True

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker_side.save_kv_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker_side.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        return self.worker_side.get_kv_connector_stats() if self.worker_side is not None else None

    def flush_saves(self, timeout: float = 30.0) -> bool:
        """Wait until every save handed to the background writer is stored (tests, shutdown)."""
        return self.worker_side.flush_saves(timeout) if self.worker_side is not None else True

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
