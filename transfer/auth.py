"""Connection handshake and authenticated control frames.

Protocol 2: both hellos (role, names, nonces, wire mode) form a transcript; the client proves it
knows the cluster secret over the transcript first, then the server does. Both derive per-direction
session keys from the secret and the transcript, so a party that relays a handshake learns nothing
it can use: every later frame (control frames here, data frames in the native engine when the wire
mode is "aead") is authenticated with keys only the two ends hold. One deadline covers the whole
handshake, however slowly the other side trickles its bytes.

Tenants: a client hello may name a tenant; the server then checks the client's proof, and derives
the session keys, with that tenant's own secret (from the tenants it was given) instead of the
cluster secret, and the session carries the tenant. Tenant secrets are independent of the cluster
secret and of each other: a tenant proves nothing but itself. An unknown tenant fails like a wrong
secret. A tenant's engine identity is scoped by its name (`scoped_peer`), so the write grants a
server gives one tenant's engine can never be claimed by another tenant's.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import AuthenticationFailed, ProtocolError, TransferTimeout

PROTOCOL_VERSION = 2
MAX_FRAME = 1 << 20
MAX_HELLO = 4096  # before authentication a peer gets this much of our memory, no more
WIRE_MODES = ("aead", "plain")  # per-frame AES-GCM on TCP data streams, or plaintext (trusted network)
_MAC_BYTES = 32
PEER_ID = re.compile(r"[0-9a-f]{32}")  # an engine's peer identity: 128 random bits, hex
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch; no ':' (kvstore.keys uses it)
TENANT_RULE = "1-64 chars of [A-Za-z0-9_.-], starting with a letter or digit"


def scoped_peer(tenant: str, peer: str) -> str:
    """The identity write grants name for engine `peer` authenticated as `tenant` ("" for the
    cluster): a tenant's engines can only ever hold grants made for that tenant."""
    return f"{tenant}/{peer}" if tenant and peer else peer


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout("handshake did not finish before its deadline")
            sock.settimeout(left)
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("connection closed during handshake")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _decode(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("control frame is not JSON") from exc
    if not isinstance(message, dict):
        raise ProtocolError("control frame is not a JSON object")
    return message


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """One unauthenticated frame (handshake only)."""
    payload = _encode(message)
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def recv_raw(sock: socket.socket, limit: int = MAX_FRAME, deadline: float | None = None) -> bytes:
    (length,) = struct.unpack("<I", _recv_exact(sock, 4, deadline))
    if length > limit:
        raise ProtocolError(f"control frame of {length} bytes exceeds {limit}")
    return _recv_exact(sock, length, deadline)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME, deadline: float | None = None) -> dict[str, Any]:
    """One unauthenticated frame (handshake only)."""
    return _decode(recv_raw(sock, limit, deadline))


@dataclass(frozen=True)
class Session:
    """Outcome of a handshake: the peer's hello, the agreed wire mode and our two session keys."""

    hello: dict[str, Any]
    wire: str
    tx: bytes
    rx: bytes
    tenant: str = ""  # the tenant the client authenticated as ("" : the cluster secret)

    @property
    def peer(self) -> str:
        """The peer identity the client's hello named ("" when none, or not a valid one): proven
        with the rest of the hello by the client's MAC over the transcript."""
        value = self.hello.get("peer")
        return value if isinstance(value, str) and PEER_ID.fullmatch(value) else ""

    @property
    def identity(self) -> str:
        """The peer identity, scoped by the tenant it authenticated as (what write grants name)."""
        return scoped_peer(self.tenant, self.peer)

    @property
    def native_keys(self) -> tuple[bytes, bytes]:
        """(tx, rx) for the native data plane; empty keys mean plaintext."""
        return (self.tx, self.rx) if self.wire == "aead" else (b"", b"")


def _transcript(client_hello: bytes, server_hello: bytes) -> bytes:
    h = hashlib.sha256(b"kvstore-transfer-2")
    for part in (client_hello, server_hello):
        h.update(struct.pack("<I", len(part)) + part)
    return h.digest()


def _mac(secret: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, label + transcript, hashlib.sha256).digest()


