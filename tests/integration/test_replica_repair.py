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

from tests_support import until

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


def wait_for(predicate, timeout: float, what: str) -> None:
    assert until(predicate, timeout, every=0.2), f"timed out waiting for {what}"


def read_back(client: Client, hashes: list[bytes]) -> list[str]:
    """The blocks that do not read back byte for byte."""
    lost = []
    for h in hashes:
        out = np.zeros(BLOCK, np.uint8)
        if not (client.get(h, out) and np.array_equal(out, content(h))):
            lost.append(h.hex())
    return lost


def holders(client: Client, nodes: list[str], hashes: list[bytes]) -> list[int]:
    """How many of `nodes` hold each block, as the nodes themselves answer (not the index)."""
    counts = [0] * len(hashes)
    for name in nodes:
        try:
            records = client.reads.lookup(name, FP.digest, hashes)
        except Exception:  # noqa: BLE001 - a node gone holds nothing
            continue
        for i, record in enumerate(records):
            counts[i] += record is not None
    return counts


def store_on_a_and_b(client: Client, metadata: str, cluster: str, hashes: list[bytes], start_c):
    """Once node-a and node-b are up: every block on both, both replicas published for everyone;
    then node-c joins (`start_c()`, returned) and holds none of them. Node-c joins only then: a
    repair round the join sets off while the put's records are still on their way could copy a
    block that looks short to node-c (the repairer asks the holders first, but a holder still
    verifying a large put says it has nothing)."""
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
    assert client.put_many([(h, content(h)) for h in hashes]) == 2 * len(hashes)
    with Client(metadata, cluster=cluster, fingerprint=FP, timeout=3.0) as observer:
        def holders() -> set[tuple[str, ...]]:
            return {tuple(sorted(observer.mirror.lookup(FP.digest, h))) for h in hashes}

        assert until(lambda: holders() == {("node-a", "node-b")}, 10, every=0.2), \
            f"timed out waiting for both replicas published: the blocks' holders {sorted(holders())}"
    node_c = start_c()
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 3, 10)
    return node_c


def test_survivors_re_replicate_after_a_node_dies(index_url, spawn_daemon):
    """In one etcd and over two shards alike (the repairers read the index through a mirror per
    shard, `kvstore admin status` too)."""
    cluster = uuid.uuid4().hex[:8]
    extra = ["--replicas", "2"]
    a = spawn_daemon("node-a", index_url, cluster, extra=extra, lease_ttl=2)
    b = spawn_daemon("node-b", index_url, cluster, extra=extra, lease_ttl=2)
    hashes = external_hashes(list(range(1, 25)), FP)
    with Client(index_url, cluster=cluster, fingerprint=FP, timeout=3.0, replicas=2) as client:
        mirror = client.mirror
        assert mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        assert client.put_many([(h, content(h)) for h in hashes]) == 2 * len(hashes)
        wait_for(lambda: all(len(mirror.lookup(FP.digest, h)) == 2 for h in hashes), 10, "both replicas listed")
        assert under_replicated(index_url, cluster) == 0

        b.kill()  # node-b's replicas leave the index when its lease expires
        wait_for(lambda: "node-b" not in mirror.nodes, 15, "node-b's lease to expire")
        # Nowhere to copy to: node-a reports every block it alone holds now.
        wait_for(lambda: under_replicated(index_url, cluster) == len(hashes), 15, "the under-replicated count")

        spawn_daemon("node-c", index_url, cluster, extra=extra, lease_ttl=2)
        wait_for(lambda: all(set(mirror.lookup(FP.digest, h)) == {"node-a", "node-c"} for h in hashes), 20,
                        "re-replication onto node-c")
        assert under_replicated(index_url, cluster) == 0

        a.kill()  # the repaired copies alone must serve every block, byte for byte
        wait_for(lambda: "node-a" not in mirror.nodes, 15, "node-a's lease to expire")
        for h in hashes:
            out = np.zeros(BLOCK, np.uint8)
            assert client.get(h, out) and np.array_equal(out, content(h))


