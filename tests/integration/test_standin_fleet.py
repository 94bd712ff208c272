"""Stand-in vLLM engines (conductor/sim/engine) over real sockets: what routers and the store see of
them is what vLLM 0.32 shows (KV events read by vLLM's own decoder, `/metrics` read by the
gateway's scraper, the HTTP API), their faults are visible, and KV handed over through a real
store arrives intact."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
from typing import TYPE_CHECKING, Callable

import aiohttp
import pytest

from conductor.gateway.pool import parse_load
from conductor.sim.engine.engine import Faults
from conductor.sim.engine.fleet import FleetConfig, StandinFleet
from conductor.sim.engine.hashing import external

if TYPE_CHECKING:
    import zmq.asyncio

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")
needs_zmq = pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="needs pyzmq (the gateway extra)")
needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (scripts/install-test-deps.sh)")
MODEL = "meta-llama/Meta-Llama-3-8B"


async def complete(http: aiohttp.ClientSession, url: str, prompt, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw}
    async with http.post(url + "/v1/completions", json=body) as resp:
        return {"status": resp.status, **(await resp.json())}


async def sub_socket(endpoint: str):
    import zmq
    import zmq.asyncio

    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    await subscribed(sock, lambda: sock.connect(endpoint))
    return sock


async def subscribed(sock: zmq.asyncio.Socket, connect: Callable[[], object]) -> None:
    """Run `connect()` (a connect, or whatever makes the publisher come back) and wait until the SUB
    socket has (re)connected and its subscription has had time to reach the publisher: the slow
    joiner, an event published before that is lost."""
    import zmq

    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        connect()
        await asyncio.wait_for(monitor.recv_multipart(), 10)  # connected; the subscription goes next
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    await asyncio.sleep(0.3)  # for the publisher to take the subscription in


@needs_vllm
@needs_zmq
async def test_kv_events_decode_with_vllms_own_classes():
    """Kills: events in a shape vLLM does not publish (array-encoded events, bytes hashes, a missing
    field, sequence numbers that do not count from 0), hashes that are not vLLM's own for the same
    tokens, or a replay socket that does not answer as vLLM's does."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    config = FleetConfig(engines=1, kv_events_base_port=0, time_scale=0.2)  # free ports, bound by the engine
    async with StandinFleet(config) as fleet:
        sock = await sub_socket(fleet.describe()["engines"][0]["kv_events"])
        prompt = list(range(1000, 1300))  # two full blocks of 128, and a partial one
        async with aiohttp.ClientSession() as http:
            answer = await complete(http, fleet.urls[0], prompt, max_tokens=1)
            assert answer["status"] == 200
            topic, seq, payload = await asyncio.wait_for(sock.recv_multipart(), 10)
            batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
            assert topic == b"" and int.from_bytes(seq, "big") == 0 and batch.data_parallel_rank == 0
            (stored,) = batch.events
            assert type(stored).__name__ == "BlockStored" and stored.medium == "GPU" and stored.block_size == 128
            assert stored.token_ids == prompt[:256] and stored.parent_block_hash is None
            first = kv_cache_utils.hash_block_tokens(sha256, None, prompt[:128], None)
            second = kv_cache_utils.hash_block_tokens(sha256, first, prompt[128:256], None)
            assert stored.block_hashes == [kv_cache_utils.maybe_convert_block_hash(h) for h in (first, second)]
            async with http.post(fleet.urls[0] + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            _, seq, payload = await asyncio.wait_for(sock.recv_multipart(), 10)
            batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
            assert int.from_bytes(seq, "big") == 1 and type(batch.events[0]).__name__ == "AllBlocksCleared"
        replay = zmq.asyncio.Context.instance().socket(zmq.DEALER)  # many answers to one request
        replay.connect(fleet.describe()["engines"][0]["replay"])
        await replay.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            frames = await asyncio.wait_for(replay.recv_multipart(), 10)  # [b"", topic, seq, payload]
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
            got.append(int.from_bytes(frames[2], "big"))
            msgspec.msgpack.Decoder(type=KVEventBatch).decode(frames[3])
        replay.close(linger=0)
        sock.close(linger=0)
    assert got[:2] == [0, 1]
    assert external(b"\x01" * 32) == kv_cache_utils.maybe_convert_block_hash(b"\x01" * 32)


async def test_metrics_read_by_the_gateways_scraper():
    """Kills: a /metrics page the gateway cannot read (its load would be 0 everywhere), or gauges
    that do not follow the engine (requests running, KV usage)."""
    from prometheus_client.parser import text_string_to_metric_families

    config = FleetConfig(engines=1, time_scale=4.0)
    async with StandinFleet(config) as fleet:
        url = fleet.urls[0]
        async with aiohttp.ClientSession() as http:
            pending = asyncio.ensure_future(complete(http, url, list(range(3, 2000)), max_tokens=50))
            await asyncio.sleep(0.6)  # the prefill is done: the request is decoding
            text = await (await http.get(url + "/metrics")).text()
            load = parse_load(text)
            assert load["running"] == 1 and load["waiting"] == 0 and 0 < load["kv_usage"] < 1
            names = {f.name for f in text_string_to_metric_families(text)}  # the whole page, strictly
            assert {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
                    "vllm:num_preemptions", "vllm:external_prefix_cache_hits"} <= names
            assert (await pending)["status"] == 200
            text = await (await http.get(url + "/metrics")).text()
            assert parse_load(text)["running"] == 0


async def test_openai_shapes_usage_and_cached_tokens():
    """Kills: streams without include_usage's final chunk or [DONE], cached_tokens that ignore the
    prefix cache, token-id prompts refused, or vLLM's error object missing on bad input."""
    async with StandinFleet(FleetConfig(engines=1, time_scale=0.2, stream_interval=4)) as fleet:
        url = fleet.urls[0]
        async with aiohttp.ClientSession() as http:
            prompt = list(range(5, 700))
            assert (await complete(http, url, prompt))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 9, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.post(url + "/v1/completions", json=body) as resp:
                raw = await resp.text()
            events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
            assert "".join(texts) == " tok" * 9 and len(texts) == 4  # the first, every 4th, the rest with the finish
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
            assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 640  # 5 blocks: n - 1 rule
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
            async with http.post(url + "/v1/chat/completions", json=chat) as resp:
                answer = await resp.json()
            assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 3
            async with http.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["type"] == "NotFoundError"
            async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, True]}) as resp:
                assert resp.status == 400 and "prompt" in (await resp.json())["error"]["message"]
            async with http.post(url + "/tokenize", json={"model": MODEL, "prompt": "a b"}) as resp:
                assert (await resp.json())["count"] == 3
            async with http.post(url + "/v1/completions/render", json={"model": MODEL, "prompt": "a"}) as resp:
                assert resp.status == 403  # vllm serve without --enable-scale-out


