"""Trace mode: replay a Mooncake-format JSONL trace through N prefill and M decode instances.

Prefill: requests in arrival order; the policy sees each instance's queue and the prompt's leading
blocks in that instance's LRU cache (and in the global pool, for policies that use it); one
prefill at a time per instance. The KV then moves to the least-loaded decode instance.
Conditional disaggregation prefills short or mostly cached prompts on the decode instance itself.
Decode: continuous batching, simulated per epoch (between joins and leaves the batch is constant,
so many steps advance at once). SLO-aware admission refuses requests whose predicted TTFT or TBT
breaks the SLO.
"""
from __future__ import annotations

import gzip
import heapq
import json
import lzma
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import IO

from ..cost import CostModel
from ..policies import InstanceView, Policy, RouteRequest, Slo, admit

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def open_trace(path: str) -> IO[str]:
    """Open a JSONL trace, plain or compressed (.xz, .gz), as text."""
    if path.endswith(".xz"):
        return lzma.open(path, "rt")
    if path.endswith(".gz"):
        return gzip.open(path, "rt")
    return open(path)


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    out = []
    with open_trace(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            out.append(TraceRequest(float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                                    tuple(row["hash_ids"])))
            if limit and len(out) >= limit:
                break
    return out


class BlockLRU:
    """A cache of block ids with a capacity in blocks (0 = none, None = unbounded)."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def prefix(self, ids: tuple[int, ...]) -> int:
        n = 0
        for block in ids:
            if block not in self._blocks:
                break
            n += 1
        return n

    def insert(self, ids: tuple[int, ...]) -> None:
        if self.capacity == 0:
            return
        blocks = self._blocks
        for block in ids:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)


@dataclass
class Fleet:
    prefill: int
    decode: int
    local_cache_tokens: int | None  # per prefill instance; None = unbounded
    global_pool_tokens: int | None = 0  # 0 = no pool
    max_batch: int = 128
    local_prefill_tokens: int = 0  # conditional disaggregation: prefill on decode below this many uncached tokens
    # None: a prompt's blocks are in its instance's cache and the pool from its arrival on (the optimistic
    # model). A number: they enter the instance's cache when its prefill ends, and the pool that many ms
    # later (saving and publishing): a request arriving meanwhile misses them, as it does live.
    publish_lag_ms: float | None = None


@dataclass
class Outcome:
    ttft_ms: float = math.nan
    tbt_ms: float = math.nan
    cached_tokens: int = 0
    rejected: str | None = None
    gaps: dict[float, int] = field(default_factory=dict)


def tbt(gaps: dict[float, int]) -> float:
    """Mooncake's TBT: mean of the slowest 10% of a request's inter-token gaps."""
    total = sum(gaps.values())
    if total == 0:
        return 0.0
    want = max(1, math.ceil(total * 0.1))
    taken, acc = 0, 0.0
    for duration in sorted(gaps, reverse=True):
        n = min(gaps[duration], want - taken)
        acc += n * duration
        taken += n
        if taken == want:
            break
    return acc / want


class _Decode:
    """One decode instance: joins (ready time, request) then continuous batching."""

    def __init__(self) -> None:
        self.joins: list[tuple[float, int, int, int, float]] = []  # ready, rid, steps, context, stall_ms
        self.busy_until: list[float] = []  # estimated finishing times, for load and TBT prediction

    def load_at(self, t: float) -> int:
        heap = self.busy_until
        while heap and heap[0] <= t:
            heapq.heappop(heap)
        return len(heap)

    def run(self, cost: CostModel, max_batch: int, outcomes: list[Outcome]) -> None:
        joins = sorted(self.joins)
        t, i = 0.0, 0
        active: dict[int, int] = {}  # rid -> steps left
        first_gap_from: dict[int, float] = {}
        context: dict[int, int] = {}
        waiting: list[tuple[float, int, int, int, float]] = []
        while i < len(joins) or active or waiting:
            if not active and not waiting and i < len(joins):
                t = max(t, joins[i][0])
            while i < len(joins) and joins[i][0] <= t:
                waiting.append(joins[i])
                i += 1
            stall = 0.0
            while waiting and len(active) < max_batch:
                ready, rid, steps, ctx, prefill_here = waiting.pop(0)
                active[rid] = steps
                first_gap_from[rid] = ready
                context[rid] = ctx
                stall += prefill_here  # a local prefill pauses the whole batch
            if not active:
                t = joins[i][0] if i < len(joins) else t
                continue
            t += stall
            b = len(active)
            step = cost.decode_step_ms(b, sum(context.values()))
            k = min(active.values())
            if i < len(joins) and len(active) < max_batch:
                k = max(1, min(k, math.ceil((joins[i][0] - t) / step)))
            start, t = t, t + k * step
            for rid in list(active):
                gaps = outcomes[rid].gaps
                n = k
                if rid in first_gap_from:
                    first = start + step - first_gap_from.pop(rid)
                    gaps[first] = gaps.get(first, 0) + 1
                    n -= 1
                if n:
                    gaps[step] = gaps.get(step, 0) + n
                context[rid] += k
                active[rid] -= k
                if active[rid] == 0:
                    del active[rid], context[rid]


def simulate(trace: list[TraceRequest], fleet: Fleet, policy: Policy, cost: CostModel, slo: Slo) -> dict:
    """Replay `trace`; metrics under the names the report and --json use."""
    local_blocks = None if fleet.local_cache_tokens is None else fleet.local_cache_tokens // BLOCK_TOKENS
    caches = [BlockLRU(local_blocks) for _ in range(fleet.prefill)]
    pool = BlockLRU(None if fleet.global_pool_tokens is None else fleet.global_pool_tokens // BLOCK_TOKENS)
    free_at = [0.0] * fleet.prefill
    names = [f"prefill-{i}" for i in range(fleet.prefill)]
    decodes = [_Decode() for _ in range(fleet.decode)]
    outcomes = [Outcome() for _ in trace]
    prefill_busy_ms = 0.0
    est_step = cost.decode_step_ms(16, 16 * 8000)
    pending: list[tuple[float, int, int, tuple[int, ...]]] = []  # (visible at, order, cache: -1 the pool, ids)
    order = 0

    def visible(at: float, cache: int, ids: tuple[int, ...]) -> None:
        nonlocal order
        if fleet.publish_lag_ms is None:
            (pool if cache < 0 else caches[cache]).insert(ids)
        else:
            heapq.heappush(pending, (at, order, cache, ids))
            order += 1

    for rid, req in enumerate(trace):
        t = req.arrival_ms
        ids = req.hash_ids
        while pending and pending[0][0] <= t:
            _, _, cache, done = heapq.heappop(pending)
            (pool if cache < 0 else caches[cache]).insert(done)
        global_prefix = min(pool.prefix(ids) * BLOCK_TOKENS, req.input_tokens) if fleet.global_pool_tokens != 0 else 0
        views = [InstanceView(names[k], max(0.0, free_at[k] - t),
                              min(caches[k].prefix(ids) * BLOCK_TOKENS, req.input_tokens)) for k in range(fleet.prefill)]
        route = RouteRequest(req.input_tokens, req.output_tokens, global_prefix, session=str(ids[1]) if len(ids) > 1 else None)
        choice = policy.choose(route, views)
        d = min(range(fleet.decode), key=lambda k: (decodes[k].load_at(t), k))
        load = decodes[d].load_at(t)
        predicted_tbt = cost.decode_step_ms(min(load + 1, fleet.max_batch), (load + 1) * 8000)
        local_prefill = 0.0
        uncached = req.input_tokens - choice.cached_tokens
        if fleet.local_prefill_tokens and uncached < fleet.local_prefill_tokens:
            local_prefill = cost.prefill_ms(uncached, req.input_tokens)
            predicted_tbt += local_prefill  # the decode batch waits for it
        why = admit(choice, predicted_tbt, slo)
        out = outcomes[rid]
        if why is not None:
            out.rejected = why
            continue
        out.cached_tokens = choice.cached_tokens
        k = names.index(choice.instance)
        if local_prefill:
            ready = t + cost.transfer_ms(choice.loaded_tokens) + local_prefill
            stall = local_prefill
        else:
            compute = cost.prefill_ms(uncached, req.input_tokens)
            start = max(t, free_at[k])
            free_at[k] = start + cost.transfer_ms(choice.loaded_tokens) + compute
            prefill_busy_ms += compute
            ready = free_at[k] + cost.transfer_ms(req.input_tokens)
            visible(free_at[k], k, ids)
            stall = 0.0
        prefill_busy_ms += local_prefill
        if fleet.global_pool_tokens != 0:
            visible((ready if local_prefill else free_at[k]) + (fleet.publish_lag_ms or 0.0), -1, ids)
        out.ttft_ms = ready - t
        decodes[d].joins.append((ready, rid, max(1, req.output_tokens), req.input_tokens, stall))
        heapq.heappush(decodes[d].busy_until, ready + req.output_tokens * est_step)
    for inst in decodes:
        inst.run(cost, fleet.max_batch, outcomes)
    return _metrics(trace, outcomes, slo, prefill_busy_ms)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _metrics(trace: list[TraceRequest], outcomes: list[Outcome], slo: Slo, prefill_busy_ms: float) -> dict:
    served = [(r, o) for r, o in zip(trace, outcomes) if o.rejected is None]
    for _, o in served:
        o.tbt_ms = tbt(o.gaps)
    ttft = [o.ttft_ms for _, o in served]
    tbts = [o.tbt_ms for _, o in served]
    good = sum(1 for _, o in served if o.ttft_ms <= slo.ttft_ms and o.tbt_ms <= slo.tbt_ms)
    prompt_tokens = sum(r.input_tokens for r in trace)  # refused requests count as misses
    duration_s = max((trace[-1].arrival_ms - trace[0].arrival_ms) / 1000, 1e-9) if trace else 1.0
    return {
        "requests": len(trace),
        "rejected": len(trace) - len(served),
        "prefix_cache_hit_ratio": sum(o.cached_tokens for _, o in served) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p90_ms": _pct(ttft, 0.9), "ttft_p99_ms": _pct(ttft, 0.99),
        "tbt_p50_ms": _pct(tbts, 0.5), "tbt_p99_ms": _pct(tbts, 0.99),
        "slo_attainment": good / len(trace) if trace else 0.0,
        "goodput_rps": good / duration_s,
        "prefill_gpu_seconds": prefill_busy_ms / 1000,
    }


def infinite_cache_hit_ratio(trace: list[TraceRequest]) -> float:
    """Prefix-token hit ratio with one unbounded cache: the ceiling for any policy."""
    cache = BlockLRU(None)
    hit = total = 0
    for req in trace:
        hit += min(cache.prefix(req.hash_ids) * BLOCK_TOKENS, req.input_tokens)
        total += req.input_tokens
        cache.insert(req.hash_ids)
    return hit / total if total else 0.0
