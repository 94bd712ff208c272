"""The /route service's view for the router core (conductor.routing): `Conductor.route(request)`
from the block-index mirror (which store nodes hold the prompt's leading blocks) and the load
instances report, in well under a millisecond."""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from kvstore.index import IndexMirror
from kvstore.keys import ModelFingerprint

from . import routing
from .cost import CostModel
from .policies import RouteRequest, Slo


@dataclass
class InstanceLoad:
    """What an instance reports about itself."""

    name: str
    role: str  # "prefill" | "decode"
    queue_ms: float = 0.0
    running_tokens: int = 0
    running_requests: int = 0
    free_kv_tokens: int | None = None  # None: not said (its KV room is then not checked)
    store_node: str | None = None  # the store node sharing its host (whose blocks it can use cheaply)
    reported_at: float = field(default_factory=time.monotonic)

    def candidate(self) -> routing.Candidate:
        """As the router core sees it; a KV capacity only where the instance said what is free."""
        capacity = None if self.free_kv_tokens is None else self.running_tokens + self.free_kv_tokens
        return routing.Candidate(self.name, self.queue_ms, self.running_requests, 0,
                                 float(self.running_tokens) if capacity else None, capacity or None,
                                 self.running_tokens)


@dataclass(frozen=True)
class Decision:
    accepted: bool
    reason: str = ""  # why it was refused
    prefill: str | None = None  # None with accepted=True: prefill on the decode instance (P/D: a prefill
    # instance decoding itself while every decode instance's KV is full, route_reason "overflow")
    decode: str | None = None
    cached_tokens: int = 0
    load_from: dict[str, int] = field(default_factory=dict)  # store node -> leading blocks it holds
    predicted_ttft_ms: float = 0.0
    predicted_tbt_ms: float = 0.0
    route_reason: str = ""  # which term of the policy decided (as the gateway's route reasons)

    def to_dict(self) -> dict:
        return asdict(self)


class Conductor:
    """Routes requests; feed it load reports, it reads the index mirror itself."""

    def __init__(self, mirror: IndexMirror, fingerprint: ModelFingerprint | str, *, policy: str = "cache_global",
                 cost: CostModel | None = None, slo: Slo | None = None, block_tokens: int = 512,
                 stale_report_s: float = 10.0, local_prefill_tokens: int = 0, overflow_kv_share: float = 0.0) -> None:
        self.mirror, self.fingerprint = mirror, fingerprint
        self.core = routing.Router(policy, cost, slo, local_prefill_tokens, overflow_kv_share)
        self.block_tokens, self.stale_report_s = block_tokens, stale_report_s
        self._loads: dict[str, InstanceLoad] = {}
        self._lock = threading.Lock()

    def report(self, load: InstanceLoad) -> None:
        if load.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {load.role!r}")
        if not isinstance(load.name, str) or not (load.store_node is None or isinstance(load.store_node, str)):
            raise ValueError("name and store_node must be strings")
        for key in ("queue_ms", "running_tokens", "running_requests", "free_kv_tokens"):
            value = getattr(load, key)
            if value is None and key == "free_kv_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{key} must be a number >= 0, not {value!r}")
        load.reported_at = time.monotonic()
        with self._lock:
            self._loads[load.name] = load

    def _live(self) -> list[InstanceLoad]:
        """Instances whose last report is recent: a silent one is out of the rotation."""
        cutoff = time.monotonic() - self.stale_report_s
        with self._lock:
            return [l for l in self._loads.values() if l.reported_at >= cutoff]

    def route(self, hashes: Sequence[bytes], prompt_tokens: int, output_tokens: int = 0,
              session: str | None = None, exclude: frozenset[str] = frozenset()) -> Decision:
        """Where to prefill and decode a prompt whose full blocks hash to `hashes`; `exclude`:
        instances this request already failed on."""
        live = self._live()
        per_node = routing.node_prefix_blocks(self.mirror, self.fingerprint, hashes)
        store = min(max(per_node.values(), default=0) * self.block_tokens, prompt_tokens)
        nodes = {l.name: l.store_node or l.name for l in live}

        def credit(name: str) -> int:  # an instance holds what its host's store node holds
            return min(per_node.get(nodes[name], 0) * self.block_tokens, prompt_tokens)

        try:
            placed = self.core.route(RouteRequest(prompt_tokens, output_tokens, store, session),
                                     [l.candidate() for l in live if l.role == "prefill"],
                                     [l.candidate() for l in live if l.role == "decode"], credit, exclude)
        except routing.NoEngine:
            return Decision(False, "no healthy decode instance")
        except routing.SloRefused as exc:
            return Decision(False, exc.reason, predicted_ttft_ms=exc.predicted_ttft_ms,
                            predicted_tbt_ms=exc.predicted_tbt_ms)
        return Decision(True, "", placed.prefill, placed.decode, placed.cached_tokens, per_node,
                        placed.predicted_ttft_ms, placed.predicted_tbt_ms, placed.reason)
