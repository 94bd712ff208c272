"""Per-tenant shares of a node's authenticated control-wire connections, against a real daemon in
its own process and real etcd: tenant acme (a share of 4 connections, from the tenants file) opens
connections until the node refuses it, on the same-host unix socket and on the TCP wire. The
refusal is typed and says why (`ConnectionsExhausted`); tenant beta still gets a connection and
puts over the wire; and acme's own client, refused a connection while acme holds its share, waits
within its timeout for one of acme's connections to close and then puts, or fails with the
refusal's reason when none closes.

Kills (each seen failing): a node with no per-tenant share (acme took all 256 slots of the socket:
beta's puts left the wire), a client that gives up at the first refusal (acme's put failed though a
connection came free), a refusal that closes the connection without saying why (the client could
not tell it from a dead node).
"""
from __future__ import annotations

import json
import threading
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.daemon.local import MAX_CONNECTIONS
from kvstore.errors import ConnectionsExhausted, KVStoreError
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import connect

CLUSTER_SECRET = "tenant-connections-cluster-secret"
SECRETS = {"acme": "acme-connections-secret-0123", "beta": "beta-connections-secret-3210"}
FPS = {name: ModelFingerprint("conns", "float16", 16, 2, 2, 64, kv_layout="bytes", tenant=name) for name in SECRETS}
SHARE = 4


@pytest.fixture
def cluster(etcd_server, spawn_daemon, tmp_path):
    tenants = tmp_path / "tenants"
    tenants.write_text(f"acme {SECRETS['acme']} connections={SHARE}\nbeta {SECRETS['beta']}\n")
    tenants.chmod(0o600)
    name = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("shared", etcd_server.url, name, secret=CLUSTER_SECRET, extra=["--tenants", str(tenants)])
    return daemon, name


def client(etcd_server, cluster_name: str, tenant: str, transport: str) -> Client:
    c = Client(etcd_server.url, cluster=cluster_name, fingerprint=FPS[tenant], secret=SECRETS[tenant], tenant=tenant,
               transport="auto" if transport == "unix" else "tcp", timeout=2.0)
    assert c.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    return c


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8)


def address_of(client: Client, node: str, transport: str) -> str:
    """The node's control-wire address, read from its segment (no connection made)."""
    segment = json.loads(client.mirror.segments[node])
    return segment["kvstore_local"] if transport == "unix" else "tcp://" + segment["kvstore_wire"]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_tenant_holding_its_share_of_connections_starves_no_other(etcd_server, cluster, transport):
    daemon, cluster_name = cluster
    with client(etcd_server, cluster_name, "acme", transport) as acme, \
            client(etcd_server, cluster_name, "beta", transport) as beta:
        address = address_of(acme, daemon.name, transport)
        held, refusal = [], None
        try:
            for _ in range(MAX_CONNECTIONS + 1):  # as many as the node lets acme have
                try:
                    held.append(connect(address, SECRETS["acme"].encode(), "greedy", 5.0, tenant="acme"))
                except ConnectionsExhausted as exc:
                    refusal = exc
                    break
            assert len(held) == SHARE and refusal is not None, len(held)
            assert "'acme'" in str(refusal) and f"{SHARE} connections" in str(refusal) and "\n" not in str(refusal)
            # beta is not starved: its puts go over the wire
            h = external_hashes([1], FPS["beta"])[0]
            assert beta.put(h, block(1)) == 1
            assert beta.stats["local_puts" if transport == "unix" else "wire_puts"] == 1
            # acme itself, at its share: its put is refused a connection and says why...
            h = external_hashes([10], FPS["acme"])[0]
            with pytest.raises(KVStoreError, match=f"{SHARE} connections"):
                acme.put(h, block(10))
            # ... or, when one of acme's connections closes meanwhile, waits for it and goes in
            release = threading.Timer(0.3, held.pop().sock.close)
            release.start()
            assert acme.put(h, block(10)) == 1
            release.join()
            assert acme.stats["local_puts" if transport == "unix" else "wire_puts"] == 1
            out = np.zeros(4096, np.uint8)
            assert acme.get(h, out) and np.array_equal(out, block(10))
        finally:
            for frames in held:
                frames.sock.close()
    assert metric(daemon, "kvstore_control_connections_refused", 'reason="tenant"') >= 2


def metric(daemon, name: str, labels: str) -> float:
    """One sample of the daemon's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name) and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not in /metrics")


def test_the_default_share_leaves_room_for_every_tenant_and_the_cluster():
    """Kills: a default that lets one tenant have every slot (or none)."""
    from kvstore.access import TenantLimits, Tenants

    tenants = Tenants({"acme": b"a" * 16, "beta": b"b" * 16}, {"acme": TenantLimits(connections=4)})
    assert tenants.connections("acme", MAX_CONNECTIONS) == 4
    assert tenants.connections("beta", MAX_CONNECTIONS) == MAX_CONNECTIONS // 3
    assert Tenants({f"t{i}": b"%016d" % i for i in range(1000)}).connections("t1", MAX_CONNECTIONS) == 1
