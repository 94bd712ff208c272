"""Tenants that need not trust each other, against a real daemon (`kvstore serve --tenants FILE`,
its own process) and real etcd: two tenants with secrets of their own, each client authenticated as
its tenant in the engine and wire handshakes. The attacker is a tenant client
whose own client-side check was taken out (a client anyone can modify): the daemon must refuse it.
Each test's docstring names the broken variant it kills (applied to a copy of the tree, seen to
fail it)."""
from __future__ import annotations

import json
import os
import signal
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.errors import AccessDenied, AuthenticationFailed
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import connect
from transfer import Engine, TransferError, Write, WriteNotGranted

CLUSTER_SECRET = "tenants-cluster-secret-0123456789"
SECRETS = {"acme": "acme-own-secret-0123456789", "beta": "beta-own-secret-9876543210"}
ACME = ModelFingerprint("tenants", "float16", 16, 2, 2, 64, kv_layout="bytes", tenant="acme")
BETA = ModelFingerprint("tenants", "float16", 16, 2, 2, 64, kv_layout="bytes", tenant="beta")
SIZES = [4096, 1 << 20]  # one control round trip with the bytes; or reserve, engine write, commit


@pytest.fixture
def cluster(etcd_server, spawn_daemon, tmp_path):
    """(the daemon, its cluster name): a node given the two tenants."""
    tenants = tmp_path / "tenants"
    tenants.write_text("# name secret\n" + "".join(f"{name} {secret}\n" for name, secret in SECRETS.items()))
    tenants.chmod(0o600)
    name = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("shared", etcd_server.url, name, secret=CLUSTER_SECRET, extra=["--tenants", str(tenants)])
    return daemon, name


def tenant_client(etcd_server, cluster_name: str, tenant: str, transport: str) -> Client:
    """A client of `tenant` whose control calls go over the same host's unix socket (auto) or the
    TCP wire (tcp)."""
    client = Client(etcd_server.url, cluster=cluster_name, fingerprint=ACME if tenant == "acme" else BETA,
                    secret=SECRETS[tenant], tenant=tenant, transport=transport)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    return client


def attacker(etcd_server, cluster_name: str, transport: str) -> Client:
    """Tenant beta's client, authenticated as beta, with its own check of fingerprints taken out."""
    client = tenant_client(etcd_server, cluster_name, "beta", transport)
    client.put_many([(os.urandom(16), np.ones(size, np.uint8)) for size in SIZES[:1]])  # connected as beta
    client.put_many([(os.urandom(16), np.ones(size, np.uint8)) for size in SIZES[1:]])
    client.tenant = ""  # what its own code no longer checks, the node still does
    client.fingerprint = None
    return client


