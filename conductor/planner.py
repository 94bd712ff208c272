"""Pool planner: how many prefill and decode instances a workload needs, and whether to
disaggregate at all.

Demand in instance-seconds per second: prefill = rate x prompt x ms/token; decode = rate x
output x step time / batch. Divided by a target utilisation, rounded up, that is the pool size.
Disaggregation pays when a co-located prefill would stall every running decode for longer than
the TBT SLO allows.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .cost import CostModel


@dataclass(frozen=True)
class Workload:
    arrival_rate: float  # requests per second
    prompt_tokens: float  # mean
    output_tokens: float  # mean
    cached_fraction: float = 0.0  # of prompt tokens served from the KV pool


@dataclass(frozen=True)
class Plan:
    prefill_gpu_seconds_per_second: float
    decode_gpu_seconds_per_second: float
    prefill_instances: int
    decode_instances: int
    decode_batch: int
    disaggregate: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def plan(workload: Workload, cost: CostModel, *, decode_batch: int = 1, tbt_slo_ms: float = 100.0,
         utilisation: float = 1.0) -> Plan:
    """Sizes for `workload` with decode batches of `decode_batch` sequences."""
    if not 0 < utilisation <= 1:
        raise ValueError("utilisation must be in (0, 1]")
    uncached = workload.prompt_tokens * (1 - workload.cached_fraction)
    prefill_ms = cost.prefill_ms_per_token * uncached  # linear term: the textbook's model
    prefill_load = workload.arrival_rate * prefill_ms / 1000
    step_ms = cost.decode_ms_per_step if decode_batch == 1 else cost.decode_step_ms(decode_batch, 0)
    decode_load = workload.arrival_rate * workload.output_tokens * step_ms / decode_batch / 1000
    disaggregate = prefill_ms > tbt_slo_ms
    reason = (f"a co-located prefill ({prefill_ms:.0f} ms) would stall running decodes past the {tbt_slo_ms:.0f} ms TBT SLO"
              if disaggregate else f"prefills ({prefill_ms:.0f} ms) fit inside the {tbt_slo_ms:.0f} ms TBT SLO: co-locate")
    return Plan(prefill_load, decode_load, math.ceil(prefill_load / utilisation - 1e-9),
                math.ceil(decode_load / utilisation - 1e-9), decode_batch, disaggregate, reason)


def batching_table(workload: Workload, cost: CostModel, batches=(1, 2, 4, 8, 16, 32, 64)) -> list[Plan]:
    """How decode batching changes the decode pool (prefill is unaffected)."""
    return [plan(workload, cost, decode_batch=b) for b in batches]
