"""`conductor serve`: the live router behind an HTTP/JSON front (see conductor/server.py).

Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad arguments (one line on stderr), 5 the metadata
service cannot be reached, 1 anything else."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from kvstore.cli_args import Parser, alias, fail, host_port, metadata_url, positive_int

PROG = "conductor serve"


def policy_name(value: str) -> str:
    """A routing policy's name, checked here so that a typo is one line (exit 2), not a traceback."""
    from .cost import CostModel
    from .policies import POLICIES, make_policy

    try:
        make_policy(value, CostModel())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (one of {', '.join(sorted(POLICIES))}, optionally with "
                                         "parameters, e.g. affinity(stay_ms=500), and +sticky)") from None
    return value


def build_parser() -> Parser:
    parser = Parser(prog="conductor", description="cache- and load-aware request router")
    parser.add_version()
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="route requests over HTTP",
                                description="Route requests: the OpenAI gateway in front of vllm serve engines "
                                            "(--decode URL ...), or POST /route answers (--metadata and --fingerprint).")
    serve.add_version()
    serve.add_argument("--metadata", type=metadata_url, metavar="URL",
                       help="etcd://host:port[,host:port...] or memory://name (required without engines)")
    serve.add_argument("--cluster", default=None, metavar="NAME", help="kvstore cluster name")
    serve.add_argument("--fingerprint", metavar="JSON", help="model fingerprint JSON (kvstore.ModelFingerprint fields)")
    serve.add_argument("--policy", default=None, type=policy_name, metavar="NAME",
                       help="cache_global, cache_local, least_loaded, round_robin; +sticky keeps sessions on one "
                            "engine (default: cache_global for /route, cache_global+sticky for the gateway)")
    serve.add_argument("--listen", default="127.0.0.1:0", type=host_port, metavar="HOST:PORT", help="HTTP address")
    serve.add_argument("--block-tokens", type=positive_int, default=None, metavar="N",
                       help="tokens per KV block (default: the fingerprint's block size)")
    from .gateway.serve import add_arguments

    add_arguments(serve)
    from dataclasses import fields

    from .gateway.config import GatewayConfig

    defaults = {f.name: f.default for f in fields(GatewayConfig)}
    for action in serve._actions:  # the gateway's flags default to its config file, else GatewayConfig's
        default = defaults.get(action.dest)
        if action.default is None and action.help and "(default" not in action.help \
                and isinstance(default, (str, int, float)) and default not in ("", None):
            action.help += f" (default: {default})"
    alias(serve, "--ttft-slo-ms", dest="slo_ttft_ms", type=float)  # the spelling of `python -m conductor.sim` before
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefill is not None or args.decode is not None or args.config:
        from .gateway.serve import config_from, serve_gateway

        try:
            config_from(args)  # the settings checked before anything starts
        except (OSError, ValueError, TypeError) as exc:
            fail(PROG, f"{type(exc).__name__}: {exc}" if isinstance(exc, TypeError) else str(exc))
        from kvstore.errors import MetadataUnavailable

        try:
            return serve_gateway(args)  # the OpenAI gateway in front of vllm serve engines
        except MetadataUnavailable as exc:  # its index mirror could not start: one line, as below
            fail(PROG, f"cannot reach the metadata service {args.metadata}: {exc}", 5)
    if not args.metadata or not args.fingerprint:
        fail(PROG, "serve needs --decode engine URLs (the gateway), or --metadata and --fingerprint (POST /route)")

    from kvstore.errors import KVStoreError
    from kvstore.index import open_mirror
    from kvstore.keys import ModelFingerprint

    from .router import Conductor
    from .server import make_server

    try:
        fingerprint = ModelFingerprint(**json.loads(args.fingerprint))
    except (ValueError, TypeError, KVStoreError) as exc:
        fail(PROG, f"--fingerprint: {exc} (a JSON object of kvstore.ModelFingerprint fields: model_id, dtype, "
                   "block_size, num_layers, num_kv_heads, head_size, ...)")
    mirror_log = logging.getLogger("kvstore.index")
    level = mirror_log.level
    mirror_log.setLevel(logging.ERROR)  # its retries while starting: the one line below says it if they fail
    try:
        mirror = open_mirror(args.metadata, args.cluster or "default").start()
    except KVStoreError as exc:
        fail(PROG, f"cannot reach the metadata service {args.metadata}: {exc}", 5)
    finally:
        mirror_log.setLevel(level)
    conductor = Conductor(mirror, fingerprint, policy=args.policy or "cache_global",
                          block_tokens=args.block_tokens or fingerprint.block_size,
                          local_prefill_tokens=args.local_prefill_tokens or 0,
                          overflow_kv_share=args.overflow_kv_share or 0.0)
    host, _, port = args.listen.rpartition(":")
    server = make_server(conductor, host, int(port), fingerprint)
    print(json.dumps({"listen": f"{host}:{server.server_address[1]}"}), flush=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    mirror.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
