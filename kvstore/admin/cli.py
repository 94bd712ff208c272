"""`kvstore admin …`: see, query and steer a running cluster.

Finds nodes through the metadata service, calls each node's Admin API (every call with --timeout),
and prints tables (rich) or JSON (--json). The global flags (--metadata, --cluster,
--admin-token-file, --tls-ca, --json, --timeout) go before or after the subcommand.

Commands that ask every node (status, nodes, blocks, query, evict) answer from the nodes that
answer and mark the others `unreachable` with a short reason; they then exit 5.

Exit codes: 0 ok, 2 bad arguments or an unmet precondition (no --metadata), 3 not found (a node,
a model's blocks on a named node, or no node at all in the cluster), 4 not allowed (admin token),
5 unavailable or timed out (the metadata service, the node asked, or some of the nodes asked: the
answer printed is from the others), 1 anything else.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from ..cli_args import alias, fraction, number, timeout_seconds
from ..errors import InvalidConfig, KVStoreError
from ..index import open_mirror
from ..keys import ModelFingerprint, chain_hashes
from . import render
from .render import message_dict
from .v1 import admin_pb2, admin_pb2_grpc

OK, FAILED, USAGE, NOT_FOUND, NOT_ALLOWED, UNAVAILABLE = 0, 1, 2, 3, 4, 5
EXIT = {grpc.StatusCode.INVALID_ARGUMENT: USAGE, grpc.StatusCode.FAILED_PRECONDITION: USAGE,
        grpc.StatusCode.NOT_FOUND: NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED: NOT_ALLOWED,
        grpc.StatusCode.PERMISSION_DENIED: NOT_ALLOWED, grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED: UNAVAILABLE}
PROG = "kvstore admin"


class Fail(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Unreachable(Fail):
    """A node that could not be asked (down, not answering within the timeout)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} unreachable ({reason})", UNAVAILABLE)
        self.name, self.reason = name, reason


def fingerprint_arg(text: str) -> str:
    from ..keys import FINGERPRINT_DIGEST

    if not FINGERPRINT_DIGEST.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a model fingerprint digest (32 lowercase hex digits, "
                                         "behind 'TENANT:' for a tenant's)")
    return text


def hex_prefix(text: str) -> str:
    if len(text) > 32 or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a hash prefix (hex digits, at most 32)")
    return text.lower()


def _global_flags(parser: argparse.ArgumentParser, after: bool) -> None:
    """The flags every subcommand shares. Before the subcommand they carry the defaults; after it
    (after=True) they default to nothing, so that they only override what was given before."""
    hidden = {"default": argparse.SUPPRESS} if after else {}
    where = " (also before the subcommand)" if after else ""
    parser.add_argument("--metadata", metavar="URL", **hidden,
                        help=f"the cluster's etcd://HOST:PORT[,HOST:PORT...] (default: $KVSTORE_METADATA){where}")
    parser.add_argument("--cluster", metavar="NAME", **hidden,
                        help=f"cluster name (default: $KVSTORE_CLUSTER, else default){where}")
    parser.add_argument("--admin-token-file", metavar="PATH", **hidden,
                        help="admin bearer token for drain, evict, policy, blocks and query (default: $KVSTORE_ADMIN_TOKEN, "
                             f"else ~/.kvstore/<cluster>.admin-token when it exists){where}")
    alias(parser, "--token-file", dest="admin_token_file")
    parser.add_argument("--tls-ca", metavar="PEM", **hidden, help=f"CA bundle: talk TLS to the daemons{where}")
    parser.add_argument("--json", action="store_true", **hidden, help=f"machine-readable output{where}")
    parser.add_argument("--timeout", type=timeout_seconds, metavar="SECONDS",
                        **(hidden or {"default": 10.0}), help=f"timeout of every call{where}")


