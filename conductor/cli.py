"""`conductor serve`: the live router behind an HTTP/JSON front (see conductor/server.py)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conductor", description="cache- and load-aware request router")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="route requests over HTTP")
    serve.add_argument("--metadata", help="etcd://host:port or memory://name (required without engines)")
    serve.add_argument("--cluster", default=None)
    serve.add_argument("--fingerprint", help="model fingerprint JSON (kvstore.ModelFingerprint fields)")
    serve.add_argument("--policy", default=None, help="cache_global (default), cache_local, least_loaded, "
                       "round_robin; +sticky keeps sessions on one engine")
    serve.add_argument("--listen", default="127.0.0.1:0")
    serve.add_argument("--block-tokens", type=int, default=None, help="default: the fingerprint's block size")
    from .gateway.serve import add_arguments, serve_gateway

    add_arguments(serve)
    args = parser.parse_args(argv)
    if args.prefill is not None or args.decode is not None or args.config:
        return serve_gateway(args)  # the OpenAI gateway in front of vllm serve engines
    if not args.metadata or not args.fingerprint:
        parser.error("serve needs --decode engine URLs (the gateway), or --metadata and --fingerprint (POST /route)")

    from kvstore.index import IndexMirror
    from kvstore.keys import ModelFingerprint

    from .router import Conductor
    from .server import make_server

    fingerprint = ModelFingerprint(**json.loads(args.fingerprint))
    mirror = IndexMirror(args.metadata, args.cluster or "default").start()
    conductor = Conductor(mirror, fingerprint, policy=args.policy or "cache_global",
                          block_tokens=args.block_tokens or fingerprint.block_size)
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
