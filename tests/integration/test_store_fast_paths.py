"""Store fast paths (issue 12), against real etcd and daemons in their own processes: one control
round trip per put, read-your-writes for the putting client, puts of a burst spread over nodes, and
same-host NVMe reads from the tier file's fd (never wrong bytes while the node evicts)."""
from __future__ import annotations

import fcntl
import os
import re
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tests_support import until

from kvstore import Client
from kvstore.client.local_node import read_block
from kvstore.client.placement import DOWN_S
from kvstore.errors import NoStoreNodes, PutFailed
from kvstore.index.records import BlockRecord
from kvstore.index.signatures import RecordSigner
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore_testing.node_status import node_status
from transfer import Write

FP = ModelFingerprint("fast-paths", "float16", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "fast-path-secret"


def content(h: bytes, size: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def control_ops(daemon) -> dict[str, float]:
    """Control calls the daemon answered so far, per op (from its Prometheus endpoint)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^kvstore_op_latency_seconds_count\{op="([a-z_]+)"\} ([0-9.e+]+)$', text, re.M)}


def stats(daemon):
    return node_status(daemon.control)


def put_calls(before: dict[str, float], after: dict[str, float]) -> int:
    """Store operations answered between two control_ops() readings, hit reports (`touch`, sent in
    the background) left out."""
    return int(sum(after.get(op, 0) - before.get(op, 0) for op in after if not op.endswith("touch")))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_put_is_one_control_round_trip_and_the_putter_reads_its_write(etcd_server, spawn_daemon, transport):
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("one-rtt", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client, \
            Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as other:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        sizes = [64 << 10, 200 << 10] + ([1 << 20] if transport == "auto" else [])
        for i, size in enumerate(sizes):
            h = external_hashes([i], FP)[0]
            data = content(h, size)
            before = control_ops(daemon)
            assert client.put(h, data) == 1
            assert put_calls(before, control_ops(daemon)) == 1, f"{size}-byte put over {transport}"
            # Read-your-writes: this client lists and reads the block the moment put returned.
            assert client.contains(h) and client.match_prefix([h]) == 1
            out = np.zeros(size, np.uint8)
            assert client.get(h, out) and np.array_equal(out, data)
            # Others see it once the node's background publish lands (well within a second here).
            assert other.mirror.wait_until(lambda m: m.contains(FP, h), 15)
            out[:] = 0
            assert other.get(h, out) and np.array_equal(out, data)
        # Putting a block the node already holds: still one call, nothing newly stored.
        before = control_ops(daemon)
        assert client.put(external_hashes([0], FP)[0], content(external_hashes([0], FP)[0], 64 << 10)) == 0
        assert put_calls(before, control_ops(daemon)) == 1


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_read_your_writes_with_background_publishing(etcd_server, spawn_daemon, transport):
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("ryw", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        hashes = external_hashes(range(200, 230), FP)
        for i, h in enumerate(hashes):
            client.put(h, content(h, 4096))
            assert client.match_prefix(hashes) == i + 1  # no waiting for the watch
        outs = [np.zeros(4096, np.uint8) for _ in hashes]
        assert all(client.get_many(hashes, outs))


def put_two_and_settle(client: Client, observer: Client, node: str, ids: list[int]):
    """Put two 8 KiB blocks on `node` and wait until the client's mirror has their watch events (a
    stale record set before they land would be overwritten); returns both hashes and records."""
    first, second = external_hashes(ids, FP)
    client.put_many([(first, content(first, 8192)), (second, content(second, 8192))])
    assert observer.mirror.wait_until(lambda m: m.contains(FP, first) and m.contains(FP, second), 15)
    assert client.mirror.wait_for_revision(observer.mirror.revision, 15)
    return first, second, client.mirror.lookup(FP, first)[node], client.mirror.lookup(FP, second)[node]


def at_offset_of(record: BlockRecord, other: BlockRecord, cluster: str, node: str, h: bytes) -> BlockRecord:
    """`record` of block `h` pointing at `other`'s bytes: what a mirror that missed a move would
    hold (a record the node sealed when the block was there)."""
    return RecordSigner(SECRET.encode(), cluster, node).sign(
        FP.digest, h, BlockRecord(record.tier, record.region, other.offset, record.size, record.digest))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_block_that_moved_since_the_mirror_heard_is_read_from_where_the_node_has_it(
        etcd_server, spawn_daemon, transport):
    """A mirror that still points at a block's old place (the node demoted or promoted it, and the
    slot now holds another block) gets bytes that fail the digest: the client asks the node where
    the block is now and reads it from there, instead of reporting a miss or a corrupt copy."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("moved", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client, \
            Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as observer:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        moved, other, real, elsewhere = put_two_and_settle(client, observer, "moved", [500, 501])
        stale = at_offset_of(real, elsewhere, cluster, "moved", moved)
        op = ("local_" if transport == "auto" else "wire_") + "lookup"
        out = np.zeros(8192, np.uint8)
        mirror = client.mirror
        # The stale record is planted in the mirror, as if the move had not reached us. Twice in
        # ~15 fresh-clone runs the get then read the right bytes with no lookup, the mirror's
        # revision unchanged and its record the real one: what a snapshot reload does, rightly,
        # when etcd's revision has not moved meanwhile (a mirror reloads where it cannot resume
        # its watch). Only then is the stale record planted again: a resumed watch replays events
        # and must not undo it, so anything else fails, saying whether the mirror reloaded or resumed.
        for _ in range(3):
            resyncs, resumes = mirror.resyncs, mirror.resumes
            mirror.remember_many(FP, "moved", [(moved, stale)])
            assert mirror.lookup(FP, moved)["moved"] == stale
            lookups, revision = control_ops(daemon).get(op, 0), mirror.revision
            assert client.get(moved, out) and np.array_equal(out, content(moved, 8192))
            if mirror.resyncs == resyncs:
                break
        assert control_ops(daemon).get(op, 0) == lookups + 1, (
            f"no {op}: mirror revision {revision} -> {mirror.revision}, resyncs {resyncs} -> {mirror.resyncs}, "
            f"resumes {resumes} -> {mirror.resumes}, record now {mirror.lookup(FP, moved).get('moved')}, "
            f"stale {stale}, real {real}")
        assert client.mirror.lookup(FP, moved)["moved"] == real  # learnt: the next get reads it straight
        assert client.get(moved, out) and control_ops(daemon).get(op, 0) == lookups + 1
        # A block the node no longer holds stays a plain miss, and is not reported as corrupt.
        client.remove([other])
        assert client.mirror.wait_until(lambda m: not m.contains(FP, other), 15)  # its delete event has passed
        gone = at_offset_of(elsewhere, real, cluster, "moved", other)
        client.mirror.remember_many(FP, "moved", [(other, gone)])
        lookups = control_ops(daemon).get(op, 0)
        assert not client.get(other, out)
        assert control_ops(daemon).get(op, 0) == lookups + 1
        assert not client.contains(other)  # forgotten: the next get does not try again
        hits = stats(daemon).counters.get("hits_dram", 0)
        assert client.get(moved, out)  # its hit report goes out after anything queued before it
        assert until(lambda: stats(daemon).counters.get("hits_dram", 0) > hits)
        assert stats(daemon).counters.get("client_reported_corrupt", 0) == 0


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_put_reply_learned_after_the_blocks_delete_event_does_not_bring_it_back(
        etcd_server, spawn_daemon, transport):
    """The node drops a block between sealing it and the putter learning the reply, and the delete's
    watch event reaches the putter's mirror first: the late reply must not list the block again."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("late", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client, \
            Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as other:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        h, kept = external_hashes([700, 701], FP)
        learn = client.mirror.remember_many

        def late(fp, node, blocks, since=None):
            assert other.mirror.wait_until(lambda m: m.contains(FP, h), 15)
            assert other.remove([h]) == 1
            assert other.mirror.wait_until(lambda m: not m.contains(FP, h), 15)
            assert client.mirror.wait_for_revision(other.mirror.revision, 15)  # the delete event has passed
            learn(fp, node, blocks, since)

        client.mirror.remember_many = late
        client.put_many([(h, content(h, 8192)), (kept, content(kept, 8192))])
        client.mirror.remember_many = learn
        assert not client.contains(h) and client.match_prefix([h]) == 0
        out = np.zeros(8192, np.uint8)
        assert not client.get(h, out)
        assert client.mirror.wait_until(lambda m: m.contains(FP, kept), 15)  # the other block is listed
        assert client.get(kept, out) and np.array_equal(out, content(kept, 8192))


def test_a_block_dropped_before_its_put_was_published_leaves_the_putters_mirror(etcd_server, spawn_daemon):
    """The putter's mirror lists a block from the put's reply; if the node drops it before the put's
    record went out, the putter still hears of the deletion (etcd has no event for deleting a key
    it never had, so the node publishes the put first)."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("unpublished", etcd_server.url, cluster, secret=SECRET, extra=["--publish-window-ms", "1000"])
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        many = external_hashes(range(800, 1300), FP)
        client.put_many([(h, content(h, 1024)) for h in many])  # its batch holds the next one back ~1 s
        h = external_hashes([1300], FP)[0]
        client.put(h, content(h, 4096))
        assert client.contains(h)  # read-your-writes, from the reply
        assert client.remove([h]) == 1  # the node drops it while its put still waits to go out
        assert client.mirror.wait_until(lambda m: not m.contains(FP, h), 10)
        assert not client.contains(h) and client.match_prefix([h]) == 0


