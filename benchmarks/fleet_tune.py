"""The affinity policy's parameters, chosen by conductor.sim on some trace shapes and reported on
others that played no part in the choice.

    python -m benchmarks.fleet_tune [--tune shape:conversation,shape:toolagent]
                                    [--report shape:synthetic,mooncake-conversation,mooncake-synthetic]
                                    [--load 1.2] [--minutes 3] [--json PATH]

Each trace is cut as the fleet benchmark cuts it (`--minutes` simulated minutes of arrivals at
`--load` of the 12-engine fleet's capacity by the `h100-llama3-8b` cost model) and replayed by
conductor.sim on 12 prefill and 12 decode instances, each caching what an engine's KV cache
holds, with the pool behind them and blocks usable once their prefill ended (the fleet's
publish-lag model). Every (stay_ms, stay_share) of the grid runs on the tuning traces; the one
with the lowest mean TTFT p90 relative to the grid's best on each trace wins. The report gives
it, the default and cache_global / cache_local on the other traces: TTFT p50 and p90, hit
ratio. The simulator has no colocated decode interference, so `decode_weight` is not tuned here."""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys

PROG = "python -m benchmarks.fleet_tune"
STAY_MS = (0.0, 100.0, 250.0, 500.0, 1000.0, 2000.0)
STAY_SHARE = (0.0, 0.25, 0.5, 1.0)
DEFAULT = "affinity"


def slice_of(trace: str, load: float, minutes: float, seed: int = 0):
    from benchmarks.fleet import arrivals, capacity_rps, read_trace
    from conductor.sim.data import TRACES, resolve
    from conductor.sim.engine.profile import get_profile

    if trace.startswith("shape:"):
        import os
        import tempfile

        from conductor.sim import shapes

        path = tempfile.mkstemp(suffix=".jsonl")[1]
        try:
            shapes.write(shapes.generate(shapes.shape_from(trace.removeprefix("shape:"), {"seed": seed})), path)
            rows = read_trace(path)
        finally:
            os.unlink(path)
    else:
        rows = read_trace(resolve(trace, TRACES))
    profile = get_profile("h100-llama3-8b")
    return arrivals(rows, load * capacity_rps(profile, rows, "colocated", 12, 8), minutes * 60)


def simulate(policy: str, slice_) -> dict:
    from conductor.cost import CostModel
    from conductor.policies import Slo, make_policy
    from conductor.sim.engine.profile import get_profile
    from conductor.sim.trace import Fleet, TraceRequest, simulate as replay

    profile = get_profile("h100-llama3-8b")
    cost = CostModel.from_dict(profile.cost_model())
    trace = [TraceRequest(at * 1e3, row.input_tokens, row.output_tokens, row.hash_ids) for at, row in slice_]
    fleet = Fleet(12, 12, profile.kv_capacity_tokens, None, publish_lag_ms=50.0)
    out = replay(trace, fleet, make_policy(policy, cost), cost, Slo(1e12, 1e12))
    return {"ttft_p50_ms": out["ttft_p50_ms"], "ttft_p90_ms": out["ttft_p90_ms"],
            "hit_ratio": out["prefix_cache_hit_ratio"]}


def run(argv: list[str] | None = None) -> int:
    from benchmarks.records import write_json

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--tune", default="shape:conversation,shape:toolagent")
    p.add_argument("--report", default="shape:synthetic,mooncake-conversation,mooncake-synthetic")
    p.add_argument("--load", type=float, default=1.2)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tune = [t for t in args.tune.split(",") if t]
    report = [t for t in args.report.split(",") if t]
    if set(tune) & set(report):
        print(f"{PROG}: error: a trace both tunes and reports: {', '.join(set(tune) & set(report))}", file=sys.stderr)
        return 2
    slices = {t: slice_of(t, args.load, args.minutes) for t in tune + report}
    grid = [f"affinity(stay_ms={a:g},stay_share={b:g})" for a, b in itertools.product(STAY_MS, STAY_SHARE)]
    tuned = {t: {g: simulate(g, slices[t]) for g in grid} for t in tune}
    score = {g: statistics.fmean(tuned[t][g]["ttft_p90_ms"] / min(r["ttft_p90_ms"] for r in tuned[t].values())
                                 for t in tune) for g in grid}
    chosen = min(grid, key=lambda g: (score[g], g))
    print(f"  chosen on {', '.join(tune)} (load {args.load:g}, {args.minutes:g} simulated minutes): {chosen} "
          f"(mean TTFT p90 {score[chosen]:.3f} of each trace's best; the default {DEFAULT}: "
          f"{score.get('affinity(stay_ms=250,stay_share=0.5)', float('nan')):.3f})")
    rows = []
    print(f"  {'trace':<26}{'policy':<44}{'TTFT p50':>10}{'p90':>9}{'hit':>7}")
    for t in report:
        for policy in (chosen, DEFAULT, "cache_global", "cache_local"):
            r = simulate(policy, slices[t])
            rows.append({"trace": t, "policy": policy, **r})
            print(f"  {t:<26}{policy:<44}{r['ttft_p50_ms']:>10.0f}{r['ttft_p90_ms']:>9.0f}{r['hit_ratio']:>7.3f}")
    if args.json:
        write_json(args.json, {"tune": tune, "report": report, "load": args.load, "minutes": args.minutes,
                               "chosen": chosen, "score": score, "tuned": tuned, "reported": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run())
