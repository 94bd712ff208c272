"""Tenants' capacity shares against a real daemon in its own process and real etcd: the tenants file
gives acme half and beta a quarter of each tier. Beta stores a few blocks (within its share), then
acme streams blocks far past the node's DRAM: every one of beta's blocks stays and reads back, acme
evicts its own, and what each tenant holds is in /metrics and `kvstore admin tenants`.

Kills (seen failing): eviction in plain LRU order whatever the shares (acme's stream evicted every
block of beta's).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid

import numpy as np

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

CLUSTER_SECRET = "tenant-shares-cluster-secret-01"
SECRETS = {"acme": "acme-shares-secret-0123456789", "beta": "beta-shares-secret-9876543210"}
FPS = {name: ModelFingerprint("shares", "float16", 16, 2, 2, 64, kv_layout="bytes", tenant=name) for name in SECRETS}
BLOCK = 64 << 10
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def tenant(etcd_server, cluster: str, name: str) -> Client:
    client = Client(etcd_server.url, cluster=cluster, fingerprint=FPS[name], secret=SECRETS[name], tenant=name)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    return client


def metrics(daemon) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvstore_tenant_")}


def test_a_tenant_filling_the_store_does_not_evict_another_within_its_share(etcd_server, spawn_daemon, tmp_path):
    tenants = tmp_path / "tenants"
    tenants.write_text(f"acme {SECRETS['acme']} capacity=50%\nbeta {SECRETS['beta']} capacity=25%\n")
    tenants.chmod(0o600)
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("shared", etcd_server.url, cluster, secret=CLUSTER_SECRET, dram="4MiB",
                          extra=["--tenants", str(tenants)])
    with tenant(etcd_server, cluster, "beta") as beta, tenant(etcd_server, cluster, "acme") as acme:
        kept = external_hashes(range(12), FPS["beta"])  # 768 KiB of its 1 MiB share
        for i, h in enumerate(kept):
            assert beta.put(h, block(i)) == 1
        stream = external_hashes(range(1000, 1200), FPS["acme"])  # 12.5 MiB into 4 MiB
        for i, h in enumerate(stream):
            assert acme.put(h, block(1000 + i)) == 1
        for i, h in enumerate(kept):
            out = np.zeros(BLOCK, np.uint8)
            assert beta.get(h, out) and np.array_equal(out, block(i)), f"beta's block {i} was evicted"
        assert acme.mirror.wait_until(lambda m: not m.contains(FPS["acme"], stream[0]), 10)  # acme's own went
        out = np.zeros(BLOCK, np.uint8)
        assert acme.get(stream[-1], out) and np.array_equal(out, block(1199))
    seen = metrics(daemon)
    assert seen['kvstore_tenant_bytes{tenant="beta",tier="dram"}'] == 12 * BLOCK
    assert seen['kvstore_tenant_share_bytes{tenant="beta",tier="dram"}'] == 1 << 20
    assert seen['kvstore_tenant_bytes{tenant="acme",tier="dram"}'] > 2 << 20  # over its share: nobody else wants room
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "admin", "tenants", "--metadata", etcd_server.url,
                           "--cluster", cluster, "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=clean)
    assert done.returncode == 0, done.stderr
    rows = {(r["tenant"], r["tier"]): r for r in json.loads(done.stdout)["tenants"]}
    assert rows[("beta", "dram")] == {"tenant": "beta", "node": "shared", "tier": "dram", "bytes": 12 * BLOCK,
                                      "share_bytes": 1 << 20}
    assert rows[("acme", "dram")]["share_bytes"] == 2 << 20
