"""The Admin gRPC service of one daemon (proto/kvstore/admin/v1/admin.proto)."""
from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Protocol

import grpc

from ..errors import KVStoreError
from ..index.records import NodeRecord
from ..keys import FINGERPRINT_DIGEST
from .v1 import admin_pb2, admin_pb2_grpc


class NodeOperations(Protocol):
    """What the admin service asks of the daemon it runs in: its block store (keys, find, remove,
    set_policy, tiers, counters), its state, and the node-wide operations. The daemon passes itself."""

    store: Any
    address: str
    draining: bool
    drain_in_progress: bool

    def registered_nodes(self) -> list[str]: ...

    def publish(self, updates: list) -> None: ...

    def drain(self, move: bool, is_active: Callable[[], bool]) -> Iterator[admin_pb2.DrainProgress]: ...

    def set_draining(self, draining: bool) -> None: ...

_FINGERPRINT = FINGERPRINT_DIGEST  # 32 hex chars, behind 'tenant:' for a tenant's fingerprint
_HEX = re.compile(r"^[0-9a-f]{0,32}$")


def _check_fingerprint(value: str, context) -> str:
    if not _FINGERPRINT.fullmatch(value):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fingerprint: must be the 32 hex chars of a model fingerprint "
                                                        "(behind 'TENANT:' for a tenant's)")
    return value


def _held(store, fingerprint: str, node: str, context) -> list:
    """This node's blocks of `fingerprint`; NOT_FOUND when it holds none."""
    blocks = store.keys(fingerprint)
    if not blocks:
        context.abort(grpc.StatusCode.NOT_FOUND, f"fingerprint: {node} holds no blocks of {fingerprint}")
    return blocks


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, daemon: NodeOperations, node: str, cluster: str) -> None:
        self.daemon = daemon
        self.store = daemon.store
        self.node = node
        self.cluster = cluster

    def _status(self) -> admin_pb2.NodeStatus:
        store = self.store
        with store.lock:
            counters = dict(store.counters)
            tiers = [admin_pb2.TierStatus(name=t.name, capacity_bytes=t.capacity, used_bytes=t.used, blocks=len(t.sealed),
                                          high_watermark=t.high, low_watermark=t.low,
                                          hits=int(counters.get(f"hits_{t.name}", 0)),
                                          evictions=int(counters.get(f"evictions_{t.name}", 0))) for t in store.tiers]
            fingerprints = len({k[0] for t in store.tiers for k in t.sealed})
        for tenant, tier, held, share in store.tenant_usage():  # `kvstore admin tenants` reads these
            counters[f"tenant_bytes:{tier}:{tenant}"] = held
            if share is not None:
                counters[f"tenant_share_bytes:{tier}:{tenant}"] = share
        hits = sum(counters.get(f"hits_{t.name}", 0) for t in store.tiers)
        misses = counters.get("client_reported_corrupt", 0)
        return admin_pb2.NodeStatus(name=self.node, control_endpoint=self.daemon.address,
                                    version=NodeRecord.__dataclass_fields__["version"].default,
                                    draining=self.daemon.draining, eviction_policy=store.dram.policy.name, tiers=tiers,
                                    counters=counters, hit_ratio=hits / (hits + misses) if hits + misses else 0.0,
                                    fingerprints=fingerprints)

    def ClusterStatus(self, request, context):
        try:
            nodes = self.daemon.registered_nodes()
        except KVStoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"metadata service: {exc}")
        return admin_pb2.ClusterStatusResponse(cluster=self.cluster, nodes=nodes, self=self._status())

    def GetNodeStatus(self, request, context):
        return self._status()

    def ListBlocks(self, request, context):
        fingerprint = _check_fingerprint(request.fingerprint, context)
        if request.page_size > 10_000:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_size: at most 10000")
        if request.page_token and not _HEX.match(request.page_token):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_token: not a token this API returned")
        size = request.page_size or 100
        blocks = _held(self.store, fingerprint, self.node, context)
        start = 0
        if request.page_token:
            start = next((i for i, (k, _) in enumerate(blocks) if k[1].hex() > request.page_token), len(blocks))
        page = blocks[start : start + size]
        more = start + size < len(blocks)
        return admin_pb2.ListBlocksResponse(
            blocks=[admin_pb2.BlockInfo(fingerprint=k[0], hash=k[1].hex(), tier=s.tier.name, size=s.size,
                                        digest=s.digest.hex()) for k, s in page],
            next_page_token=page[-1][0][1].hex() if more and page else "", total=len(blocks))

    def Query(self, request, context):
        fingerprint = _check_fingerprint(request.fingerprint, context)
        _held(self.store, fingerprint, self.node, context)
        tiers = []
        for h in request.hashes:
            if len(h) != 16:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hashes: 16 bytes each, got {len(h)}")
            slot = self.store.find((fingerprint, bytes(h)))
            if slot is None:
                break
            tiers.append(slot.tier.name)
        return admin_pb2.QueryResponse(leading_blocks=len(tiers), tiers=tiers)

    def Evict(self, request, context):
        fingerprint = _check_fingerprint(request.fingerprint, context)
        prefix = request.hash_prefix.lower()
        if not _HEX.match(prefix):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hash_prefix: hex digits only, at most 32")
        hashes = [k[1] for k, _ in _held(self.store, fingerprint, self.node, context)
                  if k[1].hex().startswith(prefix)]
        removed, updates = self.store.remove(fingerprint, hashes)
        if updates:
            self.daemon.publish(updates)
        return admin_pb2.EvictResponse(evicted=removed)

    def Drain(self, request, context) -> Iterator[admin_pb2.DrainProgress]:
        if self.daemon.draining and self.daemon.drain_in_progress:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a drain of this node is already running")
        yield from self.daemon.drain(move=request.mode == admin_pb2.DrainRequest.MOVE, is_active=context.is_active)

    def SetPolicy(self, request, context):
        if request.eviction_policy and request.eviction_policy not in ("lru", "lfu"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "eviction_policy: one of lru, lfu")
        for field_name in ("high_watermark", "low_watermark"):
            value = getattr(request, field_name)
            if value and not 0 < value <= 1:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field_name}: must be in (0, 1]")
        try:
            self.store.set_policy(request.eviction_policy or None, request.high_watermark or None,
                                  request.low_watermark or None)
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"low_watermark: {exc}")
        if request.set_accept_puts:
            self.daemon.set_draining(not request.accept_puts)
        return self._status()
