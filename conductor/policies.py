"""Routing policies behind one interface, used by the simulator and the live router alike.

A policy sees, per prefill instance, how long its queue is and how many leading blocks of the
prompt it holds locally, plus how many the global pool holds, and picks where to prefill.
"""
from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, replace

from .cost import CostModel


@dataclass(frozen=True)
class InstanceView:
    """What a policy knows about one prefill instance."""

    name: str
    queue_ms: float  # until it could start this prefill
    local_prefix_tokens: int  # leading prompt tokens in its own cache
    decoding: int = 0  # requests decoding there (colocated: each waits out a prefill placed there)
    kv_fill: float = 0.0  # the share of its KV cache in use: of engines equally fast, the emptier takes it


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    output_tokens: int = 0
    global_prefix_tokens: int = 0  # leading prompt tokens anywhere in the pool
    session: str | None = None


@dataclass(frozen=True)
class Choice:
    """Where to prefill and what it will cost."""

    instance: str
    cached_tokens: int  # prompt tokens not recomputed
    loaded_tokens: int  # of those, fetched from the pool (transfer cost paid)
    predicted_ttft_ms: float
    # Which term decided (PrefixAffinity): "local" (the engine's own cache kept it), "pool" (the
    # engine holding the prefix was too busy: another loads it from the pool), "queue" (no
    # prefix anywhere worth having: the shortest wait).
    reason: str = ""


class Policy(abc.ABC):
    name: str
    uses_global_pool = False

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def estimate(self, req: RouteRequest, inst: InstanceView) -> Choice:
        """TTFT if `req` prefills on `inst` (using the pool only if this policy does)."""
        local = min(inst.local_prefix_tokens, req.prompt_tokens)
        best = max(local, min(req.global_prefix_tokens, req.prompt_tokens)) if self.uses_global_pool else local
        loaded = best - local
        # Loading is only worth it when it beats recomputing those tokens.
        if loaded and self.cost.transfer_ms(loaded) >= self.cost.prefill_ms(req.prompt_tokens - local, req.prompt_tokens) \
                - self.cost.prefill_ms(req.prompt_tokens - best, req.prompt_tokens):
            best, loaded = local, 0
        ttft = (inst.queue_ms + self.cost.transfer_ms(loaded) + self.cost.prefill_ms(req.prompt_tokens - best, req.prompt_tokens)
                + self.cost.transfer_ms(req.prompt_tokens))  # the whole KV then moves to the decode instance
        return Choice(inst.name, best, loaded, ttft)

    @abc.abstractmethod
    def choose(self, req: RouteRequest, instances: list[InstanceView]) -> Choice: ...


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        self._next = itertools.count()

    def choose(self, req, instances):
        return self.estimate(req, instances[next(self._next) % len(instances)])


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, req, instances):
        return self.estimate(req, min(instances, key=lambda i: (i.queue_ms, i.name)))


class CacheAwareLocal(Policy):
    """Min over instances of queue + prefill of what its own cache lacks."""

    name = "cache_local"

    def choose(self, req, instances):
        fill = {i.name: i.kv_fill for i in instances}
        return min((self.estimate(req, i) for i in instances),
                   key=lambda c: (c.predicted_ttft_ms, fill[c.instance], c.instance))


class CacheAwareGlobal(CacheAwareLocal):
    """Mooncake's Algorithm 1: queue + transfer of pool blocks + prefill of the rest, minimised."""

    name = "cache_global"
    uses_global_pool = True


