"""Scenario mode: the textbook co-located vs disaggregated experiment, exactly.

Model (no batching: one request per step):
- Requests arrive every `gap_ms`; each needs a prefill of `prompt_tokens * prefill_ms_per_token`,
  then `output_tokens` decode steps of `decode_ms_per_step`.
- Co-located: one worker runs ready work in order of (ready time, prefill before decode, request
  id); a prefill blocks everything behind it. The first token comes out of the prefill.
- Disaggregated: each prompt goes to the earliest-free prefill worker in arrival order; its KV then
  takes `kv_transfer_ms` to reach the decode pool, where the first token appears. Decode steps go
  to the earliest-free decode worker in order of (ready time, request id).
- TTFT = first token - arrival. Inter-token gaps: one per decode step, the first from the first
  token to the end of the first decode step. TPOT mean = mean of all gaps; p99 = the gap at index
  int(0.99 * (n - 1)) of all gaps sorted (nearest rank).
"""
from __future__ import annotations

import heapq
import json
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Requests:
    count: int
    gap_ms: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Costs:
    prefill_ms_per_token: float
    decode_ms_per_step: float
    kv_transfer_ms: float = 0.0


@dataclass
class Scenario:
    requests: Requests
    cost: Costs
    designs: dict[str, dict[str, int]] = field(default_factory=dict)
    decode_batching: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Scenario":
        try:
            requests = Requests(**data["requests"])
            cost = Costs(**data["cost"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"scenario needs 'requests' and 'cost' objects: {exc}") from exc
        designs = data.get("designs") or {"colocated": {"workers": 1}}
        if data.get("decode_batching"):
            raise ValueError("scenario mode models the unbatched textbook case; use trace mode for batching")
        return cls(requests, cost, designs, False)


@dataclass
class Timeline:
    """First-token time and every token time after it, per request."""

    arrivals: list[float]
    first_token: list[float]
    tokens: list[list[float]]  # end of each decode step

    def metrics(self) -> dict[str, float]:
        ttft = [f - a for f, a in zip(self.first_token, self.arrivals)]
        gaps = []
        for first, steps in zip(self.first_token, self.tokens):
            previous = first
            for t in steps:
                gaps.append(t - previous)
                previous = t
        ordered = sorted(gaps)
        p99 = ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0
        ttft_sorted = sorted(ttft)
        return {"ttft_mean_ms": statistics.fmean(ttft), "ttft_max_ms": max(ttft),
                "ttft_p99_ms": ttft_sorted[int(0.99 * (len(ttft_sorted) - 1))],
                "tpot_mean_ms": statistics.fmean(gaps) if gaps else 0.0, "tpot_p99_ms": p99}


def colocated(req: Requests, cost: Costs, workers: int = 1) -> Timeline:
    """Ready work in order of (ready time, prefill first, request id) on the earliest-free worker."""
    arrivals = [i * req.gap_ms for i in range(req.count)]
    prefill = req.prompt_tokens * cost.prefill_ms_per_token
    first = [0.0] * req.count
    tokens: list[list[float]] = [[] for _ in range(req.count)]
    ready = [(arrivals[i], 0, i) for i in range(req.count)]  # (ready, 0=prefill/1=decode, request)
    heapq.heapify(ready)
    free = [0.0] * workers
    while ready:
        at, kind, rid = heapq.heappop(ready)
        w = min(range(workers), key=lambda k: (free[k], k))
        start = max(at, free[w])
        end = start + (prefill if kind == 0 else cost.decode_ms_per_step)
        free[w] = end
        if kind == 0:
            first[rid] = end
        else:
            tokens[rid].append(end)
        if len(tokens[rid]) < req.output_tokens:
            heapq.heappush(ready, (end, 1, rid))
    return Timeline(arrivals, first, tokens)


def disaggregated(req: Requests, cost: Costs, prefill_workers: int, decode_workers: int) -> Timeline:
    arrivals = [i * req.gap_ms for i in range(req.count)]
    prefill = req.prompt_tokens * cost.prefill_ms_per_token
    free_p = [0.0] * prefill_workers
    first = []
    for a in arrivals:  # arrival order, earliest-free prefill worker
        w = min(range(prefill_workers), key=lambda k: (free_p[k], k))
        end = max(a, free_p[w]) + prefill
        free_p[w] = end
        first.append(end + cost.kv_transfer_ms)
    tokens: list[list[float]] = [[] for _ in range(req.count)]
    ready = [(first[i], i) for i in range(req.count)]
    heapq.heapify(ready)
    free_d = [0.0] * decode_workers
    while ready:
        at, rid = heapq.heappop(ready)
        w = min(range(decode_workers), key=lambda k: (free_d[k], k))
        end = max(at, free_d[w]) + cost.decode_ms_per_step
        free_d[w] = end
        tokens[rid].append(end)
        if len(tokens[rid]) < req.output_tokens:
            heapq.heappush(ready, (end, rid))
    return Timeline(arrivals, first, tokens)


def run_scenario(scenario: Scenario) -> dict[str, dict[str, float]]:
    """Metrics per design named in the scenario."""
    out = {}
    for name, design in scenario.designs.items():
        if "workers" in design:
            timeline = colocated(scenario.requests, scenario.cost, int(design["workers"]))
        else:
            timeline = disaggregated(scenario.requests, scenario.cost, int(design["prefill_workers"]),
                                     int(design["decode_workers"]))
        out[name] = timeline.metrics()
    return out


def load(path: str) -> Scenario:
    with open(path) as f:
        return Scenario.from_dict(json.load(f))
