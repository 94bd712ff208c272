"""The index mirror against the in-process backend: queries, replicas, lease cleanup, bad records."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from kvstore.errors import InvalidRecord, MetadataUnavailable
from kvstore.index import IndexMirror
from kvstore.keys import ModelFingerprint, chain_hashes
from kvstore.layout import BlockRecord, Layout, NodeRecord
from kvstore.metadata import Put, open_metadata
from kvstore.session import NodeSession

FP = ModelFingerprint("m", "float16", 4, 2, 2, 64)
HASHES = chain_hashes(FP, list(range(4 * 10)))


def records(hashes, tier="dram"):
    return [(h, BlockRecord(tier, 3, i * 4096, 4096, 1000 + i)) for i, h in enumerate(hashes)]


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
        assert mirror.lookup(FP, HASHES[0])["b"] == BlockRecord("nvme", 3, 0, 4096, 1000)
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
        await node.publish(FP.digest, [(HASHES[0], BlockRecord("tape", 1, 0, 1, 0))])
    with pytest.raises(InvalidRecord):
        await node.publish(FP.digest, [(b"short", BlockRecord("dram", 1, 0, 1, 0))])
    with pytest.raises(InvalidRecord):
        await node.publish(FP.digest, [(HASHES[0], BlockRecord("dram", -1, 0, 1, 0))])
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


async def test_remember_makes_a_block_visible_before_its_watch_event(url):
    with IndexMirror(url, "c") as mirror:
        mirror.remember(FP, HASHES[0], "a", BlockRecord("dram", 3, 0, 4096, 7))
        assert mirror.match(FP, HASHES).length == 1
        assert mirror.lookup(FP, HASHES[0]) == {"a": BlockRecord("dram", 3, 0, 4096, 7)}
        node = await start_node(url, "a")
        revision = await node.publish(FP.digest, records(HASHES[:2]))
        assert mirror.wait_for_revision(revision)  # the event itself replaces the remembered record
        assert mirror.match(FP, HASHES).length == 2 and mirror.block_count == 2
        assert mirror.lookup(FP, HASHES[0]) == {"a": BlockRecord("dram", 3, 0, 4096, 1000)}
        with pytest.raises(InvalidRecord):
            mirror.remember(FP, HASHES[5], "a", b"garbage")
        assert not mirror.contains(FP, HASHES[5])
        await node.close()
