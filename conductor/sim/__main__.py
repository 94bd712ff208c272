"""python -m conductor.sim --scenario textbook|FILE.json [--json [OUT]]
   python -m conductor.sim --trace mooncake-conversation|FILE.jsonl --prefill N --decode M [--policy NAME|all]

Prints a table; `--json` prints the raw results instead, `--json OUT` writes them to OUT as well."""
from __future__ import annotations

import json
import os
import sys
import time

from kvstore.cli_args import Parser, alias, fail

from ..cost import CostModel
from ..policies import POLICIES, Slo, make_policy
from .data import SCENARIOS, TRACES, resolve
from .report import render
from .scenario import load, run_scenario
from .trace import Fleet, infinite_cache_hit_ratio, load_trace, simulate


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m conductor.sim", description="discrete-event simulator")
    parser.add_version()
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", metavar="NAME|FILE",
                        help=f"a scenario JSON, or a built-in one: {', '.join(SCENARIOS)}")
    source.add_argument("--trace", metavar="NAME|FILE",
                        help=f"a Mooncake-format JSONL trace (512 tokens per hash id; .xz too), or a built-in one: "
                             f"{', '.join(TRACES)}")
    parser.add_argument("--json", metavar="OUT", nargs="?", const="-",
                        help="the raw results as JSON: on stdout instead of the table, or written to OUT")
    parser.add_argument("--prefill", type=int, default=8, help="prefill instances")
    parser.add_argument("--decode", type=int, default=4, help="decode instances")
    parser.add_argument("--local-cache-tokens", type=int, default=None, help="per prefill instance (default: total/N)")
    parser.add_argument("--total-cache-tokens", type=int, default=50_000_000, help="KV cache of the fleet, in tokens")
    parser.add_argument("--global-pool-tokens", type=int, default=None, help="default: the total cache")
    parser.add_argument("--local-prefill-tokens", type=int, default=0, help="conditional disaggregation threshold")
    parser.add_argument("--policy", default="all", help=f"one of {sorted(POLICIES)} (+sticky), or all")
    parser.add_argument("--slo-ttft-ms", type=float, default=30_000, help="TTFT SLO (as conductor serve)")
    alias(parser, "--ttft-slo-ms", dest="slo_ttft_ms", type=float)
    parser.add_argument("--slo-tbt-ms", type=float, default=200, help="time-between-tokens SLO")
    alias(parser, "--tbt-slo-ms", dest="slo_tbt_ms", type=float)
    parser.add_argument("--cost", metavar="JSON", help="cost model JSON (defaults in conductor/cost.py)")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    args = parser.parse_args(argv)

    if args.policy != "all":
        try:
            make_policy(args.policy, CostModel())
        except ValueError as exc:
            parser.error(f"argument --policy: {exc}, or all")
    try:  # the inputs, read before anything runs: a bad one is one line, not a traceback
        scenario = load(resolve(args.scenario, SCENARIOS)) if args.scenario else None
        if not args.scenario:
            with open(args.cost) if args.cost else open(os.devnull) as f:
                cost = CostModel.from_dict(json.load(f)) if args.cost else CostModel()
            trace = load_trace(resolve(args.trace, TRACES), args.limit)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(parser.prog, f"{type(exc).__name__}: {exc}")
    if scenario is not None:
        results = run_scenario(scenario)
    else:
        fleet = Fleet(args.prefill, args.decode,
                      args.local_cache_tokens if args.local_cache_tokens is not None else args.total_cache_tokens // args.prefill,
                      args.global_pool_tokens if args.global_pool_tokens is not None else args.total_cache_tokens,
                      local_prefill_tokens=args.local_prefill_tokens)
        names = sorted(POLICIES) if args.policy == "all" else [args.policy]
        results = {"infinite_cache_hit_ratio": infinite_cache_hit_ratio(trace)}
        for name in names:
            started = time.perf_counter()
            metrics = simulate(trace, fleet, make_policy(name, cost), cost, Slo(args.slo_ttft_ms, args.slo_tbt_ms))
            metrics["wall_seconds"] = time.perf_counter() - started
            results[name] = metrics
    text = json.dumps(results, indent=1)
    print(text if args.json == "-" else render(results))
    if args.json not in (None, "-"):
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
