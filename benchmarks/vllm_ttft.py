"""TTFT on real vLLM (CPU): no connector vs vLLM's ExampleConnector vs ours, side by side.

    python -m benchmarks.vllm_ttft [--json PATH] [--prompts N] [--quick]

A local model big enough that prefill dominates; prompts of 960-1087 tokens whose first half is
shared. Per system, each prompt runs cold (its first sight: only a shared prefix saved by an
earlier prompt can help) and then warm (the same prompt again, vLLM's own prefix cache reset so
only the connector can help). TTFT = the time of a 1-token generation. Each system runs
in a process of its own; ours uses a `kvstore serve` daemon (DRAM) registered in a local etcd.
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
ttft([5] * 64)  # warm-up: compile paths, first connections
cold = [ttft(p) for p in spec["prompts"]]
warm = [ttft(p) for p in spec["prompts"]]
totals = {}
try:
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    totals = dict(getattr(get_kv_transfer_group(), "totals").data)
except Exception:
    pass
print("RESULT " + json.dumps({"cold": cold, "warm": warm, "totals": totals}), flush=True)
"""


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def run_system(model: str, connector: dict | None, prompts: list[list[int]]) -> dict:
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps({"model": model, "connector": connector,
                                                                     "prompts": prompts})],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_ttft", description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--quick", action="store_true", help="4 prompts, a smaller model")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.layers, args.hidden = 4, 6, 512

    from kvstore.etcd_server import EtcdServer
    from kvstore.integrations.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(os.path.join(os.path.expanduser("~"), ".cache", "kvstore",
                                          f"bench-llama-{args.layers}x{args.hidden}"),
                             layers=args.layers, hidden=args.hidden, heads=args.hidden // 64)
    shared = [(11 * i) % 500 + 3 for i in range(args.prompt_tokens // 2)]  # half of each prompt is shared
    # Lengths spread over a whole block (about 1k each) so no connector's block alignment is favoured.
    lengths = [args.prompt_tokens - 64 + (k * 131) % 128 for k in range(args.prompts)]
    prompts = [shared + [(13 * i + 7 * k) % 500 + 3 for i in range(n - len(shared))] for k, n in enumerate(lengths)]
    storage = tempfile.mkdtemp(prefix="kvstore-example-connector-")
    results = {}
    with EtcdServer() as etcd:
        daemon = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--node", "ttft", "--metadata",
                                   etcd.url, "--dram", "4GiB", "--insecure"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        daemon.stdout.readline()
        try:
            systems = {
                "no connector": None,
                "ExampleConnector": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"shared_storage_path": storage}},
                "kvstore": {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
                            "kv_connector_extra_config": {"metadata": etcd.url},
                            "kv_load_failure_policy": "recompute"},
            }
            for name, connector in systems.items():
                print(f"  running {name} ...", flush=True)
                results[name] = run_system(model, connector, prompts)
        finally:
            daemon.terminate()
            daemon.wait(15)
            shutil.rmtree(storage, ignore_errors=True)

    print(f"\n  model: {args.layers} layers, hidden {args.hidden}; {args.prompts} prompts of {args.prompt_tokens} tokens")
    print(f"  {'system':<18}{'cold p50':>10}{'cold p99':>10}{'warm p50':>10}{'warm p99':>10}"
          f"{'loaded tok':>12}{'load GB/s':>11}")
    summary = {}
    for name, r in results.items():
        t = r["totals"]
        loaded = int(t.get("hit_tokens", 0))
        gbps = t["load_bytes"] / t["load_seconds"] / 1e9 if t.get("load_seconds") else None
        summary[name] = {"cold_p50_ms": percentile(r["cold"], 0.5), "cold_p99_ms": percentile(r["cold"], 0.99),
                         "warm_p50_ms": percentile(r["warm"], 0.5), "warm_p99_ms": percentile(r["warm"], 0.99),
                         "tokens_loaded": loaded, "load_gbps": gbps}
        s = summary[name]
        print(f"  {name:<18}{s['cold_p50_ms']:>10.1f}{s['cold_p99_ms']:>10.1f}{s['warm_p50_ms']:>10.1f}"
              f"{s['warm_p99_ms']:>10.1f}{loaded if name == 'kvstore' else '-':>12}"
              f"{'-' if gbps is None else f'{gbps:.2f}':>11}")
    ours, example = summary["kvstore"], summary["ExampleConnector"]
    ratios = {"ours warm / ours cold (<= 0.5)": ours["warm_p50_ms"] / ours["cold_p50_ms"],
              "ours warm / ExampleConnector warm (<= 0.7)": ours["warm_p50_ms"] / example["warm_p50_ms"]}
    print("\n  targets (p50 ratios in this run)")
    for label, value in ratios.items():
        print(f"  {label:<46}{value:>8.2f}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "layers": args.layers, "hidden": args.hidden, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "systems": summary, "raw": results, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