def test_a_lookup_answer_older_than_a_re_put_does_not_hide_the_block(etcd_server, spawn_daemon):
    """A get's bytes fail their digest, the node answers that it no longer holds the block, and the
    block is put there again before that answer is learned: the re-put's event wins, the block stays
    listed and the next get reads it."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("reput", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client, \
            Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as other:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        h, filler, real, elsewhere = put_two_and_settle(client, other, "reput", [800, 801])
        assert client.remove([h]) == 1
        assert client.mirror.wait_until(lambda m: not m.contains(FP, h), 15)
        stale = at_offset_of(real, elsewhere, cluster, "reput", h)
        client.mirror.remember_many(FP, "reput", [(h, stale)])  # as if the remove had not reached us
        ask = client.reads.lookup

        def answer_then_re_put(name, fp, hashes):
            answer = ask(name, fp, hashes)
            assert answer == [None]  # the node does not hold it ...
            other.put(h, content(h, 8192))  # ... until another client puts it there again
            assert client.mirror.wait_until(lambda m: m.lookup(FP, h).get("reput") not in (None, stale), 15)
            return answer

        client.reads.lookup = answer_then_re_put
        out = np.zeros(8192, np.uint8)
        assert not client.get(h, out)  # this read missed: its bytes were the filler's
        client.reads.lookup = ask
        assert client.contains(h)  # but the re-put block stays listed ...
        assert client.get(h, out) and np.array_equal(out, content(h, 8192))  # ... and reads


def test_a_corrupt_replica_is_reported_even_when_another_serves_the_block(etcd_server, spawn_daemon):
    """The first replica's bytes are damaged: the get is served by the second, and the first node
    is told, so it re-checks the copy and drops it (its record did not move, so no second read)."""
    cluster = uuid.uuid4().hex[:8]
    first = spawn_daemon("a-node", etcd_server.url, cluster, secret=SECRET)
    spawn_daemon("b-node", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, replicas=2) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        h = external_hashes([600], FP)[0]
        data = content(h, 8192)
        assert client.put(h, data) == 2
        record = client.mirror.lookup(FP, h)["a-node"]
        garbage = np.full(8192, 7, np.uint8)
        scratch = client.engine.register(garbage, remote_access=False)
        try:  # a stray write into a-node's copy (the put path may write there, so this client can)
            client.engine.transfer([Write(scratch, 0, client.links.node("a-node").peer.region(record.region),
                                          record.offset, 8192)])
        finally:
            client.engine.unregister(scratch)
        out = np.zeros(8192, np.uint8)
        assert client.get(h, out) and np.array_equal(out, data)
        assert until(lambda: stats(first).counters.get("corrupt_blocks_dram", 0) == 1)


def test_sync_publish_is_visible_to_others_when_put_returns(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("sync-node", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, publish="sync") as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        hashes = external_hashes(range(100, 110), FP)
        client.put_many([(h, content(h, 8192)) for h in hashes])
        # Published before the reply: a fresh read of etcd lists every block.
        with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as fresh:
            assert all(fresh.contains(h) for h in hashes)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_put_answered_before_its_check_publishes_only_bytes_that_verified(etcd_server, spawn_daemon,
                                                                              monkeypatch, transport):
    """Puts of 2 MiB or more are answered before the node's digest pass; a block whose bytes then
    fail it is never published (nor read as a hit), one that passes is, on every put path (inline
    and engine). A smaller put is checked before its answer."""
    import kvstore.client.put_path as client_module

    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("verify-after", etcd_server.url, cluster, secret=SECRET)
    sizes = [3 << 20, 8 << 20]  # same host: one inline (one round trip), one reserve/engine write/commit
    good, bad = external_hashes([1, 2], FP), external_hashes([3, 4], FP)
    small = external_hashes([5], FP)[0]
    bad.append(small)
    digests, put_many = client_module.block_digests, Client.put_many
    # The client sends a digest its bytes do not have, as a corrupted transfer would look to the node.
    # Only while putting (on any thread: a helper hashes large puts): gets check what landed with
    # the same function.
    putting = {"now": False}

    def putting_many(self, *args, **kwargs):
        putting["now"] = True
        try:
            return put_many(self, *args, **kwargs)
        finally:
            putting["now"] = False

    def flip(hs, values):
        return [bytes([value[0] ^ 1]) + value[1:] if putting["now"] and h in bad else value
                for h, value in zip(hs, values)]

    monkeypatch.setattr(Client, "put_many", putting_many)
    monkeypatch.setattr(client_module, "block_digests", lambda hs, ds: flip(hs, digests(hs, ds)))
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client, \
            Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as other:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        for h, size in zip(good + bad, sizes + sizes):
            assert client.put(h, content(h, size)) == 1  # written: the answer does not wait for the check
        with pytest.raises(PutFailed, match="digest mismatch"):
            client.put(small, content(small, 64 << 10))
        assert other.mirror.wait_until(lambda m: all(m.contains(FP, h) for h in good), 15)
        assert until(lambda: stats(daemon).counters.get("corrupt_writes", 0) == 3)
        time.sleep(0.3)  # past a publish batch: what was dropped must not show up late either
        assert not any(other.contains(h) for h in bad)
        for h, size in zip(good + bad, sizes + sizes + [64 << 10]):
            out = np.zeros(size, np.uint8)
            assert other.get(h, out) == (h in good) and (h not in good or np.array_equal(out, content(h, size)))
            assert client.get(h, out) == (h in good)  # the putter's own record of a dropped block misses
        assert sum(t.blocks for t in stats(daemon).tiers) == 2


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_put_like_the_last_writes_into_slots_its_commit_leased(etcd_server, spawn_daemon, transport):
    """A large put's commit leases slots for the next put of that shape, which then writes before
    its one control call (the commit) instead of reserving first; closing the client gives unused
    slots back, and slots near their expiry are not written into."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("leases", etcd_server.url, cluster, secret=SECRET)
    block, count = 1 << 20, 8  # 8 MiB: past the same-host inline limit, an eighth of the node's DRAM
    everything: list[bytes] = []

    def put_round(client: Client, calls: int) -> None:
        hashes = external_hashes(range(len(everything), len(everything) + count), FP)
        everything.extend(hashes)
        before = control_ops(daemon)
        assert client.put_many([(h, content(h, block)) for h in hashes]) == count
        assert put_calls(before, control_ops(daemon)) == calls, f"put {len(everything) // count} over {transport}"

    def dram_used() -> int:
        return next(t for t in stats(daemon).tiers if t.name == "dram").used_bytes

    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client, \
            Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as other:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        for calls in (2, 1, 1):  # reserve + commit, then the commit alone
            put_round(client, calls)
        assert stats(daemon).counters.get("leased_slots", 0) == 3 * count
        assert other.mirror.wait_until(lambda m: all(m.contains(FP, h) for h in everything), 15)
        outs = [np.zeros(block, np.uint8) for _ in everything]
        assert all(other.get_many(everything, outs))
        assert all(np.array_equal(out, content(h, block)) for out, h in zip(outs, everything))
        assert dram_used() == len(everything) * block + count * block  # the blocks and one put's lease
    assert until(lambda: dram_used() == len(everything) * block)  # closed: the lease is given back
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        put_round(client, 2)
        for slot in client.links.leases.slots():
            slot.usable_until = 0.0  # as if a write now could outlive the node's hold on them
        put_round(client, 3)  # reserved again (an old lease is never written into); the old ones given back
        assert until(lambda: dram_used() == len(everything) * block + count * block)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_lease_from_before_a_node_restart_is_never_written_into(etcd_server, spawn_daemon, transport):
    """The restarted node's arena has the old one's region ids: a client that wrote into its old
    leased slots there would overwrite other clients' blocks."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("restarted", etcd_server.url, cluster, secret=SECRET)
    block, count = 1 << 20, 8
    mine = external_hashes(range(count), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport,
                timeout=3.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        assert client.put_many([(h, content(h, block)) for h in mine]) == count  # leases 8 slots
        old_segment = client.mirror.segments.get(daemon.name)
        daemon.proc.kill()
        daemon.proc.wait(10)
        daemon = spawn_daemon("restarted", etcd_server.url, cluster, secret=SECRET)
        assert client.mirror.wait_until(lambda m: m.segments.get(daemon.name) not in (None, old_segment), 10)
        theirs = external_hashes(range(100, 100 + 2 * count), FP)
        with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as other:
            assert other.mirror.wait_until(lambda m: daemon.name in m.nodes, 10)
            assert other.put_many([(h, content(h, block)) for h in theirs]) == 2 * count
            again = external_hashes(range(200, 200 + count), FP)
            stored, deadline = 0, time.monotonic() + 20
            while time.monotonic() < deadline:  # the first may meet the old connection and fail over
                try:
                    stored = client.put_many([(h, content(h, block)) for h in again])
                    break
                except NoStoreNodes:
                    time.sleep(DOWN_S + 0.1)  # the failed node is skipped this long: try after it
            assert stored == count
            outs = [np.zeros(block, np.uint8) for _ in theirs]
            assert all(other.get_many(theirs, outs))
            assert all(np.array_equal(out, content(h, block)) for out, h in zip(outs, theirs))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_puts_count_blocks_new_on_the_node_and_large_batches_go_through(etcd_server, spawn_daemon, transport):
    """A put of blocks already stored counts none of them (whether its slots were leased or
    reserved); a put of more blocks than a lease grants still goes through."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("counting", etcd_server.url, cluster, secret=SECRET, dram="256MiB")  # 5,000 blocks in one round
    block, count = 1 << 20, 8
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        items = [(h, content(h, block)) for h in external_hashes(range(count), FP)]
        assert [client.put_many(items) for _ in range(3)] == [count, 0, 0]
        many = [(h, np.full(4096, i % 251, np.uint8)) for i, h in enumerate(external_hashes(range(1000, 6000), FP))]
        assert client.put_many(many) == len(many) and client.put_many(many[:10]) == 0
        outs = [np.zeros(4096, np.uint8) for _ in many[::500]]
        assert all(client.get_many([h for h, _ in many[::500]], outs))
        assert all(np.array_equal(out, data) for out, (_, data) in zip(outs, many[::500]))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_write_that_timed_out_does_not_give_its_slots_back(etcd_server, spawn_daemon, transport,
                                                                   monkeypatch):
    """A write the client stopped waiting for may still be landing: its slots are not given back
    (another block could get them and be overwritten); the node frees them at their expiry."""
    from transfer import TransferTimeout
    from transfer.batch import Batch

    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("timed-out", etcd_server.url, cluster, secret=SECRET)
    block, count = 1 << 20, 8
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        real_wait = Batch.wait

        def stalled(batch, timeout=None, **kwargs):
            real_wait(batch, timeout, **kwargs)
            raise TransferTimeout("as if the write had stalled past the timeout")

        monkeypatch.setattr(Batch, "wait", stalled)
        before = control_ops(daemon)
        with pytest.raises(NoStoreNodes):
            client.put_many([(h, content(h, block)) for h in external_hashes(range(count), FP)])
        monkeypatch.setattr(Batch, "wait", real_wait)
        after = control_ops(daemon)

        def calls(counts: dict[str, float], op: str) -> float:  # over any control path
            return sum(counts.get(prefix + op, 0) for prefix in ("", "local_", "wire_"))

        assert calls(after, "reserve") > calls(before, "reserve")  # it did write into reserved slots
        assert calls(after, "abort") == calls(before, "abort")
        assert next(t for t in stats(daemon).tiers if t.name == "dram").used_bytes == count * block  # still held