async def test_injected_5xx_and_cut_streams():
    """Kills: fault knobs that do nothing (a fault benchmark measuring a healthy fleet)."""
    faults = {0: Faults(error_rate=1.0), 1: Faults(die_mid_stream=1.0)}
    async with StandinFleet(FleetConfig(engines=2, time_scale=0.2, faults=faults)) as fleet:
        async with aiohttp.ClientSession() as http:
            answer = await complete(http, fleet.urls[0], [5, 6, 7])
            assert answer["status"] == 500 and answer["error"]["type"] == "InternalServerError"
            body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "stream": True}
            with pytest.raises(aiohttp.ClientPayloadError):
                async with http.post(fleet.urls[1] + "/v1/completions", json=body) as resp:
                    await resp.read()


@needs_zmq
async def test_a_restart_empties_the_cache_and_restarts_event_numbers():
    """Kills: a restarted engine that keeps its cache or its event sequence (vllm-router's kv_aware
    detects a restart by sequence numbers starting again at 0), or one that publishes on another port
    after it (the events port was picked free at the first start: a router keeps the first one)."""
    config = FleetConfig(engines=1, kv_events_base_port=0, time_scale=1.0, replay=False)
    async with StandinFleet(config) as fleet:
        url, engine = fleet.urls[0], fleet.engines[0]
        sock = await sub_socket(fleet.describe()["engines"][0]["kv_events"])
        async with aiohttp.ClientSession() as http:
            assert (await complete(http, url, list(range(3, 300))))["status"] == 200
            _, seq, _ = await asyncio.wait_for(sock.recv_multipart(), 10)
            assert int.from_bytes(seq, "big") == 0
            # A pending receive, as a router's subscriber always has: ZMQ attaches the reconnected
            # pipe (and resends the subscription) only when the socket is used.
            after = asyncio.ensure_future(sock.recv_multipart())
            # Down 0.2 s from now (however long the above took), back 0.5 s later; the socket then
            # reconnects to the restarted engine's same port.
            await subscribed(sock, lambda: engine.inject(Faults(down_at=0.2, down_for=0.5)))
            assert engine.restarts == 1 and engine.alive
            again = await complete(http, url, list(range(3, 300)))
            assert again["status"] == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            _, seq, _ = await asyncio.wait_for(after, 10)
            assert int.from_bytes(seq, "big") == 0 and fleet.engines[0].restarts == 1
        sock.close(linger=0)


