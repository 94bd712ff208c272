"""The index mirror against the in-process backend: queries, replicas, lease cleanup, bad records."""
from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from kvstore.index import mirror as index_module
from kvstore.daemon.session import NodeSession
from kvstore.errors import InvalidRecord, MetadataUnavailable, WatchCompacted
from kvstore.index import IndexMirror
from kvstore.index.records import BlockRecord, Layout, NodeRecord
from kvstore.keys import ModelFingerprint, chain_hashes
from kvstore.metadata import Put, open_metadata

FP = ModelFingerprint("m", "float16", 4, 2, 2, 64)
HASHES = chain_hashes(FP, list(range(4 * 10)))


def records(hashes, tier="dram"):
    return [(h, BlockRecord(tier, 3, i * 4096, 4096, (1000 + i).to_bytes(32, "little"))) for i, h in enumerate(hashes)]


@pytest.fixture
def url():
    return f"memory://{uuid.uuid4().hex[:10]}"


async def start_node(url, name, ttl=30):
    session = NodeSession(open_metadata(url), Layout("c"), NodeRecord(name, f"{name}:1"), segment="{}", ttl=ttl)
    await session.start()
    return session


async def test_match_prefix_lengths_and_lookup(url):
    with IndexMirror(url, "c") as mirror:
        a, b = await start_node(url, "a"), await start_node(url, "b")
        await a.publish(FP.digest, records(HASHES[:8]))
        revision = await b.publish(FP.digest, records(HASHES[:3], "nvme") + records(HASHES[5:6]))
        assert mirror.wait_for_revision(revision)
        result = mirror.match(FP, HASHES)
        assert result.length == 8 and not result.stale
        assert result.locations[0] == (("a", "dram"), ("b", "nvme"))
        assert result.locations[3] == (("a", "dram"),)
        assert mirror.node_prefix_lengths(FP, HASHES) == {"a": 8, "b": 3}
        assert mirror.node_prefix_lengths(FP.digest, HASHES[1:]) == {"a": 7, "b": 2}
        assert mirror.lookup(FP, HASHES[0])["b"] == BlockRecord("nvme", 3, 0, 4096, (1000).to_bytes(32, "little"))
        assert mirror.contains(FP, HASHES[7]) and not mirror.contains(FP, HASHES[8])
        assert not mirror.contains(ModelFingerprint("other", "float16", 4, 2, 2, 64), HASHES[0])
        assert mirror.match(FP, HASHES[8:]).length == 0
        other = ModelFingerprint("other", "float16", 4, 2, 2, 64)
        assert mirror.match(other, HASHES).length == 0  # same hashes, other model: no hit
        revision = await a.unpublish(FP.digest, [HASHES[4]])
        assert mirror.wait_for_revision(revision)
        assert mirror.match(FP, HASHES).length == 4
        await b.close()
        assert mirror.wait_until(lambda m: "b" not in m.nodes)
        assert mirror.match(FP, HASHES).locations[0] == (("a", "dram"),)
        assert mirror.block_count == 7
        await a.close()


async def test_expired_lease_removes_blocks(url):
    with IndexMirror(url, "c") as mirror:
        node = await start_node(url, "short", ttl=1)
        await node.publish(FP.digest, records(HASHES))
        assert mirror.wait_until(lambda m: m.block_count == len(HASHES))
        node._keepalive.cancel()  # the process "hangs": no more keep-alives
        assert await asyncio.to_thread(mirror.wait_until, lambda m: m.block_count == 0 and not m.nodes, 5)


async def test_bad_records_are_refused_before_anything_is_written(url):
    node = await start_node(url, "a")
    with pytest.raises(InvalidRecord):
        await node.publish(FP.digest, [(HASHES[0], BlockRecord("tape", 1, 0, 1, bytes(32)))])
    with pytest.raises(InvalidRecord):
        await node.publish(FP.digest, [(b"short", BlockRecord("dram", 1, 0, 1, bytes(32)))])
    with pytest.raises(InvalidRecord):
        await node.publish(FP.digest, [(HASHES[0], BlockRecord("dram", -1, 0, 1, bytes(32)))])
    with pytest.raises(InvalidRecord):
        NodeSession(open_metadata(url), Layout("c"), NodeRecord("bad/name", "x")).node.encode()
    items, _ = await open_metadata(url).range(Layout("c").blocks_prefix())
    assert items == []
    await node.close()


