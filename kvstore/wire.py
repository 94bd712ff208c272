"""The framed control wire: length-prefixed JSON frames, each with an HMAC under the session key
over its sequence number (so frames cannot be injected, replayed or reordered), and raw block bytes
after a frame. Spoken by a store daemon's unix socket and its TCP twin (`kvstore.daemon.local`)
and their clients: the one protocol of the store operations. Over TCP it may run inside TLS (a
node with --tls-cert): the same frames and tags, encrypted.

Over TCP the raw bytes after a frame (attachments) are authenticated too: a 32-byte tag follows
them, keyed BLAKE3 under a key derived from the sender's session key, over the sequence number of
the frame they follow and their bytes. A relay that passes the handshake and the frames untouched
and changes the bytes is refused at the tag, before anything is sealed. Keyed BLAKE3 is a PRF (a
MAC) at 6 GB/s a core here, against 1.3 for HMAC-SHA256: 12 us per 64 KiB, 45 us per 256 KiB a
side. Measured on a put over TCP (client and daemon in processes of their own on 2 busy vCPUs, p50
of alternating tagged and untagged runs): +28-43 us on 64 KiB (8-11 %), +135-152 us on 256 KiB
(23-26 %). The unix socket's attachments carry no tag: nothing sits between its ends, and every process
that may connect to it (the daemon's uid, root) can write the daemon's arena directly anyway."""
from __future__ import annotations

import hmac
import json
import socket
import ssl
import struct
import time
from typing import Any, Sequence

import blake3
from transfer._native import wait_readable

from transfer.auth import client_handshake
from transfer.descriptor import unix_address

from .errors import ConnectionsExhausted, NodeRefused

MAX_FRAME = 4 << 20  # a put of 4096 blocks still fits its header
# Waking a thread parked on an idle vCPU costs 20-30 us here, twice per round trip (a unix socket
# ping-pong between two processes: 43 us parked, 5 us polling). A reply, and a client's next
# request, usually come sooner than these: polled for (without the GIL, yielding to anything else
# runnable) before parking. Serial 64 KiB puts: p50 155 us against 234 us parked, p90 321 vs 425.
REPLY_SPIN_S = 200e-6
NEXT_REQUEST_SPIN_S = 100e-6
_MAC = 32
ATTACHMENT_TAG = 32  # after the attachments of a frame, on a sealed (TCP) wire
TCP_SCHEME = "tcp://"


class MalformedFrame(ValueError):
    """An authentic frame whose payload is not a JSON object: the stream is still in step."""


class AttachmentsAltered(PermissionError):
    """The bytes after a frame failed their tag: changed (or cut, or added to) on the way."""


def _attachment_key(session_key: bytes) -> bytes:
    return hmac.digest(session_key, b"kvstore wire attachments v1", "sha256")


