"""`kvstore admin …`: see, query and steer a running cluster.

Finds nodes through the metadata service, calls each node's Admin API, and prints tables (rich)
or JSON (--json). Exit codes: 0 ok, 2 bad arguments, 3 not found, 4 not allowed (token),
5 unavailable or timed out, 1 anything else.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from ..index import IndexMirror
from ..keys import ModelFingerprint, chain_hashes
from .v1 import admin_pb2, admin_pb2_grpc

EXIT = {grpc.StatusCode.INVALID_ARGUMENT: 2, grpc.StatusCode.FAILED_PRECONDITION: 2, grpc.StatusCode.NOT_FOUND: 3,
        grpc.StatusCode.UNAUTHENTICATED: 4, grpc.StatusCode.PERMISSION_DENIED: 4, grpc.StatusCode.UNAVAILABLE: 5,
        grpc.StatusCode.DEADLINE_EXCEEDED: 5}


class Fail(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def add_parser(commands) -> None:
    admin = commands.add_parser("admin", help="inspect and steer a running cluster")
    admin.add_argument("--metadata", default=os.environ.get("KVSTORE_METADATA", "memory://default"))
    admin.add_argument("--cluster", default=os.environ.get("KVSTORE_CLUSTER", "default"))
    admin.add_argument("--token-file", help="admin bearer token (or KVSTORE_ADMIN_TOKEN)")
    admin.add_argument("--tls-ca", help="PEM CA bundle: talk TLS to the daemons")
    admin.add_argument("--json", action="store_true", help="machine-readable output")
    admin.add_argument("--timeout", type=float, default=10.0)
    sub = admin.add_subparsers(dest="admin_command", required=True)
    sub.add_parser("status", help="cluster summary")
    sub.add_parser("nodes", help="list nodes")
    node = sub.add_parser("node", help="one node in detail")
    node.add_argument("name")
    blocks = sub.add_parser("blocks", help="list blocks of a model fingerprint")
    blocks.add_argument("--fingerprint", required=True)
    blocks.add_argument("--node", help="only this node")
    blocks.add_argument("--page-size", type=int, default=100)
    blocks.add_argument("--page-token", default="")
    query = sub.add_parser("query", help="which nodes and tiers hold a prompt's leading blocks")
    query.add_argument("--fingerprint", help="digest (with --hashes)")
    query.add_argument("--hashes", nargs="*", default=[], help="hash chain, hex")
    query.add_argument("--tokens", help="JSON file of token ids (with --model)")
    query.add_argument("--model", help="ModelFingerprint fields as JSON (with --tokens)")
    evict = sub.add_parser("evict", help="drop a model's blocks (all nodes unless --node)")
    evict.add_argument("--fingerprint", required=True)
    evict.add_argument("--prefix", default="", help="only hashes starting with these hex digits")
    evict.add_argument("--node")
    drain = sub.add_parser("drain", help="move a node's blocks elsewhere and stop its puts")
    drain.add_argument("name")
    drain.add_argument("--mode", choices=["move", "drop"], default="move")
    policy = sub.add_parser("policy", help="change eviction policy, watermarks, or put acceptance")
    policy.add_argument("name")
    policy.add_argument("--eviction", choices=["lru", "lfu"])
    policy.add_argument("--high", type=float)
    policy.add_argument("--low", type=float)
    policy.add_argument("--accept-puts", choices=["yes", "no"])


class AdminClient:
    """Node discovery through the metadata service plus one Admin stub per node."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        token = args.token_file and open(args.token_file).read().strip() or os.environ.get("KVSTORE_ADMIN_TOKEN")
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        try:
            self.mirror = IndexMirror(args.metadata, args.cluster, timeout=args.timeout).start()
        except Exception as exc:  # noqa: BLE001 - becomes an exit code
            raise Fail(f"cannot reach the metadata service {args.metadata}: {exc}", 5) from exc
        self._channels: dict[str, grpc.Channel] = {}

    def nodes(self) -> dict[str, Any]:
        return self.mirror.nodes

    def stub(self, name: str) -> admin_pb2_grpc.AdminStub:
        record = self.mirror.nodes.get(name)
        if record is None:
            raise Fail(f"no node named {name!r} in cluster {self.args.cluster!r}", 3)
        if name not in self._channels:
            if self.args.tls_ca:
                creds = grpc.ssl_channel_credentials(open(self.args.tls_ca, "rb").read())
                self._channels[name] = grpc.secure_channel(record.endpoint, creds)
            else:
                self._channels[name] = grpc.insecure_channel(record.endpoint)
        return admin_pb2_grpc.AdminStub(self._channels[name])

    def call(self, name: str, method: str, request, stream: bool = False):
        try:
            return getattr(self.stub(name), method)(request, timeout=self.args.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise Fail(f"{name}: {exc.code().name}: {exc.details()}", EXIT.get(exc.code(), 1)) from exc

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self.mirror.stop()


def _per_node(client: AdminClient, args, method: str, request) -> dict:
    """Call `method` on every node (or --node): a node holding nothing of the fingerprint answers
    NOT_FOUND, which only matters when that node was named."""
    names = [args.node] if getattr(args, "node", None) else sorted(client.nodes())
    replies = {}
    for name in names:
        try:
            replies[name] = client.call(name, method, request)
        except Fail as exc:
            if exc.code != 3 or getattr(args, "node", None):
                raise
            replies[name] = None
    return replies


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _status_rows(client: AdminClient) -> list[dict]:
    rows = []
    for name in sorted(client.nodes()):
        try:
            status = client.call(name, "GetNodeStatus", admin_pb2.NodeStatusRequest())
            rows.append(MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
        except Fail as exc:
            rows.append({"name": name, "error": str(exc)})
    return rows


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    try:
        client = AdminClient(args)
    except Fail as exc:
        print(f"kvstore admin: {exc}", file=sys.stderr)
        return exc.code
    try:
        return COMMANDS[args.admin_command](client, args, console)
    except Fail as exc:
        print(f"kvstore admin: {exc}", file=sys.stderr)
        return exc.code
    finally:
        client.close()


def cmd_status(client: AdminClient, args, console) -> int:
    rows = _status_rows(client)
    # Each under-replicated block is counted by exactly one surviving holder (the one repairing it).
    under = sum(int(r.get("counters", {}).get("under_replicated_blocks", 0)) for r in rows if "error" not in r)
    if args.json:
        print(json.dumps({"cluster": args.cluster, "under_replicated_blocks": under, "nodes": rows}, indent=1))
        return 0
    table = Table(title=f"cluster {args.cluster}: {len(rows)} node(s), {under} under-replicated block(s)")
    for col in ("node", "endpoint", "DRAM", "NVMe", "blocks", "hit ratio", "policy", "state"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["name"], "-", "-", "-", "-", "-", "-", f"[red]{r['error']}[/red]")
            continue
        tiers = {t["name"]: t for t in r["tiers"]}
        fmt = lambda t: f"{_size(int(t['used_bytes']))} / {_size(int(t['capacity_bytes']))}" if t else "-"  # noqa: E731
        table.add_row(r["name"], r["control_endpoint"], fmt(tiers.get("dram")), fmt(tiers.get("nvme")),
                      str(sum(int(t["blocks"]) for t in r["tiers"])), f"{r['hit_ratio']:.1%}", r["eviction_policy"],
                      "draining" if r["draining"] else "serving")
    console.print(table)
    return 0


def cmd_nodes(client: AdminClient, args, console) -> int:
    nodes = client.nodes()
    if args.json:
        print(json.dumps([{"name": n.name, "endpoint": n.endpoint, "host": n.host, "tiers": n.tiers, "used": n.used,
                           "draining": n.draining, "version": n.version} for n in nodes.values()], indent=1))
        return 0
    table = Table(title="nodes")
    for col in ("node", "endpoint", "host", "version", "state"):
        table.add_column(col)
    for n in sorted(nodes.values(), key=lambda n: n.name):
        table.add_row(n.name, n.endpoint, n.host, n.version, "draining" if n.draining else "serving")
    console.print(table)
    return 0


def cmd_node(client: AdminClient, args, console) -> int:
    status = MessageToDict(client.call(args.name, "GetNodeStatus", admin_pb2.NodeStatusRequest()),
                           preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    table = Table(title=f"node {args.name} ({'draining' if status['draining'] else 'serving'}, {status['eviction_policy']})")
    for col in ("tier", "used", "capacity", "blocks", "watermarks", "hits", "evictions"):
        table.add_column(col)
    for t in status["tiers"]:
        table.add_row(t["name"], _size(int(t["used_bytes"])), _size(int(t["capacity_bytes"])), str(t["blocks"]),
                      f"{t['low_watermark']:.2f}-{t['high_watermark']:.2f}", str(t["hits"]), str(t["evictions"]))
    console.print(table)
    counters = Table(title="counters")
    counters.add_column("name")
    counters.add_column("value", justify="right")
    for k, v in sorted(status["counters"].items()):
        counters.add_row(k, f"{v:,.0f}")
    console.print(counters)
    return 0


def cmd_blocks(client: AdminClient, args, console) -> int:
    replies = _per_node(client, args, "ListBlocks", admin_pb2.ListBlocksRequest(
        fingerprint=args.fingerprint, page_size=args.page_size, page_token=args.page_token))
    out = []
    for name, reply in replies.items():
        if reply is None:
            out.append({"node": name, "total": 0, "next_page_token": "", "blocks": []})
            continue
        out.append({"node": name, "total": reply.total, "next_page_token": reply.next_page_token,
                    "blocks": [MessageToDict(b, preserving_proto_field_name=True) for b in reply.blocks]})
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for page in out:
        table = Table(title=f"{page['node']}: {page['total']} block(s)"
                      + (f", next page: --page-token {page['next_page_token']}" if page["next_page_token"] else ""))
        for col in ("hash", "tier", "size"):
            table.add_column(col)
        for b in page["blocks"]:
            table.add_row(b["hash"], b["tier"], _size(int(b["size"])))
        console.print(table)
    return 0


def cmd_query(client: AdminClient, args, console) -> int:
    if args.tokens:
        if not args.model:
            raise Fail("--tokens needs --model (the fingerprint fields as JSON)", 2)
        fingerprint = ModelFingerprint(**json.loads(args.model))
        hashes = chain_hashes(fingerprint, json.load(open(args.tokens)))
        digest = fingerprint.digest
    else:
        if not args.fingerprint or not args.hashes:
            raise Fail("give --fingerprint and --hashes, or --tokens and --model", 2)
        try:
            hashes = [bytes.fromhex(h) for h in args.hashes]
        except ValueError as exc:
            raise Fail(f"--hashes: {exc}", 2) from exc
        digest = args.fingerprint
    result = {}
    for name, reply in _per_node(client, args, "Query", admin_pb2.QueryRequest(fingerprint=digest, hashes=hashes)).items():
        result[name] = {"leading_blocks": reply.leading_blocks if reply else 0, "tiers": list(reply.tiers) if reply else []}
    cluster = client.mirror.match(digest, hashes)
    summary = {"fingerprint": digest, "blocks": len(hashes), "cluster_leading_blocks": cluster.length, "nodes": result}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    table = Table(title=f"{cluster.length} of {len(hashes)} leading blocks cached in the cluster")
    for col in ("node", "leading blocks", "tiers"):
        table.add_column(col)
    for name, r in result.items():
        tiers = ", ".join(f"{t}×{r['tiers'].count(t)}" for t in sorted(set(r["tiers"])))
        table.add_row(name, str(r["leading_blocks"]), tiers or "-")
    console.print(table)
    return 0


def cmd_evict(client: AdminClient, args, console) -> int:
    names = [args.node] if args.node else sorted(client.nodes())
    evicted = {}
    request = admin_pb2.EvictRequest(fingerprint=args.fingerprint, hash_prefix=args.prefix)
    with Progress(TextColumn("evicting"), BarColumn(), TextColumn("{task.completed}/{task.total} nodes"),
                  disable=args.json, console=Console(stderr=True)) as progress:
        task = progress.add_task("evict", total=len(names))
        for name in names:
            try:
                evicted[name] = client.call(name, "Evict", request).evicted
            except Fail as exc:
                if exc.code != 3 or args.node:  # NOT_FOUND: that node held none of it
                    raise
                evicted[name] = 0
            progress.advance(task)
    if args.json:
        print(json.dumps({"evicted": evicted, "total": sum(evicted.values())}, indent=1))
    else:
        console.print(f"evicted {sum(evicted.values())} block(s): " + ", ".join(f"{k}={v}" for k, v in evicted.items()))
    return 0


def cmd_drain(client: AdminClient, args, console) -> int:
    mode = admin_pb2.DrainRequest.MOVE if args.mode == "move" else admin_pb2.DrainRequest.DROP
    last = None
    try:
        stream = client.stub(args.name).Drain(admin_pb2.DrainRequest(mode=mode), timeout=max(args.timeout, 600),
                                              metadata=client.metadata)
        with Progress(TextColumn(f"draining {args.name}"), BarColumn(), TextColumn("{task.completed}/{task.total} blocks"),
                      disable=args.json, console=Console(stderr=True)) as progress:
            task = progress.add_task("drain", total=None)
            for update in stream:
                last = update
                progress.update(task, total=update.total, completed=update.moved + update.dropped + update.failed)
    except grpc.RpcError as exc:
        raise Fail(f"{args.name}: {exc.code().name}: {exc.details()}", EXIT.get(exc.code(), 1)) from exc
    result = {f: getattr(last, f) for f in ("total", "moved", "dropped", "failed", "done")} if last else {}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        console.print(f"{args.name}: moved {result.get('moved', 0)}, dropped {result.get('dropped', 0)}, "
                      f"failed {result.get('failed', 0)} of {result.get('total', 0)}; it accepts no new puts")
    return 0 if result.get("done") and not int(result.get("failed", 0)) else 1


def cmd_policy(client: AdminClient, args, console) -> int:
    request = admin_pb2.SetPolicyRequest(eviction_policy=args.eviction or "", high_watermark=args.high or 0,
                                         low_watermark=args.low or 0)
    if args.accept_puts:
        request.set_accept_puts = True
        request.accept_puts = args.accept_puts == "yes"
    status = client.call(args.name, "SetPolicy", request)
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True), indent=1))
    else:
        tier = status.tiers[0]
        console.print(f"{args.name}: {status.eviction_policy}, watermarks {tier.low_watermark:.2f}-{tier.high_watermark:.2f}, "
                      f"{'draining' if status.draining else 'accepting puts'}")
    return 0


COMMANDS = {"status": cmd_status, "nodes": cmd_nodes, "node": cmd_node, "blocks": cmd_blocks, "query": cmd_query,
            "evict": cmd_evict, "drain": cmd_drain, "policy": cmd_policy}
