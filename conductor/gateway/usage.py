"""What each answer's prompt cost: `usage.prompt_tokens_details.cached_tokens`, its split by where the
cached tokens came from, and the prefill time and money the caches saved (metrics per model).

The numbers come from the engines. vLLM counts a request's cached tokens once, when it is first
scheduled (`--enable-prompt-tokens-details` puts that count in its usage); the kvstore connector
returns the same count split by tier in the answer's `kv_transfer_params` (`kvstore_hits`: device,
host, disk, p2p; see kvstore/hits.py). Which report a request gets:

- P/D: the prefill engine's report, as vLLM's own P/D reports it (`remote_prefill_cached_tokens`):
  the decode engine's hand-off tokens were computed for this very request, so they are no saving.
- colocated, not streamed: the answer's own report (cached_tokens from the engine's usage when
  it gives one, with the store tiers from the connector; device is the rest).
- colocated, streamed: vLLM streams no `kv_transfer_params`, so the split of the engine's
  cached_tokens is the gateway's: device up to what routing knew the engine held, the rest host
  (`cached_tokens_source: "routing"`). An engine that never reported a store tier has only its own
  cache: all device, exactly.

Every split sums to cached_tokens. Streams are asked for usage from the engine even when the client
did not ask (the usage chunk is then kept from the client), so the metrics count every answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.hits import HITS_KEY, TIERS

from ..cost import CostModel

# In aiohttp's request storage: the request's UsageContext, and whether the gateway (not the
# client) asked the engine for a stream's usage chunk.
USAGE: Any = web.RequestKey("conductor_gateway_usage", object) if hasattr(web, "RequestKey") \
    else "conductor_gateway_usage"
ADDED: Any = web.RequestKey("conductor_gateway_usage_added", bool) if hasattr(web, "RequestKey") \
    else "conductor_gateway_usage_added"


@dataclass
class CachedSplit:
    cached_tokens: int
    tiers: dict[str, int]
    source: str  # "engine": the engines' own report; "routing": the gateway's split of the engine's count

    def details(self) -> dict[str, Any]:
        return {"cached_tokens": self.cached_tokens, "cached_tokens_by_tier": dict(self.tiers),
                "cached_tokens_source": self.source}


def take_hits(params: dict | None) -> dict[str, int] | None:
    """Remove the connector's tier report from `params` (an engine's kv_transfer_params) and return it."""
    if not isinstance(params, dict):
        return None
    hits = params.pop(HITS_KEY, None)
    if not isinstance(hits, dict):
        return None
    try:
        return {tier: max(0, int(hits.get(tier, 0))) for tier in TIERS}
    except (TypeError, ValueError):
        return None


def settle(engine_cached: int | None, hits: dict[str, int] | None, prefill_hits: dict[str, int] | None,
           credited: int, reports_tiers: bool) -> CachedSplit | None:
    """The cached tokens of one answer and their split (see the module docstring); None: unknown."""
    if prefill_hits is not None:
        return CachedSplit(sum(prefill_hits.values()), prefill_hits, "engine")
    if hits is not None:
        store = hits["host"] + hits["disk"] + hits["p2p"]
        cached = sum(hits.values()) if engine_cached is None else engine_cached
        if cached < store:  # never seen (both are counted at admission); the connector's count holds
            return CachedSplit(sum(hits.values()), hits, "engine")
        return CachedSplit(cached, {**hits, "device": cached - store}, "engine")
    if engine_cached is None:
        return None
    if not reports_tiers:  # no connector: an engine's cached tokens are its own prefix cache's
        return CachedSplit(engine_cached, {"device": engine_cached, "host": 0, "disk": 0, "p2p": 0}, "engine")
    device = min(engine_cached, max(0, credited))
    return CachedSplit(engine_cached, {"device": device, "host": engine_cached - device, "disk": 0, "p2p": 0},
                       "routing")


@dataclass
class UsageContext:
    """One request's part: what the answer's usage needs beyond the engine's answer."""
    model: str
    prompt_tokens: int
    credited: int  # prompt tokens routing credited the answering engine's own cache with
    prefill_hits: dict[str, int] | None
    client_wants_usage: bool  # a stream whose client asked for the usage chunk
    settled: CachedSplit | None = None
    buffer: bytes = b""
    engines: set[str] = field(default_factory=set)


