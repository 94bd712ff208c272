"""python -m conductor.sim.engine --engines 12 --base-port 8100 --profile h100-llama3-8b --time-scale 2

Runs stand-in vLLM engines in this process until SIGTERM/SIGINT, and prints one JSON line once
they serve: their URLs, roles and KV-event endpoints, the store fingerprint, the control URL.
Exit codes: 0 stopped by a signal, 2 bad arguments (one line), 5 the store cannot be reached."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from kvstore.cli_args import Parser, fail, metadata_url

from .engine import Faults, parse_fault
from .fleet import FleetConfig, StandinFleet
from .profile import PROFILES

PROG = "python -m conductor.sim.engine"
FAULTS_HELP = ("slow:ENGINE:FACTOR (steps FACTOR times slower), error:ENGINE:RATE (that share of generation "
               "requests answered 500), cut:ENGINE:RATE (that share of streams cut after the first token), "
               "down:ENGINE:AT[:FOR] (dies at simulated second AT, comes back empty after FOR seconds; "
               "never without FOR), drop:ENGINE:AT:FOR (its KV-event batches from AT for FOR seconds are lost "
               "on the wire; numbered and kept for replay all the same); repeatable")


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="stand-in vLLM engines (simulated GPU, real HTTP, KV events and store)")
    p.add_version()
    p.add_argument("--engines", type=int, default=4, help="engines in this process")
    p.add_argument("--base-port", type=int, default=0, help="engine i listens on BASE+i (0: free ports)")
    p.add_argument("--host", default="127.0.0.1", help="address the engines listen on")
    p.add_argument("--profile", default="h100-llama3-8b", help=f"cost model: {', '.join(PROFILES)}")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per simulated second (2: twice slower than real time)")
    p.add_argument("--prefill", type=int, default=0,
                   help="the first N engines are P/D prefill engines (kv_producer), the rest decode (kv_consumer); "
                        "0: all colocated (kv_both)")
    p.add_argument("--metadata", type=metadata_url, default=None,
                   help="etcd://HOST:PORT of a kvstore cluster: the engines share its pool (none: engine-local only)")
    p.add_argument("--cluster", default="default", help="kvstore cluster name")
    p.add_argument("--secret-file", default=None, help="the cluster secret (else KVSTORE_SECRET or ~/.kvstore)")
    p.add_argument("--bytes-scale", type=int, default=16384,
                   help="stored blocks are the profile's block bytes divided by this")
    p.add_argument("--kv-events-port", type=int, default=None,
                   help="publish vLLM KV events: engine i on tcp://*:PORT+i, its replay socket on PORT+ENGINES+i "
                        "(0: free ports, listed in the fleet's first output line)")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk (vLLM's --stream-interval)")
    p.add_argument("--model-dir", default=None, help="a model directory whose tokenizer the engines use")
    p.add_argument("--enable-scale-out", action="store_true",
                   help="answer the /render endpoints (vllm serve --enable-scale-out)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC", help=FAULTS_HELP)
    p.add_argument("--control-port", type=int, default=0, help="GET /fleet/stats here (0: a free port)")
    p.add_argument("--block-size", type=int, default=None, help="override the profile's block size")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override the profile's KV capacity (blocks)")
    p.add_argument("--seed", type=int, default=0)
    return p


def config_from(args) -> FleetConfig:
    faults: dict[int, Faults] = {}
    for spec in args.fault:
        parse_fault(spec, faults)
    if not 0 <= args.prefill < args.engines:
        raise ValueError(f"--prefill must be between 0 and {args.engines - 1} (decode engines are needed too)")
    roles = ["kv_producer"] * args.prefill + ["kv_consumer"] * (args.engines - args.prefill) if args.prefill else []
    secret = None
    if args.secret_file:
        with open(args.secret_file) as f:
            secret = f.read().strip()
    overrides = {}
    if args.block_size is not None:
        if args.block_size < 1:
            raise ValueError("--block-size must be at least 1")
        overrides["block_size"] = args.block_size
    if args.num_gpu_blocks is not None:
        if args.num_gpu_blocks < 1:
            raise ValueError("--num-gpu-blocks must be at least 1")
        overrides["num_gpu_blocks"] = args.num_gpu_blocks
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be at least 1")
    return FleetConfig(engines=args.engines, profile=args.profile, time_scale=args.time_scale, host=args.host,
                       base_port=args.base_port, roles=roles, metadata=args.metadata, cluster=args.cluster,
                       secret=secret, bytes_scale=args.bytes_scale, kv_events_base_port=args.kv_events_port,
                       stream_interval=args.stream_interval, model_dir=args.model_dir,
                       enable_scale_out=args.enable_scale_out, faults=faults, control_port=args.control_port,
                       seed=args.seed, overrides=overrides).validate()


async def _serve(config: FleetConfig) -> None:
    from kvstore.errors import KVStoreError

    fleet = StandinFleet(config)
    try:
        await fleet.start()
    except KVStoreError as exc:
        await fleet.stop()
        fail(PROG, f"cannot reach the store at {config.metadata}: {exc}", 5)
    except OSError as exc:
        await fleet.stop()
        fail(PROG, f"cannot listen: {exc}")
    print(json.dumps(fleet.describe()), flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await fleet.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from(args)
    except (OSError, ValueError) as exc:
        fail(PROG, str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
