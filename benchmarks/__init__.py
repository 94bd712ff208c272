"""The benchmarks: `python -m benchmarks.NAME` or `kvstore bench NAME` (same arguments, e.g. `--quick`,
`--json PATH`). Each one's `--quick` run is in the test suite (tests/benchmarks/test_quick.py).

Kept light: `kvstore`'s command line imports this module to list the benchmarks."""
from __future__ import annotations

import argparse

# name -> what it measures (`kvstore bench --help`); every module here with a main() is listed.
BENCHMARKS = {
    "transfer": "Transfer Engine shm/tcp/UCX vs memcpy, loopback sockets, Mooncake Transfer Engine",
    "transfer_ucx": "the Transfer Engine over UCX vs raw UCX and ucx_perftest (transfer's UCX records alone)",
    "metadata": "index publishing, mirror snapshot load, convergence, match() latency, bytes per block (etcd)",
    "scale": "the index as the fleet grows: publish rate and lag over 1/2/4 etcd shards, mirror loads, host lookups and memory",
    "store": "store puts/gets over shm/tcp/NVMe vs Mooncake Store, Redis, dd, and the machine's limits",
    "codec": "lz4 block codec: ratio, per-core speed, NVMe tier capacity and reads, a throttled 1 Gbit/s link",
    "restart": "a rolling restart of daemons with persistent NVMe tiers: hit ratio before/after, wrong/lost blocks",
    "faults": "wrong bytes, lost blocks, late calls and recovery under injected faults (kill -9, SIGSTOP, etcd)",
    "soak": "N minutes of mixed puts/gets/removes at ~70% of capacity: RSS, fds, threads and p99 over time",
    "conductor": "routing policies on the Mooncake trace (simulated), textbook sweeps, live route() latency",
    "gateway": "the gateway's own cost in front of instant stand-in engines (tokenizing on threads vs the loop)",
    "vllm_ttft": "TTFT on real vLLM: no connector vs vLLM's ExampleConnector and OffloadingConnector vs ours, first sight, warm and from a second engine",
    "kv_copy": "a step's KV through the vLLM connector's batched copy path vs a plain copy (CPU, or CUDA)",
    "serving": "the gateway vs vllm-router vs round-robin over real `vllm serve` engines, P/D and colocated",
    "fleet": "routers side by side over 12 stand-in vLLM engines (simulated H100s, real HTTP, events, store)",
    "tenant_timing": "can a tenant tell from its TTFT that another sent a prefix? ROC AUC, salts bound to keys or not",
}


def add_parser(commands) -> argparse.ArgumentParser:
    """`kvstore bench NAME [ARGS...]` on `commands` (an argparse subparsers object)."""
    width = max(map(len, BENCHMARKS))
    bench = commands.add_parser(
        "bench", help="run a benchmark (same as python -m benchmarks.NAME)",
        description="Run a benchmark; ARGS go to it (e.g. --quick, --json PATH; `kvstore bench NAME --help`).",
        epilog="benchmarks:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("what", metavar="NAME", choices=list(BENCHMARKS), help=", ".join(BENCHMARKS))
    bench.add_argument("rest", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    return bench


def run(args: argparse.Namespace) -> int:
    """Run `args.what`'s main(args.rest); no child process of it outlives the run."""
    import importlib

    from kvstore_testing.processes import run_main

    module = importlib.import_module(f"benchmarks.{args.what}")
    return run_main(module.main, list(args.rest), prog=f"kvstore bench {args.what}")
