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
