"""A client's connections to store nodes: the engine peer and gRPC stub of each node, the framed
control wire (same host: a unix socket; other hosts: TCP), which of them a call takes, and what is
left alone for a while after a failure or a refusal.

The put and read pipelines (`put_path`, `read_path`) reach nodes only through `NodeLinks`; the
client's secret is checked against a node's record before any connection to it is made.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from transfer import Engine, Peer, TransferError
from transfer.descriptor import host_id

from ..access import ControlAuth
from ..errors import (
    AccessDenied,
    AllocationFailed,
    AuthenticationFailed,
    ConnectionReplaced,
    ConnectionsExhausted,
    KVStoreError,
    NoStoreNodes,
    WrongSize,
)
from ..index import IndexMirror
from ..index.records import NodeRecord
from ..store.v1 import store_pb2, store_pb2_grpc
from ..wire import TCP_SCHEME, tcp_endpoint
from .channel_guard import ChannelGuard
from .leases import SlotLeases
from .local_node import LocalNode
from .placement import PutPlacement

log = logging.getLogger(__name__)
WIRE_CONNECT_S = 2.0  # the first connection to a node's TCP wire; unreachable, gRPC is used instead
WIRE_RETRY_S = 30.0  # ... for this long
# A node that refused this client a control-wire connection (its tenant's share, or all of them, taken)
# is called over gRPC for this long before the wire is tried again.
WIRE_BUSY_S = 10.0


@dataclass
class NodeLink:
    """A node's engine peer and gRPC stub."""

    name: str
    peer: Peer
    guard: ChannelGuard  # retire() it, never close the channel: calls may still be on it
    stub: store_pb2_grpc.StoreControlStub


