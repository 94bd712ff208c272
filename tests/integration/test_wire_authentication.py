"""What a store daemon's control channels authenticate, against someone on the path who holds no
secret and a local user who is not the daemon's: a frame injected or replayed after the handshake
(both framed wires: the same-host unix socket and its TCP twin, through a relay of ours), block
bytes altered in flight on the TCP wire, a connection from another uid on the daemon's same-host
sockets, and a gRPC control token carried over to another request body. Real etcd, a real daemon
in its own process. Each test's docstring names the broken variant it kills (each was applied to
a copy of the tree and seen to fail it).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import threading
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import ATTACHMENT_TAG, TCP_SCHEME, connect, tcp_endpoint
from kvstore_testing.node_status import node_counters
from transfer.auth import client_handshake

FP = ModelFingerprint("wire-auth", "float16", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "wire-authentication-secret"
NOBODY = 65534


def _exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


class Relay:
    """A relay on the path between a client and a daemon's wire, holding no secret: it passes the
    handshake through untouched, then, on the client's side of the stream, once: `inject` puts a
    frame of its own (a lookup under a made-up tag) before the client's first; `replay` sends the
    client's first frame again right after it; `alter` flips a byte of the first put's block bytes.
    Everything else, and all the daemon says, goes through as it is."""

    def __init__(self, upstream: str, mode: str) -> None:
        self.upstream, self.mode, self.done = upstream, mode, False
        self.tcp = upstream.startswith(TCP_SCHEME)
        if self.tcp:
            self._server = socket.create_server(("127.0.0.1", 0))
            self.address = f"{TCP_SCHEME}127.0.0.1:{self._server.getsockname()[1]}"
        else:
            self.address = f"relay-{uuid.uuid4().hex}"
            self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._server.bind("\0" + self.address)
            self._server.listen(8)
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _dial(self) -> socket.socket:
        if self.tcp:
            return socket.create_connection(tcp_endpoint(self.upstream), timeout=10)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + self.upstream if not self.upstream.startswith("/") else self.upstream)
        return sock

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            server = self._dial()
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _requests(self, client: socket.socket, server: socket.socket) -> None:
        try:
            for _ in range(2):  # the client's hello and its proof: untouched
                head = _exact(client, 4)
                server.sendall(head + _exact(client, struct.unpack("<I", head)[0]))
            while True:
                head = _exact(client, 4)
                payload = _exact(client, struct.unpack("<I", head)[0])
                frame = head + payload + _exact(client, 32)
                # `done` is marked before anything is sent: the daemon's answer or close can reach
                # the client (and the test read `done`) before this thread runs again after sendall.
                tamper = self.mode in ("inject", "replay") and not self.done
                self.done = self.done or tamper
                if tamper and self.mode == "inject":
                    forged = json.dumps({"op": "lookup", "fp": FP.digest, "hashes": []}).encode()
                    server.sendall(struct.pack("<I", len(forged)) + forged + os.urandom(32))
                server.sendall(frame)
                message = json.loads(payload)
                if message.get("op") == "put" and message.get("hashes"):
                    rest = bytearray(_exact(client, sum(message["sizes"]) + (ATTACHMENT_TAG if self.tcp else 0)))
                    if self.mode == "alter" and not self.done:
                        rest[0] ^= 0x01
                        self.done = True
                    server.sendall(rest)
                if tamper and self.mode == "replay":
                    server.sendall(frame)
        except (OSError, ValueError):
            pass
        finally:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for sock in self._socks:
            sock.close()


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    """A secured daemon (its own process) and a client; module-scoped: the daemon serves every test."""
    import subprocess
    import sys

    tmp = tmp_path_factory.mktemp("wire-auth")
    secret_file = tmp / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    name = uuid.uuid4().hex[:8]
    log = open(tmp / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--node", "guarded", "--metadata",
                             etcd_server.url, "--cluster", name, "--dram", "64MiB", "--timeout", "2",
                             "--secret-file", str(secret_file), "--admin-token-file", str(tmp / "admin-token")],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        hello = json.loads(proc.stdout.readline())
        with Client(etcd_server.url, cluster=name, fingerprint=FP, secret=SECRET) as client:
            assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
            yield client, hello["control"]
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def wire_address(client: Client, wire: str) -> str:
    link = client.links.local("guarded") if wire == "unix" else client.links.wire("guarded")
    assert link is not None
    return link.address


def still_serves(client: Client, first: int) -> None:
    items = [(h, np.full(4096, i + 1, np.uint8)) for i, h in enumerate(external_hashes(range(first, first + 2), FP))]
    client.put_many(items)
    outs = [np.zeros(4096, np.uint8) for _ in items]
    assert all(client.get_many([h for h, _ in items], outs))


@pytest.mark.parametrize("wire", ["unix", "tcp"])
def test_a_frame_injected_after_the_handshake_is_refused(cluster, wire):
    """Kills: the daemon's framed wire not checking each frame's HMAC (Frames.recv taking any tag):
    a relay without the secret then gets its own request answered on the client's connection."""
    client, _ = cluster
    relay = Relay(wire_address(client, wire), "inject")
    try:
        frames = connect(relay.address, SECRET.encode(), "victim", 5.0)
        frames.send({"op": "lookup", "fp": FP.digest, "hashes": [external_hashes([1], FP)[0].hex()]})
        with pytest.raises((ConnectionError, OSError)):  # closed unanswered: neither request is served
            frames.recv(5.0)
        assert relay.done
    finally:
        relay.close()
    still_serves(client, 10)


