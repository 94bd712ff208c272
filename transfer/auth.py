"""Connection handshake: framing, an HMAC challenge both ways, and the peer's declared role.

Either side proves it knows the cluster secret without sending it; an engine without a secret
uses the empty key, so a peer with a secret never authenticates against one without.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any

from .errors import AuthenticationFailed, ProtocolError

PROTOCOL_VERSION = 1
MAX_FRAME = 1 << 20


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    payload = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("connection closed during handshake")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = struct.unpack("<I", _recv_exact(sock, 4))
    if length > MAX_FRAME:
        raise ProtocolError(f"control frame of {length} bytes exceeds {MAX_FRAME}")
    try:
        message = json.loads(_recv_exact(sock, length))
    except ValueError as exc:
        raise ProtocolError("control frame is not JSON") from exc
    if not isinstance(message, dict):
        raise ProtocolError("control frame is not a JSON object")
    return message


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(secret, label + first + second, hashlib.sha256).hexdigest()


def client_handshake(sock: socket.socket, secret: bytes, role: str, name: str) -> dict[str, Any]:
    """Authenticate to a server as `role` ("ctl" | "data"); returns the server's hello."""
    client_nonce = os.urandom(32)
    send_frame(sock, {"hello": PROTOCOL_VERSION, "role": role, "name": name, "nonce": client_nonce.hex()})
    hello = recv_frame(sock)
    if hello.get("hello") != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol {hello.get('hello')!r}, we speak {PROTOCOL_VERSION}")
    server_nonce = bytes.fromhex(str(hello.get("nonce", "")))
    expected = _mac(secret, b"server", client_nonce, server_nonce)
    if not hmac.compare_digest(expected, str(hello.get("mac", ""))):
        raise AuthenticationFailed("peer could not prove it knows the cluster secret")
    send_frame(sock, {"mac": _mac(secret, b"client", server_nonce, client_nonce)})
    verdict = recv_frame(sock)
    if not verdict.get("ok"):
        raise AuthenticationFailed(str(verdict.get("error", "peer refused our credentials")))
    return hello


def server_handshake(sock: socket.socket, secret: bytes, name: str) -> dict[str, Any]:
    """Challenge a connecting client; returns its hello (with its role) or raises."""
    hello = recv_frame(sock)
    if hello.get("hello") != PROTOCOL_VERSION or hello.get("role") not in ("ctl", "data"):
        send_frame(sock, {"hello": PROTOCOL_VERSION, "nonce": "", "mac": ""})
        raise ProtocolError(f"bad hello {hello!r:.200}")
    client_nonce = bytes.fromhex(str(hello.get("nonce", "")))
    server_nonce = os.urandom(32)
    send_frame(sock, {"hello": PROTOCOL_VERSION, "name": name, "nonce": server_nonce.hex(),
                      "mac": _mac(secret, b"server", client_nonce, server_nonce)})
    answer = recv_frame(sock)
    if not hmac.compare_digest(_mac(secret, b"client", server_nonce, client_nonce), str(answer.get("mac", ""))):
        send_frame(sock, {"ok": False, "error": "authentication failed: wrong or missing cluster secret"})
        raise AuthenticationFailed(f"client {hello.get('name')!r} failed the challenge")
    send_frame(sock, {"ok": True})
    return hello
