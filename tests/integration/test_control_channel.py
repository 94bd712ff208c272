"""The store's control wire over TLS against a real daemon in its own process (`kvstore serve
--tls-cert/--tls-key`): every store operation a client on another host makes (puts small and
large, lookups, reads, removals, hit reports) crosses it encrypted; a client without the roots,
or with the wrong ones, is refused in one clear line."""
from __future__ import annotations

import json
import socket
import ssl
import subprocess
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.errors import AuthenticationFailed, InvalidConfig, KVStoreError
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import tcp_endpoint

from .test_engine_hardening import Relay

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024
SECRET = "control-secret-0123456789"


def certificate(tmp_path, name: str) -> tuple:
    key, cert = tmp_path / f"{name}-key.pem", tmp_path / f"{name}-cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


class Recorder(Relay):
    """A relay (test_engine_hardening's, injecting nothing) that keeps every byte the client sends:
    what someone on the path reads."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.seen = bytearray()
        super().__init__(*upstream, forged=b"")

    def _pump(self, src: socket.socket, dst: socket.socket, to_server: bool) -> None:
        super()._pump(_Kept(src, self.seen) if to_server else src, dst, to_server)


class _Kept:
    """`sock`, the bytes received from it also appended to `seen`."""

    def __init__(self, sock: socket.socket, seen: bytearray) -> None:
        self._sock, self._seen = sock, seen

    def recv(self, n: int) -> bytes:
        data = self._sock.recv(n)
        self._seen += data
        return data

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


@pytest.fixture
def tls_node(etcd_server, spawn_daemon, tmp_path):
    key, cert = certificate(tmp_path, "kvstore-node")
    cluster = uuid.uuid4().hex[:8]
    node = spawn_daemon("ctl-node", etcd_server.url, cluster, secret=SECRET,
                        extra=["--tls-cert", str(cert), "--tls-key", str(key)])
    return node, cluster, cert


def test_every_store_operation_crosses_the_tcp_wire_encrypted(etcd_server, tls_node, monkeypatch):
    """Kills: a TCP wire left in the clear on a node with --tls-cert (the relay would read the
    frames' JSON and the blocks' bytes)."""
    node, cluster, cert = tls_node
    rng = np.random.default_rng(7)
    small = rng.integers(0, 256, BLOCK, dtype=np.uint8)  # inline, with the request
    large = rng.integers(0, 256, 1 << 20, dtype=np.uint8)  # reserve, engine write, commit
    h_small, h_large = external_hashes([7, 8], FP)
    # transport="tcp": on this host the client would otherwise use the daemon's unix socket, which
    # never touches the network. Its control wire goes through a relay that records what it sends.
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, tls_ca=str(cert),
                transport="tcp") as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        segment = json.loads(client.mirror.segments["ctl-node"])
        recorder = Recorder(tcp_endpoint("tcp://" + segment["kvstore_wire"]))
        segment["kvstore_wire"] = f"127.0.0.1:{recorder.port}"
        relayed, mirror, heard = json.dumps(segment), client.mirror, type(client.mirror).segments
        monkeypatch.setattr(type(mirror), "segments", property(  # this client's mirror names the relay
            lambda m: {**heard.fget(m), "ctl-node": relayed} if m is mirror else heard.fget(m)))
        try:
            assert client.put(h_small, small) == 1 and client.put(h_large, large) == 1
            assert client.stats["wire_puts"] == 1
            out_small, out_large = np.zeros_like(small), np.zeros_like(large)
            assert client.get(h_small, out_small) and np.array_equal(out_small, small)
            assert client.get(h_large, out_large) and np.array_equal(out_large, large)
            assert [r is not None for r in client.reads.lookup("ctl-node", FP.digest, [h_small, h_large])] == \
                [True, True]
            assert client.remove([h_small]) == 1
            frames = client.links.wires["ctl-node"]._idle[0][0]
            assert isinstance(frames.sock, ssl.SSLSocket)
        finally:
            recorder.close()
        assert len(recorder.seen) > BLOCK  # the small put's block went through it
        for plain in (b'"op"', b"reserve", FP.digest.encode(), bytes(small[:64])):
            assert plain not in recorder.seen, plain


def test_a_client_without_the_roots_or_with_others_is_refused(etcd_server, tls_node, tmp_path):
    """Kills: a client that talks plaintext to a TLS wire (or trusts any certificate) instead of
    refusing in one line."""
    node, cluster, _ = tls_node
    data = np.ones(BLOCK, np.uint8)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport="tcp") as plain:
        assert plain.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        with pytest.raises(KVStoreError, match="speaks TLS.*tls_ca"):
            plain.put(external_hashes([9], FP)[0], data)
        with pytest.raises(InvalidConfig, match="speaks TLS"):
            plain.links.control("ctl-node")
    _, other = certificate(tmp_path, "someone-else")
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, tls_ca=str(other),
                transport="tcp", timeout=3.0) as wrong:
        assert wrong.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        with pytest.raises(AuthenticationFailed, match="certificate does not verify"):
            wrong.put(external_hashes([10], FP)[0], data)


def test_a_client_given_roots_never_talks_to_a_node_in_the_clear(etcd_server, spawn_daemon, tmp_path):
    """Kills: a client given tls_ca that falls back to the clear wire of a node without --tls-cert
    (or waits out its timeout on the node's reset) instead of refusing in one line; and roots that
    are not PEM failing with a traceback."""
    _, cert = certificate(tmp_path, "kvstore-node")
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("plain-node", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, tls_ca=str(cert),
                transport="tcp") as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        with pytest.raises(InvalidConfig, match="in the clear"):
            client.put(external_hashes([11], FP)[0], np.ones(BLOCK, np.uint8))
    garbage = tmp_path / "not-pem"
    garbage.write_bytes(b"\x00\x01 not a certificate")
    for roots in (str(garbage), str(tmp_path / "missing.pem")):
        with pytest.raises(InvalidConfig, match="tls_ca"):
            Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, tls_ca=roots)