def add_parser(commands) -> None:
    admin = commands.add_parser(
        "admin", help="inspect and steer a running cluster",
        description="Inspect and steer a running cluster. Exit codes: 0 ok, 2 bad arguments or no --metadata, "
                    "3 not found (also: no node in the cluster), 4 admin token missing or wrong, 5 unavailable or "
                    "timed out (also when some nodes could not be asked: the answer is from the others, the rest "
                    "marked unreachable), 1 anything else.")
    admin.add_version()
    _global_flags(admin, after=False)
    sub = admin.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help_text, description=help_text)
        _global_flags(parser, after=True)
        return parser

    command("status", "cluster summary")
    command("nodes", "list nodes (each one asked: unreachable ones are marked)")
    command("tenants", "what each tenant's blocks take on each node, beside its capacity share")
    node = command("node", "one node in detail")
    node.add_argument("name", help="node name")
    blocks = command("blocks", "list blocks of a model fingerprint")
    blocks.add_argument("--fingerprint", required=True, type=fingerprint_arg, metavar="DIGEST",
                        help="model fingerprint digest (32 hex digits; TENANT:32 hex digits for a tenant's)")
    blocks.add_argument("--node", help="only this node")
    blocks.add_argument("--page-size", type=number(int, 1, 10_000), default=100, metavar="N",
                        help="blocks per node and page (at most 10000)")
    blocks.add_argument("--page-token", default="", metavar="TOKEN", help="the next page, as the last one said")
    query = command("query", "which nodes and tiers hold a prompt's leading blocks")
    query.add_argument("--fingerprint", type=fingerprint_arg, metavar="DIGEST", help="digest (with --hashes)")
    query.add_argument("--hashes", nargs="*", default=[], metavar="HEX", help="hash chain, hex")
    query.add_argument("--tokens", metavar="PATH", help="JSON file of token ids (with --model)")
    query.add_argument("--model", metavar="JSON", help="ModelFingerprint fields as JSON (with --tokens)")
    evict = command("evict", "drop a model's blocks (all nodes unless --node)")
    evict.add_argument("--fingerprint", required=True, type=fingerprint_arg, metavar="DIGEST",
                       help="model fingerprint digest (32 hex digits)")
    evict.add_argument("--prefix", default="", type=hex_prefix, help="only hashes starting with these hex digits")
    evict.add_argument("--node", help="only this node")
    drain = command("drain", "move a node's blocks elsewhere and stop its puts")
    drain.add_argument("name", help="node name")
    drain.add_argument("--mode", choices=["move", "drop"], default="move",
                       help="move: copy blocks to the other nodes first; drop: just remove them")
    policy = command("policy", "change eviction policy, watermarks, or put acceptance")
    policy.add_argument("name", help="node name")
    policy.add_argument("--eviction", choices=["lru", "lfu"], help="eviction policy")
    policy.add_argument("--high-watermark", type=fraction, metavar="FRACTION",
                        help="a tier this full evicts down to the low watermark")
    alias(policy, "--high", dest="high_watermark", type=fraction)
    policy.add_argument("--low-watermark", type=fraction, metavar="FRACTION", help="where eviction stops")
    alias(policy, "--low", dest="low_watermark", type=fraction)
    policy.add_argument("--accept-puts", choices=["yes", "no"], help="no: new puts go to other nodes")


def _reason(exc: grpc.RpcError, timeout: float) -> str:
    """A few words on why a node could not be asked (gRPC's own text runs to a paragraph)."""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {timeout:g} s"
    details = (exc.details() or "").lower()
    for needle, reason in (("connection refused", "connection refused"), ("no route", "no route to host"),
                           ("resolve", "cannot resolve its address"), ("handshake", "TLS handshake failed"),
                           ("ssl", "TLS handshake failed"), ("timed out", "connecting timed out"),
                           ("reset", "connection reset"), ("shutdown", "shutting down")):
        if needle in details:
            return reason
    short = (exc.details() or exc.code().name).split(";")[0].strip()
    return short if len(short) <= 60 else short[:57] + "..."


def _read_token(args: argparse.Namespace) -> str | None:
    """The admin token: --admin-token-file, else KVSTORE_ADMIN_TOKEN, else the one `kvstore serve`
    generated for this cluster on this host. A token file others may read is refused (Fail 2)."""
    from ..access import admin_token_path, read_private_file
    from ..errors import InsecureFile

    if args.admin_token_file:
        try:
            return read_private_file(args.admin_token_file, "the admin token")
        except InsecureFile as exc:
            raise Fail(f"--admin-token-file: {exc}", USAGE) from None
        except OSError as exc:
            raise Fail(f"--admin-token-file: cannot read {args.admin_token_file}: {exc.strerror or exc}", USAGE)
    if os.environ.get("KVSTORE_ADMIN_TOKEN"):
        return os.environ["KVSTORE_ADMIN_TOKEN"]
    path = admin_token_path(args.cluster)
    try:  # the token `kvstore serve` generated for this cluster on this host, if any
        return read_private_file(path, "the admin token") or None
    except InsecureFile as exc:
        raise Fail(str(exc), USAGE) from None
    except OSError:
        return None