def test_a_client_whose_timeout_a_lease_cannot_cover_asks_for_none(etcd_server, spawn_daemon):
    """With a timeout of a quarter of the node's hold or more, a leased slot could never be used
    safely: the first grant goes back at once, and later commits ask for none."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("slow-client", etcd_server.url, cluster, secret=SECRET)
    block, count = 1 << 20, 8
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, timeout=8.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        for round_, calls in enumerate([3, 2, 2]):  # reserve, commit (and the grant returned); then no grant
            hashes = external_hashes(range(round_ * count, round_ * count + count), FP)
            before = control_ops(daemon)
            assert client.put_many([(h, content(h, block)) for h in hashes]) == count
            assert put_calls(before, control_ops(daemon)) == calls
            used = next(t for t in stats(daemon).tiers if t.name == "dram").used_bytes
            assert used == (round_ + 1) * count * block  # no slots left stranded at the node


def test_a_burst_of_puts_spreads_over_three_nodes(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    daemons = [spawn_daemon(f"burst{i}", etcd_server.url, cluster, secret=SECRET) for i in range(3)]
    block = 64 << 10
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 3, 10)
        hashes = external_hashes(range(1000, 1256), FP)
        data = {h: content(h, block) for h in hashes}
        with ThreadPoolExecutor(32) as pool:
            assert sum(pool.map(lambda h: client.put(h, data[h]), hashes)) == 256
        per_node = [sum(t.blocks for t in stats(d).tiers) for d in daemons]
        assert sum(per_node) == 256
        assert max(per_node) / min(per_node) <= 1.3, per_node
        # Everything readable, by this client at once.
        outs = [np.zeros(block, np.uint8) for _ in hashes]
        assert all(client.get_many(hashes, outs))
        assert all(np.array_equal(o, data[h]) for o, h in zip(outs, hashes))


@pytest.fixture
def nvme_node(etcd_server, spawn_daemon):
    """A node with 1 MiB of DRAM and a 4 MiB NVMe tier, no promotion: blocks live on NVMe soon."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("nvme-node", etcd_server.url, cluster, secret=SECRET, dram="1MiB", disk="4MiB",
                          extra=["--no-promote"])
    client = Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, timeout=3)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    yield daemon, client
    client.close()


