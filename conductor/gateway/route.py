"""Where a request prefills and decodes: the conductor's policies over live engines, with each
engine's own prefix cache (PrefixTracker) and the store pool (index mirror) as cached tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstore.keys import ModelFingerprint

from ..cost import CostModel
from ..policies import InstanceView, RouteRequest, Slo, admit, make_policy
from .errors import ApiError
from .pool import Engine, Pool
from .prefix import PrefixTracker


@dataclass(frozen=True)
class Route:
    prefill: Engine | None  # None: the decode engine prefills itself (colocated)
    decode: Engine
    cached_tokens: int
    store_tokens: int  # leading prompt tokens in the store pool
    predicted_ttft_ms: float


class Router:
    def __init__(self, pool: Pool, tracker: PrefixTracker, fingerprint: ModelFingerprint, *, mirror=None,
                 policy: str = "cache_global+sticky", cost: CostModel | None = None, slo: Slo | None = None,
                 block_tokens: int = 128, local_prefill_tokens: int = 0) -> None:
        self.pool, self.tracker, self.fingerprint, self.mirror = pool, tracker, fingerprint, mirror
        self.cost = cost or CostModel()
        self.policy = make_policy(policy, self.cost)
        self.slo = slo or Slo()
        self.block_tokens, self.local_prefill_tokens = block_tokens, local_prefill_tokens
        self.store_enabled = mirror is not None

    def queue_ms(self, engine: Engine) -> float:
        """Until `engine` could start a new prefill: what the gateway sent it plus what it reports."""
        waiting = max(engine.waiting * self.block_tokens, engine.inflight_tokens)
        return self.cost.prefill_ms(waiting, waiting) + self.cost.decode_step_ms(engine.running, 0) * (engine.running > 0)

    def store_prefix_tokens(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        if not self.store_enabled or not hashes:
            return 0
        match = self.mirror.match(self.fingerprint, hashes)
        return 0 if match.stale else min(match.length * self.block_tokens, prompt_tokens)

    def route(self, hashes: Sequence[bytes], prompt_tokens: int, output_tokens: int = 0,
              session: str | None = None, exclude: frozenset[str] = frozenset()) -> Route:
        decodes = [e for e in self.pool.role("decode") if e.url not in exclude]
        if not decodes:
            raise ApiError(503, "no healthy decode engine", code="no_engine")
        prefills = [e for e in self.pool.role("prefill") if e.url not in exclude]
        store = self.store_prefix_tokens(hashes, prompt_tokens)
        request = RouteRequest(prompt_tokens, output_tokens, store, session)
        candidates = prefills or decodes  # colocated: the decode engines prefill too
        views = [InstanceView(e.url, self.queue_ms(e),
                              min(self.tracker.prefix_blocks(e.url, hashes) * self.block_tokens, prompt_tokens))
                 for e in candidates]
        choice = self.policy.choose(request, views)
        picked = next(e for e in candidates if e.url == choice.instance)
        if prefills:
            decode = min(decodes, key=lambda e: (e.inflight + e.running, e.url))
            # What the decode engine would not have to compute: its own cache, or the store's blocks.
            reusable = max(store, min(self.tracker.prefix_blocks(decode.url, hashes) * self.block_tokens, prompt_tokens))
            uncached = prompt_tokens - reusable
            # Conditional disaggregation: a short tail prefills on the decode engine, unless its own
            # queue makes that slower than the hand-off (one decode engine must not absorb them all).
            local = uncached < self.local_prefill_tokens and \
                self.queue_ms(decode) + self.cost.prefill_ms(uncached, prompt_tokens) <= choice.predicted_ttft_ms
        else:
            decode, local = picked, True
        tbt = self.cost.decode_step_ms(decode.running + decode.inflight + 1, 0)
        why = admit(choice, tbt, self.slo)
        if why is not None:
            raise ApiError(429, why, code="slo_admission")
        return Route(None if local else picked, decode, choice.cached_tokens, store, choice.predicted_ttft_ms)
