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
    serve.add_argument("--metadata", required=True, help="etcd://host:port or memory://name")
    serve.add_argument("--cluster", default="default")
    serve.add_argument("--fingerprint", required=True, help="model fingerprint JSON (kvstore.ModelFingerprint fields)")
    serve.add_argument("--policy", default="cache_global")
    serve.add_argument("--listen", default="127.0.0.1:0")
    serve.add_argument("--block-tokens", type=int, default=None, help="default: the fingerprint's block size")
    args = parser.parse_args(argv)

    from kvstore.index import IndexMirror
    from kvstore.keys import ModelFingerprint

    from .router import Conductor
    from .server import make_server

    fingerprint = ModelFingerprint(**json.loads(args.fingerprint))
    mirror = IndexMirror(args.metadata, args.cluster).start()
    conductor = Conductor(mirror, fingerprint, policy=args.policy,
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
