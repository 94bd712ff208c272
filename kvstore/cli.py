"""`kvstore` command line: composes the transfer engine, store and conductor for people."""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="run a store daemon")
    serve.add_argument("--node", required=True, help="node name, unique in the cluster")
    serve.add_argument("--metadata", default="memory://default", help="etcd://host:port or memory://name")
    serve.add_argument("--cluster", default="default")
    serve.add_argument("--listen", default="127.0.0.1:0", help="control (gRPC) address")
    serve.add_argument("--engine-listen", default="127.0.0.1:0", help="Transfer Engine address")
    serve.add_argument("--wire-port", type=int, default=0,
                       help="TCP port of the framed control wire, on the --listen host (0: any free port; "
                            "-1: none, clients on other hosts use gRPC); never opened with --tls-cert")
    serve.add_argument("--dram", default="1GiB", help="DRAM tier capacity")
    serve.add_argument("--disk-dir", help="NVMe tier directory (no NVMe tier without it)")
    serve.add_argument("--disk", default="4GiB", help="NVMe tier capacity")
    serve.add_argument("--secret-file", help="cluster secret file (or set KVSTORE_SECRET); created (0600) with a "
                       "fresh secret if missing; default ~/.kvstore/<cluster>.secret")
    serve.add_argument("--insecure", action="store_true",
                       help="no cluster secret: anyone who reaches this node may read and write its memory")
    serve.add_argument("--replicas", type=int, default=1, help="default replicas for clients of this cluster")
    serve.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
    serve.add_argument("--high-watermark", type=float, default=0.95)
    serve.add_argument("--low-watermark", type=float, default=0.85)
    serve.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = any free port)")
    serve.add_argument("--lease-ttl", type=int, default=10, help="seconds a dead daemon's blocks stay listed")
    serve.add_argument("--timeout", type=float, default=5.0, help="timeout of every remote call")
    serve.add_argument("--publish-window-ms", type=float, default=10.0,
                       help="under a stream of puts, index publish batches start up to this far apart "
                       "(2 ms per update of the previous batch; a lone put goes at once)")
    serve.add_argument("--no-promote", action="store_true", help="leave NVMe blocks on NVMe when they are hit")
    serve.add_argument("--admin-token-file", help="admin bearer token for mutating admin calls (or KVSTORE_ADMIN_TOKEN)")
    serve.add_argument("--tls-cert", help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    serve.add_argument("--tls-key", help="PEM private key")
    serve.add_argument("--tls-ca", help="PEM roots for this node's own calls to other nodes (drain moves)")


def read_secret(path: str | None) -> str | None:
    if path:
        with open(path) as f:
            return f.read().strip()
    return os.environ.get("KVSTORE_SECRET") or None


def ensure_secret(path: str | None, cluster: str) -> tuple[str, str]:
    """(secret, where it came from): KVSTORE_SECRET, else the secret file, created 0600 with a fresh
    random secret when it does not exist yet (other nodes of the cluster are given the same file)."""
    if not path and os.environ.get("KVSTORE_SECRET"):
        return os.environ["KVSTORE_SECRET"], "KVSTORE_SECRET"
    from .access import secret_path

    path = path or secret_path(cluster)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = read_secret(path) or ""
        if not secret:
            raise ValueError(f"secret file {path} is empty")
        return secret, path
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        return ensure_secret(path, cluster)
    import secrets

    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    print(f"kvstore serve: generated a cluster secret in {path} (mode 0600); give it to clients and other "
          "nodes of this cluster", file=sys.stderr)
    return secret, path


def read_token(path: str | None) -> str | None:
    if path:
        with open(path) as f:
            return f.read().strip()
    return os.environ.get("KVSTORE_ADMIN_TOKEN") or None


def run_serve(args: argparse.Namespace) -> int:
    from transfer import TransferError

    from .daemon import Daemon, DaemonConfig
    from .errors import KVStoreError
    from .library import parse_size

    secret = None
    if not args.insecure:
        try:
            secret, _ = ensure_secret(args.secret_file, args.cluster)
        except (OSError, ValueError) as exc:
            print(f"kvstore serve: no cluster secret: {exc} (or pass --insecure)", file=sys.stderr)
            return 1
    if not 0 <= args.publish_window_ms <= 1000:  # also refuses nan
        print("kvstore serve: --publish-window-ms must be within 0..1000", file=sys.stderr)
        return 2
    if not -1 <= args.wire_port <= 65535:
        print("kvstore serve: --wire-port must be within -1..65535", file=sys.stderr)
        return 2
    config = DaemonConfig(node=args.node, metadata=args.metadata, cluster=args.cluster, listen=args.listen,
                          engine_listen=args.engine_listen, wire_port=None if args.wire_port < 0 else args.wire_port, dram_bytes=parse_size(args.dram), disk_dir=args.disk_dir,
                          disk_bytes=parse_size(args.disk) if args.disk_dir else 0, secret=secret,
                          insecure=args.insecure,
                          replicas=args.replicas, eviction=args.eviction, high_watermark=args.high_watermark,
                          low_watermark=args.low_watermark, metrics_port=args.metrics_port, lease_ttl=args.lease_ttl,
                          timeout=args.timeout, promote=not args.no_promote,
                          publish_window=args.publish_window_ms / 1000,
                          admin_token=read_token(args.admin_token_file), tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    try:
        daemon = Daemon(config).start()
    except (KVStoreError, TransferError, OSError, ValueError) as exc:
        print(f"kvstore serve: cannot start {config.node}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    daemon.enable_reflection()
    daemon.serve()
    print(json.dumps({"node": config.node, "control": daemon.address, "metrics_port": daemon.metrics_port,
                      "engine": daemon.engine.export().to_json()}), flush=True)
    daemon.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description="KV-cache store and transfer engine")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the quick-start demo on the embedded default")
    demo.add_argument("what", nargs="?", default="vllm", choices=["vllm", "transfer"],
                      help="vllm (default): the connector on real vLLM; transfer: the Transfer Engine alone")
    demo.add_argument("--verbose", action="store_true", help="keep vLLM's own logging (errors only otherwise)")
    add_serve(commands)
    from .admin.cli import add_parser as add_admin

    add_admin(commands)
    from benchmarks import add_parser as add_bench

    add_bench(commands)  # every benchmark module: kvstore bench NAME [ARGS]
    args = parser.parse_args(argv)

    if args.command == "demo":
        if args.what == "transfer":
            from transfer.demo import run

            return run()
        from .integrations.vllm.demo import run as run_vllm

        return run_vllm(verbose=args.verbose)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "admin":
        from .admin.cli import run as run_admin

        return run_admin(args)
    if args.command == "bench":
        from benchmarks import run as run_bench

        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
