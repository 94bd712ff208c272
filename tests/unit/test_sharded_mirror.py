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


def test_a_stale_shard_taints_only_the_answers_that_rest_on_it():
    """Kills: a sharded match that says stale whenever any shard is (one shard down would make
    every answer stale, and a router credits no prefix from a stale answer), and a `since` from a
    host index (an int for every shard) that the sharded mirror cannot take."""
    tag = uuid.uuid4().hex[:8]
    mirror = open_mirror(f"memory://stale-a-{tag};memory://stale-b-{tag}", "unit").start()
    try:
        hashes = external_hashes(range(64), FP)
        mirror.remember_many(FP, "a", [(h, record(i)) for i, h in enumerate(hashes)], since=0)
        first = [h for h in hashes if shard_of(h, 2) == 0]
        assert mirror.match(FP, first).length == len(first) and not mirror.match(FP, first).stale
        mirror.shards[1].stop()  # the second shard's mirror stops following: stale from now on
        assert mirror.shards[1].stale and mirror.stale
        found = mirror.match(FP, first)
        assert found.length == len(first) and not found.stale
        assert mirror.match(FP, hashes).stale  # this prompt rests on the stale shard too
        mirror.forget_many(FP, "a", first[:1], since=0)
        assert mirror.match(FP, first).length == 0
    finally:
        mirror.stop()


def test_the_start_up_line_hides_every_shards_password():
    """Kills: a redaction of the first user:password@ only (the second shard's password would be
    printed in the daemon's start-up line and logs)."""
    from kvstore.daemon.startup import redact

    shown = redact("etcd://u:pw1@a:2379,b:2379;etcd+tls://v:pw2@c:2379?ca=ca.pem")
    assert shown == "etcd://a:2379,b:2379;etcd+tls://c:2379?ca=ca.pem"


def test_the_vectorised_split_follows_shard_of():
    """Kills: writers and readers splitting by another rule than shard_of (a record published to
    one shard and looked for on another), for full hashes and for odd ones alike."""
    from kvstore.index.shards import split_by_shard

    hashes = external_hashes(range(500), FP) + [b"short", bytearray(16)]
    for shards in (2, 3, 4, 7):
        parts = split_by_shard(hashes, shards)
        assert sum(len(positions) for positions, _ in parts) == len(hashes)
        for k, (positions, own) in enumerate(parts):
            assert list(positions) == sorted(positions)
            assert all(shard_of(hashes[i], shards) == k for i in positions.tolist())
            assert list(own) == [hashes[i] for i in positions.tolist()]