def _engine_cached(usage: dict) -> int | None:
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class UsageMetrics:
    """Cached tokens by tier, prefill seconds spent and saved (from the cost model), and the prompt
    cost per million tokens at the configured GPU price, per model."""

    def __init__(self, registry: CollectorRegistry, cost: CostModel, gpu_hour_price: float = 0.0,
                 gpus_per_engine: int = 1) -> None:
        self.cost = cost
        self.price_per_s = gpu_hour_price * gpus_per_engine / 3600.0
        r = registry
        self.cached = Counter("conductor_gateway_cached_tokens", "prompt tokens answered from a cache, by tier "
                              "(device: the engine's own; host, disk: the store pool; p2p: a peer)",
                              ["model", "tier"], registry=r)
        self.answered = Counter("conductor_gateway_answered_prompt_tokens", "prompt tokens of answers whose usage "
                                "is known", ["model"], registry=r)
        self.spent = Counter("conductor_gateway_prefill_seconds", "modelled prefill seconds the engines spent "
                             "(cost model)", ["model"], registry=r)
        self.saved = Counter("conductor_gateway_prefill_seconds_saved", "modelled prefill seconds the cached "
                             "tokens saved (cost model)", ["model"], registry=r)
        self._totals: dict[str, list[float]] = {}  # model -> [prompt tokens, seconds spent, seconds saved]
        if self.price_per_s > 0:
            self.cost_saved = Counter("conductor_gateway_prefill_cost_saved", "GPU cost the cached tokens saved "
                                      "(gpu_hour_price units)", ["model"], registry=r)
            self.per_million = Gauge("conductor_gateway_prompt_cost_per_million_tokens", "prefill GPU cost per "
                                     "million prompt tokens, as served (with the caches)", ["model"], registry=r)
            self.per_million_uncached = Gauge("conductor_gateway_prompt_cost_per_million_tokens_uncached",
                                              "the same if nothing had been cached", ["model"], registry=r)

    def observe(self, model: str, prompt_tokens: int, split: CachedSplit) -> None:
        cached = min(split.cached_tokens, prompt_tokens) if prompt_tokens else split.cached_tokens
        prompt = max(prompt_tokens, cached)
        for tier, tokens in split.tiers.items():
            if tokens:
                self.cached.labels(model, tier).inc(tokens)
        spent = self.cost.prefill_ms(prompt - cached, prompt) / 1000.0
        saved = self.cost.prefill_ms(prompt, prompt) / 1000.0 - spent
        self.answered.labels(model).inc(prompt)
        self.spent.labels(model).inc(spent)
        self.saved.labels(model).inc(saved)
        totals = self._totals.setdefault(model, [0.0, 0.0, 0.0])
        totals[0] += prompt
        totals[1] += spent
        totals[2] += saved
        if self.price_per_s > 0:
            self.cost_saved.labels(model).inc(saved * self.price_per_s)
            if totals[0]:
                self.per_million.labels(model).set(totals[1] / totals[0] * 1e6 * self.price_per_s)
                self.per_million_uncached.labels(model).set((totals[1] + totals[2]) / totals[0] * 1e6
                                                            * self.price_per_s)


class Usage:
    """The gateway's side: ask engines for usage, rewrite each answer's usage, count it."""

    def __init__(self, metrics: UsageMetrics) -> None:
        self.metrics = metrics
        self.reports_tiers: set[str] = set()  # engines whose answers carried a connector report

    def prepare(self, request: web.Request, body: dict) -> bool:
        """Ask a stream's engine for its usage chunk whatever the client asked; whether `body` changed."""
        if not body.get("stream"):
            return False
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            return False
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        request[ADDED] = True
        return True

    def begin(self, request: web.Request, body: dict, prompt_tokens: int, credited: int,
              prefill_params: dict | None) -> None:
        """After routing (and the prefill, whose report P/D answers take): the request's context."""
        request[USAGE] = UsageContext(model=str(body.get("model")), prompt_tokens=prompt_tokens, credited=credited,
                                      prefill_hits=take_hits(prefill_params),
                                      client_wants_usage=not request.get(ADDED, False))

    def answer(self, request: web.Request, raw: bytes, engine_url: str) -> bytes:
        """A whole (not streamed) answer, its usage completed."""
        ctx = request.get(USAGE)
        if ctx is None:
            return raw
        try:
            body = json.loads(raw)
        except ValueError:
            return raw
        if not isinstance(body, dict):
            return raw
        params = body.get("kv_transfer_params")
        hits = take_hits(params)
        if hits is not None:
            self.reports_tiers.add(engine_url)
            if not params:
                body["kv_transfer_params"] = None
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        split = settle(_engine_cached(usage), hits, ctx.prefill_hits, ctx.credited, engine_url in self.reports_tiers)
        if split is None:
            return raw if hits is None else json.dumps(body).encode()
        self._settled(ctx, split)
        usage.setdefault("prompt_tokens", ctx.prompt_tokens)
        usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}), **split.details()}
        body["usage"] = usage
        return json.dumps(body).encode()

    def stream(self, request: web.Request, chunk: bytes, engine_url: str, final: bool = False) -> bytes:
        """Part of a streamed answer: usage chunks completed (or kept back where the client asked
        for none); everything else passes as it came. `final`: the stream ended (flush what is kept)."""
        ctx = request.get(USAGE)
        if ctx is None:
            return chunk
        data = ctx.buffer + chunk
        if b'"usage"' not in data and not final:
            # No usage in sight: pass whole events on, keep an unfinished one until it ends.
            cut = data.rfind(b"\n\n")
            ctx.buffer = data[cut + 2:] if cut >= 0 else data
            return data[:cut + 2] if cut >= 0 else b""
        events = data.split(b"\n\n")
        ctx.buffer = b"" if final else events.pop()
        out = []
        for event in events:
            if not event:
                continue
            if b'"usage"' in event and event.startswith(b"data: {"):
                event = self._usage_event(ctx, event, engine_url)
                if event is None:
                    continue
            out.append(event + b"\n\n")
        return b"".join(out)

    def _usage_event(self, ctx: UsageContext, event: bytes, engine_url: str) -> bytes | None:
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(payload, dict):
            return event
        usage = payload.get("usage")
        if isinstance(usage, dict):
            split = settle(_engine_cached(usage), None, ctx.prefill_hits, ctx.credited,
                           engine_url in self.reports_tiers)
            if split is not None:
                if not payload.get("choices"):  # the final usage chunk (others have it with continuous stats)
                    self._settled(ctx, split)
                usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}), **split.details()}
        elif ctx.client_wants_usage:
            return event
        if not ctx.client_wants_usage:
            if not payload.get("choices") and isinstance(usage, dict):
                return None  # the usage chunk the client did not ask for
            payload.pop("usage", None)
        return b"data: " + json.dumps(payload).encode()

    def _settled(self, ctx: UsageContext, split: CachedSplit) -> None:
        if ctx.settled is None:
            ctx.settled = split
            self.metrics.observe(ctx.model, ctx.prompt_tokens, split)
