"""The live router: `Conductor.route(request)` from the block-index mirror (which instances hold
the prompt's leading blocks) and the load instances report, in well under a millisecond."""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from kvstore.index import IndexMirror
from kvstore.keys import ModelFingerprint

from .cost import CostModel
from .policies import InstanceView, Policy, RouteRequest, Slo, admit, make_policy


@dataclass
class InstanceLoad:
    """What an instance reports about itself."""

    name: str
    role: str  # "prefill" | "decode"
    queue_ms: float = 0.0
    running_tokens: int = 0
    running_requests: int = 0
    free_kv_tokens: int = 0
    store_node: str | None = None  # the store node sharing its host (whose blocks it can use cheaply)
    reported_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Decision:
    accepted: bool
    reason: str = ""
    prefill: str | None = None  # None with accepted=True: prefill on the decode instance
    decode: str | None = None
    cached_tokens: int = 0
    load_from: dict[str, int] = field(default_factory=dict)  # store node -> leading blocks it holds
    predicted_ttft_ms: float = 0.0
    predicted_tbt_ms: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class Conductor:
    """Routes requests; feed it load reports, it reads the index mirror itself."""

    def __init__(self, mirror: IndexMirror, fingerprint: ModelFingerprint | str, *, policy: str = "cache_global",
                 cost: CostModel | None = None, slo: Slo | None = None, block_tokens: int = 512,
                 stale_report_s: float = 10.0, local_prefill_tokens: int = 0) -> None:
        self.mirror, self.fingerprint = mirror, fingerprint
        self.cost = cost or CostModel()
        self.policy: Policy = make_policy(policy, self.cost)
        self.slo = slo or Slo()
        self.block_tokens, self.stale_report_s = block_tokens, stale_report_s
        self.local_prefill_tokens = local_prefill_tokens
        self._loads: dict[str, InstanceLoad] = {}
        self._lock = threading.Lock()

    def report(self, load: InstanceLoad) -> None:
        if load.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {load.role!r}")
        load.reported_at = time.monotonic()
        with self._lock:
            self._loads[load.name] = load

    def _live(self, role: str) -> list[InstanceLoad]:
        cutoff = time.monotonic() - self.stale_report_s
        with self._lock:
            return [l for l in self._loads.values() if l.role == role and l.reported_at >= cutoff]

    def route(self, hashes: Sequence[bytes], prompt_tokens: int, output_tokens: int = 0,
              session: str | None = None) -> Decision:
        """Where to prefill and decode a prompt whose full blocks hash to `hashes`."""
        decodes = self._live("decode")
        if not decodes:
            return Decision(False, "no healthy decode instance")
        decode = min(decodes, key=lambda l: (l.running_tokens, l.name))
        per_node = self.mirror.node_prefix_lengths(self.fingerprint, hashes)
        global_prefix = min(max(per_node.values(), default=0) * self.block_tokens, prompt_tokens)
        request = RouteRequest(prompt_tokens, output_tokens, global_prefix, session)
        tbt = self.cost.decode_step_ms(decode.running_requests + 1, decode.running_tokens + prompt_tokens)
        prefills = self._live("prefill")
        if prefills:
            views = [InstanceView(l.name, l.queue_ms,
                                  min(per_node.get(l.store_node or l.name, 0) * self.block_tokens, prompt_tokens))
                     for l in prefills]
            choice = self.policy.choose(request, views)
        else:  # fall back to prefilling on the decode instance
            choice = self.policy.estimate(request, InstanceView(decode.name, decode.queue_ms, 0))
        local = not prefills or (self.local_prefill_tokens and
                                 prompt_tokens - choice.cached_tokens < self.local_prefill_tokens)
        if local:
            tbt += self.cost.prefill_ms(prompt_tokens - choice.cached_tokens, prompt_tokens)
        why = admit(choice, tbt, self.slo)
        if why is not None:
            return Decision(False, why, predicted_ttft_ms=choice.predicted_ttft_ms, predicted_tbt_ms=tbt)
        return Decision(True, "", None if local else choice.instance, decode.name, choice.cached_tokens, per_node,
                        choice.predicted_ttft_ms, tbt)