def resolve(args: argparse.Namespace) -> None:
    """Fill in the defaults that come from the environment; Fail(2) without a usable metadata URL."""
    from ..metadata import check_metadata_url

    args.metadata = args.metadata or os.environ.get("KVSTORE_METADATA")
    args.cluster = args.cluster or os.environ.get("KVSTORE_CLUSTER") or "default"
    if not args.metadata:
        raise Fail("no metadata service: pass --metadata etcd://HOST:PORT or set KVSTORE_METADATA", USAGE)
    try:
        check_metadata_url(args.metadata)
    except ValueError as exc:
        raise Fail(f"--metadata: {exc}", USAGE) from None
    if args.metadata.startswith("memory:"):
        raise Fail(f"--metadata {args.metadata}: a memory:// index lives inside one process; give the cluster's "
                   "etcd://HOST:PORT", USAGE)
    if args.tls_ca and not os.access(args.tls_ca, os.R_OK):
        raise Fail(f"--tls-ca: cannot read {args.tls_ca}", USAGE)


class AdminClient:
    """Node discovery through the metadata service plus one Admin stub per node."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        token = _read_token(args)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        try:
            self.mirror = open_mirror(args.metadata, args.cluster, timeout=args.timeout).start()
        except InvalidConfig as exc:  # a shard map that disagrees with the cluster's
            raise Fail(str(exc), USAGE) from exc
        except Exception as exc:  # noqa: BLE001 - becomes an exit code
            raise Fail(f"cannot reach the metadata service {args.metadata} within {args.timeout:g} s", UNAVAILABLE) from exc
        self._channels: dict[str, grpc.Channel] = {}
        self.unreachable: dict[str, str] = {}  # node -> why it could not be asked

    def nodes(self) -> dict[str, Any]:
        return self.mirror.nodes

    def stub(self, name: str) -> admin_pb2_grpc.AdminStub:
        record = self.mirror.nodes.get(name)
        if record is None:
            raise Fail(f"no node named {name!r} in cluster {self.args.cluster!r}", NOT_FOUND)
        if name not in self._channels:
            if self.args.tls_ca:
                with open(self.args.tls_ca, "rb") as f:
                    creds = grpc.ssl_channel_credentials(f.read())
                self._channels[name] = grpc.secure_channel(record.endpoint, creds)
            else:
                self._channels[name] = grpc.insecure_channel(record.endpoint)
        return admin_pb2_grpc.AdminStub(self._channels[name])

    def call(self, name: str, method: str, request):
        try:
            return getattr(self.stub(name), method)(request, timeout=self.args.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self.error(name, exc) from exc

    def error(self, name: str, exc: grpc.RpcError) -> Fail:
        code = EXIT.get(exc.code(), FAILED)
        if code == UNAVAILABLE:
            return Unreachable(name, _reason(exc, self.args.timeout))
        hint = ""
        if code == NOT_ALLOWED:
            hint = (" (pass --admin-token-file with the node's token file, or set KVSTORE_ADMIN_TOKEN)"
                    if not self.metadata else " (the node has another admin token)")
        return Fail(f"{name}: {exc.code().name}: {exc.details()}{hint}", code)

    def ask(self, names: list[str], method: str, request, *, missing_ok: bool = True) -> dict[str, Any]:
        """`method` on each node at once: name -> reply (None: NOT_FOUND, with missing_ok). Nodes
        that cannot be asked are left out and noted in `unreachable`; any other error is raised."""
        def one(name: str):
            try:
                return self.call(name, method, request)
            except Unreachable as exc:
                return exc
            except Fail as exc:
                if exc.code == NOT_FOUND and missing_ok:
                    return None
                raise

        if not names:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
            answers = dict(zip(names, pool.map(one, names)))
        replies = {}
        for name, answer in answers.items():
            if isinstance(answer, Unreachable):
                self.unreachable[name] = answer.reason
            else:
                replies[name] = answer
        return replies

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self.mirror.stop()


def _targets(client: AdminClient, args) -> list[str]:
    return [args.node] if getattr(args, "node", None) else sorted(client.nodes())


def _status_rows(client: AdminClient) -> list[dict]:
    names = sorted(client.nodes())
    replies = client.ask(names, "GetNodeStatus", admin_pb2.NodeStatusRequest(), missing_ok=False)
    rows = []
    for name in names:
        if name in replies:
            row = message_dict(replies[name])
            row["state"] = "draining" if row["draining"] else "serving"
        else:
            record = client.nodes().get(name)
            row = {"name": name, "control_endpoint": record.endpoint if record else "", "state": "unreachable",
                   "reason": client.unreachable.get(name, "")}
        rows.append(row)
    return rows


def _partial(client: AdminClient) -> int:
    """Exit code of a command that asked every node: 5 when some could not be asked (said on stderr)."""
    if not client.unreachable:
        return OK
    gone = ", ".join(f"{name} ({why})" for name, why in sorted(client.unreachable.items()))
    print(f"{PROG}: unreachable: {gone}; the answer is from the other nodes", file=sys.stderr)
    return UNAVAILABLE


def run(args: argparse.Namespace) -> int:
    import logging

    ours, level = logging.getLogger("kvstore"), logging.getLogger("kvstore").level
    if not logging.getLogger().handlers:  # the command line: its one line says it, not the mirror's retries
        ours.setLevel(logging.CRITICAL)
    try:
        return _run(args)
    finally:
        ours.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    try:
        resolve(args)
        if args.admin_command == "query":
            args.query = _query_input(args)  # bad input is refused before anything is called
        client = AdminClient(args)
    except Fail as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    try:
        if args.admin_command in ASK_ALL and not client.nodes():  # a mistyped --cluster looks just like this
            raise Fail(f"no nodes in cluster {args.cluster!r} at {args.metadata} (check --cluster or "
                       "KVSTORE_CLUSTER, and that its nodes run)", NOT_FOUND)
        return COMMANDS[args.admin_command](client, args, console)
    except Fail as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    finally:
        client.close()


def cmd_status(client: AdminClient, args, console) -> int:
    rows = _status_rows(client)
    # Each under-replicated block is counted by exactly one surviving holder (the one repairing it).
    under = sum(int(r.get("counters", {}).get("under_replicated_blocks", 0)) for r in rows)
    if args.json:
        print(json.dumps({"cluster": args.cluster, "under_replicated_blocks": under, "nodes": rows,
                          "unreachable": dict(sorted(client.unreachable.items()))}, indent=1))
        return _partial(client)
    down = f", {len(client.unreachable)} unreachable" if client.unreachable else ""
    table = render.table(f"cluster {args.cluster}: {len(rows)} node(s){down}, {under} under-replicated block(s)",
                         ["node", "endpoint", "DRAM", "NVMe", "blocks", "hits", "policy", "state"],
                         right=("DRAM", "NVMe", "blocks", "hits"))
    for r in rows:
        if r["state"] == "unreachable":
            table.add_row(r["name"], r["control_endpoint"], "-", "-", "-", "-", "-",
                          f"[red]unreachable[/red] ({r['reason']})")
            continue
        tiers = {t["name"]: t for t in r["tiers"]}
        fmt = lambda t: f"{render.size(int(t['used_bytes']))}/{render.size(int(t['capacity_bytes']))}" if t else "-"  # noqa: E731
        table.add_row(r["name"], r["control_endpoint"], fmt(tiers.get("dram")), fmt(tiers.get("nvme")),
                      str(sum(int(t["blocks"]) for t in r["tiers"])), str(sum(int(t["hits"]) for t in r["tiers"])),
                      r["eviction_policy"], r["state"])
    console.print(table)
    return _partial(client)


def cmd_nodes(client: AdminClient, args, console) -> int:
    nodes = client.nodes()
    asked = client.ask(sorted(nodes), "GetNodeStatus", admin_pb2.NodeStatusRequest(), missing_ok=False)
    rows = []
    for n in sorted(nodes.values(), key=lambda n: n.name):
        if n.name in asked:
            state, reason = ("draining" if asked[n.name].draining else "serving"), ""
        else:
            state, reason = "unreachable", client.unreachable.get(n.name, "")
        rows.append({"name": n.name, "endpoint": n.endpoint, "host": n.host, "tiers": n.tiers, "used": n.used,
                     "draining": n.draining, "version": n.version, "state": state, "reason": reason})
    if args.json:
        print(json.dumps(rows, indent=1))
        return _partial(client)
    table = render.table("nodes", ["node", "endpoint", "host", "version", "state"])
    for r in rows:
        state = f"[red]unreachable[/red] ({r['reason']})" if r["state"] == "unreachable" else r["state"]
        table.add_row(r["name"], r["endpoint"], r["host"], r["version"], state)
    console.print(table)
    return _partial(client)


def cmd_node(client: AdminClient, args, console) -> int:
    status = message_dict(client.call(args.name, "GetNodeStatus", admin_pb2.NodeStatusRequest()))
    if args.json:
        print(json.dumps(status, indent=1))
        return OK
    table = render.table(f"node {args.name} ({'draining' if status['draining'] else 'serving'}, "
                         f"{status['eviction_policy']})", ["tier", "used", "capacity", "blocks", "watermarks", "hits",
                                                          "evictions"],
                         right=("used", "capacity", "blocks", "hits", "evictions"))
    for t in status["tiers"]:
        table.add_row(t["name"], render.size(int(t["used_bytes"])), render.size(int(t["capacity_bytes"])), str(t["blocks"]),
                      f"{t['low_watermark']:.2f}-{t['high_watermark']:.2f}", str(t["hits"]), str(t["evictions"]))
    console.print(table)
    counters = render.table("counters", ["name", "value"], right=("value",))
    for k, v in sorted(status["counters"].items()):
        counters.add_row(k, f"{v:,.0f}")
    console.print(counters)
    return OK


def _named_unreachable(client: AdminClient, args) -> None:
    """A node named with --node that could not be asked is the command's failure, not a partial answer."""
    if getattr(args, "node", None) and args.node in client.unreachable:
        raise Unreachable(args.node, client.unreachable[args.node])