def _keys(secret: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(client->server, server->client) session keys."""
    return _mac(secret, b"key c2s", transcript), _mac(secret, b"key s2c", transcript)


def _agree(ours: str, theirs: Any) -> str:
    if theirs not in WIRE_MODES:
        raise ProtocolError(f"unknown wire mode {theirs!r}")
    return "aead" if "aead" in (ours, theirs) else "plain"


def _hex(value: Any, what: str) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ProtocolError(f"{what} must be 32 bytes of hex")
    return raw


def client_handshake(sock: socket.socket, secret: bytes, role: str, name: str, *, wire: str = "aead",
                     timeout: float = 5.0, peer: str = "", tenant: str = "") -> Session:
    """Authenticate to a server as `role` ("ctl" | "data"); returns the session. `peer`: the
    engine's peer identity (what the server's write grants name), authenticated with the rest.
    `tenant`: authenticate as this tenant, `secret` being the tenant's own (not the cluster's)."""
    deadline = time.monotonic() + timeout
    hello = {"hello": PROTOCOL_VERSION, "role": role, "name": name, "nonce": os.urandom(32).hex(), "wire": wire}
    if peer:
        hello["peer"] = peer
    if tenant:
        hello["tenant"] = tenant
    ours = _encode(hello)
    sock.settimeout(timeout)
    sock.sendall(struct.pack("<I", len(ours)) + ours)
    raw = recv_raw(sock, MAX_HELLO, deadline)
    hello = _decode(raw)
    if hello.get("hello") != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol {hello.get('hello')!r}, we speak {PROTOCOL_VERSION}")
    _hex(hello.get("nonce"), "server nonce")
    agreed = _agree(wire, hello.get("wire"))
    transcript = _transcript(ours, raw)
    send_frame(sock, {"mac": _mac(secret, b"client", transcript).hex()})
    verdict = recv_frame(sock, MAX_HELLO, deadline)
    if not verdict.get("ok"):
        raise AuthenticationFailed(str(verdict.get("error", "peer refused our credentials"))[:200])
    if not hmac.compare_digest(_mac(secret, b"server", transcript).hex(), str(verdict.get("mac", ""))):
        raise AuthenticationFailed("peer could not prove it knows the cluster secret")
    c2s, s2c = _keys(secret, transcript)
    return Session(hello, agreed, c2s, s2c, tenant)


def server_handshake(sock: socket.socket, secret: bytes, name: str, *, wire: str = "aead",
                     timeout: float = 5.0, tenants: Mapping[str, bytes] | None = None) -> Session:
    """Challenge a connecting client within `timeout` in all; returns its session or raises. A
    client whose hello names a tenant proves itself with that tenant's secret from `tenants`."""
    deadline = time.monotonic() + timeout
    raw = recv_raw(sock, MAX_HELLO, deadline)
    hello = _decode(raw)
    if hello.get("hello") != PROTOCOL_VERSION or hello.get("role") not in ("ctl", "data"):
        raise ProtocolError(f"bad hello {raw[:200]!r}")
    _hex(hello.get("nonce"), "client nonce")
    tenant = hello.get("tenant", "")
    if tenant:
        if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
            raise ProtocolError(f"tenant must be {TENANT_RULE}")
        # An unknown tenant meets a key no one holds: it fails exactly as a wrong secret does.
        secret = (tenants or {}).get(tenant) or os.urandom(32)
    agreed = _agree(wire, hello.get("wire"))
    ours = _encode({"hello": PROTOCOL_VERSION, "name": name, "nonce": os.urandom(32).hex(), "wire": wire})
    sock.sendall(struct.pack("<I", len(ours)) + ours)
    transcript = _transcript(raw, ours)
    answer = recv_frame(sock, MAX_HELLO, deadline)
    # The client proves itself first, over both nonces: our proof is never an oracle for strangers.
    if not hmac.compare_digest(_mac(secret, b"client", transcript).hex(), str(answer.get("mac", ""))):
        send_frame(sock, {"ok": False, "error": f"authentication failed: wrong secret for tenant {tenant!r}, or no "
                                               "such tenant here" if tenant else
                          "authentication failed: wrong or missing cluster secret"})
        raise AuthenticationFailed(f"client {str(hello.get('name'))[:64]!r}"
                                   f"{f' of tenant {tenant!r}' if tenant else ''} failed the challenge")
    send_frame(sock, {"ok": True, "mac": _mac(secret, b"server", transcript).hex()})
    c2s, s2c = _keys(secret, transcript)
    return Session(hello, agreed, s2c, c2s, tenant)


class Channel:
    """Control frames after the handshake: each carries a MAC over (direction, sequence, payload)
    under the session key, so frames cannot be injected, replayed or reordered."""

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self.sock = sock
        self._tx, self._rx = session.tx, session.rx
        self._sent = self._received = 0

    def _tag(self, key: bytes, seq: int, payload: bytes) -> bytes:
        return hmac.new(key, struct.pack("<Q", seq) + payload, hashlib.sha256).digest()

    def send(self, message: dict[str, Any]) -> None:
        payload = _encode(message)
        tag = self._tag(self._tx, self._sent, payload)
        self._sent += 1
        self.sock.sendall(struct.pack("<I", len(payload)) + payload + tag)

    def recv(self) -> dict[str, Any]:
        payload = recv_raw(self.sock)
        tag = _recv_exact(self.sock, _MAC_BYTES, None)
        if not hmac.compare_digest(tag, self._tag(self._rx, self._received, payload)):
            raise AuthenticationFailed("control frame failed authentication (injected or replayed)")
        self._received += 1
        return _decode(payload)
