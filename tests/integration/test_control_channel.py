"""The store control channel against a real daemon: TLS like the admin API, and per-call tokens
bound to the node and method that a captured one cannot be replayed."""
from __future__ import annotations

import subprocess
import uuid

import grpc
import numpy as np
import pytest

from kvstore import Client
from kvstore.access import control_token
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.store.v1 import store_pb2, store_pb2_grpc

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024
SECRET = "control-secret-0123456789"
STATS = "/kvstore.store.v1.StoreControl/Stats"


@pytest.fixture
def tls_files(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=kvstore-test", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def test_control_calls_over_tls_with_one_time_tokens(etcd_server, spawn_daemon, tls_files):
    key, cert = tls_files
    cluster = uuid.uuid4().hex[:8]
    node = spawn_daemon("ctl-node", etcd_server.url, cluster, secret=SECRET,
                        extra=["--tls-cert", str(cert), "--tls-key", str(key)])
    h = external_hashes([7], FP)[0]
    data = np.random.default_rng(7).integers(0, 256, BLOCK, dtype=np.uint8)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, tls_ca=str(cert)) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        assert client.put(h, data) == 1
        out = np.zeros(BLOCK, np.uint8)
        assert client.get(h, out) and np.array_equal(out, data)
    # No TLS: refused. (transport="tcp": on this host the client would otherwise use the daemon's
    # same-host unix socket, which never touches the network and needs no TLS.)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport="tcp") as plain:
        assert plain.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        with pytest.raises(Exception):
            plain.put(external_hashes([8], FP)[0], data)

    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(node.control, credentials) as channel:
        stub = store_pb2_grpc.StoreControlStub(channel)
        token = control_token(SECRET.encode(), "ctl-node", STATS, "eve")
        stub.Stats(store_pb2.StatsRequest(), timeout=5, metadata=[("authorization", token)])  # first use: fine
        for bad in (token,  # the same token again: a replay
                    control_token(SECRET.encode(), "other-node", STATS, "eve"),  # minted for another node
                    control_token(SECRET.encode(), "ctl-node", "/kvstore.store.v1.StoreControl/Allocate", "eve"),
                    control_token(b"wrong-secret", "ctl-node", STATS, "eve")):
            with pytest.raises(grpc.RpcError) as info:
                stub.Stats(store_pb2.StatsRequest(), timeout=5, metadata=[("authorization", bad)])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
