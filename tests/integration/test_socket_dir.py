"""Same-host sockets as files in $KVSTORE_SOCKET_DIR, with $KVSTORE_HOST_ID naming the host: how
containers on one host that share no network namespace (Kubernetes pods: deploy/k8s) reach a store
daemon's shared memory.

An abstract unix socket lives in one network namespace; the engine-level test runs the peer in a
network namespace of its own (`unshare --net` and a veth pair, as root: TCP crosses, as between
pods) to show that the file socket crosses it and the abstract one does not. The daemon-level test shows a store client taking its same-host
path through the directory, and the daemon leaving nothing behind there.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from transfer import Engine, PeerUnreachable, Read
from transfer import descriptor as descriptor_module

ROOT = Path(__file__).resolve().parents[2]
SECRET = "socket-dir-secret-0123456789"


PEER = """
import json, sys
import numpy as np
from transfer import Engine
engine = Engine("peer", listen=sys.argv[1], secret=sys.argv[2])
shm = engine.allocate(1 << 20)
np.frombuffer(shm.buffer, np.uint8)[:] = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8) ^ 0x5A
print(json.dumps({"descriptor": engine.export().to_json(), "region": shm.id}), flush=True)
sys.stdin.readline()
engine.close()
"""
EXPECTED = (np.arange(1 << 20, dtype=np.uint32).astype(np.uint8) ^ 0x5A).tobytes()


@pytest.fixture
def socket_dir():
    folder = tempfile.mkdtemp(prefix="kvs-sock-")  # short: a socket path holds at most 107 bytes
    yield folder
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)


@pytest.fixture
def same_host(monkeypatch):
    """This process on host "node-a" (as a pod given its node's name is)."""
    monkeypatch.setenv("KVSTORE_HOST_ID", "node-a")
    descriptor_module.host_id.cache_clear()
    yield
    monkeypatch.delenv("KVSTORE_HOST_ID")
    descriptor_module.host_id.cache_clear()


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns():
    """A network namespace of the test's own, joined to this one by a veth pair on link-local
    addresses (169.254.77.1 here, .2 there): TCP crosses, abstract unix sockets do not.
    Yields a command prefix that runs a program in it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip (iproute2) to make a network namespace")
    holder = subprocess.Popen(["unshare", "--net", "sleep", "600"])
    ns = f"/proc/{holder.pid}/ns/net"
    link = f"kvs{uuid.uuid4().hex[:8]}"
    try:
        for _ in range(100):  # until unshare has switched namespaces
            if os.readlink(ns) != os.readlink("/proc/self/ns/net"):
                break
            time.sleep(0.02)
        try:
            run("ip", "link", "add", link, "type", "veth", "peer", "name", "eth-kvs", "netns", str(holder.pid))
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make a veth pair here: {exc.stderr.decode().strip()}")
        run("ip", "addr", "add", "169.254.77.1/30", "dev", link)
        run("ip", "link", "set", link, "up")
        inside = ["nsenter", f"--net={ns}"]
        run(*inside, "ip", "addr", "add", "169.254.77.2/30", "dev", "eth-kvs")
        run(*inside, "ip", "link", "set", "eth-kvs", "up")
        run(*inside, "ip", "link", "set", "lo", "up")
        yield inside
    finally:
        holder.kill()
        holder.wait(10)
        subprocess.run(["ip", "link", "del", link], capture_output=True)  # gone with the namespace anyway


def peer_in(netns: list[str], env: dict) -> tuple[subprocess.Popen, dict]:
    """An engine with one shared-memory region in the namespace, with `env` added."""
    proc = subprocess.Popen([*netns, sys.executable, "-c", PEER, "169.254.77.2:0", SECRET], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **env}, cwd=ROOT)
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError("peer process did not start")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(10)


def test_shared_memory_crosses_network_namespaces_through_the_socket_directory(netns, socket_dir, same_host):
    host = {"KVSTORE_HOST_ID": "node-a"}
    proc, hello = peer_in(netns, {**host, "KVSTORE_SOCKET_DIR": socket_dir})
    try:
        card = json.loads(hello["descriptor"])
        assert card["unix"].startswith(socket_dir + "/"), card["unix"]  # published by path
        assert os.path.exists(card["unix"])
        with Engine("reader", secret=SECRET, listen=None) as engine:
            peer = engine.connect(hello["descriptor"], transport="shm")
            assert peer.transport == "shm"
            landed = engine.allocate(1 << 20)
            engine.submit([Read(landed, 0, peer.region(hello["region"]), 0, 1 << 20)]).wait(10)
            assert bytes(landed.host_view()) == EXPECTED
            stats = engine.stats()
            assert stats["local_bytes"] >= 1 << 20 and stats["tcp_rx_bytes"] == 0  # through the mapping, not TCP
    finally:
        stop(proc)
    assert os.listdir(socket_dir) == []  # the peer removed its socket file

    # Control: the same peer on an abstract socket (no KVSTORE_SOCKET_DIR), naming the same host,
    # cannot be reached through shared memory from this network namespace.
    proc, hello = peer_in(netns, host)
    try:
        assert not json.loads(hello["descriptor"])["unix"].startswith("/")
        with Engine("reader", secret=SECRET, listen=None) as engine:
            with pytest.raises(PeerUnreachable):
                engine.connect(hello["descriptor"], transport="shm", timeout=3)
    finally:
        stop(proc)


def test_store_client_takes_the_same_host_path_through_the_socket_directory(socket_dir, same_host, monkeypatch,
                                                                             etcd_server, spawn_daemon):
    import kvstore

    monkeypatch.setenv("KVSTORE_SOCKET_DIR", socket_dir)
    cluster = uuid.uuid4().hex[:8]
    env = {**os.environ, "KVSTORE_SOCKET_DIR": socket_dir, "KVSTORE_HOST_ID": "node-a"}
    daemon = spawn_daemon("sockdir", etcd_server.url, cluster, secret=SECRET, env=env)
    sockets = sorted(os.listdir(socket_dir))
    assert len(sockets) == 2, sockets  # the daemon's wire and its engine's control socket
    with open("/proc/net/unix") as f:
        abstract = [line.split()[-1] for line in f if line.split()[-1].startswith("@kvstore-")]
    assert not any(name[1:] in sockets for name in abstract)  # none of them abstract

    fp = kvstore.ModelFingerprint("sockdir", "float16", block_size=16, num_layers=1, num_kv_heads=1, head_size=64)
    hashes = kvstore.chain_hashes(fp, list(range(64)))
    blocks = [np.full(fp.block_bytes, i, np.uint8) for i in range(len(hashes))]
    with kvstore.Client(etcd_server.url, cluster=cluster, fingerprint=fp, secret=SECRET, timeout=5) as client:
        client.put_many(list(zip(hashes, blocks)))
        outs = [np.empty(fp.block_bytes, np.uint8) for _ in hashes]
        assert all(client.get_many(hashes, outs))
        assert all((out == block).all() for out, block in zip(outs, blocks))
        assert client.stats["local_puts"] > 0  # the same-host path, not the TCP wire
    assert daemon.terminate() == 0
    assert os.listdir(socket_dir) == []  # a daemon that stops removes its socket files
