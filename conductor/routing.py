"""The one router core: where a request prefills and decodes, for the gateway and the /route service.

Each front builds the same view of its engines (a `Candidate` per engine: the wait before a new
prefill, the requests there, the KV it holds against its capacity) and says which leading prompt
tokens each engine holds itself; the core applies everything else once: exclusion of engines a
request already failed on, the room check on KV caches, the policy and its route reason, the
colocated spread, decode placement, decode overflow and conditional disaggregation, the SLO
admission, the pick for a decode retried elsewhere. Credit for cached blocks only comes from a view
that can vouch for it: a stale index mirror credits nothing (`pool_prefix_tokens`,
`node_prefix_blocks`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .cost import CostModel
from .policies import Choice, InstanceView, RouteRequest, Slo, admit, make_policy

KV_HEADROOM = 0.95  # an engine whose KV cache would be fuller than this with the request is avoided
# Colocated: engines predicted within this much of the best TTFT count as equally fast, and the one
# with the fewest requests in flight takes it (see Router._spread).
SPREAD_SLACK_MS = 50.0
SPREAD_SLACK_SHARE = 0.25
# P/D: the share of a prefill engine's KV cache that decodes overflowing a full decode pool may take;
# the rest stays for its prefills and the prefix cache they hit.
OVERFLOW_KV_SHARE = 0.5


@dataclass(slots=True)
class Candidate:
    """One engine as the router sees it."""

    name: str
    queue_ms: float = 0.0  # until it could start a new prefill
    running: int = 0  # requests it reports running
    sent: int = 0  # requests this router's front sent there and has not seen finish
    kv_load: float | None = None  # KV tokens it holds or will hold; None: its capacity is unknown
    kv_capacity: int | None = None
    context_tokens: int = 0  # KV tokens its running decodes read each step, where known

    @property
    def busy(self) -> int:
        return self.running + self.sent

    def fits(self, tokens: int) -> bool:
        """Would `tokens` more KV fit without the engine preempting (or queueing for blocks)?"""
        return self.kv_load is None or self.kv_load + tokens <= KV_HEADROOM * (self.kv_capacity or 0)


@dataclass(frozen=True)
class Placement:
    """Where one request goes and what the router predicted for it."""

    prefill: str | None  # None: the decode engine prefills itself (colocated)
    decode: str
    cached_tokens: int
    store_tokens: int  # leading prompt tokens in the store pool
    predicted_ttft_ms: float
    predicted_tbt_ms: float
    reason: str  # which term decided (the policy's Choice.reason; "spread", the policy's name)
    credited_tokens: int = 0  # leading prompt tokens the router believed the picked engine holds itself


class Unroutable(Exception):
    """No placement for this request; `reason` says why in a line."""

    def __init__(self, reason: str, predicted_ttft_ms: float = 0.0, predicted_tbt_ms: float = 0.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.predicted_ttft_ms, self.predicted_tbt_ms = predicted_ttft_ms, predicted_tbt_ms


class NoEngine(Unroutable):
    """No healthy decode engine (after exclusions)."""


class SloRefused(Unroutable):
    """Early rejection: the SLO cannot be met (Mooncake's admission)."""


Credit = Callable[[str], int]  # engine name -> leading prompt tokens it holds itself (at most the prompt)


class Router:
    """One per front: the policy keeps state (round-robin's turn, sessions' homes)."""

    def __init__(self, policy: str = "cache_global", cost: CostModel | None = None, slo: Slo | None = None,
                 local_prefill_tokens: int = 0, overflow_kv_share: float = 0.0) -> None:
        self.cost = cost or CostModel()
        self.policy = make_policy(policy, self.cost)
        # Spreading near-equal picks corrects cache-aware policies, which pile requests on prefixes;
        # round_robin and least_loaded spread by themselves, and overriding them breaks their order.
        self.spread = policy.partition("+")[0].startswith("cache")
        self.slo = slo or Slo()
        self.local_prefill_tokens = local_prefill_tokens
        self.overflow_kv_share = overflow_kv_share

    def route(self, request: RouteRequest, prefills: Sequence[Candidate], decodes: Sequence[Candidate],
              credit: Credit, exclude: frozenset[str] = frozenset()) -> Placement:
        """Place `request` (its `global_prefix_tokens`: the store pool's leading tokens). `exclude`:
        engines this request already failed on. Raises NoEngine or SloRefused."""
        decodes = [c for c in decodes if c.name not in exclude]
        if not decodes:
            raise NoEngine("no healthy decode engine")
        prefills = [c for c in prefills if c.name not in exclude]
        prompt = request.prompt_tokens
        # Engines whose KV cache would overflow with this request preempt (recompute) or hold it back:
        # the others first. Every cache-aware pick piles requests where prefixes are; this is what stops it.
        need = prompt + request.output_tokens
        fitting = [c for c in decodes if c.fits(need)]
        roomy = fitting or decodes
        # Colocated, every engine stays a candidate: its queue decides. Kept to the engines with room,
        # 1 request in 5 waited behind 8k or more prompt tokens more than an idle engine had (the
        # fleet's placement figure, load 1.2), since many engines sat near full KV at once. Only the
        # pull of a cached prefix is room-checked: an engine it would overflow gets no credit for it.
        candidates = prefills or decodes
        room = {c.name for c in roomy}
        views = [InstanceView(c.name, c.queue_ms, credit(c.name) if prefills or c.name in room else 0,
                              0 if prefills else max(c.running, c.sent), _fill(c)) for c in candidates]
        choice = self.policy.choose(request, views)
        if self.spread and not prefills and request.session is None and len(views) > 1:
            spread = self._spread(choice, request, views, candidates)
            choice = choice if spread.instance == choice.instance else replace(spread, reason="spread")
        credited = next(v.local_prefix_tokens for v in views if v.name == choice.instance)
        picked = next(c for c in candidates if c.name == choice.instance)
        if prefills and not fitting and self._may_overflow(picked, need):
            # Decode overflow: every decode engine's KV is full, so a hand-off would wait there for
            # blocks (the fleet at P/D load 0.9: every decode engine's KV reached 96-100 % in every
            # run while the prefill engines' stayed 4-8 % full on average): the picked prefill
            # engine decodes it itself.
            decode, local = picked, True
            choice = replace(choice, reason="overflow")
        elif prefills:
            decode = min(roomy, key=_decode_order)
            # What the decode engine would not have to compute: its own cache, or the store's blocks.
            uncached = prompt - max(request.global_prefix_tokens, credit(decode.name))
            # Conditional disaggregation: a short tail prefills on the decode engine, unless its own
            # queue makes that slower than the hand-off (one decode engine must not absorb them all).
            local = uncached < self.local_prefill_tokens and \
                decode.queue_ms + self.cost.prefill_ms(uncached, prompt) <= choice.predicted_ttft_ms
        else:
            decode, local = picked, True
        tbt = self.cost.decode_step_ms(decode.busy + 1, decode.context_tokens)
        why = admit(choice, tbt, self.slo)
        if why is not None:
            raise SloRefused(why, choice.predicted_ttft_ms, tbt)
        return Placement(None if local else choice.instance, decode.name, choice.cached_tokens,
                         request.global_prefix_tokens, choice.predicted_ttft_ms, tbt,
                         choice.reason or self.policy.name, credited)

    def _may_overflow(self, engine: Candidate, tokens: int) -> bool:
        """May a prefill engine decode `tokens` of KV itself? Only within its overflow share (never
        past the headroom the decode engines keep), and only where its KV capacity is known."""
        if self.overflow_kv_share <= 0 or engine.kv_load is None or not engine.kv_capacity:
            return False
        return engine.kv_load + tokens <= min(self.overflow_kv_share, KV_HEADROOM) * engine.kv_capacity

    def _spread(self, best: Choice, request: RouteRequest, views: list[InstanceView],
                candidates: list[Candidate]) -> Choice:
        """A colocated engine's prefill chunks share its steps with its decodes: every request placed
        there stretches the inter-token gaps of those already decoding. With a store pool any engine
        can load a prefix (tens of ms), so a local prefix is worth little next to that: among the
        engines predicted nearly as fast as the best, the least busy one. (In front of 12 stand-ins
        at load 0.9, picking the best alone put 35-119 requests on each engine and doubled TPOT p50
        against vllm-router kv_aware, 39 vs 23 ms.)"""
        slack = max(SPREAD_SLACK_MS, SPREAD_SLACK_SHARE * best.predicted_ttft_ms)
        busy = {c.name: (c.sent, c.running, _fill(c)) for c in candidates}
        near = [self.policy.estimate(request, v) for v in views]
        near = [c for c in near if c.predicted_ttft_ms <= best.predicted_ttft_ms + slack]
        return min(near, key=lambda c: (busy[c.instance], c.predicted_ttft_ms, c.instance), default=best)

    @staticmethod
    def retry_decode(decodes: Sequence[Candidate], exclude: frozenset[str], by_room: bool = False) -> str | None:
        """Where a decode that failed before its first token goes next: the least busy engine it has
        not failed on (its hand-off is already made, so no policy), or None. `by_room` (an overflow
        route: the whole request, no hand-off): the engine whose KV is least full first, since the
        decode engines were passed over for being full."""
        others = [c for c in decodes if c.name not in exclude]
        key = _decode_order if by_room else (lambda c: (c.busy, c.name))
        return min(others, key=key).name if others else None


def _fill(c: Candidate) -> float:
    """The share of its KV cache the engine holds (0 when unknown)."""
    return 0.0 if c.kv_load is None or not c.kv_capacity else c.kv_load / c.kv_capacity


def _decode_order(c: Candidate) -> tuple:
    return (_fill(c), c.busy, c.name)


def pool_prefix_tokens(mirror, fingerprint, hashes: Sequence[bytes], prompt_tokens: int, block_tokens: int) -> int:
    """Leading prompt tokens the store pool holds, 0 while the mirror cannot vouch for its view."""
    if mirror is None or not hashes:
        return 0
    match = mirror.match(fingerprint, hashes)
    return 0 if match.stale else min(match.length * block_tokens, prompt_tokens)


def node_prefix_blocks(mirror, fingerprint, hashes: Sequence[bytes]) -> dict[str, int]:
    """Per store node, the leading blocks it holds itself; none while the mirror is stale."""
    if mirror is None or not hashes or mirror.stale:
        return {}
    return mirror.node_prefix_lengths(fingerprint, hashes)