async def test_the_gateway_routes_around_a_standin_that_dies():
    """Kills: a gateway that keeps sending to a dead engine, or a dead stand-in whose requests hang
    instead of failing (errors must show up, counted, not hidden)."""
    from conductor.gateway import Gateway, GatewayConfig

    faults = {1: Faults(down_at=2.0)}  # engine 1 dies 2 s in, for good
    async with StandinFleet(FleetConfig(engines=3, time_scale=1.0, faults=faults)) as fleet:
        config = GatewayConfig(decode=fleet.urls, block_tokens=128, health_interval_s=0.2, local_prefill_tokens=0,
                               fingerprint=fleet.describe()["fingerprint"])
        gateway = Gateway(config)
        port = await gateway.start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                async def one(k: int) -> int:
                    body = {"model": MODEL, "prompt": list(range(k * 1000, k * 1000 + 500)), "max_tokens": 600,
                            "stream": True}
                    try:
                        async with http.post(url + "/v1/completions", json=body) as resp:
                            raw = await resp.read()
                            return resp.status if b"[DONE]" in raw else -1
                    except aiohttp.ClientError:
                        return -1

                first = await asyncio.gather(*(one(k) for k in range(9)))  # in flight when engine 1 dies
                await asyncio.sleep(0.5)
                served_by_dead = fleet.fronts[1].requests
                later = await asyncio.gather(*(one(k) for k in range(20, 29)))
                metrics = await (await http.get(url + "/metrics")).text()
        finally:
            await gateway.stop()
    assert -1 in first or 502 in first  # the requests it held failed, visibly
    assert later == [200] * 9 and fleet.fronts[1].requests == served_by_dead
    failures = [line for line in metrics.splitlines() if line.startswith("conductor_gateway_upstream_failures_total")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in failures) >= 1


@needs_etcd
async def test_pd_handoff_through_a_real_store_arrives_intact(tmp_path):
    """Kills: a decode that recomputes the prompt instead of loading the prefill's KV, keys other than
    the connector's, or loaded bytes that differ from the saved ones (wrong_bytes must stay 0)."""
    from kvstore_testing import processes
    from kvstore_testing.etcd import EtcdServer

    (tmp_path / "secret").write_text("s" * 32)
    (tmp_path / "secret").chmod(0o600)
    with EtcdServer() as etcd:
        daemon, _ = await asyncio.to_thread(processes.start_store_daemon, [
            "--node", "n0", "--metadata", etcd.url, "--cluster", "standin", "--dram", "64MiB",
            "--secret-file", str(tmp_path / "secret")])
        try:
            config = FleetConfig(engines=3, roles=["kv_producer", "kv_consumer", "kv_both"], metadata=etcd.url,
                                 cluster="standin", secret="s" * 32, time_scale=0.5)
            async with StandinFleet(config) as fleet:
                prompt = list(range(3000, 4000))
                async with aiohttp.ClientSession() as http:
                    pre = await complete(http, fleet.urls[0], prompt, max_tokens=1,
                                         kv_transfer_params={"do_remote_decode": True})
                    params = pre["kv_transfer_params"]
                    assert params["kvstore"]["num_tokens"] == 999 and params["kvstore"]["num_blocks"] == 7
                    dec = await complete(http, fleet.urls[1], prompt, max_tokens=4, kv_transfer_params=params)
                    assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] == 999
                    other = await complete(http, fleet.urls[2], prompt + [1, 2, 3])  # colocated: the pool's blocks
                    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 896
                stats = fleet.stats()
        finally:
            processes.stop(daemon)
    store = stats["store"]
    assert store["wrong_bytes"] == 0 and store["load_failures"] == 0 and store["loaded_blocks"] == 8 + 7
    assert stats["engines"][1]["handoff_hits"] == 999 and stats["engines"][2]["handoff_hits"] == 0
