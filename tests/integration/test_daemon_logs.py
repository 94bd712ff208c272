"""What `kvstore serve` logs after its start-up line, read from real daemons' stderr: drains, evictions
(summed), neighbours dying and joining, replica repair, index publishing failing and recovering,
the lease lost and taken again."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import grpc
import numpy as np

from kvstore import Client
from kvstore.admin.v1 import admin_pb2, admin_pb2_grpc
from kvstore.index.records import Layout
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import open_metadata

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 2 * 2 * 16 * 2 * 64 * 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


def logged(daemon, text: str, timeout: float = 20.0) -> str:
    """The first log line of `daemon` containing `text`, waiting for it."""
    deadline = time.monotonic() + timeout
    while True:
        for line in daemon.log().splitlines():
            if text in line:
                return line
        assert time.monotonic() < deadline, f"{text!r} not logged by {daemon.name}:\n{daemon.log()[-3000:]}"
        time.sleep(0.2)


def test_evictions_are_summed_and_drains_are_logged(etcd_server, spawn_daemon):
    """Kills: a daemon silent after its start-up line (no eviction or drain lines), and eviction
    lines per block."""
    cluster = uuid.uuid4().hex[:8]
    node = spawn_daemon("ev-node", etcd_server.url, cluster, dram="1MiB")  # room for 32 blocks
    hashes = external_hashes(range(120), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        for start in range(0, len(hashes), 8):
            client.put_many([(h, content(h)) for h in hashes[start : start + 8]])
    line = logged(node, "evicted ", timeout=25)
    assert "blocks in the last" in line and "from dram" in line and " ev-node " in line
    evicted = int(line.split("evicted ")[1].split()[0])
    assert evicted >= 60 and sum("evicted " in x for x in node.log().splitlines()) <= 2

    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "admin", "drain", "ev-node", "--json",
                           "--metadata", etcd_server.url, "--cluster", cluster], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "started (moving its blocks to other nodes)" in logged(node, "drain of ev-node started")
    assert "no other node to move blocks to" in logged(node, "drain of ev-node: no other node")
    end = logged(node, "drain of ev-node done")
    assert f"dropped {json.loads(done.stdout)['dropped']}" in end and "INFO" in end


def test_a_neighbours_death_and_the_repair_are_logged(etcd_server, spawn_daemon):
    """Kills: a neighbour dying (kill -9, lease ran out) and the replica repair after it passing
    without a line in the survivor's log."""
    cluster = uuid.uuid4().hex[:8]
    replicas = ["--replicas", "2"]
    a = spawn_daemon("node-a", etcd_server.url, cluster, extra=replicas)
    b = spawn_daemon("node-b", etcd_server.url, cluster, extra=replicas)
    hashes = external_hashes(range(8), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        client.put_many([(h, content(h)) for h in hashes], replicas=2)
        assert client.mirror.wait_until(lambda m: all(len(m.lookup(FP, h)) == 2 for h in hashes), 10)
    seen = logged(a, "node-b")  # node-b came up after node-a: it joined; else node-a found it there
    assert "node node-b joined the cluster" in seen or "other nodes in the cluster: node-b" in seen
    b.kill()
    assert "WARNING" in logged(a, "node node-b left the cluster")
    assert "8 blocks held here have fewer than 2 live replicas" in logged(a, "live replicas")
    logged(a, "8 under-replicated blocks have no node left to copy to")
    spawn_daemon("node-c", etcd_server.url, cluster, extra=replicas)
    logged(a, "node node-c joined the cluster")
    logged(a, "replica repair copied 8 blocks")
    logged(a, "every block held here has its 2 replicas again")


def test_publish_failure_recovery_and_lease_loss_are_logged(fresh_etcd, spawn_daemon, caplog):
    """Kills: index publish failures logged at INFO (hidden at the default level) or once per retry,
    their recovery not said, and a lost lease re-taken without a line; while etcd is down, the
    daemon's lease keep-alive and a library client's index mirror each logging every retry (four
    lines a second into the daemon's log, one a second into the application's stderr)."""
    cluster = uuid.uuid4().hex[:8]
    node = spawn_daemon("pub-node", fresh_etcd.url, cluster)
    hashes = external_hashes(range(4), FP)
    watcher = Client(fresh_etcd.url, cluster=cluster, fingerprint=FP, timeout=3.0)  # stays open through the outage
    with Client(fresh_etcd.url, cluster=cluster, fingerprint=FP, timeout=3.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        client.put_many([(h, content(h)) for h in hashes])
        assert client.mirror.wait_until(lambda m: m.block_count == 4, 10)
    assert watcher.mirror.wait_until(lambda m: m.block_count == 4, 10)
    caplog.set_level("INFO", logger="kvstore.index.mirror")
    fresh_etcd.kill()
    logged(node, "lease keep-alive for pub-node failed")
    time.sleep(4)  # an outage of some seconds: retried many times, said once
    assert sum("lease keep-alive" in x for x in node.log().splitlines()) == 1
    assert sum("index mirror lost" in r.getMessage() for r in caplog.records) == 1
    watcher.close()
    with grpc.insecure_channel(node.control) as channel:  # its index update cannot be published now
        try:
            admin_pb2_grpc.AdminStub(channel).Evict(admin_pb2.EvictRequest(fingerprint=FP.digest,
                                                                           hash_prefix=hashes[0].hex()[:8]), timeout=10)
        except grpc.RpcError:
            pass  # the eviction is done; its publication waits for etcd
    failed = logged(node, "index updates failed, retrying")
    assert "WARNING" in failed
    fresh_etcd.start()
    logged(node, "index publishing recovered after", timeout=30)
    assert sum("index updates failed" in x for x in node.log().splitlines()) == 1

    async def revoke() -> None:  # the lease taken away, as etcd does when keep-alives stop too long
        metadata = open_metadata(fresh_etcd.url)
        try:
            record = await metadata.get(Layout(cluster).node_key("pub-node"))
            await metadata.lease_revoke(record.lease)
        finally:
            await metadata.close()

    asyncio.run(revoke())
    logged(node, "lost its lease")
    assert "republished its 3 blocks" in logged(node, "re-registered and republished")