def cmd_blocks(client: AdminClient, args, console) -> int:
    names = _targets(client, args)
    replies = client.ask(names, "ListBlocks", admin_pb2.ListBlocksRequest(
        fingerprint=args.fingerprint, page_size=args.page_size, page_token=args.page_token), missing_ok=not args.node)
    _named_unreachable(client, args)
    out = []
    for name in names:
        if name in client.unreachable:
            out.append({"node": name, "state": "unreachable", "reason": client.unreachable[name]})
            continue
        reply = replies[name]
        if reply is None:
            out.append({"node": name, "total": 0, "next_page_token": "", "blocks": []})
            continue
        out.append({"node": name, "total": reply.total, "next_page_token": reply.next_page_token,
                    "blocks": [message_dict(b, defaults=False) for b in reply.blocks]})
    if args.json:
        print(json.dumps(out, indent=1))
        return _partial(client)
    for page in out:
        if page.get("state") == "unreachable":
            console.print(f"{page['node']}: [red]unreachable[/red] ({page['reason']})")
            continue
        table = render.table(f"{page['node']}: {page['total']} block(s)"
                             + (f", next page: --page-token {page['next_page_token']}" if page["next_page_token"]
                                else ""), ["hash", "tier", "size"], right=("size",))
        for b in page["blocks"]:
            table.add_row(b["hash"], b["tier"], render.size(int(b["size"])))
        console.print(table)
    return _partial(client)


