"""`kvstore admin` and `kvstore serve` as a new user meets them, against a real etcd and daemons in
their own processes: dead nodes marked instead of failing or lying, flags after the subcommand,
admin token files, the metrics address, the config file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.keys import ModelFingerprint, chain_hashes

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 2 * 2 * 16 * 2 * 64 * 4  # FP's geometry: key and value x layers x tokens x heads x head size x 4 bytes
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


def kvstore(args: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`kvstore ARGS` with no admin token, metadata or cluster from this process's environment."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("KVSTORE_ADMIN_TOKEN", "KVSTORE_METADATA", "KVSTORE_CLUSTER", "KVSTORE_SECRET")}
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**clean, **(env or {})}, cwd=ROOT)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_admin_answers_from_live_nodes_and_marks_a_dead_one(etcd_server, spawn_daemon):
    """Kills: `nodes` showing a kill -9'd node as `serving` until its lease ends; `query`, `blocks`
    and `evict` failing outright with UNAVAILABLE instead of answering from node-a; `status`
    printing gRPC's raw error text in its state column with exit 0; a stopped node holding the
    command past its --timeout."""
    cluster = uuid.uuid4().hex[:8]
    url = etcd_server.url
    spawn_daemon("node-a", url, cluster, lease_ttl=60)
    b = spawn_daemon("node-b", url, cluster, lease_ttl=60)  # its records outlive it: the index still lists it
    hashes = chain_hashes(FP, list(range(16 * 6)))
    with Client(url, cluster=cluster, fingerprint=FP, timeout=3.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        client.put_many([(h, content(h)) for h in hashes], replicas=2)
        assert client.mirror.wait_until(lambda m: all(len(m.lookup(FP, h)) == 2 for h in hashes), 10)
    where = ["--metadata", url, "--cluster", cluster]

    b.pause()  # alive but silent: each call ends at the timeout
    started = time.monotonic()
    done = kvstore(["admin", "status", "--json", "--timeout", "2", *where])
    assert done.returncode == 5 and time.monotonic() - started < 20, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)["nodes"]}
    assert rows["node-a"]["state"] == "serving"
    assert rows["node-b"]["state"] == "unreachable" and rows["node-b"]["reason"] == "no answer within 2 s"
    b.resume()
    b.kill()  # kill -9: nothing revokes its lease

    nodes = kvstore(["admin", "nodes", "--json", *where])
    assert nodes.returncode == 5, nodes.stderr
    states = {n["name"]: (n["state"], n["reason"]) for n in json.loads(nodes.stdout)}
    assert states == {"node-a": ("serving", ""), "node-b": ("unreachable", "connection refused")}
    assert "node-b (connection refused)" in one_line(nodes.stderr)

    table = kvstore(["admin", "status", *where])
    assert table.returncode == 5 and "unreachable" in table.stdout and "serving" in table.stdout
    assert "failed to connect" not in table.stdout.lower() and "UNAVAILABLE" not in table.stdout

    query = kvstore(["admin", "query", "--json", "--fingerprint", FP.digest, "--hashes", *[h.hex() for h in hashes],
                     *where])
    assert query.returncode == 5, query.stderr
    answer = json.loads(query.stdout)
    assert answer["nodes"]["node-a"]["leading_blocks"] == 6 and answer["cluster_leading_blocks"] == 6
    assert answer["nodes"]["node-b"] == {"state": "unreachable", "reason": "connection refused"}

    blocks = kvstore(["admin", "blocks", "--json", "--fingerprint", FP.digest, *where])
    assert blocks.returncode == 5, blocks.stderr
    pages = {p["node"]: p for p in json.loads(blocks.stdout)}
    assert pages["node-a"]["total"] == 6 and pages["node-b"]["state"] == "unreachable"

    named = kvstore(["admin", "blocks", "--fingerprint", FP.digest, "--node", "node-b", *where])
    assert named.returncode == 5 and "node-b unreachable (connection refused)" in one_line(named.stderr)
    node = kvstore(["admin", "node", "node-b", *where])
    assert node.returncode == 5 and "node-b unreachable (connection refused)" in one_line(node.stderr)

    evict = kvstore(["admin", "evict", "--json", "--fingerprint", FP.digest, *where])
    assert evict.returncode == 5, evict.stderr
    assert json.loads(evict.stdout)["evicted"] == {"node-a": 6}
    assert json.loads(evict.stdout)["unreachable"] == {"node-b": "connection refused"}


def test_admin_flags_after_the_subcommand_and_token_files(etcd_server, spawn_daemon, tmp_path):
    """Kills: `kvstore admin status --json` refused (the flags worked only before the subcommand);
    `kvstore serve --admin-token-file PATH` with no file there crashing with a traceback."""
    cluster = uuid.uuid4().hex[:8]
    token_file = tmp_path / "made-for-me" / "admin-token"
    node = spawn_daemon("tok-node", etcd_server.url, cluster, extra=["--admin-token-file", str(token_file)])
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(token_file.read_text().strip()) >= 32
    assert f"generated an admin token in {token_file}" in node.log()
    status = kvstore(["admin", "status", "--json", "--metadata", etcd_server.url, "--cluster", cluster])
    assert status.returncode == 0 and json.loads(status.stdout)["nodes"][0]["name"] == "tok-node", status.stderr
    evict = ["admin", "evict", "--fingerprint", FP.digest, "--metadata", etcd_server.url, "--cluster", cluster]
    refused = kvstore(evict)
    assert refused.returncode == 4 and "admin bearer token" in one_line(refused.stderr)
    assert kvstore([*evict, "--admin-token-file", str(token_file)]).returncode == 0
    assert kvstore([*evict, "--token-file", str(token_file)]).returncode == 0  # the old spelling
    missing = kvstore([*evict, "--admin-token-file", str(tmp_path / "nope")])
    assert missing.returncode == 2 and "--admin-token-file" in one_line(missing.stderr)


def test_a_secured_node_makes_an_admin_token_kvstore_admin_finds(etcd_server, tmp_path):
    """Kills: a node with a cluster secret and no --admin-token-file taking drain, evict and policy
    calls from anyone."""
    cluster = uuid.uuid4().hex[:8]
    home = {"HOME": str(tmp_path)}
    clean = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_ADMIN_TOKEN", "KVSTORE_SECRET")}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--node", "sec", "--metadata",
                             etcd_server.url, "--cluster", cluster, "--dram", "4MiB", "--lease-ttl", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**clean, **home})
    try:
        assert json.loads(proc.stdout.readline())["node"] == "sec"
        made = tmp_path / ".kvstore" / f"{cluster}.admin-token"
        assert made.stat().st_mode & 0o777 == 0o600
        evict = ["admin", "evict", "--fingerprint", FP.digest, "--metadata", etcd_server.url, "--cluster", cluster]
        assert kvstore(evict, env=home).returncode == 0  # same user, same host: the generated token is found
        other = tmp_path / "elsewhere"
        other.mkdir()
        assert kvstore(evict, env={"HOME": str(other)}).returncode == 4  # anyone else: refused
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def test_metrics_listen_address(etcd_server, spawn_daemon):
    """Kills: /metrics bound to 127.0.0.1 whatever --metrics-listen says."""
    node = spawn_daemon("metrics-node", etcd_server.url, uuid.uuid4().hex[:8], extra=["--metrics-listen", "127.0.0.2"])
    body = urllib.request.urlopen(f"http://127.0.0.2:{node.metrics_port}/metrics", timeout=5).read().decode()
    assert "kvstore_blocks" in body
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5)


def test_serve_from_a_config_file(etcd_server, tmp_path):
    """Kills: `kvstore serve --config PATH` ignoring the file (no --node: refused) or its values."""
    cluster = uuid.uuid4().hex[:8]
    config = tmp_path / "node.toml"
    config.write_text(f'node = "from-config"\nmetadata = "{etcd_server.url}"\ncluster = "{cluster}"\ninsecure = true\n'
                      'dram = "4MiB"\nmetrics-port = 0\nlease-ttl = 3\n')
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(config), "--dram", "8MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        hello = json.loads(proc.stdout.readline())
        assert hello["node"] == "from-config" and hello["metrics_port"]
        status = kvstore(["admin", "node", "from-config", "--json", "--metadata", etcd_server.url, "--cluster", cluster])
        assert status.returncode == 0, status.stderr
        dram = [t for t in json.loads(status.stdout)["tiers"] if t["name"] == "dram"][0]
        assert int(dram["capacity_bytes"]) == 8 << 20  # the command line beat the file
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def test_a_cluster_with_no_nodes_is_not_found(etcd_server):
    """Kills: a mistyped --cluster answering an empty table with exit 0."""
    done = kvstore(["admin", "status", "--metadata", etcd_server.url, "--cluster", "no-such-cluster"])
    assert done.returncode == 3 and "no nodes in cluster 'no-such-cluster'" in one_line(done.stderr)
