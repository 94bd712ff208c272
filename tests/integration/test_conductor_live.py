"""The live router against real etcd: published blocks steer routing; the HTTP front works."""
from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

from conductor.router import Conductor, InstanceLoad
from conductor.server import make_server
from kvstore.daemon.session import NodeSession
from kvstore.index import IndexMirror
from kvstore.index.records import BlockRecord, Layout, NodeRecord
from kvstore.keys import ModelFingerprint, chain_hashes
from kvstore.metadata import open_metadata

FP = ModelFingerprint("m", "float16", 512, 32, 8, 128)


def test_routes_by_cached_prefix_and_load(etcd_server):
    cluster = uuid.uuid4().hex[:8]
    tokens = list(range(512 * 64))
    hashes = chain_hashes(FP, tokens)

    async def publish():
        sessions = []
        for name, blocks in (("node-a", 48), ("node-b", 8)):
            s = NodeSession(open_metadata(etcd_server.url), Layout(cluster), NodeRecord(name, name), ttl=30)
            await s.start()
            await s.publish(FP.digest, [(h, BlockRecord("dram", 1, i, 1, i.to_bytes(32, "little")))
                                        for i, h in enumerate(hashes[:blocks])])
            sessions.append(s)
        return sessions

    loop = asyncio.new_event_loop()
    sessions = loop.run_until_complete(publish())
    with IndexMirror(etcd_server.url, cluster) as mirror:
        assert mirror.wait_until(lambda m: m.block_count == 48 and len(m.lookup(FP, hashes[0])) == 2, 10)
        conductor = Conductor(mirror, FP)
        conductor.report(InstanceLoad("prefill-a", "prefill", queue_ms=0, store_node="node-a"))
        conductor.report(InstanceLoad("prefill-b", "prefill", queue_ms=0, store_node="node-b"))
        conductor.report(InstanceLoad("decode-1", "decode", running_tokens=10_000, running_requests=4))
        conductor.report(InstanceLoad("decode-2", "decode", running_tokens=1_000, running_requests=1))
        decision = conductor.route(hashes, len(tokens), 100)
        assert decision.accepted and decision.prefill == "prefill-a" and decision.decode == "decode-2"
        assert decision.cached_tokens == 48 * 512 and decision.load_from == {"node-a": 48, "node-b": 8}
        # A long queue on the warm instance: the pool's blocks move to the idle one instead.
        conductor.report(InstanceLoad("prefill-a", "prefill", queue_ms=120_000, store_node="node-a"))
        decision = conductor.route(hashes, len(tokens), 100)
        assert decision.prefill == "prefill-b" and decision.cached_tokens == 48 * 512
        # Nothing can meet the SLO: an early rejection with the reason.
        conductor.report(InstanceLoad("prefill-b", "prefill", queue_ms=120_000, store_node="node-b"))
        decision = conductor.route(hashes, len(tokens), 100)
        assert not decision.accepted and "TTFT" in decision.reason
        conductor.report(InstanceLoad("prefill-b", "prefill", queue_ms=0, store_node="node-b"))

        server = make_server(conductor, fingerprint=FP)
        import threading

        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        body = json.dumps({"token_ids": tokens, "output_tokens": 100}).encode()
        reply = json.loads(urllib.request.urlopen(urllib.request.Request(url + "/route", body), timeout=5).read())
        assert reply["accepted"] and reply["prefill"] == "prefill-b" and reply["cached_tokens"] == 48 * 512
        # A proxy retrying after decode-2 failed: the router core's exclusion, as the gateway's.
        body = json.dumps({"token_ids": tokens, "output_tokens": 100, "exclude": ["decode-2"]}).encode()
        reply = json.loads(urllib.request.urlopen(urllib.request.Request(url + "/route", body), timeout=5).read())
        assert reply["accepted"] and reply["decode"] == "decode-1" and reply["route_reason"] == "cache_global"
        for path, data in (("/route", b'{"hashes": ["zz"]}'), ("/route", b'{"hashes": [], "exclude": "prefill-a"}'),
                           ("/load", b'{"name": "p", "role": "prefill", "queue_ms": "slow"}')):
            try:
                urllib.request.urlopen(urllib.request.Request(url + path, data), timeout=5)
                raise AssertionError(f"malformed request accepted: {data!r}")
            except urllib.error.HTTPError as exc:
                assert exc.code == 400
        server.shutdown()
    for s in sessions:
        loop.run_until_complete(s.close())
    loop.close()
