"""Connector statistics through vLLM's connector-stats hooks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

FIELDS = ("hit_tokens", "loaded_blocks", "load_bytes", "load_seconds", "load_failures", "saved_blocks",
          "save_bytes", "save_seconds")


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