class Frames:
    """Length-prefixed JSON frames with an HMAC over (sequence, payload) in each direction, and raw
    attachments after a frame (`sealed`: followed by their tag, see the module docstring; the
    receiver takes them with recv_into/discard, then `attachments_end`). The socket keeps one
    timeout for every single send and receive; a whole receive also ends at its deadline
    (TimeoutError)."""

    BUFFER = 64 << 10

    def __init__(self, sock: socket.socket, tx: bytes, rx: bytes, timeout: float, sealed: bool = False) -> None:
        self.sock, self._tx, self._rx, self.timeout = sock, tx, rx, timeout
        self.sealed = sealed
        self._attach_tx = _attachment_key(tx) if sealed else b""
        self._attach_rx = _attachment_key(rx) if sealed else b""
        self._incoming: blake3.blake3 | None = None  # the tag of the attachments being received
        self._sent = self._received = 0
        self._buf = bytearray(self.BUFFER)
        self._view = memoryview(self._buf)
        self._head = self._tail = 0  # bytes received but not consumed yet
        # A TLS socket (the TCP wire of a node with --tls-cert) has no gather write, and may hold
        # decrypted bytes that its descriptor no longer shows as readable.
        self._tls = isinstance(sock, ssl.SSLSocket)
        sock.settimeout(timeout)

    @staticmethod
    def _tag(key: bytes, seq: int, payload) -> bytes:
        return hmac.digest(key, struct.pack("<Q", seq) + bytes(payload), "sha256")

    @staticmethod
    def _attachments(key: bytes) -> blake3.blake3:
        # The frame's sequence number goes in last (`_sealed_by`): the bytes are hashed from offset 0,
        # in whole 1 KiB chunks (the prefix cost a 64 KiB put a third more). Their length is the
        # authenticated frame's, so where they end and the number starts is never in doubt.
        return blake3.blake3(key=key)

    @staticmethod
    def _sealed_by(state: blake3.blake3, seq: int) -> bytes:
        state.update(struct.pack("<Q", seq))
        return state.digest()

    def send(self, message: dict[str, Any], attachments: Sequence = ()) -> None:
        """One frame, and (when `attachments` is not empty) their bytes after it, and their tag
        when sealed."""
        payload = json.dumps(message, separators=(",", ":")).encode()
        head = struct.pack("<I", len(payload)) + payload + self._tag(self._tx, self._sent, payload)
        self._sent += 1
        if not attachments:
            self.sock.sendall(head)
            return
        # One gather write for the frame and its blocks (the peer wakes once), finishing what the
        # socket buffer did not take.
        parts = [memoryview(head)] + [memoryview(a).cast("B") for a in attachments]
        if self.sealed:
            tag = self._attachments(self._attach_tx)
            for part in parts[1:]:
                tag.update(part)
            parts.append(memoryview(self._sealed_by(tag, self._sent - 1)))
        if self._tls:
            for part in parts:
                self.sock.sendall(part)
            return
        while parts:
            sent = self.sock.sendmsg(parts[:512])
            while parts and sent >= parts[0].nbytes:
                sent -= parts[0].nbytes
                parts.pop(0)
            if sent:
                parts[0] = parts[0][sent:]

    def _fill(self, need: int, deadline: float | None, idle_until: float | None = None, exact: bool = False) -> None:
        """Have at least `need` (<= BUFFER) unconsumed bytes in the buffer (`exact`: never more, so
        that a descriptor sent after a frame is not read past)."""
        if self._tail - self._head >= need:
            return
        if self._head:
            left = self._tail - self._head
            self._buf[:left] = self._buf[self._head : self._tail]
            self._head, self._tail = 0, left
        while self._tail < need:
            try:
                got = self._recv_some(self._view[self._tail : need if exact else None], deadline)
            except socket.timeout:
                if idle_until is not None and self._tail == 0:
                    if time.monotonic() < idle_until:
                        continue  # a server waiting for the next request: no deadline until it starts
                    raise ConnectionAbortedError("idle connection") from None
                raise TimeoutError("no answer in time") from None
            if got == 0:
                raise ConnectionError("connection closed")
            self._tail += got
            idle_until = None

    def _recv_some(self, view: memoryview, deadline: float | None) -> int:
        """One recv that ends by `deadline`: a peer that sends just often enough to beat the
        socket's timeout cannot stretch a receive past it, and a call given longer than the socket's
        timeout (a sync put's answer) waits that long. Bytes already here count even when late."""
        if deadline is None:
            return self.sock.recv_into(view)
        while True:
            left = deadline - time.monotonic()
            if left >= self.timeout:
                try:
                    return self.sock.recv_into(view)
                except socket.timeout:
                    continue  # the deadline is further off than one socket wait
            self.sock.settimeout(max(left, 0.0))
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):  # past the deadline, nothing buffered
                raise TimeoutError("no data before the deadline") from None
            finally:
                self.sock.settimeout(self.timeout)

    def recv_into(self, view: memoryview, deadline: float | None) -> None:
        """Exactly view.nbytes bytes (an attachment) into `view` (sealed: counted into the tag that
        `attachments_end` checks)."""
        self._read_into(view, deadline)
        if self.sealed:
            if self._incoming is None:
                self._incoming = self._attachments(self._attach_rx)
            self._incoming.update(view)

    def attachments_end(self, deadline: float | None) -> None:
        """After the attachments of the last frame received (at least one was announced): on a
        sealed wire, read their tag and raise AttachmentsAltered unless it is theirs."""
        if not self.sealed:
            return
        expected = self._sealed_by(self._incoming or self._attachments(self._attach_rx), self._received - 1)
        self._incoming = None
        tag = bytearray(ATTACHMENT_TAG)
        self._read_into(memoryview(tag), deadline)
        if not hmac.compare_digest(bytes(tag), expected):
            raise AttachmentsAltered("the bytes after a frame failed authentication (altered in flight)")

    def _read_into(self, view: memoryview, deadline: float | None) -> None:
        n = view.nbytes
        take = min(n, self._tail - self._head)
        if take:
            view[:take] = self._view[self._head : self._head + take]
            self._head += take
        while take < n:
            try:
                got = self._recv_some(view[take:], deadline)
            except socket.timeout:
                raise TimeoutError("no data in time") from None
            if got == 0:
                raise ConnectionError("connection closed")
            take += got

    def discard(self, n: int, deadline: float | None) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n > 0:
            take = min(n, scratch.nbytes)
            self.recv_into(scratch[:take], deadline)
            n -= take

    def recv(self, timeout: float, idle: float = 0.0, exact: bool = False, spin: float = 0.0) -> dict[str, Any]:
        """One frame within `timeout`; with `idle` (seconds), the wait for its first byte may last
        that long instead (a server waiting for the next request; ConnectionAbortedError after it),
        the rest still has `timeout`. `exact`: read nothing past the frame (a descriptor follows it).
        `spin`: first poll this many seconds without the GIL for the frame to arrive."""
        if spin and self._tail - self._head < 4 and not (self._tls and self.sock.pending()):
            wait_readable(self.sock.fileno(), spin)
        deadline = None if idle else time.monotonic() + timeout
        self._fill(4, deadline, time.monotonic() + idle if idle else None, exact)
        deadline = time.monotonic() + timeout if deadline is None else deadline
        (length,) = struct.unpack_from("<I", self._buf, self._head)
        if length > MAX_FRAME:
            raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME}")
        total = 4 + length + _MAC
        if total <= self.BUFFER:
            self._fill(total, deadline, exact=exact)
            body = bytes(self._view[self._head + 4 : self._head + total])
            self._head += total
        else:
            self._head += 4
            whole = bytearray(length + _MAC)
            self._read_into(memoryview(whole), deadline)
            body = bytes(whole)
        payload, tag = body[:length], body[length:]
        if not hmac.compare_digest(tag, self._tag(self._rx, self._received, payload)):
            raise PermissionError("frame failed authentication (injected or replayed)")
        self._received += 1
        self._incoming = None
        try:
            message = json.loads(payload)
        except (ValueError, RecursionError) as exc:
            raise MalformedFrame(f"frame is not JSON: {str(exc)[:200]}") from None
        if not isinstance(message, dict):
            raise MalformedFrame("frame is not a JSON object")
        return message


