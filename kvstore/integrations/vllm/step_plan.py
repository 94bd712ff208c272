"""What the scheduler side tells the worker side each step (vLLM carries it between processes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .plan import GroupBlock


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to load and to save, as (group, block id, key)."""

    loads: dict[str, list[GroupBlock]] = field(default_factory=dict)  # asynchronous
    sync_loads: dict[str, list[GroupBlock]] = field(default_factory=dict)  # before this forward
    saves: dict[str, list[GroupBlock]] = field(default_factory=dict)
    load_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens each load provides
    handoffs: set[str] = field(default_factory=set)  # saves a decode instance waits for
    remote_waits: dict[str, float] = field(default_factory=dict)  # P/D loads: seconds to wait for blocks
