"""`kvstore` command line: composes the transfer engine, store and conductor for people."""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import ModuleType

from .cli_args import (Parser, alias, fail, fraction, host_port, metadata_url, number, port, positive_float,
                       positive_int, readable_file, replica_count, size, timeout_seconds)


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_serve(commands) -> None:
    serve = commands.add_parser(
        "serve", help="run a store daemon",
        description="Run a store daemon. Every flag may also come from a --config TOML file (keys = the long "
                    "flag names without --, e.g. disk-dir = \"/mnt/nvme\"; a .json file: the same keys as JSON); "
                    "flags given here override it.")
    serve.add_version()
    serve.add_argument("--config", metavar="PATH",
                       help="TOML (or .json) file of flag values; flags given here override it")
    serve.add_argument("--node", required=True, type=node_name, metavar="NAME", help="node name, unique in the cluster")
    serve.add_argument("--metadata", default="memory://default", type=metadata_url, metavar="URL",
                       help="etcd://host:port[,host:port...] (the members of an etcd cluster: fails over), "
                       "etcd+tls://host:port[,...]?ca=...&cert=...&key=... or memory://name; several etcd "
                       "clusters separated by ';' shard the block index over them")
    serve.add_argument("--cluster", default="default", type=cluster_name, metavar="NAME", help="cluster name (key prefix in etcd)")
    serve.add_argument("--listen", default="127.0.0.1:0", type=host_port, metavar="HOST:PORT", help="admin API (gRPC) address, HOST:PORT; the TCP control wire listens on its host")
    serve.add_argument("--engine-listen", default="127.0.0.1:0", type=host_port, metavar="HOST:PORT", help="Transfer Engine address")
    serve.add_argument("--wire-port", type=number(int, -1, 65535, what="a port in [-1, 65535]"), default=0, metavar="PORT",
                       help="TCP port of the framed control wire, the store operations' protocol, on the --listen "
                            "host (0: any free port; -1: none, only clients on this host use the node); TLS with "
                            "--tls-cert")
    serve.add_argument("--dram", default="1GiB", type=size, metavar="SIZE", help="DRAM tier capacity (e.g. 512MiB, 16GiB)")
    serve.add_argument("--disk-dir", metavar="PATH", help="NVMe tier directory (no NVMe tier without it)")
    serve.add_argument("--disk-size", default="4GiB", type=size, metavar="SIZE",
                       help="NVMe tier capacity (with --disk-dir)")
    alias(serve, "--disk", dest="disk_size", type=size)
    serve.add_argument("--keep-disk", action="store_true",
                       help="a persistent NVMe tier: its file and journal stay when the daemon ends (a stop or a "
                            "crash), and a daemon started again with the same --disk-dir, --node, --cluster and "
                            "--disk-size serves their blocks again, each verified first (by default the tier goes "
                            "with the daemon, even after a crash)")
    serve.add_argument("--persist-on-stop", action="store_true",
                       help="on SIGTERM, first demote DRAM blocks to the NVMe tier (most recently used first, "
                            "within --persist-timeout), so that a --keep-disk tier serves them after a restart")
    serve.add_argument("--persist-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                       help="how long --persist-on-stop may take before the daemon stops anyway")
    serve.add_argument("--disk-codec", default="none", choices=["none", "lz4"],
                       help="code NVMe blocks (lz4 over byte planes, in the background after demotion; a block "
                            "gaining under 5%% stays raw): more blocks on the same disk for some CPU. bf16 KV "
                            "gains about 1.2x; fp16 and fp8 KV usually nothing (leave it off)")
    serve.add_argument("--secret-file", metavar="PATH",
                       help="cluster secret file (or set KVSTORE_SECRET); created (0600) with a fresh secret if "
                            "missing; default ~/.kvstore/<cluster>.secret")
    serve.add_argument("--insecure", action="store_true",
                       help="no cluster secret: anyone who reaches this node may read and write its memory (and, "
                            "without --admin-token-file, drain or evict it)")
    serve.add_argument("--tenants", metavar="PATH",
                       help="tenants file (0600): one 'NAME SECRET [capacity=SHARE] [connections=N]' per line, "
                            "each secret 16+ bytes of its own; a client given tenant=NAME and that secret may "
                            "write, reserve and look up only fingerprints of tenant NAME (digests 'NAME:...'); "
                            "capacity=25%%: a share of each tier no other tenant's blocks evict it below; "
                            "connections=N: its control-wire connections per socket (default: an equal share); "
                            "the cluster secret stays the operator's, trusted with everything")
    serve.add_argument("--replicas", type=replica_count, default=1, metavar="N",
                       help="default replicas for clients of this cluster (at most one per live node)")
    serve.add_argument("--eviction", default="lru", choices=["lru", "lfu"], help="eviction policy")
    serve.add_argument("--high-watermark", type=fraction, default=0.95, metavar="FRACTION",
                       help="a tier this full evicts down to --low-watermark")
    alias(serve, "--high", dest="high_watermark", type=fraction)
    serve.add_argument("--low-watermark", type=fraction, default=0.85, metavar="FRACTION", help="where eviction stops")
    alias(serve, "--low", dest="low_watermark", type=fraction)
    serve.add_argument("--metrics-port", type=port, metavar="PORT", help="Prometheus /metrics port (0: any free port; none without it)")
    serve.add_argument("--metrics-listen", default="127.0.0.1", metavar="HOST",
                       help="address /metrics listens on (0.0.0.0: every interface; it has no authentication and "
                            "serves only counters)")
    serve.add_argument("--lease-ttl", type=positive_int, default=10, metavar="SECONDS", help="seconds a dead daemon's blocks stay listed")
    serve.add_argument("--timeout", type=timeout_seconds, default=5.0, metavar="SECONDS",
                       help="timeout (seconds) of every remote call")
    serve.add_argument("--publish-window-ms", type=number(float, 0, 1000), default=10.0, metavar="MS",
                       help="under a stream of puts, index publish batches start up to this far apart "
                       "(2 ms per update of the previous batch; a lone put goes at once)")
    serve.add_argument("--no-promote", action="store_true", help="leave NVMe blocks on NVMe when they are hit")
    serve.add_argument("--admin-token-file", metavar="PATH",
                       help="bearer token that drain, evict and policy calls must carry (or KVSTORE_ADMIN_TOKEN); "
                            "created (0600) with a fresh token if missing; default ~/.kvstore/<cluster>.admin-token "
                            "(none with --insecure: those calls are then open)")
    alias(serve, "--token-file", dest="admin_token_file")
    serve.add_argument("--tls-cert", type=readable_file, metavar="PEM",
                       help="certificate: serve gRPC and the TCP control wire over TLS (with --tls-key)")
    serve.add_argument("--tls-key", type=readable_file, metavar="PEM", help="private key of --tls-cert")
    serve.add_argument("--tls-ca", type=readable_file, metavar="PEM",
                       help="roots for this node's own calls to other nodes (drain moves, repair)")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                       help="log lines on stderr: drain start and end, evictions (summed every 10 s), nodes joining "
                            "and leaving, replica repair, index publish failures and recovery, lease loss")


