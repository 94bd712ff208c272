"""The index against a real etcd: killed nodes vanish from every mirror, etcd restarts resume the watch."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
from node_process import node_fingerprint

from kvstore.daemon.session import NodeSession
from kvstore.index import IndexMirror
from kvstore.index.records import BlockRecord, Layout, NodeRecord
from kvstore.keys import ModelFingerprint, chain_hashes
from kvstore.metadata import open_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn_node(url, cluster, node, blocks=200, ttl=2, seed=1):
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "helpers", "node_process.py"), "--url", url,
                             "--cluster", cluster, "--node", node, "--blocks", str(blocks), "--ttl", str(ttl),
                             "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hello = json.loads(proc.stdout.readline())
    return proc, hello["revision"], [bytes.fromhex(h) for h in hello["hashes"]]


def test_killed_node_disappears_from_every_mirror(etcd_server):
    cluster = uuid.uuid4().hex[:8]
    fp = node_fingerprint()
    mirrors = [IndexMirror(etcd_server.url, cluster).start() for _ in range(2)]
    victim, rev1, hashes = spawn_node(etcd_server.url, cluster, "victim", blocks=300, seed=1)
    keeper, rev2, kept_hashes = spawn_node(etcd_server.url, cluster, "keeper", blocks=50, seed=2)
    try:
        for mirror in mirrors:
            assert mirror.wait_for_revision(max(rev1, rev2), 10)
            assert mirror.match(fp, hashes).length == 300 and mirror.block_count == 350
            assert set(mirror.nodes) == {"victim", "keeper"} and set(mirror.segments) == {"victim", "keeper"}
        victim.kill()
        victim.wait()
        started = time.monotonic()
        for mirror in mirrors:
            assert mirror.wait_until(lambda m: m.block_count == 50 and set(m.nodes) == {"keeper"}, 10)
            assert mirror.match(fp, hashes).length == 0
            assert mirror.match(fp, kept_hashes).length == 50
        assert time.monotonic() - started < 2 + 6  # TTL plus etcd's lease check slack
    finally:
        for mirror in mirrors:
            mirror.stop()
        for proc in (victim, keeper):
            proc.kill()
            proc.wait()


def test_etcd_restart_resumes_the_mirror(fresh_etcd):
    """etcd killed and restarted on its data: the mirror goes stale, then resumes its watch from the
    revision after the last it applied (no snapshot reloaded) and ends up with every change made
    meanwhile. Kills: a mirror that reloads the whole index after every disconnect (resyncs 2,
    resumes 0), or one that resumes from the wrong revision (a change missed)."""
    cluster = uuid.uuid4().hex[:8]
    fp = ModelFingerprint("m", "float16", 4, 2, 2, 64)
    hashes = chain_hashes(fp, list(range(4 * 100)))
    layout = Layout(cluster)

    async def session(name):
        s = NodeSession(open_metadata(fresh_etcd.url), layout, NodeRecord(name, "x"), ttl=60)
        await s.start()
        return s

    async def scenario():
        a = await session("a")
        rev = await a.publish(fp.digest, [(h, BlockRecord("dram", 1, i, 1, i.to_bytes(32, "little")))
                                          for i, h in enumerate(hashes[:60])])
        mirror = IndexMirror(fresh_etcd.url, cluster, stale_after=1.0, timeout=2.0).start()
        try:
            assert await asyncio.to_thread(mirror.wait_for_revision, rev)
            assert mirror.match(fp, hashes).length == 60 and not mirror.stale
            fresh_etcd.kill()
            assert await asyncio.to_thread(mirror.wait_until, lambda m: m.stale, 10), "never reported stale"
            assert mirror.match(fp, hashes).stale
            fresh_etcd.start()
            # Changes the mirror has not seen: more blocks, some removed, a new node.
            writer = open_metadata(fresh_etcd.url)
            b = NodeSession(writer, layout, NodeRecord("b", "y"), ttl=60)
            await b.start()
            await b.publish(fp.digest, [(h, BlockRecord("nvme", 2, i, 1, i.to_bytes(32, "little")))
                                        for i, h in enumerate(hashes[:80])])
            last_write = await a.unpublish(fp.digest, hashes[:10])
            items, _ = await writer.range(layout.root)
            assert await asyncio.to_thread(mirror.wait_for_revision, last_write, 15)
            assert await asyncio.to_thread(mirror.wait_until, lambda m: not m.stale, 10)
            assert mirror.resumes >= 1 and mirror.resyncs == 1, (mirror.resumes, mirror.resyncs)
            assert set(mirror.nodes) == {"a", "b"}
            assert mirror.block_count == 80
            assert mirror.node_prefix_lengths(fp, hashes) == {"b": 80}
            assert mirror.lookup(fp, hashes[20]).keys() == {"a", "b"}
            assert mirror.lookup(fp, hashes[5]).keys() == {"b"}
            block_keys = {i.key for i in items if b"/blocks/" in i.key}
            assert len(block_keys) == 80 + 50  # etcd and mirror agree replica for replica
            await b.close()
            await a.close()
        finally:
            mirror.stop()

    asyncio.run(scenario())


def test_a_waiter_on_stale_wakes_when_the_connection_drops(fresh_etcd):
    """A waiter on `stale` wakes when the watch breaks, not at its timeout. Kills the mirror that
    marked itself disconnected without a notify: with 30 s of silence allowed nothing else woke
    the waiter, which slept out its 8 s (the restart test above would sleep out its 10 s whenever
    its first look beat the drop)."""
    mirror = IndexMirror(fresh_etcd.url, uuid.uuid4().hex[:8], stale_after=30, timeout=2.0).start()
    looked, result = threading.Event(), {}

    def stale(m: IndexMirror) -> bool:
        looked.set()
        return m.stale

    def wait() -> None:
        started = time.monotonic()
        result["stale"] = mirror.wait_until(stale, 8)
        result["seconds"] = time.monotonic() - started

    try:
        assert mirror.wait_loaded(10) and not mirror.stale
        waiter = threading.Thread(target=wait)
        waiter.start()
        assert looked.wait(5)  # it found the mirror current and sleeps until told otherwise
        fresh_etcd.kill()
        waiter.join(15)
        assert result["stale"] and result["seconds"] < 4
    finally:
        mirror.stop()


def test_concurrent_publishers_of_the_same_block_end_consistent(etcd_server):
    """The mirror is waited on at the revision of the last write under its cluster, not at the
    store-wide revision of a read after it: etcd's revision counts every cluster's writes, and a
    neighbour's write (here on purpose; in a full run another test's lease expiring) between the
    publishes and that read gave a revision no event of this cluster ever carries, so the wait ran
    out its 10 s."""
    cluster = uuid.uuid4().hex[:8]
    fp = ModelFingerprint("m", "float16", 4, 2, 2, 64)
    hashes = chain_hashes(fp, list(range(4 * 64)))
    layout = Layout(cluster)

    async def scenario():
        mirror = IndexMirror(etcd_server.url, cluster).start()
        sessions = []
        for name in ("x", "y"):
            s = NodeSession(open_metadata(etcd_server.url), layout, NodeRecord(name, name), ttl=30)
            await s.start()
            sessions.append(s)
        # Both nodes store and publish the same 64 blocks at the same time, twice over.
        revisions = await asyncio.gather(*[s.publish(fp.digest, [(h, BlockRecord("dram", k, i, 1, bytes(32)))
                                                                 for i, h in enumerate(hashes)])
                                           for k in (1, 2) for s in sessions])
        reader = open_metadata(etcd_server.url)
        neighbour = Layout(uuid.uuid4().hex[:8]).root + "neighbour"
        await reader.put(neighbour, b"x")  # another cluster writes to the same etcd
        items, _ = await reader.range(layout.blocks_prefix(fp.digest))
        await reader.delete(neighbour)
        await reader.close()
        assert mirror.wait_for_revision(max(revisions), 10)
        assert len(items) == 128
        assert mirror.match(fp, hashes).length == 64
        for item in items:
            _, hash_hex, node = item.key.decode().rsplit("/", 2)
            assert mirror.lookup(fp, bytes.fromhex(hash_hex))[node] == BlockRecord.decode(item.value)
        for s in sessions:
            await s.close()
        mirror.stop()

    asyncio.run(scenario())


def test_a_revision_is_announced_only_once_all_its_events_are_applied(etcd_server, monkeypatch):
    """One transaction publishes 64 blocks as one revision, and the mirror is held after applying
    the first of them: wait_for_revision must not return until all 64 are in. Kills the mirror that
    announced each event's revision as it applied it: its waiter woke with 1 block of 64 (under
    load, the test above read a record its last transaction had not replaced yet)."""
    cluster = uuid.uuid4().hex[:8]
    fp = ModelFingerprint("m", "float16", 4, 2, 2, 64)
    hashes = chain_hashes(fp, list(range(4 * 64)))
    layout = Layout(cluster)
    held, release, answered = threading.Event(), threading.Event(), threading.Event()
    mirror = IndexMirror(etcd_server.url, cluster).start()
    real_apply, blocks = mirror.tables.apply, []

    def held_apply(snap, kind, key, value):
        if b"/blocks/" in key:
            blocks.append(key)
            if len(blocks) == 2:  # the transaction's first block is in: hold the rest
                held.set()
                release.wait(10)
        return real_apply(snap, kind, key, value)

    seen = {}

    def wait(revision: int) -> None:
        seen["revision"] = mirror.wait_for_revision(revision, 10)
        seen["blocks"] = mirror.match(fp, hashes).length
        answered.set()

    async def scenario():
        session = NodeSession(open_metadata(etcd_server.url), layout, NodeRecord("n", "n"), ttl=30)
        await session.start()
        try:
            revision = await session.publish(fp.digest, [(h, BlockRecord("dram", 1, i, 1, i.to_bytes(32, "little")))
                                                         for i, h in enumerate(hashes)])
            waiter = asyncio.create_task(asyncio.to_thread(wait, revision))
            assert await asyncio.to_thread(held.wait, 10)
            await asyncio.to_thread(answered.wait, 1.5)  # a mirror that announces the revision early answers here
            release.set()
            await waiter
            assert seen == {"revision": True, "blocks": 64}
        finally:
            release.set()
            await session.close()

    try:
        assert mirror.wait_loaded(10)
        monkeypatch.setattr(mirror.tables, "apply", held_apply)
        asyncio.run(scenario())
    finally:
        release.set()
        mirror.stop()


def test_oversize_and_wrong_type_input_gets_typed_errors(etcd_server):
    from kvstore.errors import InvalidKey, InvalidRecord, InvalidValue, ValueTooLarge

    async def scenario():
        md = open_metadata(etcd_server.url)
        layout = Layout(uuid.uuid4().hex[:8])
        with pytest.raises(ValueTooLarge):
            await md.put(layout.root + "big", b"x" * (3 << 20))
        with pytest.raises(InvalidValue):
            await md.put(layout.root + "k", {"not": "bytes"})  # type: ignore[arg-type]
        with pytest.raises(InvalidKey):
            await md.get(b"")
        with pytest.raises(InvalidRecord):
            layout.block_key("fp", b"\0" * 15, "n")
        with pytest.raises(InvalidRecord):
            Layout("bad cluster name")
        assert (await md.range(layout.root))[0] == []
        await md.close()

    asyncio.run(scenario())