MODEL_FIELDS = "model_id, dtype, block_size, num_layers, num_kv_heads, head_size"


def _model(text: str) -> ModelFingerprint:
    """--model's JSON as a ModelFingerprint; Fail(2) naming what is wrong and what is accepted."""
    import dataclasses

    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise Fail(f"--model: not JSON ({exc}); give an object with {MODEL_FIELDS}", USAGE) from None
    if not isinstance(fields, dict):
        raise Fail(f"--model: give a JSON object with {MODEL_FIELDS}", USAGE)
    known = [f.name for f in dataclasses.fields(ModelFingerprint)]
    required = [f.name for f in dataclasses.fields(ModelFingerprint)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in fields]
    unknown = sorted(set(fields) - set(known))
    if missing or unknown:
        what = "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                           f"unknown {', '.join(unknown)}" if unknown else "") if part)
        raise Fail(f"--model: {what} (required: {', '.join(required)}; optional: "
                   f"{', '.join(k for k in known if k not in required)})", USAGE)
    try:
        return ModelFingerprint(**fields)
    except (TypeError, ValueError, KVStoreError) as exc:
        raise Fail(f"--model: {exc}", USAGE) from None


def _query_input(args) -> tuple[str, list[bytes]]:
    """(fingerprint digest, hashes) of `query`; Fail(2) on input that cannot name blocks."""
    if args.tokens or args.model:
        if not (args.tokens and args.model):
            raise Fail("--tokens and --model go together (the token ids file and the fingerprint fields as JSON)",
                       USAGE)
        fingerprint = _model(args.model)
        try:
            with open(args.tokens) as f:
                tokens = json.load(f)
        except OSError as exc:
            raise Fail(f"--tokens: cannot read {args.tokens}: {exc.strerror or exc}", USAGE) from None
        except ValueError as exc:
            raise Fail(f"--tokens: {args.tokens} is not JSON ({exc}); give a JSON list of token ids", USAGE) from None
        try:
            hashes = chain_hashes(fingerprint, tokens)
        except (TypeError, ValueError, KVStoreError) as exc:
            raise Fail(f"--tokens: {args.tokens}: {exc} (give a JSON list of token ids)", USAGE) from None
        digest = fingerprint.digest
    else:
        if not args.fingerprint or not args.hashes:
            raise Fail("give --fingerprint and --hashes, or --tokens and --model", USAGE)
        try:
            hashes = [bytes.fromhex(h) for h in args.hashes]
        except ValueError as exc:
            raise Fail(f"--hashes: {exc} (give the hash chain as hex, 32 digits each)", USAGE) from exc
        if any(len(h) != 16 for h in hashes):
            raise Fail("--hashes: each hash is 32 hex digits (16 bytes)", USAGE)
        digest = args.fingerprint
    return digest, hashes