@pytest.mark.parametrize("wire", ["unix", "tcp"])
def test_a_frame_replayed_after_the_handshake_is_refused(cluster, wire):
    """Kills: the same (no per-frame HMAC check): the relay's copy of the client's frame would be
    served a second time (here a second answer; for a put, a second write)."""
    client, _ = cluster
    relay = Relay(wire_address(client, wire), "replay")
    try:
        frames = connect(relay.address, SECRET.encode(), "victim", 5.0)
        frames.send({"op": "lookup", "fp": FP.digest, "hashes": [external_hashes([2], FP)[0].hex()]})
        assert frames.recv(5.0) == {"ok": True, "records": [None]}  # the original is served
        assert relay.done
        with pytest.raises((ConnectionError, OSError)):  # its copy is not: the connection ends
            frames.recv(5.0)
    finally:
        relay.close()
    still_serves(client, 20)


def test_block_bytes_altered_in_flight_on_the_tcp_wire_are_refused_at_the_wire(cluster):
    """Kills: the TCP wire taking a put's raw bytes unauthenticated (no tag after the attachments,
    or a tag not checked): the relay's altered block then reached the node's digest check (and the
    node answered); now the wire refuses it before anything is sealed, and the connection ends."""
    client, _ = cluster
    h = external_hashes([3], FP)[0]
    block = np.random.default_rng(3).integers(0, 256, 64 << 10, dtype=np.uint8)
    relay = Relay(wire_address(client, "tcp"), "alter")
    try:
        frames = connect(relay.address, SECRET.encode(), "victim", 5.0)
        frames.send({"op": "put", "fp": FP.digest, "hashes": [h.hex()], "sizes": [block.nbytes],
                     "digests": [block_digest(h, block).hex()], "sync": True}, [block])
        with pytest.raises((ConnectionError, OSError)):
            frames.recv(5.0)
        assert relay.done
    finally:
        relay.close()
    assert counters(cluster).get("wire_attachments_refused", 0) >= 1
    assert not client.contains(h)
    with Client(client.mirror.url, cluster=client.mirror.layout.cluster, fingerprint=FP, secret=SECRET,
                transport="tcp") as honest:  # the same put, untouched, goes in over the TCP wire
        assert honest.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        assert honest.put(h, block) == 1 and honest.stats["wire_puts"] == 1
        out = np.zeros_like(block)
        assert honest.get(h, out) and np.array_equal(out, block)


def counters(cluster) -> dict[str, float]:
    return node_counters(cluster[1])


# Run as uid nobody by a Python outside root's home (this process's may not be readable by nobody):
# the client's side of the handshake, from the standard library alone, with the right secret.
NOBODY_CLIENT = r"""
import hashlib, hmac, json, os, socket, struct, sys
address, secret = sys.argv[1], os.environ["SECRET"].encode()
def frame(sock, payload):
    sock.sendall(struct.pack("<I", len(payload)) + payload)
def read(sock):
    def exact(n):
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out
    return exact(struct.unpack("<I", exact(4))[0])
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5)
try:
    sock.connect(address if address.startswith("/") else "\0" + address)
    ours = json.dumps({"hello": 2, "role": "ctl", "name": "nobody", "nonce": os.urandom(32).hex(),
                       "wire": "plain"}).encode()
    frame(sock, ours)
    theirs = read(sock)
    transcript = hashlib.sha256(b"kvstore-transfer-2" + struct.pack("<I", len(ours)) + ours
                                + struct.pack("<I", len(theirs)) + theirs).digest()
    frame(sock, json.dumps({"mac": hmac.new(secret, b"client" + transcript, hashlib.sha256).hexdigest()}).encode())
    print("authenticated" if json.loads(read(sock)).get("ok") else "refused: wrong secret")
except (ConnectionError, OSError) as exc:
    print(f"refused: {type(exc).__name__}")
"""


def _system_python() -> str | None:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and os.access(candidate, os.X_OK) and not candidate.startswith(os.path.expanduser("~")):
            return candidate
    return None


def _as_nobody(address: str) -> str:
    """Connect to the same-host socket `address` as uid nobody and run the handshake with the right
    secret; what happened, in words."""
    import subprocess

    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", _system_python(),
                           "-c", NOBODY_CLIENT, address], env={"SECRET": SECRET, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30, cwd="/")
    return done.stdout.strip() or f"rc {done.returncode}: {done.stderr.strip()[-300:]}"


@pytest.mark.skipif(os.geteuid() != 0 or _system_python() is None or not shutil.which("setpriv"),
                    reason="needs root to become another user, and a Python that user can run")
@pytest.mark.parametrize("socket_of", ["wire", "engine"])
def test_another_uid_on_the_daemons_same_host_sockets_is_refused(cluster, socket_of):
    """Kills: the daemon not checking the peer's uid (SO_PEERCRED) on its framed wire's unix socket
    (`wire`), or on its engine's same-host socket (`engine`, which hands out the arena's fd): a
    local user who is not the daemon's, even one that learned the secret, would be let in. The
    daemon's own user (root here) still is."""
    client, _ = cluster
    if socket_of == "wire":
        address = wire_address(client, "unix")
    else:
        address = json.loads(client.mirror.segments["guarded"])["unix"]  # the engine's descriptor
    assert address
    outcome = _as_nobody(address)
    assert outcome in ("refused: ConnectionError", "refused: BrokenPipeError",
                       "refused: ConnectionResetError"), outcome  # closed before any answer
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the daemon's own user is let in
    sock.settimeout(5)
    try:
        sock.connect(address if address.startswith("/") else "\0" + address)
        client_handshake(sock, SECRET.encode(), "ctl", "root", wire="plain", timeout=5)
    finally:
        sock.close()


