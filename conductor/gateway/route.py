"""The gateway's view of its engines for the router core (conductor.routing): each engine's queue
and KV load from what it reports and what this gateway sent it, its own prefix cache
(PrefixTracker) and the store pool (index mirror) as cached tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstore.keys import ModelFingerprint

from .. import routing
from ..cost import CostModel
from ..policies import RouteRequest, Slo
from .errors import ApiError
from .pool import Engine, Pool
from .prefix import PrefixTracker


@dataclass(frozen=True)
class Route:
    prefill: Engine | None  # None: the decode engine prefills itself (colocated)
    decode: Engine  # P/D: a prefill engine where the decode pool's KV was full (reason "overflow")
    cached_tokens: int
    store_tokens: int  # leading prompt tokens in the store pool
    predicted_ttft_ms: float
    reason: str = ""  # which term decided (the policy's Choice.reason; "spread", "decode_local", ...)
    credited_tokens: int = 0  # leading prompt tokens the router believed the picked engine holds itself


class Router:
    def __init__(self, pool: Pool, tracker: PrefixTracker, fingerprint: ModelFingerprint, *, mirror=None,
                 policy: str = "cache_global+sticky", cost: CostModel | None = None, slo: Slo | None = None,
                 block_tokens: int = 128, local_prefill_tokens: int = 0, overflow_kv_share: float = 0.0) -> None:
        self.pool, self.tracker, self.fingerprint, self.mirror = pool, tracker, fingerprint, mirror
        self.core = routing.Router(policy, cost, slo, local_prefill_tokens, overflow_kv_share)
        self.cost = self.core.cost
        self.block_tokens = block_tokens
        self.store_enabled = mirror is not None

    def queue_ms(self, engine: Engine, kv_load: float | None = None) -> float:
        """Until `engine` could start a new prefill: what the gateway sent it plus what it reports,
        and a step of its running decodes over the KV they read (`kv_load`, when already known)."""
        waiting = max(engine.waiting * self.block_tokens, engine.inflight_tokens)
        context = int((self.kv_load(engine) if kv_load is None else kv_load) or 0)
        return self.cost.prefill_ms(waiting, waiting) + \
            self.cost.decode_step_ms(engine.running, context) * (engine.running > 0)

    @staticmethod
    def kv_load(engine: Engine) -> float | None:
        """KV tokens the engine holds or will hold: what it reported (up to a scrape old) or what this
        gateway has sent it since (prompt + output of its requests there), the larger; None when
        its KV capacity is unknown."""
        if not engine.kv_capacity:
            return None
        return max(engine.kv_usage * engine.kv_capacity, float(engine.inflight_kv))

    def candidate(self, engine: Engine, queue: bool = True) -> routing.Candidate:
        """`queue=False`: its queue is not needed (a P/D decode engine that prefills nothing)."""
        # context_tokens 0: the KV load counts output still to come, not what a decode step reads now.
        kv_load = self.kv_load(engine)
        return routing.Candidate(engine.url, self.queue_ms(engine, kv_load) if queue else 0.0, engine.running,
                                 engine.inflight, kv_load, engine.kv_capacity)

    def store_prefix_tokens(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        return routing.pool_prefix_tokens(self.mirror if self.store_enabled else None, self.fingerprint, hashes,
                                          prompt_tokens, self.block_tokens)

    def route(self, hashes: Sequence[bytes], prompt_tokens: int, output_tokens: int = 0,
              session: str | None = None, exclude: frozenset[str] = frozenset()) -> Route:
        decodes, prefills = self.pool.role("decode"), self.pool.role("prefill")
        store = self.store_prefix_tokens(hashes, prompt_tokens)

        def credit(url: str) -> int:
            return min(self.tracker.prefix_blocks(url, hashes) * self.block_tokens, prompt_tokens)

        # Decode engines prefill when there is no prefill engine, or a short tail (conditional
        # disaggregation): only then is their queue read (12 engines' queues are a tenth of a route).
        queue = self.core.local_prefill_tokens > 0 or all(e.url in exclude for e in prefills)
        try:
            placed = self.core.route(RouteRequest(prompt_tokens, output_tokens, store, session),
                                     [self.candidate(e) for e in prefills],
                                     [self.candidate(e, queue) for e in decodes], credit, exclude)
        except routing.NoEngine as exc:
            raise ApiError(503, exc.reason, code="no_engine") from None
        except routing.SloRefused as exc:
            raise ApiError(429, exc.reason, code="slo_admission") from None
        prefill = None if placed.prefill is None else next(e for e in prefills if e.url == placed.prefill)
        decode = next(e for e in decodes + prefills if e.url == placed.decode)  # a prefill engine: overflow
        return Route(prefill, decode,
                     placed.cached_tokens, placed.store_tokens, placed.predicted_ttft_ms, placed.reason,
                     placed.credited_tokens)

    def retry_decode(self, exclude: frozenset[str], whole_request: bool = False) -> Engine | None:
        """The engine a decode that failed before its first token moves to (the router core's pick).
        `whole_request` (an overflow route, no hand-off to load): the prefill engines too, the one
        with the most KV room first."""
        engines = self.pool.role("decode") + (self.pool.role("prefill") if whole_request else [])
        name = self.core.retry_decode([self.candidate(e, queue=False) for e in engines], exclude, by_room=whole_request)
        return None if name is None else self.pool.get(name)
