"""A client and a daemon given every member of a 3-member etcd cluster (real etcd members, each in a
process of its own: kvstore_testing.etcd.EtcdCluster) keep working when the member they use dies,
is cut off from the others, or is the leader: puts land, gets read the right bytes, the index
mirror keeps following without reloading, the daemon's lease (and with it every block record it
published) survives, and no call runs past its bound. A malformed multi-endpoint URL is one clear
error, at once. Each test's docstring names the broken variants it kills."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.index.records import Layout
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import open_metadata
from kvstore_testing.etcd import EtcdCluster

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP = ModelFingerprint("failover", "float16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 32 * 1024
TIMEOUT = 2.0
LEASE_TTL = 3
# A put may try every node it could use (one here) with each remote step bounded by TIMEOUT; a
# publish="sync" put waits for the node's publish (3 x its timeout); a get reads one replica.
PUT_BOUND, GET_BOUND = 3 * TIMEOUT + 1.0, 2 * TIMEOUT + 1.0


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def etcd_cluster():
    with EtcdCluster(3) as cluster:
        yield cluster


class Rig:
    """One daemon and two clients (a writer that waits for publishing, a reader with its own mirror),
    all given every member, `first` listed first (the member they start on)."""

    def __init__(self, etcd: EtcdCluster, first: str, spawn_daemon) -> None:
        self.etcd, self.cluster = etcd, uuid.uuid4().hex[:8]
        self.url = etcd.url_from(first)
        self.daemon = spawn_daemon("a", self.url, self.cluster, lease_ttl=LEASE_TTL)
        self.writer = Client(self.url, cluster=self.cluster, fingerprint=FP, timeout=TIMEOUT, publish="sync")
        self.reader = Client(self.url, cluster=self.cluster, fingerprint=FP, timeout=TIMEOUT)
        self.next_id = 1 + uuid.uuid4().int % (1 << 30)
        self.late: list[str] = []

    def close(self) -> None:
        self.writer.close()
        self.reader.close()

    def put(self, n: int) -> list[bytes]:
        hashes = external_hashes(list(range(self.next_id, self.next_id + n)), FP)
        self.next_id += n
        for h in hashes:
            started = time.monotonic()
            assert self.writer.put_many([(h, content(h))]) == 1
            if time.monotonic() - started > PUT_BOUND:
                self.late.append(f"put {time.monotonic() - started:.2f}s")
        return hashes

    def read_all(self, hashes: list[bytes]) -> None:
        """Every block, by the reader, byte for byte (each get within its bound)."""
        for h in hashes:
            out = np.zeros(BLOCK, np.uint8)
            started = time.monotonic()
            assert self.reader.get(h, out), f"block {h.hex()} missing"
            if time.monotonic() - started > GET_BOUND:
                self.late.append(f"get {time.monotonic() - started:.2f}s")
            assert np.array_equal(out, content(h)), f"block {h.hex()}: wrong bytes"

    def followed(self, hashes: list[bytes], timeout: float = 15.0) -> bool:
        """The reader's mirror lists blocks it never put (it learns them from its watch only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.reader.contains(h) for h in hashes):
                return True
            time.sleep(0.05)
        return False

    def node_lease(self, member: str) -> int:
        """The lease the daemon's node record hangs off, as `member` sees it."""
        async def read() -> int:
            md = open_metadata(self.etcd.member_url(member), timeout=TIMEOUT)
            try:
                kv = await md.get(Layout(self.cluster).node_key("a"))
                return kv.lease if kv is not None else 0
            finally:
                await md.close()

        return asyncio.run(read())


def survive(etcd: EtcdCluster, rig: Rig, fault, healthy: str) -> None:
    """Blocks before the fault; the fault; blocks after it: every block reads back, the reader's mirror
    followed without reloading, the daemon's node record still hangs off the same lease after more
    than twice its TTL, and no call ran past its bound."""
    before = rig.put(8)
    assert rig.followed(before)
    lease = rig.node_lease(healthy)
    assert lease
    fault()
    after = rig.put(8)  # through the fault: the writer's puts wait for the daemon's publish to etcd
    assert rig.followed(after), "the reader's mirror stopped following"
    rig.read_all(before + after)
    time.sleep(2 * LEASE_TTL + 1)  # a lease that was not kept alive across the switch is gone by now
    assert rig.node_lease(healthy) == lease, f"the daemon's lease was lost (it re-registered):\n{rig.daemon.log()[-3000:]}"
    assert all(rig.reader.contains(h) for h in before + after), "block records went with a lost lease"
    rig.read_all(before + after)
    assert rig.reader.mirror.resyncs == 1, f"the mirror reloaded its snapshot {rig.reader.mirror.resyncs - 1} time(s)"
    assert rig.late == [], rig.late
    assert rig.daemon.proc.poll() is None and "re-registered" not in rig.daemon.log()


def test_client_and_daemon_keep_working_when_their_member_is_killed(etcd_cluster, spawn_daemon):
    """The member the daemon and both clients use (a follower) is SIGKILLed. Kills: a handle that
    stays on its first endpoint (every call refused: the daemon's publishes fail, the writer's
    sync puts time out), a keep-alive that does not move with it (the lease expires: the node
    re-registers under a new lease), and a watch that neither resumes nor lets the mirror resume
    (the reader never learns the blocks put after the kill, or reloads its snapshot); and
    `kvstore admin` started afterwards with the dead member first in its URL failing to connect."""
    first = etcd_cluster.followers()[0]
    rig = Rig(etcd_cluster, first, spawn_daemon)
    try:
        healthy = next(n for n in etcd_cluster.names if n != first)
        survive(etcd_cluster, rig, lambda: etcd_cluster.kill(first), healthy)
        # A command started after the loss, the dead member listed first, finds the cluster anyway.
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "admin", "nodes", "--json", "--timeout", "3",
                               "--metadata", rig.url, "--cluster", rig.cluster],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert [(n["name"], n["state"]) for n in json.loads(done.stdout)] == [("a", "serving")]
    finally:
        rig.close()