async def test_malformed_entries_written_by_others_are_skipped(url):
    md = open_metadata(url)
    layout = Layout("c")
    node = await start_node(url, "a")
    await node.publish(FP.digest, records(HASHES[:2]))
    await md.put_many([Put(f"{layout.blocks_prefix(FP.digest)}{HASHES[2].hex()}/a".encode(), b"garbage"),
                       Put(f"{layout.root}nodes/zzz".encode(), b"{not json")])
    with IndexMirror(url, "c") as mirror:
        assert mirror.match(FP, HASHES).length == 2
        assert set(mirror.nodes) == {"a"}
    await node.close()


def test_unreachable_metadata_fails_start_with_typed_error():
    mirror = IndexMirror("etcd://127.0.0.1:9", "c", timeout=1.0)
    with pytest.raises(MetadataUnavailable):
        mirror.start(wait=1.5)


async def test_an_answer_learned_after_a_watch_event_about_it_does_not_undo_it(url):
    """A put's reply remembered after the block's delete event passed must not resurrect it; a
    'not held' answer forgotten after a re-put event must not hide it; with no event meanwhile the
    answer is learned at once (read-your-writes)."""
    with IndexMirror(url, "c") as mirror:
        node = await start_node(url, "a")
        assert mirror.wait_for_revision(await node.publish(FP.digest, records(HASHES[:3])))
        with mirror.asking(FP, "a", [HASHES[0], HASHES[5]]) as since:  # the put is out; meanwhile ...
            assert mirror.wait_for_revision(await node.unpublish(FP.digest, [HASHES[0]]))  # ... an eviction
            mirror.remember_many(FP, "a", records(HASHES[:1]) + records(HASHES[5:6]), since)  # the reply lands
        assert not mirror.contains(FP, HASHES[0])  # the delete came while the question was out
        assert mirror.contains(FP, HASHES[5])  # nothing came about this one: learned at once
        with mirror.asking(FP, "a", HASHES[1:3]) as since:  # a lookup says "not held"; meanwhile a re-put
            assert mirror.wait_for_revision(await node.publish(FP.digest, records(HASHES[1:2], "nvme")))
            mirror.forget_many(FP, "a", [HASHES[1], HASHES[2]], since)
        assert mirror.lookup(FP, HASHES[1]) == {"a": BlockRecord("nvme", 3, 0, 4096, (1000).to_bytes(32, "little"))}
        assert not mirror.contains(FP, HASHES[2])
        mirror.remember_many(FP, "a", records(HASHES[:1]))  # without `since`: learned as before
        assert mirror.contains(FP, HASHES[0])
        await node.close()


async def test_only_replicas_under_an_open_question_are_tracked(url):
    with IndexMirror(url, "c") as mirror:
        node = await start_node(url, "a")
        with mirror.asking(FP, "a", HASHES[:2]) as first:
            with mirror.asking(FP, "a", HASHES[1:3]) as second:
                revision = await node.publish(FP.digest, records(HASHES[:4]))
                assert mirror.wait_for_revision(revision)
                assert mirror._event_revisions == {(FP.digest, h, "a"): revision for h in HASHES[:3]}  # not block 3
                mirror.forget_many(FP, "a", HASHES[1:3], second)  # put meanwhile: nothing forgotten
            assert set(mirror._event_revisions) == {(FP.digest, h, "a") for h in HASHES[:2]}  # the older one still out
            mirror.forget_many(FP, "a", HASHES[:2], first)
        assert not mirror._event_revisions and not mirror._questions
        assert mirror.match(FP, HASHES).length == 4
        await node.close()


