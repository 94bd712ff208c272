"""The gateway's own Prometheus metrics (GET /metrics)."""
from __future__ import annotations

import statistics
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .pool import Pool

_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GatewayMetrics:
    def __init__(self, pool: Pool, kv_events: Callable[[], float] = lambda: 0.0) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("conductor_gateway_requests", "client requests", ["endpoint", "status"], registry=r)
        self.routes = Counter("conductor_gateway_routes", "routing outcomes", ["mode"], registry=r)
        self.route_reasons = Counter("conductor_gateway_route_reasons",
                                     "which term decided a route: local (an engine's own cache), pool (a load from "
                                     "the store pool instead of a busy holder), queue (no prefix: the shortest "
                                     "wait), spread, or the policy's name", ["reason"], registry=r)
        self.upstream_failures = Counter("conductor_gateway_upstream_failures", "failed engine calls", ["role"],
                                         registry=r)
        self.retries = Counter("conductor_gateway_retries", "requests moved to another engine", ["phase"], registry=r)
        self.cancelled = Counter("conductor_gateway_cancelled", "requests the client abandoned", registry=r)
        self.cached_tokens = Counter("conductor_gateway_predicted_cached_tokens", "prompt tokens routing expects cached",
                                     registry=r)
        self.prompt_tokens = Counter("conductor_gateway_prompt_tokens", "prompt tokens routed", registry=r)
        self.ttft = Histogram("conductor_gateway_ttft_seconds", "time to the first byte of the answer",
                              buckets=_LATENCY, registry=r)
        self.overhead = Histogram("conductor_gateway_overhead_seconds",
                                  "gateway time minus time spent waiting on engines", buckets=_LATENCY, registry=r)
        self.connections_refused = Counter("conductor_gateway_connections_refused",
                                           "client connections refused at a cap (503)", ["cap"], registry=r)
        self.connections_evicted = Counter("conductor_gateway_connections_evicted",
                                           "idle keep-alive connections closed to make room at a cap", registry=r)
        self.connections_shed = Counter("conductor_gateway_connections_shed",
                                        "connections closed at a cap while their request headers were still "
                                        "arriving (the oldest first; 408)", registry=r)
        self.client_kv_params_dropped = Counter("conductor_gateway_client_kv_transfer_params_dropped",
                                                "requests whose own kv_transfer_params were removed before "
                                                "forwarding", registry=r)
        self.header_timeouts = Counter("conductor_gateway_header_timeouts",
                                       "connections closed for headers not received in time (408)", registry=r)
        self.body_timeouts = Counter("conductor_gateway_body_timeouts",
                                     "requests whose body was not received in time (408)", registry=r)
        self.open_connections = Gauge("conductor_gateway_connections", "open client connections", registry=r)
        self.recent_overhead: deque[float] = deque(maxlen=10_000)
        Gauge("conductor_gateway_overhead_p50_seconds", "median overhead of the last 10k requests",
              registry=r).set_function(lambda: statistics.median(self.recent_overhead) if self.recent_overhead else 0.0)
        Gauge("conductor_gateway_kv_events", "vLLM KV-cache events applied", registry=r).set_function(kv_events)
        healthy = Gauge("conductor_gateway_engine_healthy", "1 while an engine is in the rotation", ["engine", "role"],
                        registry=r)
        inflight = Gauge("conductor_gateway_engine_inflight", "gateway requests at an engine", ["engine", "role"],
                         registry=r)
        for e in pool.engines:
            healthy.labels(e.url, e.role).set_function(lambda e=e: float(e.healthy))
            inflight.labels(e.url, e.role).set_function(lambda e=e: float(e.inflight))

    def observe_overhead(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.overhead.observe(seconds)
        self.recent_overhead.append(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
