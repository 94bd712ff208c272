"""A drain moves a node's copy of each block to a node that lacks it: replicated blocks keep their
count. Real etcd, daemons in their own processes, the drain through `kvstore admin`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import numpy as np

from kvstore import Client, ModelFingerprint, external_hashes

FP = ModelFingerprint("drain", "float16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024
TOKEN = "drain-test-admin-token-0123456789"


def test_a_drain_never_lands_a_block_on_a_node_that_already_holds_it(index_url, spawn_daemon, tmp_path):
    """node-a and node-b hold every block (replicas=2); node-c holds more unrelated bytes than
    node-b, so a put placed by DRAM use prefers node-b. Draining node-a must copy to node-c.
    Kills: a drain move that ignores the other holders (it lands on node-b, which already has
    the block, and then node-a's copy goes: two replicas become one). In one etcd and over two
    shards alike."""
    cluster = uuid.uuid4().hex[:8]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    extra = ["--admin-token-file", str(token_file)]
    for name in ("node-a", "node-b", "node-c"):
        spawn_daemon(name, index_url, cluster, extra=extra)
    with Client(index_url, cluster=cluster, fingerprint=FP) as client:
        assert client.mirror.wait_until(lambda m: {"node-a", "node-b", "node-c"} <= set(m.nodes), 10)
        hashes = external_hashes(range(20), FP)
        blocks = [np.full(BLOCK, i, dtype=np.uint8) for i in range(len(hashes))]
        client.put_many(zip(hashes, blocks), replicas=2, exclude={"node-c"})
        filler = external_hashes(range(1000, 1300), FP)
        client.put_many(((h, np.zeros(BLOCK, dtype=np.uint8)) for h in filler), replicas=1,
                        exclude={"node-a", "node-b"})
        assert client.mirror.wait_until(
            lambda m: all(set(m.lookup(FP, h)) == {"node-a", "node-b"} for h in hashes)
            and m.nodes["node-c"].used.get("dram", 0) > m.nodes["node-b"].used.get("dram", 0), 15)
        env = {**os.environ, "KVSTORE_ADMIN_TOKEN": TOKEN}
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "admin", "--metadata", index_url,
                               "--cluster", cluster, "--json", "drain", "node-a"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["failed"] == 0
        assert client.mirror.wait_until(
            lambda m: all(set(m.lookup(FP, h)) == {"node-b", "node-c"} for h in hashes), 15), \
            {h.hex()[:8]: sorted(client.mirror.lookup(FP, h)) for h in hashes}
        outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in hashes]
        assert all(client.get_many(hashes, outs))
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))


def test_blocks_a_drain_cannot_move_stay_on_the_node(etcd_server, spawn_daemon, tmp_path):
    """node-b was started with another cluster secret (a mistyped secret file, once), so every
    move from node-a fails. Kills: a drain that removes a block whose move failed (it counted
    'dropped 2, failed 2 of 2' and the only copies were gone)."""
    cluster = uuid.uuid4().hex[:8]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    extra = ["--admin-token-file", str(token_file)]
    secret = "drain-test-cluster-secret-0123456789"
    spawn_daemon("node-a", etcd_server.url, cluster, secret=secret, extra=extra)
    spawn_daemon("node-b", etcd_server.url, cluster, secret=secret[::-1], extra=extra)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=secret) as client:
        assert client.mirror.wait_until(lambda m: {"node-a", "node-b"} <= set(m.nodes), 10)
        hashes = external_hashes(range(2), FP)
        blocks = [np.full(BLOCK, i + 1, dtype=np.uint8) for i in range(len(hashes))]
        assert client.put_many(zip(hashes, blocks), exclude={"node-b"}) == 2
        env = {**os.environ, "KVSTORE_ADMIN_TOKEN": TOKEN, "KVSTORE_SECRET": secret}
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "admin", "--metadata", etcd_server.url,
                               "--cluster", cluster, "--json", "drain", "node-a"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 1, done.stderr
        result = json.loads(done.stdout)
        assert (result["moved"], result["dropped"], result["failed"], result["total"]) == (0, 0, 2, 2), result
        outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in hashes]
        assert all(client.get_many(hashes, outs))
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