@pytest.mark.parametrize("learned", ["while loading", "after the swap"])
async def test_an_answer_to_a_question_older_than_a_resync_is_not_learned(url, monkeypatch, learned):
    """The watch breaks while a put is out, its history gone (compacted: a mirror that resumes its
    watch otherwise must reload), and the block's eviction is folded into the fresh snapshot unseen:
    the late reply must not list the block again, in the loading snapshot or after."""
    loading, release = threading.Event(), threading.Event()
    real_load = index_module.load_prefix

    async def held_load(*args, **kwargs):  # the resync's load, held open until the reply has landed
        keys = await real_load(*args, **kwargs)
        if armed:
            loading.set()
            await asyncio.to_thread(release.wait, 10)
        return keys

    armed = False
    monkeypatch.setattr(index_module, "load_prefix", held_load)
    with IndexMirror(url, "c") as mirror:
        node = await start_node(url, "a")
        assert mirror.wait_for_revision(await node.publish(FP.digest, records(HASHES[:2])))
        real_event = mirror._on_event

        def watch_breaks(event):
            mirror._on_event = real_event
            raise WatchCompacted(1)  # the history is gone: a snapshot, not a resumed watch

        with mirror.asking(FP, "a", HASHES[:1]) as since:  # the put is out
            mirror._on_event, armed = watch_breaks, True
            await node.unpublish(FP.digest, [HASHES[0]])  # the node evicts the block; the watch breaks
            assert await asyncio.to_thread(loading.wait, 10)
            if learned == "after the swap":
                release.set()
                assert await asyncio.to_thread(mirror.wait_until, lambda m: not m.loading, 10)
            mirror.remember_many(FP, "a", records(HASHES[:1]), since)  # the late reply lands
            release.set()
        assert await asyncio.to_thread(mirror.wait_until, lambda m: not m.loading and m.resyncs == 2, 10)
        assert not mirror.contains(FP, HASHES[0]) and mirror.contains(FP, HASHES[1])
        await node.close()


async def test_a_question_asked_while_the_first_snapshot_loads_is_learned_at_once(url, monkeypatch):
    release = threading.Event()
    real_load = index_module.load_prefix

    async def held_load(*args, **kwargs):
        keys = await real_load(*args, **kwargs)
        await asyncio.to_thread(release.wait, 10)
        return keys

    monkeypatch.setattr(index_module, "load_prefix", held_load)
    node = await start_node(url, "a")
    await node.publish(FP.digest, records(HASHES[1:2]))  # the snapshot is read at a later revision
    mirror = IndexMirror(url, "c").start(wait=5)  # returns once loading has begun
    try:
        assert mirror.loading and mirror._fresh_base > 0
        with mirror.asking(FP, "a", HASHES[:1]) as since:  # a put right after the client started
            mirror.remember_many(FP, "a", records(HASHES[:1]), since)
        assert mirror.contains(FP, HASHES[0])  # read-your-writes while the index still loads
        release.set()
        assert await asyncio.to_thread(mirror.wait_until, lambda m: not m.loading, 10)
        assert mirror.contains(FP, HASHES[0]) and mirror.contains(FP, HASHES[1])
    finally:
        release.set()
        mirror.stop()
        await node.close()


async def test_remember_makes_a_block_visible_before_its_watch_event(url):
    with IndexMirror(url, "c") as mirror:
        mirror.remember(FP, HASHES[0], "a", BlockRecord("dram", 3, 0, 4096, (7).to_bytes(32, "little")))
        assert mirror.match(FP, HASHES).length == 1
        assert mirror.lookup(FP, HASHES[0]) == {"a": BlockRecord("dram", 3, 0, 4096, (7).to_bytes(32, "little"))}
        node = await start_node(url, "a")
        revision = await node.publish(FP.digest, records(HASHES[:2]))
        assert mirror.wait_for_revision(revision)  # the event itself replaces the remembered record
        assert mirror.match(FP, HASHES).length == 2 and mirror.block_count == 2
        assert mirror.lookup(FP, HASHES[0]) == {"a": BlockRecord("dram", 3, 0, 4096, (1000).to_bytes(32, "little"))}
        with pytest.raises(InvalidRecord):
            mirror.remember(FP, HASHES[5], "a", b"garbage")
        assert not mirror.contains(FP, HASHES[5])
        await node.close()