def connect(name: str, secret: bytes, client: str, timeout: float, connect_timeout: float | None = None,
            tenant: str = "", tls: ssl.SSLContext | None = None) -> Frames:
    """A client's authenticated connection to a daemon's control wire: its same-host socket, or
    `tcp://host:port` (the same wire over TCP, attachments sealed). Connecting and the handshake
    take at most `connect_timeout` (default `timeout`); every later send and receive, `timeout`.
    `tenant`: authenticate as that tenant, `secret` being its own. `tls`: over TCP, speak TLS
    (the node's certificate checked against its roots and its address). ConnectionsExhausted when the
    node admits no more connections (of this tenant's, or at all) on this socket."""
    tcp = name.startswith(TCP_SCHEME)
    if tcp:
        host, port = tcp_endpoint(name)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Room for a whole inline put in the socket (the kernel caps it at net.core.wmem_max): the
        # sender writes it in one go instead of waking the node once per 200 KiB.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        within = timeout if connect_timeout is None else connect_timeout
        sock.settimeout(within)
        if tcp:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect((host, port))
            if tls is not None:
                try:
                    sock = tls.wrap_socket(sock, server_hostname=host)  # the TLS handshake, within `within`
                except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:  # closed by the node mid-handshake
                    raise ConnectionError(f"connection closed during the TLS handshake: {exc}") from None
        else:
            sock.connect(unix_address(name))
        session = client_handshake(sock, secret, "ctl", client, wire="plain", timeout=within, tenant=tenant)
        frames = Frames(sock, session.tx, session.rx, timeout, sealed=tcp)  # sets the socket's timeout for what follows
        admitted = frames.recv(within)  # sent with the node's last handshake message: no round trip of its own
        if not admitted.get("ok"):
            why = str(admitted.get("error", ""))[:500]
            if admitted.get("code") == "busy":
                raise ConnectionsExhausted(why)
            raise NodeRefused(why)
        return frames
    except BaseException:
        sock.close()
        raise


def tcp_endpoint(address: str) -> tuple[str, int]:
    """(host, port) of a `tcp://host:port` wire address; ValueError when it names none."""
    host, _, port = address[len(TCP_SCHEME):].rpartition(":")
    if not address.startswith(TCP_SCHEME) or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a wire address: {address[:100]!r}")
    return host.strip("[]"), int(port)
