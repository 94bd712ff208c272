"""Snapshot loading against the in-process backend: ranges read at a past revision, the parallel
loader's exact coverage under concurrent writes, partial answers while a snapshot loads, and
malformed entries mixed into bulk pages."""
from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid

import pytest

import kvstore.index.snapshot as index_load
from kvstore.daemon.session import NodeSession
from kvstore.errors import WatchCompacted
from kvstore.index import IndexMirror
from kvstore.index.records import BlockRecord, Layout, NodeRecord
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import Delete, MemoryMetadata, Put, open_metadata, prefix_end
from tests_support import until

FP = ModelFingerprint("m", "float16", 4, 2, 2, 64)
OTHER = ModelFingerprint("other", "float16", 4, 2, 2, 64)
LAYOUT = Layout("c")


@pytest.fixture
def url():
    return f"memory://{uuid.uuid4().hex[:10]}"


def record(i: int, tier: str = "dram") -> BlockRecord:
    return BlockRecord(tier, 1, i * 4096, 4096, i.to_bytes(32, "little"))


async def node(url: str, name: str) -> NodeSession:
    session = NodeSession(open_metadata(url), LAYOUT, NodeRecord(name, f"{name}:1"), ttl=60)
    await session.start()
    return session


async def test_range_page_reads_a_past_revision_exactly(url):
    md = open_metadata(url)
    await md.put_many([Put(b"/p/%03d" % i, b"v%d" % i) for i in range(50)])
    before = await md.range_page(b"/p/", b"/p0")
    await md.put(b"/p/007", b"changed")
    await md.delete(b"/p/010")
    await md.put(b"/p/100", b"new")
    then = await md.range_page(b"/p/", b"/p0", revision=before.revision)
    assert (then.keys, then.values) == (before.keys, before.values)
    paged = await md.range_page(b"/p/", b"/p0", revision=before.revision, limit=20)
    assert paged.keys == before.keys[:20] and paged.more and paged.count == 50
    now = await md.range_page(b"/p/", b"/p0")
    assert b"/p/010" not in now.keys and now.values[now.keys.index(b"/p/007")] == b"changed"
    await md.compact(now.revision)
    with pytest.raises(WatchCompacted):
        await md.range_page(b"/p/", b"/p0", revision=before.revision)


async def test_parallel_load_is_exactly_one_revision_under_concurrent_writes(url, monkeypatch):
    monkeypatch.setattr(index_load, "PAGE", 37)  # many small pages, many cells
    md = open_metadata(url)
    prefix = LAYOUT.blocks_prefix().encode()
    for fp in (FP, OTHER):
        hashes = external_hashes(range(1500), fp)
        await md.put_many([Put(LAYOUT.block_key(fp.digest, h, n).encode(), record(i).encode())
                           for i, h in enumerate(hashes) for n in ("a", "b")[: 1 + i % 2]])
    await md.put_many([Put(prefix + b"not-a-fingerprint", b"x"), Put(prefix + FP.digest.encode() + b"/zz/a", b"y")])
    expected = await md.range_page(prefix, prefix_end(prefix))
    stop = threading.Event()

    def churn() -> None:  # writes that must not show up in a load pinned before them
        writer, rnd = MemoryMetadata(url.split("//")[1]), random.Random(1)
        loop = asyncio.new_event_loop()
        for _ in range(400):
            if stop.is_set():
                break
            time.sleep(0.0005)
            key = rnd.choice(expected.keys)
            op = Delete(key) if rnd.random() < 0.5 else Put(key, b"changed")
            loop.run_until_complete(writer.txn([], [op, Put(prefix + b"%032x/new" % rnd.getrandbits(128), b"z")]))
        loop.close()

    def take(page) -> None:
        pages.append(page)
        time.sleep(0.002)  # let the writer in between pages

    thread = threading.Thread(target=churn)
    thread.start()
    pages = []
    try:
        count = await index_load.load_prefix(md, prefix, expected.revision, take, timeout=5)
    finally:
        stop.set()
        thread.join()
    got = sorted((k, v) for page in pages for k, v in zip(page.keys, page.values))
    assert count == len(got) == len(expected.keys) and len(pages) > 20
    assert got == list(zip(expected.keys, expected.values))
    assert (await md.range_page(prefix, prefix_end(prefix))).revision > expected.revision + 100


