"""A client's connections to store nodes: the engine peer of each node, the framed control wire
(same host: a unix socket; other hosts: TCP, over TLS where the node serves it), which of them a
call takes, and what is left alone for a while after a failure or a refusal.

The put and read pipelines (`put_path`, `read_path`) reach nodes only through `NodeLinks`; the
client's secret is checked against a node's record before any connection to it is made.
"""
from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from transfer import Engine, Peer
from transfer.descriptor import host_id

from ..errors import AuthenticationFailed, ConnectionsExhausted, InvalidConfig, KVStoreError, NodeRefused, NoStoreNodes
from ..index import IndexMirror
from ..index.records import NodeRecord
from ..wire import TCP_SCHEME, tcp_endpoint
from .leases import SlotLeases
from .local_node import LocalNode
from .placement import PutPlacement

log = logging.getLogger(__name__)
# A node that refused this client a control-wire connection (its tenant's share, or all of them, taken)
# is read from through the engine, not its wire, for this long.
WIRE_BUSY_S = 10.0


@dataclass
class NodeLink:
    """A node's engine peer."""

    name: str
    peer: Peer


class NodeLinks:
    """Every connection a client holds to the cluster's nodes, and the state they share: the
    engine, the mirror, placement (which nodes are down), leased slots and the client's counters."""

    def __init__(self, engine: Engine, mirror: IndexMirror, *, timeout: float, transport: str, secret: bytes,
                 secret_source: str, tenant: str, tls: ssl.SSLContext | None, stats: dict[str, int]) -> None:
        self.engine, self.mirror, self.timeout, self.transport = engine, mirror, timeout, transport
        self.secret, self.secret_source, self.tenant = secret, secret_source, tenant
        self.tls = tls  # the TCP wire over TLS, the node's certificate checked against its roots
        self.stats = stats
        self.nodes: dict[str, NodeLink] = {}
        self.lock = threading.Lock()
        self.locals: dict[str, LocalNode] = {}
        self.in_process: dict[str, LocalNode] = {}  # nodes this very process serves (library mode)
        self.wires: dict[str, LocalNode] = {}  # the same wire over TCP, to nodes on other hosts
        self.wire_busy: dict[str, float] = {}  # node -> until when its wire is not read from (refused us)
        self._addresses: dict[tuple[str, str], tuple[str, Any, bool]] = {}  # (node, field) -> (segment, address, tls)
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
            try:
                peer = self.engine.connect(segment, transport=self.transport, timeout=self.timeout)
            except AuthenticationFailed as exc:
                raise self.refused(name, exc) from None
            node = self.nodes[name] = NodeLink(name, peer)
            return node

    def local(self, name: str) -> LocalNode | None:
        """The same-host wire to `name`, or None (another host, forced TCP)."""
        if self.transport not in ("auto", "shm"):
            return None
        if (mine := self.in_process.get(name)) is not None:
            return mine
        record = self.mirror.nodes.get(name)
        if record is None or record.host != self.here:
            return None
        return self._control_wire(name, "kvstore_local", "", self.locals)

    def wire(self, name: str) -> LocalNode | None:
        """The same framed wire to `name` over TCP (another host, or a transport other than shared
        memory), over TLS where this client was given the roots (`tls_ca`); None where the node
        serves none."""
        if self.transport == "shm":
            return None
        return self._control_wire(name, "kvstore_wire", TCP_SCHEME, self.wires)

    def control(self, name: str) -> LocalNode:
        """The framed wire for control calls to `name`: same host, else TCP."""
        wire = self.local(name) or self.wire(name)
        if wire is None:
            if name not in self.mirror.nodes:
                raise NoStoreNodes(f"node {name} is not registered")
            raise NodeRefused(f"node {name} serves no control wire this client can use (started with "
                              "--wire-port -1, or another host with transport='shm')")
        return wire

    def busy(self, name: str, why: ConnectionsExhausted) -> None:
        """`name` refused this client a wire connection: reads from it go through the engine for
        WIRE_BUSY_S (control calls wait for a connection of their own)."""
        if self.wire_busy.get(name, 0) <= time.monotonic():
            log.info("control wire of %s refused a connection, reading through the engine for %.0f s: %s", name,
                     WIRE_BUSY_S, why)
            self.stats["control_fallbacks"] += 1
        self.wire_busy[name] = time.monotonic() + WIRE_BUSY_S

    def is_busy(self, name: str) -> bool:
        return self.wire_busy.get(name, 0) > time.monotonic()

    def _control_wire(self, name: str, field: str, scheme: str, pool: dict[str, LocalNode]) -> LocalNode | None:
        """The pooled connections to the wire `name`'s segment names under `field`, or None."""
        segment = self.mirror.segments.get(name)
        if not segment:
            return None
        known = self._addresses.get((name, field))
        if known is not None and known[0] is segment:
            address, tls = known[1], known[2]
        else:
            try:
                fields = json.loads(segment)
                value, tls = fields.get(field), bool(scheme) and fields.get("kvstore_wire_tls") is True
                address = scheme + value if isinstance(value, str) and value else None
                if address and scheme:
                    tcp_endpoint(address)  # checked once per segment, not per call
            except (ValueError, AttributeError):
                address, tls = None, False
            self._addresses[(name, field)] = (segment, address, tls)
        if address is None:
            return None
        if tls and self.tls is None:
            raise InvalidConfig(f"node {name}'s control wire speaks TLS (kvstore serve --tls-cert): give this client "
                                "the PEM roots that signed its certificate (Client(tls_ca=...), --tls-ca)")
        if scheme and self.tls is not None and not tls:  # asked for TLS: never in the clear instead
            raise InvalidConfig(f"node {name}'s control wire runs in the clear (no --tls-cert) and this client was "
                                "given TLS roots (tls_ca): start the node with --tls-cert, or drop tls_ca")
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
                                          self.secret_source, tenant=self.tenant, tls=self.tls if scheme else None)
            return node

    def mark_down(self, name: str, why: Exception) -> None:
        """Leave `name` alone for a while and drop this client's connections to it."""
        log.info("store node %s failed: %s", name, why)
        self.placement.mark_down(name)
        with self.lock:
            node = self.nodes.pop(name, None)
            local = self.locals.pop(name, None)
            wire = self.wires.pop(name, None)
            self.leases.forget(name)  # its slots are of no use now
        if node is not None:
            node.peer.close()
        for control in (local, wire):
            if control is not None:
                control.close()

    # --- calls -----------------------------------------------------------------------------------
    def abort(self, name: str, tokens: list[int]) -> None:
        """Give reserved or leased slots back to `name`; best effort (the node reclaims them at expiry)."""
        try:
            self.control(name).call({"op": "abort", "tokens": tokens}, wait=False)
        except (KVStoreError, OSError, ValueError) as exc:
            log.debug("giving slots back to %s failed: %s", name, exc)

    def close(self) -> None:
        """Give leased slots back, then close every control connection."""
        for name, tokens in self.leases.drain(dict(self.nodes)).items():  # not left to expire
            self.abort(name, tokens)
        for wire in list(self.locals.values()) + list(self.wires.values()) + list(self.in_process.values()):
            wire.close()