def test_a_graceful_stop_hands_off_the_replicas_it_would_leave_short(etcd_server, spawn_daemon):
    """Kills the variant "a replica on a node that stops gracefully is never repaired in time": a
    daemon stopped with SIGTERM revoked its lease at once, dropping its replicas, and left their
    re-replication to the survivors, which start only once they notice it left (their repair loop,
    the watch). A crash of the other holder in that window lost blocks acknowledged on 2 replicas:
    the fault report's 12 lost blocks (its full-tier node stopped, then the node holding the other
    replicas of what it held took kill -9 while the report was still reading them back). Here the
    other holder cannot repair at all (stopped with SIGSTOP), so only the leaving node's own
    hand-off can keep the blocks: a node that stops gracefully first copies every block it holds
    that would be left with fewer than the cluster's replicas without it."""
    cluster = uuid.uuid4().hex[:8]
    extra = ["--replicas", "2"]
    leaver = spawn_daemon("node-a", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    # Its lease outlasts the pause below: it is still a holder while node-a leaves.
    partner = spawn_daemon("node-b", etcd_server.url, cluster, extra=extra, lease_ttl=10)
    hashes = external_hashes(list(range(100, 140)), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0, replicas=2) as client:
        mirror = client.mirror
        store_on_a_and_b(client, etcd_server.url, cluster, hashes,
                         lambda: spawn_daemon("node-c", etcd_server.url, cluster, extra=extra, lease_ttl=2))

        partner.pause()  # the other holder: no repair from it
        assert leaver.terminate() == 0  # graceful
        partner.resume()
        partner.kill()  # the second failure, right after the graceful stop
        wait_for(lambda: set(mirror.nodes) == {"node-c"}, 20, "node-a and node-b to leave the index")
        lost = read_back(client, hashes)
        assert lost == [], f"{len(lost)} of {len(hashes)} blocks acknowledged on 2 replicas lost"
        assert "handed off" in leaver.log(), leaver.log()[-3000:]  # says so, in one line


def test_a_hand_off_tries_again_when_its_targets_are_busy(etcd_server, spawn_daemon):
    """Kills the variant "a hand-off gives up on its first failed batch": the only node a leaving
    node can copy to does not answer within the timeout (busy: a loaded machine), the hand-off gave
    up the whole group and left, and the other holder's crash lost every block they shared (on a
    loaded machine the fault report's kill -9 phase lost 70 blocks once; this is one way it could).
    It now tries again until its time (30 s) is up, and says so in one line."""
    cluster = uuid.uuid4().hex[:8]
    extra = ["--replicas", "2"]
    leaver = spawn_daemon("node-a", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    # Leases that outlast their pauses below: both stay in the index while node-a leaves.
    partner = spawn_daemon("node-b", etcd_server.url, cluster, extra=extra, lease_ttl=12)
    hashes = external_hashes(list(range(400, 440)), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0, replicas=2) as client:
        mirror = client.mirror
        target = store_on_a_and_b(client, etcd_server.url, cluster, hashes,
                                  lambda: spawn_daemon("node-c", etcd_server.url, cluster, extra=extra, lease_ttl=12))

        partner.pause()  # the other holder: no repair from it
        target.pause()  # the only node to hand off to: silent past every timeout for now
        leaver.proc.terminate()  # graceful
        wait_for(lambda: "trying again" in leaver.log() or leaver.proc.poll() is not None, 30,
                 "the hand-off's first failure")
        target.resume()
        assert leaver.proc.wait(40) == 0
        partner.resume()
        partner.kill()  # the second failure, right after the graceful stop
        wait_for(lambda: "node-a" not in mirror.nodes and "node-b" not in mirror.nodes, 30,
                 "node-a and node-b to leave the index")
        lost = read_back(client, hashes)
        assert lost == [], f"{len(lost)} of {len(hashes)} blocks acknowledged on 2 replicas lost\n" + leaver.log()[-2000:]
        assert "trying again" in leaver.log() and "handed off 40 blocks" in leaver.log(), leaver.log()[-3000:]


def test_a_replica_evicted_by_a_full_node_is_repaired_at_once(etcd_server, spawn_daemon):
    """Kills the variant "a full node evicts replicas and their other holder never hears of it":
    an eviction removes one replica's record while every node stays, and repair looked only when
    the set of nodes changed (or every 30 s), so blocks acknowledged on 2 replicas sat on one until
    the full node left; the other holder's crash in that time lost them. The watch now tells the
    holders left, which repair within a round."""
    cluster = uuid.uuid4().hex[:8]
    extra = ["--replicas", "2"]
    # node-a sorts first (it would be the repairer of what it holds) and fills at once: 1 MiB of
    # DRAM and 2 MiB of NVMe hold about 45 of these 64 KiB blocks.
    spawn_daemon("node-a", etcd_server.url, cluster, dram="1MiB", disk="2MiB", extra=extra, lease_ttl=2)
    partner = spawn_daemon("node-b", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    # Two more: once node-b is gone, what it held again fits twice without node-a (which would
    # evict, for each repaired copy it took, the last copy of another block).
    spawn_daemon("node-c", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    spawn_daemon("node-d", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    nodes = ["node-a", "node-b", "node-c", "node-d"]
    hashes = external_hashes(list(range(200, 300)), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0, replicas=2) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 4, 10)
        time.sleep(3)  # the scans the nodes' arrivals started are over: no node is looking now
        for h in hashes:  # each on node-a and node-b (as a full node's puts are pinned to it and one partner)
            assert client.put_many([(h, content(h))], exclude={"node-c", "node-d"}) == 2
        assert sum(holders(client, ["node-a"], hashes)) < len(hashes) / 2  # node-a evicted most

        def settled() -> bool:
            """Every block on 2 nodes, twice in a row a usage refresh apart: a repair copy may land
            on node-a while its published use is stale (refreshed every 2 s) and make it evict
            another block, repaired in turn."""
            if min(holders(client, nodes, hashes)) < 2:
                return False
            time.sleep(2.5)
            return min(holders(client, nodes, hashes)) >= 2

        wait_for(settled, 15, "every evicted replica made again")
        partner.kill()  # the other holder of what node-a evicted
        wait_for(lambda: "node-b" not in client.mirror.nodes, 15, "node-b's lease to expire")
        assert read_back(client, hashes) == []


def test_a_node_restarted_under_its_name_before_its_lease_ended_is_repaired(etcd_server, spawn_daemon):
    """Kills the variant "a node killed and restarted under its name before its lease ran out":
    the restart re-registered the name, so the set of node names never changed; the old lease
    then took the node's replicas with it, and no survivor looked until its 30 s scan (the fault
    report's quick run left 975 blocks on one replica that way). A node's new address, and the
    replica records that leave the index, now make the survivors look."""
    cluster = uuid.uuid4().hex[:8]
    extra = ["--replicas", "2"]
    spawn_daemon("node-a", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    b = spawn_daemon("node-b", etcd_server.url, cluster, extra=extra, lease_ttl=8)
    c = spawn_daemon("node-c", etcd_server.url, cluster, extra=extra, lease_ttl=2)
    nodes = ["node-a", "node-b", "node-c"]
    hashes = external_hashes(list(range(300, 340)), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0, replicas=2) as client:
        mirror = client.mirror
        assert mirror.wait_until(lambda m: len(m.nodes) == 3, 10)
        assert client.put_many([(h, content(h)) for h in hashes], exclude={"node-a"}) == 2 * len(hashes)
        endpoint = mirror.nodes["node-b"].endpoint
        b.kill()
        again = spawn_daemon("node-b", etcd_server.url, cluster, extra=extra, lease_ttl=8)  # empty, same name
        # Seen once in ~15 fresh-clone runs: the new address had not reached the mirror after 10 s
        # (cause not found yet; the message says what the mirror and the new daemon knew).
        listed = lambda: getattr(mirror.nodes.get("node-b"), "endpoint", None)  # noqa: E731
        assert mirror.wait_until(lambda m: listed() not in (None, endpoint), 10), (
            f"node-b's new address {again.control} not seen: the mirror lists {listed()} (was {endpoint}), "
            f"revision {mirror.revision}, resyncs {mirror.resyncs}, resumes "
            f"{mirror.resumes}, stale {mirror.stale}; the new daemon's log ends: {again.log()[-1500:]}")
        assert "node-b" in mirror.nodes  # back in 2-3 s: well before the old run's lease (8 s) ends
        # The old run's records leave when that lease ends; node-c alone holds the blocks until repaired.
        wait_for(lambda: min(holders(client, nodes, hashes)) >= 2, 20, "the blocks' second replicas")
        c.kill()  # the blocks' other original holder
        wait_for(lambda: "node-c" not in mirror.nodes, 15, "node-c's lease to expire")
        assert read_back(client, hashes) == []


def test_a_full_replicated_cluster_takes_puts_and_repairs_no_storm(etcd_server, spawn_daemon):
    """Two nodes with --replicas 2 (the README's cluster shape), written well past what they hold:
    every put is taken (each node evicts, the blocks the other also holds first), and once the
    writes stop the nodes stop copying. Kills: repair copies that evict to make room (each copy
    evicted another replicated block, whose repair evicted the next: thousands of copies while
    idle), and a repair storm's reservations refusing ordinary puts."""
    from kvstore_testing.node_status import node_counters

    cluster = uuid.uuid4().hex[:8]
    extra = ["--replicas", "2"]
    nodes = [spawn_daemon(name, etcd_server.url, cluster, dram="2MiB", disk="2MiB", extra=extra)
             for name in ("node-a", "node-b")]

    def repaired() -> int:
        return sum(int(node_counters(node.control).get("replicas_repaired", 0)) for node in nodes)

    hashes = external_hashes(list(range(5000, 5200)), FP)  # 12.5 MiB into 2 x 4 MiB, twice over
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        for start in range(0, len(hashes), 8):
            batch = hashes[start : start + 8]
            assert client.put_many([(h, content(h)) for h in batch]) >= len(batch)  # taken by at least one node
        time.sleep(3)  # the repairs the writes set off end (a round, a usage refresh)
        settled = repaired()
        time.sleep(8)  # idle: nothing left the cluster, nothing is written
        assert repaired() - settled <= 8, f"{repaired() - settled} repair copies while idle"
        kept = [h for h, n in zip(hashes, holders(client, ["node-a", "node-b"], hashes)) if n]
        assert len(kept) > 40 and read_back(client, kept) == []
