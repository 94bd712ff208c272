"""A block index sharded over two real etcd servers (`--metadata "etcd://a;etcd://b"`): a store
daemon in its own process publishes each block's record to the shard its hash picks, fresh
clients read it back through a mirror per shard, and processes whose shard map disagrees are
refused at connect."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstore import Client
from kvstore.errors import ShardMapMismatch
from kvstore.index import ShardedMirror
from kvstore.index.records import Layout
from kvstore.index.shards import shard_of
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import open_metadata
from tests_support import until

FP = ModelFingerprint("sharded-index", "float16", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "sharded-index-secret"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sharded(etcd_server, second_etcd_server, spawn_daemon):
    """(metadata URL of two shards, cluster, daemon) with the daemon registered on both."""
    cluster = uuid.uuid4().hex[:8]
    url = f"{etcd_server.url};{second_etcd_server.url}"
    daemon = spawn_daemon("sharded", url, cluster, secret=SECRET)
    return url, cluster, daemon


def block_keys(url: str, cluster: str) -> set[str]:
    async def read() -> set[str]:
        metadata = open_metadata(url)
        try:
            items, _ = await metadata.range(Layout(cluster).blocks_prefix())
            return {kv.key.decode() for kv in items}
        finally:
            await metadata.close()

    return asyncio.run(read())


def test_each_record_lives_on_its_hash_shard_and_a_fresh_reader_finds_every_block(sharded, etcd_server, second_etcd_server):
    """Kills: a daemon publishing every record to the first shard (or by another rule than the
    readers'), and a reader asking the wrong shard: either way the fresh reader, who learns the
    index from etcd alone, matches a short prefix and misses blocks."""
    url, cluster, daemon = sharded
    hashes = external_hashes(range(96), FP)
    items = [(h, np.full(4096, i, np.uint8)) for i, h in enumerate(hashes)]
    with Client(url, cluster=cluster, fingerprint=FP, secret=SECRET, index="own") as writer:
        writer.put_many(items)
    layout = Layout(cluster)
    wanted = [{layout.block_key(FP.digest, h, "sharded") for h in hashes if shard_of(h, 2) == k} for k in (0, 1)]
    assert all(20 < len(keys) < 76 for keys in wanted), [len(k) for k in wanted]  # both shards hold a share
    assert until(lambda: block_keys(etcd_server.url, cluster) == wanted[0]
                 and block_keys(second_etcd_server.url, cluster) == wanted[1], 10), "records are not on their hash's shard"
    with Client(url, cluster=cluster, fingerprint=FP, secret=SECRET, index="own") as reader:
        assert isinstance(reader.mirror, ShardedMirror)
        assert until(lambda: reader.match_prefix(hashes, FP) == 96, 10), reader.match_prefix(hashes, FP)
        assert reader.mirror.node_prefix_lengths(FP, hashes) == {"sharded": 96}
        assert set(reader.mirror.nodes) == {"sharded"}
        outs = [np.zeros(4096, np.uint8) for _ in items]
        assert all(reader.get_many(hashes, outs))
        assert all((out == i).all() for i, out in enumerate(outs))
        # A block removed from the middle ends the prefix there, whichever shard held it.
        assert reader.remove([hashes[40]], FP) == 1
        assert until(lambda: reader.match_prefix(hashes, FP) == 40, 10), reader.match_prefix(hashes, FP)


def test_a_shard_map_in_another_order_or_count_is_refused_naming_both(sharded, etcd_server, second_etcd_server, tmp_path):
    """Kills: a reader or a daemon that takes the shards in another order (each block's record
    would then be looked for where it is not) or treats one shard as the whole index (a reader
    of one etcd that never looks for a shard map would see a fraction of the blocks)."""
    url, cluster, _ = sharded
    swapped = f"{second_etcd_server.url};{etcd_server.url}"
    with pytest.raises(ShardMapMismatch) as refused:
        Client(swapped, cluster=cluster, fingerprint=FP, secret=SECRET, index="own")
    assert "shard 1 of 2" in str(refused.value) and "shard 2 of 2" in str(refused.value), refused.value
    with pytest.raises(ShardMapMismatch, match="shard 1 of 2"):  # one shard read as the whole index
        Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, index="own")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    for metadata, says in ((etcd_server.url, "shard 1 of 2"), (swapped, "shard 2 of 2")):
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--node", "other", "--metadata",
                               metadata, "--cluster", cluster, "--dram", "16MiB", "--secret-file", str(secret_file),
                               "--admin-token-file", str(tmp_path / "token"), "--metrics-port", "0"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert says in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


def test_a_shard_down_leaves_the_other_shards_blocks_readable(sharded, second_etcd_server):
    """Kills: a sharded reader or writer that fails as a whole when one shard's etcd is away. With
    the second shard down, new puts are taken, the first shard's blocks read back (from a client
    that was running, and from one started meanwhile), and the down shard's blocks are misses,
    counted where they cut a prefix short, never errors."""
    url, cluster, _ = sharded
    hashes = external_hashes(range(1000, 1064), FP)
    first = [h for h in hashes if shard_of(h, 2) == 0]
    second = [h for h in hashes if shard_of(h, 2) == 1]
    with Client(url, cluster=cluster, fingerprint=FP, secret=SECRET, index="own") as client:
        client.put_many([(h, np.full(4096, 7, np.uint8)) for h in hashes])
        assert until(lambda: client.match_prefix(hashes, FP) == 64, 10)
        second_etcd_server.kill()
        try:
            more = external_hashes(range(2000, 2016), FP)
            client.put_many([(h, np.full(4096, 9, np.uint8)) for h in more])  # taken; shard 2's records wait
            outs = [np.zeros(4096, np.uint8) for _ in first]
            assert all(client.get_many(first, outs)) and all((o == 7).all() for o in outs)
            with Client(url, cluster=cluster, fingerprint=FP, secret=SECRET, index="own", timeout=2.0) as fresh:
                outs = [np.zeros(4096, np.uint8) for _ in first]
                assert until(lambda: all(fresh.get_many(first, outs)), 10)
                assert all((o == 7).all() for o in outs)
                assert not any(fresh.get_many(second, [np.zeros(4096, np.uint8) for _ in second]))
                cut = fresh.match_prefix(hashes, FP)
                assert cut == hashes.index(second[0]) and fresh.mirror.stale_cuts >= 1, cut
        finally:
            second_etcd_server.start()


def test_an_unsharded_index_is_not_taken_over_as_a_shard(etcd_server, second_etcd_server, spawn_daemon, tmp_path):
    """Kills: a sharded daemon claiming an etcd that already holds an unsharded cluster's index
    (the unsharded daemons would go on publishing every record there while the sharded ones and
    their readers look for half of them on the other shard)."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("plain", etcd_server.url, cluster, secret=SECRET)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--node", "sharded", "--metadata",
                           f"{etcd_server.url};{second_etcd_server.url}", "--cluster", cluster, "--dram", "16MiB",
                           "--secret-file", str(secret_file), "--admin-token-file", str(tmp_path / "token"),
                           "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "no shard map" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
