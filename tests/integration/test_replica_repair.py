"""Replica repair against real daemons: a node dies, survivors report the blocks left short in
`kvstore admin status`, and re-replicate them (byte for byte) once there is somewhere to put them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

ROOT = Path(__file__).resolve().parents[2]
FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


def under_replicated(metadata: str, cluster: str) -> int:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "admin", "--metadata", metadata, "--cluster", cluster,
                           "--json", "status"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "KVSTORE_ADMIN_TOKEN"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["under_replicated_blocks"]


def wait_for(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - started


def test_survivors_re_replicate_after_a_node_dies(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    extra = ["--replicas", "2"]
    a = spawn_daemon("node-a", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    b = spawn_daemon("node-b", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    hashes = external_hashes(list(range(1, 25)), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0, replicas=2) as client:
        mirror = client.mirror
        assert mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        assert client.put_many([(h, content(h)) for h in hashes]) == 2 * len(hashes)
        wait_for(lambda: all(len(mirror.lookup(FP.digest, h)) == 2 for h in hashes), 10, "both replicas listed")
        assert under_replicated(etcd_server.url, cluster) == 0

        b.kill()  # node-b's replicas leave the index when its lease expires
        wait_for(lambda: "node-b" not in mirror.nodes, 15, "node-b's lease to expire")
        # Nowhere to copy to: node-a reports every block it alone holds now.
        wait_for(lambda: under_replicated(etcd_server.url, cluster) == len(hashes), 15, "the under-replicated count")

        spawn_daemon("node-c", etcd_server.url, cluster, extra=extra, lease_ttl=2)
        took = wait_for(lambda: all(set(mirror.lookup(FP.digest, h)) == {"node-a", "node-c"} for h in hashes), 20,
                        "re-replication onto node-c")
        assert took < 20
        assert under_replicated(etcd_server.url, cluster) == 0

        a.kill()  # the repaired copies alone must serve every block, byte for byte
        wait_for(lambda: "node-a" not in mirror.nodes, 15, "node-a's lease to expire")
        for h in hashes:
            out = np.zeros(BLOCK, np.uint8)
            assert client.get(h, out) and np.array_equal(out, content(h))
