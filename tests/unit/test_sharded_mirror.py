"""The sharded index's pieces without etcd: shard URLs as the command line takes them, and a mirror
of two in-process shards answering prefix questions across them."""
from __future__ import annotations

import uuid

import pytest

from kvstore.index import ShardedMirror, open_mirror
from kvstore.index.records import BlockRecord
from kvstore.index.shards import shard_of
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import check_metadata_url, shard_urls

FP = ModelFingerprint("sharded-unit", "float16", 16, 2, 2, 64, kv_layout="bytes")


def record(i: int) -> BlockRecord:
    return BlockRecord("dram", 1, i * 4096, 4096, i.to_bytes(32, "little"))


@pytest.mark.parametrize("url, says", [
    ("etcd://a:1;etcd://a:1", "shard 2 (etcd://a:1) names an etcd (or memory store) that shard 1 names too"),
    ("etcd://a:1,b:2;etcd://b:2", "shard 2 (etcd://b:2) names an etcd"),
    ("etcd://a:1;;etcd://b:2", "shard 2 is empty"),
    ("etcd://a:1;memory://x", "shards are all etcd or all memory://"),
    ("etcd://a:1;etcd://b", "needs host and port: 'etcd://b'"),
])
def test_a_bad_shard_list_is_refused_in_one_line(url, says):
    """Kills: two shards naming one etcd (each block would be found on one of them only by luck)."""
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        check_metadata_url(url)


def test_shard_urls_keep_their_order_and_members():
    assert shard_urls("etcd://a:1,b:2;etcd+tls://c:3?ca=x.pem") == ["etcd://a:1,b:2", "etcd+tls://c:3?ca=x.pem"]
    assert shard_urls("etcd://a:1") == ["etcd://a:1"]


def test_a_prefix_ends_at_the_first_block_any_shard_lacks():
    """Kills: combining the shards' own answers by their lengths (each shard counts only its own
    blocks, in prompt order) instead of by where each one's first missing block sits."""
    tag = uuid.uuid4().hex[:8]
    mirror = open_mirror(f"memory://shard-a-{tag};memory://shard-b-{tag}", "unit")
    assert isinstance(mirror, ShardedMirror)
    with mirror:
        hashes = external_hashes(range(40), FP)
        assert {shard_of(h, 2) for h in hashes} == {0, 1}
        for i, h in enumerate(hashes):
            if i != 25:
                mirror.remember(FP, h, "a", record(i))
            if i < 17:
                mirror.remember(FP, h, "b", record(i))
        assert mirror.match(FP, hashes).length == 25
        assert mirror.node_prefix_lengths(FP, hashes) == {"a": 25, "b": 17}
        mirror.remember(FP, hashes[25], "b", record(25))
        found = mirror.match(FP, hashes)
        assert found.length == 40
        assert [set(p.nodes) for p in found.placements] == [{"a", "b"}] * 17 + [{"a"}] * 8 + [{"b"}] + [{"a"}] * 14
        assert mirror.node_prefix_lengths(FP, hashes) == {"a": 25, "b": 17}
        assert mirror.block_count == 40 and set(mirror.lookup(FP, hashes[25])) == {"b"}
        mirror.forget_many(FP, "a", [hashes[3]])
        assert mirror.node_prefix_lengths(FP, hashes) == {"a": 3, "b": 17}
        assert mirror.match(FP, hashes[:1] + [external_hashes([99], FP)[0]]).length == 1