BLOCK = 64 << 10


def on_nvme(client: Client, hashes: list[bytes]) -> list[bytes]:
    return [h for h in hashes if (r := client.mirror.lookup(FP, h).get("nvme-node")) is not None and r.tier == "nvme"]


def test_same_host_nvme_reads_go_through_the_tier_fd(nvme_node):
    _, client = nvme_node
    hashes = external_hashes(range(2000, 2040), FP)  # 2.5 MiB: most of it demoted to NVMe
    for h in hashes:
        client.put(h, content(h, BLOCK))
    assert client.mirror.wait_until(lambda m: len(on_nvme(client, hashes)) >= 10, 10)
    cold = on_nvme(client, hashes)
    tcp_before = client.engine.stats().get("tcp_rx_bytes", 0)
    outs = [np.zeros(BLOCK, np.uint8) for _ in cold]
    assert all(client.get_many(cold, outs))
    assert all(np.array_equal(o, content(h, BLOCK)) for o, h in zip(outs, cold))
    assert client.engine.stats().get("tcp_rx_bytes", 0) == tcp_before  # not a byte over TCP
    assert client.stats["nvme_fd_reads"] >= len(cold)
    # The fd the node handed over reads, never writes.
    tier = client.links.local("nvme-node").tier()
    assert fcntl.fcntl(tier.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    with pytest.raises(OSError):
        os.pwrite(tier.fd, b"x", 0)
    # Records that do not fit the tier are never read (bounds-checked against the tier's size).
    forged = BlockRecord("nvme", tier.region, tier.size - 4096, 2 * 4096, bytes(32))
    region = client.engine.register(np.zeros(2 * 4096, np.uint8), remote_access=False)
    try:
        assert read_block(tier, forged, [(region, 0, 2 * 4096)]) is False
    finally:
        client.engine.unregister(region)


def test_a_stale_nvme_record_never_returns_another_blocks_bytes(nvme_node):
    _, client = nvme_node
    hashes = external_hashes(range(3000, 3040), FP)
    for h in hashes:
        client.put(h, content(h, BLOCK))
    assert client.mirror.wait_until(lambda m: len(on_nvme(client, hashes)) >= 10, 10)
    victim = on_nvme(client, hashes)[0]
    stale = client.mirror.lookup(FP, victim)["nvme-node"]
    client.remove([victim])
    # Fill the tier again until the victim's extent holds another block.
    fresh = external_hashes(range(4000, 4080), FP)

    def reused() -> bool:
        return any((r := client.mirror.lookup(FP, f).get("nvme-node")) is not None and r.tier == "nvme"
                   and r.offset == stale.offset for f in fresh)

    for h in fresh:
        client.put(h, content(h, BLOCK))
        assert client.mirror.wait_until(lambda m: m.contains(FP, h), 15)
        if reused():
            break
    else:
        # Demotions are the node's background work: under load their records reach the mirror
        # after the puts that caused them (seen with two test suites sharing 2 vCPUs).
        if not client.mirror.wait_until(lambda _: reused(), 15):
            pytest.fail("the victim's extent was never reused")
    out = np.zeros(BLOCK, np.uint8)
    region = client.engine.register(out, remote_access=False)
    try:
        # What a get with a mirror that has not heard of the removal would do: a miss, not wrong bytes.
        assert client.reads.nodes.read_from("nvme-node", [victim], [(0, stale)], [[(region, 0, BLOCK)]]) == []
    finally:
        client.engine.unregister(region)
    assert client.stats["nvme_fd_reads"] >= 1


def test_nvme_reads_while_the_node_evicts_are_right_or_misses(nvme_node):
    _, client = nvme_node
    hashes = external_hashes(range(5000, 5040), FP)
    for h in hashes:
        client.put(h, content(h, BLOCK))
    assert client.mirror.wait_until(lambda m: len(on_nvme(client, hashes)) >= 10, 10)
    stop, wrong, hits, writer_error = threading.Event(), [], [0], []

    def writer() -> None:  # keeps demoting into, and evicting from, the 4 MiB tier
        try:
            for n in range(6000, 6400):
                if stop.is_set():
                    return
                h = external_hashes([n], FP)[0]
                client.put(h, content(h, BLOCK))
        except Exception as exc:  # noqa: BLE001 - reported below
            writer_error.append(exc)

    reads_before = client.stats["nvme_fd_reads"]
    thread = threading.Thread(target=writer)
    thread.start()
    deadline = time.monotonic() + 20
    try:
        while thread.is_alive() and time.monotonic() < deadline:
            listed = on_nvme(client, hashes + external_hashes(range(6000, 6400), FP))[:16]
            outs = [np.zeros(BLOCK, np.uint8) for _ in listed]
            for h, ok, out in zip(listed, client.get_many(listed, outs), outs):
                if ok:
                    hits[0] += 1
                    if not np.array_equal(out, content(h, BLOCK)):
                        wrong.append(h)
    finally:
        stop.set()
        thread.join(30)
    assert not writer_error, writer_error
    assert not wrong, f"{len(wrong)} reads returned wrong bytes"
    assert hits[0] > 0 and client.stats["nvme_fd_reads"] > reads_before


def test_a_daemon_publishes_to_an_etcd_that_takes_fewer_operations_per_transaction(spawn_daemon):
    """A put of more blocks than such an etcd takes in one transaction still becomes visible to
    other clients (its publish batch is split, not retried whole for ever)."""
    from kvstore_testing.etcd import EtcdServer

    with EtcdServer(extra_args=["--max-txn-ops", "16"]) as server:
        cluster = uuid.uuid4().hex[:8]
        spawn_daemon("small-txns", server.url, cluster, secret=SECRET)
        hashes = external_hashes(range(100), FP)
        with Client(server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client, \
                Client(server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as other:
            assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
            assert client.put_many([(h, content(h, 4096)) for h in hashes]) == len(hashes)
            assert other.mirror.wait_until(lambda m: all(m.contains(FP, h) for h in hashes), 10)
            assert client.remove(hashes) == len(hashes)
            assert other.mirror.wait_until(lambda m: not any(m.contains(FP, h) for h in hashes), 10)


def test_the_wire_port_can_be_chosen_or_turned_off(etcd_server, spawn_daemon):
    """`--wire-port N` puts the TCP wire where a firewall expects it; `--wire-port -1` opens none:
    only clients on its host use that node (one elsewhere is told why and puts elsewhere)."""
    import json

    from kvstore.errors import NodeRefused
    from kvstore_testing.ports import free_port

    cluster = uuid.uuid4().hex[:8]
    port = free_port()
    spawn_daemon("fixed", etcd_server.url, cluster, secret=SECRET, extra=["--wire-port", str(port)])
    spawn_daemon("none", etcd_server.url, cluster, secret=SECRET, extra=["--wire-port", "-1"])
    hashes = external_hashes(range(900, 940), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport="tcp") as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        assert json.loads(client.mirror.segments["fixed"])["kvstore_wire"] == f"127.0.0.1:{port}"
        assert "kvstore_wire" not in json.loads(client.mirror.segments["none"])
        with pytest.raises(NodeRefused, match="--wire-port -1"):
            client.links.control("none")
        result = client.put_batch([(h, content(h, 4096)) for h in hashes], replicas=2)
        assert all(r.nodes == ("fixed",) and "--wire-port -1" in r.reason for r in result)
        assert client.stats["wire_puts"] == 1
        outs = [np.zeros(4096, np.uint8) for _ in hashes]
        assert all(client.get_many(hashes, outs))
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as here:  # its own host
        assert here.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        assert here.put_many([(h, content(h, 4096)) for h in hashes], replicas=2) == len(hashes)  # the 2nd copies
        assert here.stats["local_puts"] >= 1