class NodeLinks:
    """Every connection a client holds to the cluster's nodes, and the state they share: the
    engine, the mirror, placement (which nodes are down), leased slots and the client's counters."""

    def __init__(self, engine: Engine, mirror: IndexMirror, *, timeout: float, transport: str, secret: bytes,
                 secret_source: str, tenant: str, tls_roots: bytes | None, stats: dict[str, int]) -> None:
        self.engine, self.mirror, self.timeout, self.transport = engine, mirror, timeout, transport
        self.secret, self.secret_source, self.tenant = secret, secret_source, tenant
        self.tls_roots = tls_roots  # control calls over TLS
        self.stats = stats
        self.metadata: list[tuple[str, str]] = []  # per-call tokens come from ControlAuth
        self.nodes: dict[str, NodeLink] = {}
        self.lock = threading.Lock()
        self.locals: dict[str, LocalNode] = {}
        self.in_process: dict[str, LocalNode] = {}  # nodes this very process serves (library mode)
        self.wires: dict[str, LocalNode] = {}  # the same wire over TCP, to nodes on other hosts
        self.wire_down: dict[str, float] = {}  # node -> until when its wire is left alone (unreachable)
        self.wire_busy: dict[str, float] = {}  # node -> until when both its wires are left alone (refused us)
        self._addresses: dict[tuple[str, str], tuple[str, Any]] = {}  # (node, field) -> (segment seen, address)
        self.here = host_id()  # this host's name and boot, read once
        self.placement = PutPlacement(self.here)
        self.leases = SlotLeases(timeout)

    # --- secrets ---------------------------------------------------------------------------------
    def check_secrets(self) -> None:
        """Raise AuthenticationFailed, in one line that says where this client's secret came from,
        if a registered node expects another kind of secret (none, or one) than this client has."""
        for record in list(self.mirror.nodes.values()):
            self.check_secret(record)

    def check_secret(self, record: NodeRecord) -> None:
        if record.secured and not self.secret:
            raise AuthenticationFailed(f"node {record.name} requires the cluster secret and this client has none "
                                       f"({self.secret_source}): pass secret=, or set KVSTORE_SECRET to the "
                                       "contents of the daemon's --secret-file")
        if not record.secured and self.secret:
            raise AuthenticationFailed(f"node {record.name} runs without a secret (--insecure) but this client has "
                                       f"one (from {self.secret_source}): pass secret=\"\" for none, or start the "
                                       "daemon with that secret")

    def refused(self, name: str, exc: AuthenticationFailed) -> AuthenticationFailed:
        """A node's refusal of this client's secret, saying where the secret came from."""
        return AuthenticationFailed(f"node {name} refused this client's cluster secret (from {self.secret_source}): "
                                    f"{exc}")

    # --- connections -----------------------------------------------------------------------------
    def node(self, name: str) -> NodeLink:
        with self.lock:
            node = self.nodes.get(name)
            if node is not None and node.peer.alive:
                return node
            record, segment = self.mirror.nodes.get(name), self.mirror.segments.get(name)
            if record is None or not segment:
                raise NoStoreNodes(f"node {name} is not registered")
            self.check_secret(record)
            if node is not None:
                node.peer.close()
                node.guard.retire()
            try:
                peer = self.engine.connect(segment, transport=self.transport, timeout=self.timeout)
            except AuthenticationFailed as exc:
                raise self.refused(name, exc) from None
            if self.tls_roots is not None:
                raw = grpc.secure_channel(record.endpoint, grpc.ssl_channel_credentials(self.tls_roots))
            else:
                raw = grpc.insecure_channel(record.endpoint)
            guard = ChannelGuard(raw, name)
            channel = guard.channel
            if self.secret:
                channel = grpc.intercept_channel(channel, ControlAuth(self.secret, name, self.engine.name,
                                                                      self.tenant))
            node = self.nodes[name] = NodeLink(name, peer, guard, store_pb2_grpc.StoreControlStub(channel))
            return node

    def local(self, name: str) -> LocalNode | None:
        """The same-host fast path to `name`, or None (another host, forced TCP, an older daemon)."""
        if self.transport not in ("auto", "shm"):
            return None
        if (mine := self.in_process.get(name)) is not None:
            return mine
        if self.wire_busy.get(name, 0) > time.monotonic():
            return None
        record = self.mirror.nodes.get(name)
        if record is None or record.host != self.here:
            return None
        return self._control_wire(name, "kvstore_local", "", self.locals)

    def wire(self, name: str) -> LocalNode | None:
        """The same framed wire to `name` over TCP (another host, or forced TCP): one round trip per
        control call instead of a gRPC call's thread hops. None where gRPC runs over TLS (the wire
        does not encrypt) or the node has none."""
        now = time.monotonic()
        if self.tls_roots is not None or self.transport not in ("auto", "tcp") or \
                self.wire_down.get(name, 0) > now or self.wire_busy.get(name, 0) > now:
            return None
        wire = self._control_wire(name, "kvstore_wire", TCP_SCHEME, self.wires)
        if wire is None or wire.reached:
            return wire
        try:  # first use: a wire this client cannot reach (a firewall, say) leaves gRPC to do its work
            wire.warm(min(self.timeout, WIRE_CONNECT_S))
        except AuthenticationFailed:
            raise  # a configuration error, which gRPC would meet as well
        except ConnectionsExhausted as exc:
            self.busy(name, exc)
            return None
        except (OSError, ValueError, TransferError) as exc:
            log.info("control wire to %s unreachable, using gRPC for %.0f s: %s", name, WIRE_RETRY_S, exc)
            self.wire_down[name] = time.monotonic() + WIRE_RETRY_S
            return None
        return wire

    def busy(self, name: str, why: ConnectionsExhausted) -> None:
        """`name` refused this client a control-wire connection: gRPC carries its control calls for
        WIRE_BUSY_S (the connections this client has pooled there are left alone meanwhile)."""
        if self.wire_busy.get(name, 0) <= time.monotonic():
            log.info("control wire of %s refused a connection, using gRPC for %.0f s: %s", name, WIRE_BUSY_S, why)
            self.stats["control_fallbacks"] += 1
        self.wire_busy[name] = time.monotonic() + WIRE_BUSY_S

    def control(self, name: str) -> LocalNode | None:
        """The framed wire for control calls to `name` (same host, else TCP), or None (gRPC)."""
        return self.local(name) or self.wire(name)

    def _control_wire(self, name: str, field: str, scheme: str, pool: dict[str, LocalNode]) -> LocalNode | None:
        """The pooled connections to the wire `name`'s segment names under `field`, or None."""
        segment = self.mirror.segments.get(name)
        if not segment:
            return None
        known = self._addresses.get((name, field))
        if known is not None and known[0] is segment:
            address = known[1]
        else:
            try:
                value = json.loads(segment).get(field)
                address = scheme + value if isinstance(value, str) and value else None
                if address and scheme:
                    tcp_endpoint(address)  # checked once per segment, not per call
            except (ValueError, AttributeError):
                address = None
            self._addresses[(name, field)] = (segment, address)
        if address is None:
            return None
        with self.lock:
            node = pool.get(name)
            if node is not None and node.address == address and not node.closed:
                return node
            if node is not None:
                node.close()
            record = self.mirror.nodes.get(name)
            if record is not None:
                self.check_secret(record)
            node = pool[name] = LocalNode(name, address, self.secret, self.engine.name, self.timeout,
                                          self.secret_source, tenant=self.tenant)
            return node

    def mark_down(self, name: str, why: Exception) -> None:
        """Leave `name` alone for a while and drop this client's connections to it."""
        if isinstance(why, ConnectionReplaced):  # another thread marked it down already: the connection
            return  # there now is a new one, not the one that failed
        log.info("store node %s failed: %s", name, why)
        self.placement.mark_down(name)
        with self.lock:
            node = self.nodes.pop(name, None)
            local = self.locals.pop(name, None)
            wire = self.wires.pop(name, None)
            self.leases.forget(name)  # its slots are of no use now
        if node is not None:
            node.peer.close()
            node.guard.retire()
        for control in (local, wire):
            if control is not None:
                control.close()

    # --- calls -----------------------------------------------------------------------------------
    def rpc(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise WrongSize(exc.details()) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise AllocationFailed(exc.details()) from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise AuthenticationFailed(exc.details()) from None
            if code == grpc.StatusCode.PERMISSION_DENIED:
                raise AccessDenied(exc.details()) from None
            raise

    def abort(self, name: str, tokens: list[int]) -> None:
        """Give reserved or leased slots back to `name`; best effort (the node reclaims them at expiry)."""
        try:
            wire = self.control(name)
            if wire is not None:
                try:
                    wire.call({"op": "abort", "tokens": tokens})
                    return
                except ConnectionsExhausted as exc:
                    self.busy(name, exc)
            if (node := self.nodes.get(name)) is not None:
                self.rpc(node.stub.Abort, store_pb2.AbortRequest(tokens=tokens))
        except (grpc.RpcError, KVStoreError, OSError, ValueError) as exc:
            log.debug("giving slots back to %s failed: %s", name, exc)

    def close(self) -> None:
        """Give leased slots back, then close every connection (a gRPC channel once its calls end)."""
        for name, tokens in self.leases.drain(dict(self.nodes)).items():  # not left to expire
            self.abort(name, tokens)
        for node in self.nodes.values():
            node.guard.retire()  # closed once a call another thread has on it ends
        for wire in list(self.locals.values()) + list(self.wires.values()) + list(self.in_process.values()):
            wire.close()