class PrefixAffinity(CacheAwareGlobal):
    """Sticky-first with pool fallback. Per instance three terms: its queue (the wait before this
    prefill could start), the pool load (transfer time of the prefix blocks it lacks and the pool
    holds) and the prefill of what neither holds. The instance holding the longest local prefix
    keeps the request unless its predicted TTFT is worse than the best instance's by more than the
    slack (`stay_ms`, or `stay_share` of the best TTFT, the larger); the best then loads the prefix
    from the pool. Without a prefix anywhere the shortest predicted TTFT wins.

    Why sticky: a pool load is cheap by the cost model but not free live (the load waits on the
    store and holds KV blocks while it runs), and every request spread away from its prefix turns
    a local hit into a load; vllm-router's kv_aware, which keeps prefixes where they are, was
    ahead of a policy that spread them (local hits 7.4 M tokens against 3.1 M at load 1.2)."""

    name = "affinity"

    def __init__(self, cost: CostModel, stay_ms: float = 250.0, stay_share: float = 0.5,
                 decode_weight: float = 0.125) -> None:
        super().__init__(cost)
        self.stay_ms, self.stay_share, self.decode_weight = stay_ms, stay_share, decode_weight

    def score(self, req: RouteRequest, inst: InstanceView, choice: Choice) -> float:
        """Predicted TTFT plus what the prefill costs the requests decoding there: each waits out its
        compute (`decode_weight` of a TTFT millisecond per request-millisecond stalled)."""
        compute = self.cost.prefill_ms(req.prompt_tokens - choice.cached_tokens, req.prompt_tokens)
        return choice.predicted_ttft_ms + self.decode_weight * inst.decoding * compute

    def choose(self, req, instances):
        if not instances:
            raise ValueError("no instance to choose from")
        fill = {i.name: i.kv_fill for i in instances}
        scored = [(self.score(req, i, c), c) for i in instances for c in [self.estimate(req, i)]]
        best_score, best = min(scored, key=lambda sc: (sc[0], fill[sc[1].instance], sc[1].instance))
        local = {i.name: min(i.local_prefix_tokens, req.prompt_tokens) for i in instances}
        most = max(local.values())
        if most > min(local.values()):  # a prefix only some engines hold (one all hold decides nothing)
            home_score, home = min(((sc, c) for sc, c in scored if local[c.instance] == most),
                                   key=lambda sc: (sc[0], fill[sc[1].instance], sc[1].instance))
            # Never wait at home longer than computing what it holds beyond the best engine would
            # take: a one-block prefix held by a few engines kept 87k-token prompts waiting 0.7 s
            # behind another prompt while engines sat idle (the share of a long prompt's TTFT is seconds).
            held = self.cost.prefill_ms(most - local[best.instance], req.prompt_tokens)
            slack = max(self.stay_ms, min(self.stay_share * best_score, held))
            if home_score <= best_score + slack:
                return replace(home, reason="local")
        return replace(best, reason="pool" if best.loaded_tokens else "queue")


class SessionSticky(Policy):
    """Keep a session on the instance that served it (its cache is warm) unless that instance's
    queue is more than `slack_ms` longer than the inner policy's pick."""

    def __init__(self, inner: Policy, slack_ms: float = 2000.0) -> None:
        super().__init__(inner.cost)
        self.inner, self.slack_ms = inner, slack_ms
        self.name = f"{inner.name}+sticky"
        self.uses_global_pool = inner.uses_global_pool
        self._home: dict[str, str] = {}

    def choose(self, req, instances):
        pick = self.inner.choose(req, instances)
        home = self._home.get(req.session) if req.session else None
        if home is not None and home != pick.instance:
            inst = next((i for i in instances if i.name == home), None)
            if inst is not None:
                stay = self.estimate(req, inst)
                if stay.predicted_ttft_ms <= pick.predicted_ttft_ms + self.slack_ms:
                    pick = stay
        if req.session:
            self._home[req.session] = pick.instance
        return pick


POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAwareLocal, CacheAwareGlobal, PrefixAffinity)}


def make_policy(name: str, cost: CostModel) -> Policy:
    """'cache_global', 'round_robin', ..., with '+sticky' for session stickiness; parameters in
    brackets, e.g. 'affinity(stay_ms=500,decode_weight=0.25)'."""
    spec, _, sticky = name.partition("+")
    base, _, params = spec.partition("(")
    if base not in POLICIES or sticky not in ("", "sticky") or (params and not params.endswith(")")):
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)} (optionally +sticky)")
    kwargs: dict[str, float] = {}
    for item in filter(None, params[:-1].split(",")):
        key, _, value = item.partition("=")
        try:
            kwargs[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"policy {name!r}: {item!r} is not NAME=NUMBER") from None
    try:
        policy = POLICIES[base](cost, **kwargs)
    except TypeError:
        raise ValueError(f"policy {name!r}: {base} takes no parameter {', '.join(kwargs)}") from None
    return SessionSticky(policy) if sticky else policy


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 30_000.0
    tbt_ms: float = 200.0


def admit(choice: Choice, predicted_tbt_ms: float, slo: Slo) -> str | None:
    """None to accept, else why the request is refused (a 429-style early rejection)."""
    if choice.predicted_ttft_ms > slo.ttft_ms:
        return f"predicted TTFT {choice.predicted_ttft_ms:.0f} ms exceeds the {slo.ttft_ms:.0f} ms SLO"
    if predicted_tbt_ms > slo.tbt_ms:
        return f"predicted TBT {predicted_tbt_ms:.0f} ms exceeds the {slo.tbt_ms:.0f} ms SLO"
    return None
