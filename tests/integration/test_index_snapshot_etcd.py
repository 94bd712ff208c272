"""Snapshot loading against a real etcd: the parallel loader sees exactly one revision while
others write, and a mirror started during those writes ends equal to etcd, replica for replica."""
from __future__ import annotations

import asyncio
import uuid

import kvstore.index.snapshot as index_load
from kvstore.daemon.session import NodeSession
from kvstore.index import IndexMirror
from kvstore.index.records import BlockRecord, Layout, NodeRecord
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import open_metadata, prefix_end

FPS = [ModelFingerprint(name, "float16", 4, 2, 2, 64) for name in ("m1", "m2")]


def test_load_at_one_revision_while_nodes_publish_and_unpublish(etcd_server, monkeypatch):
    monkeypatch.setattr(index_load, "PAGE", 200)
    layout = Layout(uuid.uuid4().hex[:8])
    prefix = layout.blocks_prefix().encode()

    async def scenario():
        sessions = []
        for name in ("a", "b"):
            s = NodeSession(open_metadata(etcd_server.url), layout, NodeRecord(name, name), ttl=60)
            await s.start()
            sessions.append(s)
        hashes = {fp.digest: external_hashes(range(3000), fp) for fp in FPS}
        for fp, hs in hashes.items():
            await sessions[0].publish(fp, [(h, BlockRecord("dram", 1, i, 1, i.to_bytes(32, "little")))
                                           for i, h in enumerate(hs)])
            await sessions[1].publish(fp, [(h, BlockRecord("nvme", 2, i, 1, i.to_bytes(32, "little")))
                                           for i, h in enumerate(hs[::3])])
        md = open_metadata(etcd_server.url)
        expected = await md.range_page(prefix, prefix_end(prefix))
        more = {fp.digest: external_hashes(range(3000, 4000), fp) for fp in FPS}

        async def churn() -> int:
            for i in range(0, 1000, 50):
                for fp in more:
                    await sessions[1].publish(fp, [(h, BlockRecord("dram", 3, 0, 1, bytes(32)))
                                                   for h in more[fp][i:i + 50]])
                    last = await sessions[0].unpublish(fp, hashes[fp][i:i + 50])
            return last

        pages = []
        writer = asyncio.create_task(churn())
        count = await index_load.load_prefix(md, prefix, expected.revision, pages.append, timeout=5)
        # start() returns once its snapshot has begun loading, so the load overlaps the churn; a
        # 10 ms bound here (as before) failed on a busy CI host before even connecting.
        mirror = IndexMirror(etcd_server.url, layout.cluster).start(wait=10)
        last_write = await writer
        got = sorted((k, v) for page in pages for k, v in zip(page.keys, page.values))
        assert count == len(expected.keys) == 6000 + 2000 and len(pages) > 30
        assert got == list(zip(expected.keys, expected.values))

        final = await md.range_page(prefix, prefix_end(prefix))
        assert await asyncio.to_thread(mirror.wait_loaded, 20)
        # The churn's last write, not `final.revision`: that counts other clusters' writes to this
        # etcd too (another test's lease expiring), which this mirror never hears of.
        assert await asyncio.to_thread(mirror.wait_for_revision, last_write, 10)
        seen = {(fp, h, node) for fp in hashes for h in hashes[fp] + more[fp]
                for node in mirror.lookup(fp, h)}
        in_etcd = {(k.split(b"/")[4].decode(), bytes.fromhex(k.split(b"/")[5].decode()), k.split(b"/")[6].decode())
                   for k in final.keys}
        assert seen == in_etcd and mirror.block_count == len({(fp, h) for fp, h, _ in in_etcd})
        assert mirror.match(FPS[0], hashes[FPS[0].digest]).length == 1  # a unpublished 0-999; b holds 0, not 1
        assert mirror.match(FPS[0], more[FPS[0].digest]).length == 1000
        mirror.stop()
        for s in sessions:
            await s.close()
        await md.close()

    asyncio.run(scenario())


def test_a_mirror_scoped_to_one_model_keeps_only_its_blocks(etcd_server):
    """`IndexMirror(fingerprints=[m1])` against a real etcd holding m1's and m2's blocks: its snapshot
    and its watch keep m1's only, and a question about m2 raises NotMirrored. Kills: a scoped
    mirror that loads the whole blocks prefix, one that applies another model's watch events, and
    one that answers "not held" about a model it does not mirror (a silent miss)."""
    import pytest

    from kvstore.errors import NotMirrored

    layout = Layout(uuid.uuid4().hex[:8])
    m1, m2 = FPS

    def rec(i: int) -> BlockRecord:
        return BlockRecord("dram", 1, i, 1, i.to_bytes(32, "little"))

    async def publish(session: NodeSession, fp, start: int, count: int) -> int:
        return await session.publish(fp.digest, [(h, rec(i)) for i, h in
                                                 enumerate(external_hashes(range(start, start + count), fp))])

    async def scenario() -> None:
        session = NodeSession(open_metadata(etcd_server.url), layout, NodeRecord("a", "a"), ttl=60)
        await session.start()
        await publish(session, m1, 0, 300)
        await publish(session, m2, 0, 500)
        scoped = await asyncio.to_thread(IndexMirror(etcd_server.url, layout.cluster, fingerprints=[m1]).start)
        whole = await asyncio.to_thread(IndexMirror(etcd_server.url, layout.cluster).start)
        try:
            assert await asyncio.to_thread(scoped.wait_until, lambda m: m.block_count == 300, 10)
            assert await asyncio.to_thread(whole.wait_until, lambda m: m.block_count == 800, 10)
            await publish(session, m2, 500, 200)  # another model's news: not kept
            revision = await publish(session, m1, 300, 20)
            assert await asyncio.to_thread(scoped.wait_for_revision, revision, 10)
            assert await asyncio.to_thread(whole.wait_for_revision, revision, 10)
            assert scoped.block_count == 320 and whole.block_count == 1020
            hashes = external_hashes(range(320), m1)
            assert scoped.match(m1, hashes).length == 320 and scoped.contains(m1, hashes[-1])
            assert "a" in scoped.lookup(m1, hashes[0])
            for question in (lambda: scoped.match(m2, external_hashes(range(4), m2)),
                             lambda: scoped.contains(m2, external_hashes([1], m2)[0]),
                             lambda: scoped.lookup(m2, external_hashes([1], m2)[0])):
                with pytest.raises(NotMirrored, match="fingerprint"):
                    question()
            assert scoped.nodes.keys() == whole.nodes.keys() == {"a"}  # nodes and segments: all of them
        finally:
            scoped.stop()
            whole.stop()
            await session.close()

    asyncio.run(scenario())