def block(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("size", SIZES, ids=["inline", "reserved"])
def test_a_tenant_can_neither_squat_nor_overwrite_another_tenants_keys(etcd_server, cluster, transport, size):
    """Kills: a daemon that lets any authenticated client name any fingerprint (no ownership check on
    put, reserve, commit): tenant beta could store acme's key first with its own bytes (squat: acme's
    later put returned 0 and readers got beta's bytes), or race acme's block. The node refuses beta
    (code 'denied' on the wire) and acme's own put stores its bytes."""
    _, cluster_name = cluster
    eve = attacker(etcd_server, cluster_name, transport)
    with eve, tenant_client(etcd_server, cluster_name, "acme", transport) as acme:
        squatted, overwritten = external_hashes([size, size + 1], ACME)
        with pytest.raises(AccessDenied) as denied:  # squat: first, with its own bytes
            eve.put(squatted, block(1, size), fingerprint=ACME.digest)
        assert "may only use fingerprints of its own" in str(denied.value) and "\n" not in str(denied.value)
        stored = acme.put(squatted, block(2, size))
        assert stored == 1 and stored.already_held == 0  # the victim's put stores
        assert acme.put(overwritten, block(3, size)) == 1
        with pytest.raises(AccessDenied):  # overwrite: after
            eve.put(overwritten, block(4, size), fingerprint=ACME.digest)
        with Client(etcd_server.url, cluster=cluster_name, fingerprint=ACME, secret=SECRETS["acme"],
                    tenant="acme") as reader:
            assert reader.mirror.wait_until(lambda m: m.contains(ACME, squatted) and m.contains(ACME, overwritten), 15)
            for h, seed in ((squatted, 2), (overwritten, 3)):
                out = np.zeros(size, np.uint8)
                assert reader.get(h, out) and np.array_equal(out, block(seed, size))


def test_a_tenant_cannot_look_up_or_remove_another_tenants_blocks(etcd_server, cluster):
    """Kills: lookups, touches and removals left out of the ownership check (on either socket of
    the wire): a tenant could learn which of another's blocks a node holds, or drop them."""
    daemon, cluster_name = cluster
    with tenant_client(etcd_server, cluster_name, "acme", "auto") as acme:
        h = external_hashes([7], ACME)[0]
        acme.put(h, block(7, 4096))
        for wire in (acme.links.local(daemon.name), acme.links.wire(daemon.name)):
            frames = connect(wire.address, SECRETS["beta"].encode(), "eve", 5.0, tenant="beta")
            try:
                for op in ({"op": "lookup"}, {"op": "remove"}, {"op": "touch", "corrupt": [h.hex()]}):
                    frames.send({**op, "fp": ACME.digest, "hashes": [h.hex()]})
                    reply = frames.recv(5.0)
                    assert not reply["ok"] and reply["code"] == "denied", (op, reply)
                frames.send({"op": "lookup", "fp": BETA.digest, "hashes": [h.hex()]})  # its own: fine
                assert frames.recv(5.0) == {"ok": True, "records": [None]}
            finally:
                frames.sock.close()
        assert acme.contains(h)
        out = np.zeros(4096, np.uint8)
        assert acme.get(h, out) and np.array_equal(out, block(7, 4096))


def test_a_tenants_engine_is_granted_only_its_own_tenants_slots(etcd_server, cluster):
    """Kills: write grants named by the bare peer id a handshake carries, whatever tenant it
    authenticated as: tenant beta's engine, claiming acme's engine's peer id (seen in the clear on
    the TCP wire), could write acme's reserved slot. Grants are scoped by tenant now: refused,
    while acme's own engine writes it."""
    daemon, cluster_name = cluster
    with tenant_client(etcd_server, cluster_name, "acme", "tcp") as acme:
        h = external_hashes([11], ACME)[0]
        wire = acme.links.wire(daemon.name)
        owner = Engine("acme-engine", listen=None, secret=SECRETS["acme"], tenant="acme")
        forger = Engine("beta-engine", listen=None, secret=SECRETS["beta"], tenant="beta")
        forger.peer_id = owner.peer_id  # the id beta learned
        frames = connect(wire.address, SECRETS["acme"].encode(), "acme", 5.0, tenant="acme")
        try:
            frames.send({"op": "reserve", "fp": ACME.digest, "hashes": [h.hex()], "sizes": [4096],
                         "peer": owner.peer_id})
            token, region, offset, size = frames.recv(5.0)["slots"][0]
            descriptor = json.loads(acme.mirror.segments[daemon.name])
            forged, honest = np.full(4096, 0xEE, np.uint8), block(11, 4096)
            with forger:
                src = forger.register(forged, remote_access=False)
                peer = forger.connect(descriptor, transport="tcp")
                with pytest.raises(WriteNotGranted):
                    forger.transfer([Write(src, 0, peer.region(region), offset, size)])
            with owner:
                src = owner.register(honest, remote_access=False)
                peer = owner.connect(descriptor, transport="tcp")
                owner.transfer([Write(src, 0, peer.region(region), offset, size)])
            frames.send({"op": "commit", "fp": ACME.digest, "tokens": [token],
                         "digests": [block_digest(h, honest).hex()], "sync": True, "peer": owner.peer_id})
            reply = frames.recv(5.0)
            assert reply["ok"] and reply["errors"] == [""], reply
        finally:
            frames.sock.close()
        out = np.zeros(4096, np.uint8)
        assert acme.mirror.wait_until(lambda m: m.contains(ACME, h), 15)
        assert acme.get(h, out) and np.array_equal(out, honest)


def test_a_duplicate_put_says_the_key_was_held(etcd_server, cluster):
    """Kills: a put of a key already held answering 0 with nothing to tell it from a failure to
    store (a squatter's earlier put went unnoticed): PutResult.already_held says so."""
    _, cluster_name = cluster
    with Client(etcd_server.url, cluster=cluster_name, secret=CLUSTER_SECRET) as first, \
            Client(etcd_server.url, cluster=cluster_name, secret=CLUSTER_SECRET, transport="tcp") as second:
        assert second.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        fp = ModelFingerprint("operator", "float16", 16, 2, 2, 64, kv_layout="bytes")
        for size, seed in ((4096, 20), (1 << 20, 21)):
            h = external_hashes([seed], fp)[0]
            done = first.put(h, block(seed, size), fingerprint=fp)
            assert (done, done.already_held) == (1, 0)
            again = second.put(h, block(seed + 100, size), fingerprint=fp)
            assert (again, again.already_held) == (0, 1) and isinstance(again, int)
            # A slot reserve's "held already" carries no record: the second client learns where
            # the block is from the index watch (the inline put's answer teaches it at once).
            assert second.mirror.wait_until(lambda m: m.contains(fp.digest, h), 15)
            out = np.zeros(size, np.uint8)
            assert second.get(h, out, fingerprint=fp) and np.array_equal(out, block(seed, size))  # the first stands
        assert second.stats["already_held"] == 2


def test_a_tenant_is_who_its_secret_says(etcd_server, cluster):
    """Kills: the server checking a tenant's proof with the cluster secret, or with any tenant's:
    a wrong or another tenant's secret, or an unknown tenant, is refused in the handshake."""
    daemon, cluster_name = cluster
    with tenant_client(etcd_server, cluster_name, "acme", "tcp") as acme:
        address = acme.links.wire(daemon.name).address
    for tenant, secret in (("acme", SECRETS["beta"]), ("acme", CLUSTER_SECRET), ("gamma", "gamma-secret-0123456789"),
                           ("beta", SECRETS["acme"])):
        with pytest.raises(AuthenticationFailed):
            connect(address, secret.encode(), "eve", 5.0, tenant=tenant)
        engine = Engine("eve", listen=None, secret=secret, tenant=tenant)
        with engine, pytest.raises(TransferError):
            engine.connect(json.loads(acme.mirror.segments[daemon.name]), transport="tcp")
    with pytest.raises(AuthenticationFailed) as refused:  # a client says it in one line
        with Client(etcd_server.url, cluster=cluster_name, fingerprint=ACME, secret=SECRETS["beta"],
                    tenant="acme") as wrong:
            assert wrong.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
            wrong.put(external_hashes([30], ACME)[0], block(30, 4096))
    assert "tenant" in str(refused.value) and "\n" not in str(refused.value)


def test_a_tenant_asks_the_host_index_about_its_own_blocks_only(etcd_server, cluster):
    """Kills: the host index answering a tenant about another tenant's fingerprint, a tenant's put
    not taken by the host index (etcd is frozen: only the put's answer can list the block), a
    record without its node's seal taken, and a refused question taken for a dead host (the client
    then kept a mirror of its own for good)."""
    daemon, cluster_name = cluster
    with Client(etcd_server.url, cluster=cluster_name, fingerprint=ACME, secret=SECRETS["acme"], tenant="acme",
                index="host") as acme:
        h = external_hashes([11], ACME)[0]
        reply = acme.links.control(daemon.name).call(
            {"op": "index", "q": "learn", "fp": ACME.digest, "node": daemon.name, "count": 1, "records": ["00"]}, [h])[0]
        assert reply["learned"] == 0  # no seal at all
        assert not acme.contains(h)  # the host index runs
        os.kill(etcd_server.proc.pid, signal.SIGSTOP)  # only the put's answer can make the block known
        try:
            acme.put(h, block(11, 4096))
            out = np.zeros(4096, np.uint8)
            assert acme.contains(h) and acme.get(h, out) and np.array_equal(out, block(11, 4096))
        finally:
            os.kill(etcd_server.proc.pid, signal.SIGCONT)
        with pytest.raises(AccessDenied):
            acme.mirror.match(BETA, [h])
        assert acme.mirror.own is None and acme.contains(h)