def cmd_query(client: AdminClient, args, console) -> int:
    digest, hashes = args.query
    names = sorted(client.nodes())
    replies = client.ask(names, "Query", admin_pb2.QueryRequest(fingerprint=digest, hashes=hashes))
    result = {}
    for name in names:
        if name in client.unreachable:
            result[name] = {"state": "unreachable", "reason": client.unreachable[name]}
            continue
        reply = replies[name]
        result[name] = {"leading_blocks": reply.leading_blocks if reply else 0, "tiers": list(reply.tiers) if reply else []}
    # The index still lists an unreachable node's blocks until its lease ends: count only the others'.
    leading = 0
    for h in hashes:
        if not set(client.mirror.lookup(digest, h)) - set(client.unreachable):
            break
        leading += 1
    summary = {"fingerprint": digest, "blocks": len(hashes), "cluster_leading_blocks": leading, "nodes": result}
    if args.json:
        print(json.dumps(summary, indent=1))
        return _partial(client)
    table = render.table(f"{leading} of {len(hashes)} leading blocks cached in the cluster",
                         ["node", "leading blocks", "tiers"], right=("leading blocks",))
    for name, r in result.items():
        if r.get("state") == "unreachable":
            table.add_row(name, "-", f"[red]unreachable[/red] ({r['reason']})")
            continue
        tiers = ", ".join(f"{t}×{r['tiers'].count(t)}" for t in sorted(set(r["tiers"])))
        table.add_row(name, str(r["leading_blocks"]), tiers or "-")
    console.print(table)
    return _partial(client)


def cmd_evict(client: AdminClient, args, console) -> int:
    names = _targets(client, args)
    request = admin_pb2.EvictRequest(fingerprint=args.fingerprint, hash_prefix=args.prefix)
    replies = client.ask(names, "Evict", request, missing_ok=not args.node)  # NOT_FOUND: it held none
    _named_unreachable(client, args)
    evicted = {name: (reply.evicted if reply else 0) for name, reply in replies.items()}
    if args.json:
        print(json.dumps({"evicted": evicted, "total": sum(evicted.values()),
                          "unreachable": dict(sorted(client.unreachable.items()))}, indent=1))
    else:
        console.print(f"evicted {sum(evicted.values())} block(s): " + ", ".join(f"{k}={v}" for k, v in evicted.items()))
    return _partial(client)


