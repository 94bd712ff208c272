"""TTFT on real vLLM (CPU): no connector vs vLLM's ExampleConnector vs ours, side by side.

    python -m benchmarks.vllm_ttft [--json PATH] [--prompts N] [--quick]

A local model big enough that prefill dominates; prompts of 960-1087 tokens sharing nothing. Per
system, each prompt runs at first sight (nothing cached anywhere: what saving costs a new prompt)
and then warm (the same prompt again, vLLM's own prefix cache reset so only the connector can
help). TTFT = the time of a 1-token generation. Each system runs in a process of its own; ours
uses a `kvstore serve` daemon (DRAM) registered in a local etcd. JSON `records`: one per system
and phase, with `system` (none, example, kvstore), `phase` (first_sight, warm), `ttft_p50_ms`,
`ttft_p99_ms`, `samples_ms`; `ratios` (the targets, each with `value`, `target`, `met`).

`--quick` (the test suite's run): 2 prompts of ~512 tokens, a 2-layer model with hidden 128, one
round, every system (`--layerwise` adds kvstore-layerwise).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.records import write_json
from kvstore.testing import processes

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
llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4,
          max_num_batched_tokens=2048, disable_log_stats=True, **kwargs)
one = SamplingParams(temperature=0, max_tokens=1)
def ttft(prompt):
    llm.reset_prefix_cache()
    t = time.perf_counter(); llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
    return (time.perf_counter() - t) * 1e3
def connector():
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        return get_kv_transfer_group()
    except Exception:
        return None
ttft([5] * 64)  # warm-up: compile paths, first connections
first_sight = [ttft(p) for p in spec["prompts"]]
flush = getattr(connector(), "flush_saves", None)
if flush:
    flush()  # background saves end before the same prompts come back
time.sleep(1.0)
warm = [ttft(p) for p in spec["prompts"]]
totals = dict(getattr(connector(), "totals").data) if hasattr(connector(), "totals") else {}
print("RESULT " + json.dumps({"first_sight": first_sight, "warm": warm, "totals": totals}), flush=True)
"""


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def run_system(model: str, connector: dict | None, prompts: list[list[int]], round_: int) -> dict:
    # Each round sees new prompts (first token differs): nothing from an earlier round is cached.
    prompts = [[(p[0] + 97 * round_) % 500 + 3] + p[1:] for p in prompts]
    proc = processes.spawn([sys.executable, "-c", RUNNER, json.dumps({"model": model, "connector": connector,
                                                                      "prompts": prompts})],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=1800)
    finally:
        processes.stop(proc)
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the {connector and connector['kv_connector'] or 'plain'} engine failed "
                           f"(exit code {proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_ttft", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
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

    from kvstore.integrations.vllm.tiny_model import build_tiny_model
    from kvstore.testing.etcd import EtcdServer

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
        daemon, _ = processes.start_store_daemon(["--node", "ttft", "--metadata", etcd.url, "--dram", "4GiB",
                                                  "--insecure"])
        try:
            systems = {
                "none": None,
                "example": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"shared_storage_path": storage}},
                "kvstore": {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
                            "kv_connector_extra_config": {"metadata": etcd.url},
                            "kv_load_failure_policy": "recompute"},
            }
            if args.layerwise:
                systems["kvstore-layerwise"] = dict(systems["kvstore"], kv_connector_extra_config={
                    "metadata": etcd.url, "layerwise_load_blocks": 1})
            for round_ in range(args.rounds):
                for name, connector in systems.items():
                    print(f"  round {round_ + 1}/{args.rounds}: {name} ...", flush=True)
                    if connector and name == "example":  # a fresh folder: nothing cached at first sight
                        shutil.rmtree(storage, ignore_errors=True)
                    # The layer-by-layer variant shares the daemon: it gets prompts no other system saw.
                    r = run_system(model, connector, prompts, round_ + (50 if name == "kvstore-layerwise" else 0))
                    merged = results.setdefault(name, {"first_sight": [], "warm": [], "totals": {}, "rounds": []})
                    merged["first_sight"] += r["first_sight"]
                    merged["warm"] += r["warm"]
                    merged["rounds"].append({"first_sight_p50_ms": percentile(r["first_sight"], 0.5),
                                             "warm_p50_ms": percentile(r["warm"], 0.5)})
                    for key, value in r["totals"].items():
                        merged["totals"][key] = merged["totals"].get(key, 0) + value
        finally:
            processes.stop(daemon, grace=15)
            shutil.rmtree(storage, ignore_errors=True)

    print(f"\n  model: {args.layers} layers, hidden {args.hidden}; {args.prompts} prompts of ~{args.prompt_tokens} tokens,"
          f" {args.rounds} round(s), samples pooled")
    print(f"  {'system':<18}{'first sight p50':>17}{'p99':>9}{'warm p50':>10}{'p99':>9}{'loaded tok':>12}"
          f"{'dropped':>9}{'load GB/s':>11}{'failed':>10}")
    records, p50 = [], {}
    for name, r in results.items():
        t = r["totals"]
        for phase in ("first_sight", "warm"):
            records.append({"system": name, "phase": phase, "ttft_p50_ms": percentile(r[phase], 0.5),
                            "ttft_p99_ms": percentile(r[phase], 0.99), "samples_ms": r[phase]})
            p50[name, phase] = records[-1]["ttft_p50_ms"]
        gbps = t["load_bytes"] / t["load_seconds"] / 1e9 if t.get("load_seconds") else None
        first, warm = records[-2], records[-1]
        print(f"  {name:<18}{first['ttft_p50_ms']:>17.1f}{first['ttft_p99_ms']:>9.1f}{warm['ttft_p50_ms']:>10.1f}"
              f"{warm['ttft_p99_ms']:>9.1f}{int(t.get('hit_tokens', 0)) if 'hit_tokens' in t else '-':>12}"
              f"{int(t.get('dropped_blocks', 0)) if 'dropped_blocks' in t else '-':>9}{'-' if gbps is None else f'{gbps:.2f}':>11}"
              f"{int(t.get('load_failures', 0)) if 'load_failures' in t else '-':>10}")
    targets = [("kvstore first_sight / none first_sight", p50["kvstore", "first_sight"] / p50["none", "first_sight"], 1.10),
               ("kvstore warm / kvstore first_sight", p50["kvstore", "warm"] / p50["kvstore", "first_sight"], 0.5),
               ("kvstore warm / example warm", p50["kvstore", "warm"] / p50["example", "warm"], 0.9)]
    print("\n  targets (p50 ratios in this run; per-round ratios in brackets show the noise)")
    per_round = [[rk["first_sight_p50_ms"] / rn["first_sight_p50_ms"], rk["warm_p50_ms"] / rk["first_sight_p50_ms"],
                  rk["warm_p50_ms"] / re["warm_p50_ms"]]
                 for rk, rn, re in zip(results["kvstore"]["rounds"], results["none"]["rounds"], results["example"]["rounds"])]
    for i, (label, value, bound) in enumerate(targets):
        spread = ", ".join(f"{r[i]:.2f}" for r in per_round)
        print(f"  {label:<42}{value:>8.2f}  <= {bound:<5}{'met' if value <= bound else 'NOT met':<8} [{spread}]")
    if "kvstore-layerwise" in p50:
        print(f"  kvstore-layerwise warm / kvstore warm     {p50['kvstore-layerwise', 'warm'] / p50['kvstore', 'warm']:>8.2f}"
              "  (layer-by-layer in-step loads vs whole loads before the forward)")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "layers": args.layers, "hidden": args.hidden, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                "rounds": args.rounds, "load_average": os.getloadavg(), "per_round_ratios": per_round}
        ratios = [{"ratio": label, "value": value, "target": bound, "met": value <= bound} for label, value, bound in targets]
        write_json(args.json, {"meta": meta, "records": records, "ratios": ratios,
                               "totals": {name: r["totals"] for name, r in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.vllm_ttft"))