def node_name(text: str) -> str:
    from .index.records import check_name

    try:
        return check_name("node", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cluster_name(text: str) -> str:
    from .index.records import check_name

    try:
        return check_name("cluster", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- the config file ------------------------------------------------------------------------------

def config_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """`kvstore serve --config PATH`: the file's values as command-line arguments (put before the
    ones given, which therefore win). TOML (a .json file: JSON, as `conductor serve --config`
    takes), keys = long flag names without the dashes."""
    prog = parser.prog
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        fail(prog, f"--config: cannot read {path}: {exc.strerror or exc}")
    if path.endswith(".json"):
        try:
            values = json.loads(raw)
        except ValueError as exc:
            fail(prog, f"--config: {path} is not JSON: {exc}")
        if not isinstance(values, dict):
            fail(prog, f"--config: {path} must hold a JSON object of flag names and values")
    else:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ImportError:
                fail(prog, f"--config: reading TOML needs Python 3.11 or the tomli package (pip install tomli), "
                           f"or give the same keys as a .json file; this is Python {sys.version.split()[0]}")
        try:
            values = tomllib.loads(raw.decode("utf-8", "replace"))
        except tomllib.TOMLDecodeError as exc:
            fail(prog, f"--config: {path} is not TOML: {exc}")
    flags = {opt: action for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        action = flags.get(flag)
        if action is None or flag in ("--config", "--help", "--version"):
            known = sorted(f[2:] for f, a in flags.items() if a.help is not argparse.SUPPRESS
                           and f not in ("--config", "--help", "--version"))
            fail(prog, f"--config: unknown key {key!r} in {path} (known: {', '.join(known)})")
        if action.nargs == 0:  # --insecure, --no-promote
            if not isinstance(value, bool):
                fail(prog, f"--config: {key} in {path} must be true or false")
            argv += [flag] if value else []
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            fail(prog, f"--config: {key} in {path} must be a string or a number, not {type(value).__name__}")
        text = str(value)
        try:
            if action.type is not None:
                action.type(text)
        except argparse.ArgumentTypeError as exc:
            fail(prog, f"--config: {key} in {path}: {exc}")
        if action.choices is not None and text not in action.choices:
            fail(prog, f"--config: {key} in {path} must be one of {', '.join(map(str, action.choices))}")
        argv += [flag, text]
    return argv


def _with_config(argv: list[str], parser: argparse.ArgumentParser, serve: argparse.ArgumentParser) -> list[str]:
    """argv with the values of `serve --config PATH` put in front of the serve flags."""
    if not argv or argv[0] != "serve":
        return argv
    rest = argv[1:]
    path = None
    for i, arg in enumerate(rest):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(rest):
            path = rest[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    if path is None:
        return argv
    return ["serve", *config_argv(serve, path), *rest]


# --- secrets and tokens ---------------------------------------------------------------------------

def ensure_secret(path: str | None, cluster: str) -> tuple[str, str]:
    """(secret, where it came from): KVSTORE_SECRET, else the secret file, created 0600 with a fresh
    random secret when it does not exist yet (other nodes of the cluster are given the same file)."""
    if not path and os.environ.get("KVSTORE_SECRET"):
        return os.environ["KVSTORE_SECRET"], "KVSTORE_SECRET"
    from .access import ensure_private_file, secret_path

    path = path or secret_path(cluster)
    secret, _ = ensure_private_file(path, "a cluster secret",
                                    "give it to clients and other nodes of this cluster")
    return secret, path


def secured_nodes(url: str, cluster: str, timeout: float) -> list[str]:
    """The cluster's live nodes that require a cluster secret ([] for an in-process memory:// index,
    or when the metadata service cannot be asked now: the daemon's own start says so then)."""
    if url.startswith("memory:"):
        return []
    import asyncio

    from .errors import KVStoreError
    from .index.records import Layout, NodeRecord
    from .metadata import open_metadata, shard_urls

    async def read() -> list[str]:
        metadata = open_metadata(shard_urls(url)[0], timeout=timeout)  # every shard lists the nodes
        try:
            items, _ = await asyncio.wait_for(metadata.range(f"{Layout(cluster).root}nodes/"), timeout)
        finally:
            await metadata.close()
        records = [NodeRecord.decode(item.value) for item in items]
        return sorted(r.name for r in records if r.secured)

    try:
        return asyncio.run(read())
    except (KVStoreError, OSError, ValueError, asyncio.TimeoutError):
        return []


def ensure_admin_token(path: str | None, cluster: str, insecure: bool) -> str | None:
    """The admin bearer token: --admin-token-file (created 0600 with a fresh token if missing, as
    the cluster secret is), else KVSTORE_ADMIN_TOKEN, else ~/.kvstore/<cluster>.admin-token (the
    same), except with --insecure, where no token means mutating admin calls are open."""
    how = "give it to kvstore admin with --admin-token-file"
    if not path:
        if os.environ.get("KVSTORE_ADMIN_TOKEN"):
            return os.environ["KVSTORE_ADMIN_TOKEN"]
        if insecure:
            return None
        from .access import admin_token_path

        path = admin_token_path(cluster)
        how = "kvstore admin run by this user on this host finds it; elsewhere give it with --admin-token-file"
    from .access import ensure_private_file

    token, _ = ensure_private_file(path, "an admin token", how)
    return token


def configure_logging(level: str, node: str) -> None:
    """Log lines on stderr: ours (kvstore.*, transfer.*) at `level`, other libraries' warnings."""
    import logging

    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s {node} %(name)s: %(message)s")
    for name in ("kvstore", "transfer"):
        logging.getLogger(name).setLevel(level.upper())


def run_serve(args: argparse.Namespace) -> int:
    from transfer import TransferError

    from .daemon import Daemon, DaemonConfig
    from .daemon.host_room import check_dram
    from .errors import InvalidConfig, KVStoreError
    from .sizes import parse_size

    prog = "kvstore serve"
    if args.low_watermark > args.high_watermark:
        fail(prog, f"--low-watermark {args.low_watermark} is above --high-watermark {args.high_watermark}")
    if bool(args.tls_cert) != bool(args.tls_key):
        fail(prog, "--tls-cert and --tls-key go together")
    try:
        check_dram(parse_size(args.dram))  # before any file is made: a bad flag leaves nothing behind
    except InvalidConfig as exc:
        fail(prog, str(exc))
    for flag, given in (("--keep-disk", args.keep_disk), ("--persist-on-stop", args.persist_on_stop),
                        ("--disk-codec", args.disk_codec != "none")):
        if given and not args.disk_dir:
            fail(prog, f"{flag} needs an NVMe tier: give --disk-dir too")
    configure_logging(args.log_level, args.node)
    from .access import load_tenants
    from .errors import InsecureFile

    tenants = None  # checked first: a bad file leaves nothing generated behind
    if args.tenants:
        if args.insecure:
            fail(prog, "--tenants needs a cluster secret: drop --insecure (on an open node anyone is anyone)")
        try:
            tenants = load_tenants(args.tenants)
        except (OSError, ValueError) as exc:
            fail(prog, f"--tenants: {getattr(exc, 'strerror', None) or exc}"
                       f"{f' ({exc.filename})' if getattr(exc, 'filename', None) else ''}")
    secret = None
    if not args.insecure:
        from .access import secret_path

        path = args.secret_file or (None if os.environ.get("KVSTORE_SECRET") else secret_path(args.cluster))
        if path and not os.path.exists(path) and (holders := secured_nodes(args.metadata, args.cluster, args.timeout)):
            fail(prog, f"--secret-file: {path} does not exist, and cluster {args.cluster!r} already has nodes with "
                       f"a secret ({', '.join(holders[:5])}{', ...' if len(holders) > 5 else ''}): give this node "
                       "their secret file (a fresh secret would split the cluster)")
        try:
            secret, _ = ensure_secret(args.secret_file, args.cluster)
        except InsecureFile as exc:
            fail(prog, f"--secret-file: {exc}")
        except (OSError, ValueError) as exc:
            fail(prog, f"--secret-file: no cluster secret: {getattr(exc, 'strerror', None) or exc}"
                       f"{f' ({exc.filename})' if getattr(exc, 'filename', None) else ''} (or pass --insecure)")
    try:
        admin_token = ensure_admin_token(args.admin_token_file, args.cluster, args.insecure)
    except (OSError, ValueError) as exc:
        fail(prog, f"--admin-token-file: {getattr(exc, 'strerror', None) or exc}"
                   f"{f' ({exc.filename})' if getattr(exc, 'filename', None) else ''}")
    config = DaemonConfig(node=args.node, metadata=args.metadata, cluster=args.cluster, listen=args.listen,
                          engine_listen=args.engine_listen, wire_port=None if args.wire_port < 0 else args.wire_port,
                          dram_bytes=parse_size(args.dram), disk_dir=args.disk_dir,
                          disk_bytes=parse_size(args.disk_size) if args.disk_dir else 0, keep_disk=args.keep_disk,
                          persist_on_stop=args.persist_on_stop, persist_timeout=args.persist_timeout,
                          disk_codec=None if args.disk_codec == "none" else args.disk_codec,
                          secret=secret,
                          insecure=args.insecure, tenants=tenants,
                          replicas=args.replicas, eviction=args.eviction, high_watermark=args.high_watermark,
                          low_watermark=args.low_watermark, metrics_port=args.metrics_port,
                          metrics_listen=args.metrics_listen, lease_ttl=args.lease_ttl,
                          timeout=args.timeout, promote=not args.no_promote,
                          publish_window=args.publish_window_ms / 1000,
                          admin_token=admin_token, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    try:
        daemon = Daemon(config).start()
    except KeyboardInterrupt:  # Ctrl-C while the arena's pages were being filled, say
        print(f"kvstore serve: {config.node} interrupted while starting", file=sys.stderr)
        return 130
    except (KVStoreError, TransferError, OSError, ValueError, RuntimeError) as exc:  # RuntimeError: gRPC's bind
        print(f"kvstore serve: cannot start {config.node}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    daemon.enable_reflection()
    daemon.serve()
    import logging

    from .daemon.startup import startup_line

    logging.getLogger("kvstore.serve").info("%s", startup_line(config, daemon))
    print(json.dumps({"node": config.node, "control": daemon.address, "metrics_port": daemon.metrics_port,
                      "engine": daemon.engine.export().to_json()}), flush=True)
    daemon.wait()
    return 0


def build_parser() -> Parser:
    parser = Parser(prog="kvstore", description="KV-cache store and transfer engine")
    parser.add_version()
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the quick-start demo on the embedded default")
    demo.add_argument("what", nargs="?", default="vllm", choices=["vllm", "transfer"],
                      help="vllm (default): the connector on real vLLM; transfer: the Transfer Engine alone")
    demo.add_argument("--verbose", action="store_true", help="keep vLLM's own logging (errors only otherwise)")
    add_serve(commands)
    from .admin.cli import add_parser as add_admin

    add_admin(commands)
    benchmarks = checkout_benchmarks()
    if benchmarks is not None:
        benchmarks.add_parser(commands)  # every benchmark module: kvstore bench NAME [ARGS]
    else:
        bench = commands.add_parser("bench", help="run a benchmark (from a source checkout of kvstore)")
        bench.add_argument("rest", metavar="ARGS", nargs=argparse.REMAINDER, help="the benchmark and its arguments")
    return parser


def checkout_benchmarks() -> ModuleType | None:
    """The `benchmarks` package of the source checkout this kvstore runs from, or None from an
    installed wheel: benchmarks and their test scaffolding (kvstore_testing) live in the checkout
    only. From a checkout installed editable, its root goes at the end of sys.path (shadowing
    nothing installed) so `kvstore bench` imports them as `python -m benchmarks.NAME` does."""
    import importlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not all(os.path.exists(os.path.join(root, part))
               for part in ("pyproject.toml", "kvstore_testing", os.path.join("benchmarks", "__init__.py"))):
        return None
    if root not in [os.path.abspath(entry or os.curdir) for entry in sys.path]:
        sys.path.append(root)
    benchmarks = importlib.import_module("benchmarks")
    # another distribution's top-level `benchmarks` ahead of the checkout's is not ours to run
    return benchmarks if os.path.dirname(os.path.abspath(benchmarks.__file__)) == os.path.join(root, "benchmarks") \
        else None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (with `serve --config PATH`'s values in front of the serve flags)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    return parser.parse_args(_with_config(argv, parser, parser.subcommand("serve")))


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command set its own handling (while starting, say)
        print("kvstore: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = parse(argv)

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
        benchmarks = checkout_benchmarks()
        if benchmarks is None:
            print("kvstore bench: the benchmarks come with a source checkout of kvstore, not with the installed "
                  "package; run it from a checkout (python -m benchmarks.NAME from its root)", file=sys.stderr)
            return 2
        return benchmarks.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