def cmd_drain(client: AdminClient, args, console) -> int:
    mode = admin_pb2.DrainRequest.MOVE if args.mode == "move" else admin_pb2.DrainRequest.DROP
    last = None
    try:
        stream = client.stub(args.name).Drain(admin_pb2.DrainRequest(mode=mode), timeout=max(args.timeout, 600),
                                              metadata=client.metadata)
        first = next(stream, None)  # a refusal (token, connection) comes here, before a bar is drawn
        with Progress(TextColumn(f"draining {args.name}"), BarColumn(), TextColumn("{task.completed}/{task.total} blocks"),
                      disable=args.json, console=Console(stderr=True)) as progress:
            task = progress.add_task("drain", total=None)
            for update in itertools.chain([first] if first is not None else [], stream):
                last = update
                progress.update(task, total=update.total, completed=update.moved + update.dropped + update.failed)
    except grpc.RpcError as exc:
        raise client.error(args.name, exc) from exc
    result = {f: getattr(last, f) for f in ("total", "moved", "dropped", "failed", "done")} if last else {}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        console.print(f"{args.name}: moved {result.get('moved', 0)}, dropped {result.get('dropped', 0)}, "
                      f"failed {result.get('failed', 0)} of {result.get('total', 0)}; it accepts no new puts")
    return OK if result.get("done") and not int(result.get("failed", 0)) else FAILED


def cmd_tenants(client: AdminClient, args, console) -> int:
    rows = []
    for status in _status_rows(client):
        if status["state"] == "unreachable":
            continue
        found: dict[tuple[str, str], dict] = {}
        for name, value in status.get("counters", {}).items():
            kind, _, rest = name.partition(":")
            if kind in ("tenant_bytes", "tenant_share_bytes"):
                tier, _, tenant = rest.partition(":")
                found.setdefault((tenant, tier), {"tenant": tenant, "node": status["name"], "tier": tier,
                                                  "bytes": 0, "share_bytes": None})[
                    "bytes" if kind == "tenant_bytes" else "share_bytes"] = int(value)
        rows += sorted(found.values(), key=lambda r: (r["tenant"], r["node"], r["tier"]))
    if args.json:
        print(json.dumps({"tenants": rows, "unreachable": dict(sorted(client.unreachable.items()))}, indent=1))
        return _partial(client)
    table = render.table(f"tenants of cluster {args.cluster}", ["tenant", "node", "tier", "held", "share"],
                         right=("held", "share"))
    for r in rows:
        share = "-" if r["share_bytes"] is None else render.size(r["share_bytes"])
        over = r["share_bytes"] is not None and r["bytes"] > r["share_bytes"]
        table.add_row(r["tenant"], r["node"], r["tier"], f"[yellow]{render.size(r['bytes'])}[/yellow]" if over
                      else render.size(r["bytes"]), share)
    console.print(table)
    return _partial(client)


def cmd_policy(client: AdminClient, args, console) -> int:
    request = admin_pb2.SetPolicyRequest(eviction_policy=args.eviction or "", high_watermark=args.high_watermark or 0,
                                         low_watermark=args.low_watermark or 0)
    if args.accept_puts:
        request.set_accept_puts = True
        request.accept_puts = args.accept_puts == "yes"
    status = client.call(args.name, "SetPolicy", request)
    if args.json:
        print(json.dumps(message_dict(status, defaults=False), indent=1))
    else:
        tier = status.tiers[0]
        console.print(f"{args.name}: {status.eviction_policy}, watermarks {tier.low_watermark:.2f}-{tier.high_watermark:.2f}, "
                      f"{'draining' if status.draining else 'accepting puts'}")
    return OK


ASK_ALL = ("status", "nodes", "tenants", "blocks", "query", "evict")  # the commands that ask every node
COMMANDS = {"status": cmd_status, "nodes": cmd_nodes, "tenants": cmd_tenants, "node": cmd_node, "blocks": cmd_blocks,
            "query": cmd_query, "evict": cmd_evict, "drain": cmd_drain, "policy": cmd_policy}