async def test_a_loading_mirror_serves_partial_answers_flagged_loading(url, monkeypatch):
    monkeypatch.setattr(index_load, "PAGE", 64)
    monkeypatch.setattr(index_load, "PARALLEL", 1)
    a = await node(url, "a")
    hashes = external_hashes(range(3000), FP)
    await a.publish(FP.digest, [(h, record(i)) for i, h in enumerate(hashes)])
    gate, served = threading.Event(), []
    real = MemoryMetadata.range_page

    async def slow(self, start, end, **kwargs):
        page = await real(self, start, end, **kwargs)
        if page.keys and start.startswith(LAYOUT.blocks_prefix().encode()):
            served.append(start)
            if len(served) > 3:
                await asyncio.to_thread(gate.wait, 10)  # hold the load after a few pages
        return page

    monkeypatch.setattr(MemoryMetadata, "range_page", slow)
    mirror = IndexMirror(url, "c", timeout=2.0)
    try:
        mirror.start(wait=3)  # returns although the snapshot is not complete
        assert mirror.loading and mirror.stale and not mirror.wait_loaded(0.1)
        assert set(mirror.nodes) == {"a"}  # nodes come first: puts can pick targets
        assert until(lambda: mirror.block_count > 0)  # the first pages, applied on the shared loop's thread
        partial = mirror.match(FP, hashes)
        assert partial.loading and partial.stale and partial.length < len(hashes)
        assert 0 < mirror.block_count < len(hashes)
        mirror.remember(FP, hashes[0], "a", record(0))  # a put while loading is seen at once
        assert mirror.contains(FP, hashes[0])
        gate.set()
        assert mirror.wait_loaded(10)
        full = mirror.match(FP, hashes)
        assert full.length == len(hashes) and not full.loading and not full.stale
        assert mirror.block_count == len(hashes) and mirror.lookup(FP, hashes[5]) == {"a": record(5)}
        revision = await a.unpublish(FP.digest, hashes[10:11])
        assert mirror.wait_for_revision(revision)  # the watch picks up where the snapshot ended
        assert mirror.match(FP, hashes).length == 10
    finally:
        gate.set()
        mirror.stop()
        await a.close()


async def test_bulk_pages_skip_malformed_entries_and_keep_replicas(url, monkeypatch):
    monkeypatch.setattr(index_load, "PAGE", 100)
    md = open_metadata(url)
    hashes = external_hashes(range(400), FP)
    good = [Put(LAYOUT.block_key(FP.digest, h, "a").encode(), record(i).encode()) for i, h in enumerate(hashes)]
    replicas = [Put(LAYOUT.block_key(FP.digest, h, "b").encode(), record(i, "nvme").encode())
                for i, h in enumerate(hashes[:50])]
    base = LAYOUT.blocks_prefix(FP.digest)
    bad_hash = external_hashes([10_000], FP)[0].hex()
    malformed = [
        Put(f"{base}{bad_hash}/a".encode(), b"short"),                                  # record size
        Put(f"{base}{bad_hash[:-1]}g/a".encode(), record(1).encode()),                  # not hex
        Put(f"{base}{bad_hash}x/a".encode(), record(1).encode()),                       # 33 digits
        Put(f"{base}{bad_hash}/bad node".encode(), record(1).encode()),                 # node name
        Put(f"{base}{bad_hash}/a/extra".encode(), record(1).encode()),                  # extra level
        Put(f"{base}{bad_hash[:30]}/a".encode(), record(1).encode()),                   # short hash
        Put(f"{base}{hashes[7].hex()}/c".encode(), b"\x09" + record(1).encode()[1:]),   # version
    ]
    await md.put_many(good + replicas + malformed)
    with IndexMirror(url, "c") as mirror:
        assert mirror.wait_loaded(5)
        assert mirror.block_count == 400 and mirror.malformed == len(malformed)
        result = mirror.match(FP, hashes)
        assert result.length == 400
        assert result.locations[0] == (("a", "dram"), ("b", "nvme")) and result.locations[60] == (("a", "dram"),)
        assert mirror.lookup(FP, hashes[7]) == {"a": record(7), "b": record(7, "nvme")}
        assert mirror.node_prefix_lengths(FP, hashes) == {"a": 400, "b": 50}
        assert not mirror.contains(FP, bytes.fromhex(bad_hash))
