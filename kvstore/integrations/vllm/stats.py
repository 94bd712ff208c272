"""Connector statistics through vLLM's connector-stats hooks, and their Prometheus series."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

FIELDS = ("hit_tokens", "loaded_blocks", "load_bytes", "load_seconds", "load_failures", "layer_wait_seconds",
          "handoff_wait_seconds", "saved_blocks", "save_bytes", "save_seconds", "save_failures", "dropped_blocks",
          "staging_fallbacks")

# Counters exported as vllm:kvstore_<field>_total by vLLM's /metrics (the seconds as sums).
PROM_HELP = {
    "hit_tokens": "Prompt tokens whose KV was loaded from kvstore",
    "loaded_blocks": "Blocks loaded from kvstore",
    "load_bytes": "Bytes loaded from kvstore",
    "load_seconds": "Seconds spent loading from kvstore",
    "load_failures": "Blocks that failed to load (recomputed instead)",
    "layer_wait_seconds": "Seconds the forward pass waited for layer-by-layer loads (the rest overlapped)",
    "handoff_wait_seconds": "Seconds P/D hand-offs waited for their prefill's blocks to be published",
    "saved_blocks": "Blocks saved to kvstore",
    "save_bytes": "Bytes saved to kvstore",
    "save_seconds": "Seconds the background writer spent saving",
    "save_failures": "Blocks whose save failed",
    "dropped_blocks": "Blocks not saved because the save queue was full (back-pressure)",
    "staging_fallbacks": "Workers that copy KV block by block because their registered staging could not be allocated",
}


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> "KVStoreConnectorStats":
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out = {k: d.get(k, 0) for k in FIELDS}
        out["load_gbps"] = d.get("load_bytes", 0) / d["load_seconds"] / 1e9 if d.get("load_seconds") else 0.0
        out["save_gbps"] = d.get("save_bytes", 0) / d["save_seconds"] / 1e9 if d.get("save_seconds") else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in FIELDS)


class KVStorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per statistic, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, help_text in PROM_HELP.items():
            counter = self._counter_cls(name=f"vllm:kvstore_{name}", documentation=help_text, labelnames=labelnames)
            self._counters[name] = {engine: counter.labels(*values)
                                    for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value and engine_idx in children:
                children[engine_idx].inc(value)