def test_the_leader_killed(etcd_cluster, spawn_daemon):
    """The leader, which the daemon and both clients use, is SIGKILLed: an election runs while they
    move. Kills: a handle that gives up after one round of endpoints (the survivors answer 'no
    leader' or time out during the election, so the sync puts fail), and a lost lease or watch as
    above."""
    leader = etcd_cluster.leader()
    rig = Rig(etcd_cluster, leader, spawn_daemon)
    try:
        healthy = next(n for n in etcd_cluster.names if n != leader)

        def kill_leader() -> None:
            etcd_cluster.kill(leader)

        survive(etcd_cluster, rig, kill_leader, healthy)
        assert etcd_cluster.leader() != leader
    finally:
        rig.close()


def test_the_member_they_use_partitioned_from_the_others(etcd_cluster, spawn_daemon):
    """The member the daemon and both clients use is cut off from the other two (it still answers
    its clients): it loses its leader and its data goes stale. Kills: requests without etcd's
    'hasleader' guard (the cut-off member hangs every call to its timeout, and keeps the reader's
    watch open and silent forever), a watch that does not notice it went silent, and a lease
    keep-alive whose attempt is bounded by the handle's timeout rather than a third of the TTL (the
    cut-off member holds it past the TTL: the lease expires before the next member is tried)."""
    first = etcd_cluster.followers()[0]
    rig = Rig(etcd_cluster, first, spawn_daemon)
    try:
        healthy = next(n for n in etcd_cluster.names if n != first)
        survive(etcd_cluster, rig, lambda: etcd_cluster.partition(first), healthy)
    finally:
        rig.close()
        etcd_cluster.heal()


def test_a_watch_resumes_from_its_last_revision_on_the_next_member(etcd_cluster):
    """A watch on the member that is killed carries on on another: every change made after the
    kill arrives exactly once and in order, with no error. Kills: a watch that ends with
    MetadataUnavailable when its stream breaks, and one that resumes from 'now' instead of the
    revision after its last event (the changes made while it moved are lost)."""
    first = etcd_cluster.followers()[0]

    async def scenario() -> None:
        watcher = open_metadata(etcd_cluster.url_from(first), timeout=TIMEOUT)
        writer = open_metadata(etcd_cluster.member_url(next(n for n in etcd_cluster.names if n != first)),
                               timeout=TIMEOUT)
        try:
            watch = await watcher.watch("/w/")
            seen: list[bytes] = []

            async def follow() -> None:
                async for event in watch:
                    seen.append(event.value)
                    if len(seen) == 40:
                        return

            follower = asyncio.ensure_future(follow())
            for i in range(10):
                await writer.put(f"/w/{i}", str(i).encode())
            etcd_cluster.kill(first)
            for i in range(10, 40):  # written while the watch moves
                await writer.put(f"/w/{i % 7}", str(i).encode())
            await asyncio.wait_for(follower, 20)
            assert seen == [str(i).encode() for i in range(40)]
            assert watch.resumes >= 1 and watcher.endpoint != f"127.0.0.1:{etcd_cluster.client_port[first]}"
            await watch.cancel()
        finally:
            await watcher.close()
            await writer.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("url, says", [
    ("etcd://127.0.0.1:2379,,127.0.0.1:2380", "endpoint 2 of 3 is empty"),
    ("etcd://127.0.0.1:2379,127.0.0.1", "endpoint 2 of 2 '127.0.0.1' needs a port"),
    ("etcd://127.0.0.1:2379,127.0.0.1:x", "endpoint 2 of 2 '127.0.0.1:x' has a port that is not a number"),
    ("etcd://127.0.0.1:2379,127.0.0.1:2379", "endpoint 127.0.0.1:2379 is listed twice"),
    ("etcd+tls://a:1,b:2/x?ca=ca.pem", "nothing may follow the endpoints"),
])
def test_a_malformed_multi_endpoint_url_is_one_clear_error(url, says):
    """`kvstore serve`, `conductor serve` and `kvstore admin` refuse it in one line naming what is
    wrong, exit 2, before connecting to anything; a Client raises ValueError at once. Kills: a parser
    that takes the first endpoint and drops the rest, or lets a bad one through to fail later (a
    timeout, a traceback)."""
    started = time.monotonic()
    with pytest.raises(ValueError, match=says):
        Client(url, timeout=5.0)
    assert time.monotonic() - started < 1.0
    for cmd in ([sys.executable, "-m", "kvstore.cli", "serve", "--node", "x", "--metadata", url, "--insecure"],
                [sys.executable, "-m", "kvstore.cli", "admin", "--metadata", url, "status"],
                [sys.executable, "-m", "conductor.cli", "serve", "--metadata", url, "--fingerprint", "0" * 32]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (cmd, done.returncode, done.stderr)
        assert len(lines) == 1 and says in lines[0], (cmd, done.stderr)
