"""The OpenAI gateway against fake engines: the P/D flow, routing, streaming, bad input, auth."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from conductor.gateway.kv_events import KVEventFollower
from conductor.gateway.pool import parse_load
from conductor.gateway.prefix import PrefixTracker
from kvstore_testing.fake_engines import BLOCK, MODEL, FakeEngine, Rig, completion, until
from kvstore.keys import ModelFingerprint, chain_hashes
from kvstore_testing.ports import free_port


async def test_pd_handoff_passes_kv_transfer_params():
    p, d = FakeEngine("p0"), FakeEngine("d0")
    async with Rig([p], [d]) as rig:
        status, body = await rig.post("/v1/completions", completion(list(range(40))))
    assert status == 200 and body["choices"][0]["text"] == "from-d0"
    (pre,) = p.requests
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    (dec,) = d.requests
    assert dec["kv_transfer_params"]["kvstore"]["by"] == "p0"  # the prefill's answer, passed whole
    assert dec["max_tokens"] == 8 and dec["prompt"] == list(range(40))


async def test_streaming_chat_passes_events_through():
    p, d = FakeEngine("p0"), FakeEngine("d0")
    async with Rig([p], [d]) as rig:
        async with rig.http.post(rig.url + "/v1/chat/completions",
                                 json={"model": MODEL, "messages": [{"role": "user", "content": "hi " * 30}],
                                       "stream": True, "max_tokens": 4}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.read()
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(pieces) == "fromd0"
    assert p.requests[0]["stream"] is False and d.requests[0]["stream"] is True


async def test_short_uncached_prompt_skips_disaggregation():
    p, d = FakeEngine("p0"), FakeEngine("d0")
    async with Rig([p], [d], local_prefill_tokens=64) as rig:
        status, _ = await rig.post("/v1/completions", completion(list(range(20))))
        assert status == 200 and not p.requests and "kv_transfer_params" not in d.requests[0]
        status, _ = await rig.post("/v1/completions", completion(list(range(100, 300))))
        assert status == 200 and len(p.requests) == 1  # a long one is disaggregated


async def test_short_prompt_is_disaggregated_when_the_decode_engine_is_queued():
    p, d = FakeEngine("p0"), FakeEngine("d0")
    d.waiting = 8  # eight requests queued at the decode engine (its /metrics)
    async with Rig([p], [d], local_prefill_tokens=64) as rig:
        await asyncio.sleep(0.3)  # a load scrape
        status, _ = await rig.post("/v1/completions", completion(list(range(20))))
        assert status == 200 and len(p.requests) == 1 and "kv_transfer_params" in d.requests[0]


async def test_shared_prefix_goes_where_it_was_prefilled():
    engines = [FakeEngine(f"p{i}") for i in range(3)]
    async with Rig(engines, [FakeEngine("d0")]) as rig:
        prefix = list(range(1000, 1000 + 8 * BLOCK))
        await rig.post("/v1/completions", completion(prefix + [1, 2, 3]))
        home = [e.name for e in engines if e.requests]
        for tail in range(5):
            await rig.post("/v1/completions", completion(prefix + [7, tail]))
        assert [e.name for e in engines if e.requests] == home  # every follow-up hit the warm engine
        # An unrelated prompt is free to go elsewhere: the least loaded, not necessarily home.
        assert len(home) == 1


async def test_session_sticks_by_header_and_user():
    engines = [FakeEngine(f"p{i}") for i in range(3)]
    async with Rig(engines, [FakeEngine("d0")], policy="round_robin+sticky") as rig:
        for i in range(4):
            await rig.post("/v1/completions", completion([i] * 40), headers={"x-session-id": "alice"})
        assert sorted(len(e.requests) for e in engines) == [0, 0, 4]
        for i in range(3):
            await rig.post("/v1/completions", completion([50 + i] * 40, user="bob"))
        assert sum(1 for e in engines if any(r.get("user") == "bob" for r in e.requests)) == 1


async def test_load_aware_routes_away_from_a_busy_engine():
    engines = [FakeEngine(f"p{i}", hang=True) for i in range(2)]
    async with Rig(engines, [FakeEngine("d0")], prefill_timeout_s=30) as rig:  # the first stays stuck, not timed out
        first = asyncio.create_task(rig.post("/v1/completions", completion([1] * 64)))
        while not any(e.requests for e in engines):
            await asyncio.sleep(0.01)
        busy = next(e for e in engines if e.requests)
        for e in engines:
            e.hang = False  # the first request stays stuck where it is: that engine's queue is longer
        status, _ = await rig.post("/v1/completions", completion([2] * 64))
        assert status == 200 and len(busy.requests) == 1
        first.cancel()


async def test_bad_input_gets_openai_errors_and_the_gateway_keeps_serving():
    async with Rig([FakeEngine("p0")], [FakeEngine("d0")], max_body_bytes=4096) as rig:
        cases = [
            (b"{not json", 400, None),
            (b"[1, 2]", 400, None),
            (json.dumps({"model": MODEL}), 400, "prompt"),
            (json.dumps({"prompt": "x"}), 400, "model"),
            (json.dumps(completion("x", model="gpt-nope")), 404, "model"),
            (json.dumps(completion("x", stream="yes")), 400, "stream"),
            (json.dumps(completion("x" * 10_000)), 413, None),
        ]
        for data, want, param in cases:
            status, body = await rig.post("/v1/completions", data)
            assert status == want, (data[:40], body)
            assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"]
            if param:
                assert body["error"]["param"] == param
        status, body = await rig.post("/v1/chat/completions", {"model": MODEL, "messages": []})
        assert status == 400 and body["error"]["param"] == "messages"
        async with rig.http.get(rig.url + "/v1/nowhere") as resp:
            assert resp.status == 404 and "error" in await resp.json()
        status, body = await rig.post("/v1/completions", completion("still here"))
        assert status == 200


async def test_engine_4xx_passes_through_unchanged():
    p, d = FakeEngine("p0"), FakeEngine("d0", fail_status=400)
    async with Rig([p], [d], local_prefill_tokens=10_000) as rig:
        status, body = await rig.post("/v1/completions", completion("x"))
    assert status == 400 and body["error"]["message"] == "boom"
    assert len(d.requests) == 1  # a client error is not retried


async def test_api_key_required_when_configured(tmp_path):
    async with Rig([], [FakeEngine("d0")], api_keys=["s3cret", "other"]) as rig:
        status, body = await rig.post("/v1/completions", completion("x"))
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, _ = await rig.post("/v1/completions", completion("x"), headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _ = await rig.post("/v1/completions", completion("x"), headers={"Authorization": "s3cret"})
        assert status == 401
        for path in ("/v1/models", "/metrics"):
            async with rig.http.get(rig.url + path) as resp:
                assert resp.status == 401
        status, _ = await rig.post("/v1/completions", completion("x"), headers={"Authorization": "Bearer other"})
        assert status == 200
        async with rig.http.get(rig.url + "/health") as resp:  # probes need no key
            assert resp.status == 200


async def test_slo_admission_rejects_with_429_and_a_reason():
    async with Rig([FakeEngine("p0")], [FakeEngine("d0")], slo_ttft_ms=50.0) as rig:
        status, body = await rig.post("/v1/completions", completion(list(range(2000))))
        assert status == 429 and "TTFT" in body["error"]["message"]
        status, _ = await rig.post("/v1/completions", completion([1, 2]))  # tiny: fits the bound
        assert status == 200


async def test_models_health_and_metrics():
    async with Rig([FakeEngine("p0")], [FakeEngine("d0", )]) as rig:
        async with rig.http.get(rig.url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        async with rig.http.get(rig.url + "/health") as resp:
            health = await resp.json()
            assert resp.status == 200 and all(e["healthy"] for e in health["engines"])
        await rig.post("/v1/completions", completion(list(range(40))))
        async with rig.http.get(rig.url + "/metrics") as resp:
            text = await resp.text()
        assert 'conductor_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
        assert 'conductor_gateway_routes_total{mode="pd"} 1.0' in text
        assert "conductor_gateway_overhead_p50_seconds" in text


def test_parse_load_sums_engine_gauges():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n')
    assert parse_load(text) == {"running": 3.0, "waiting": 5.0, "kv_usage": 0.5}


def test_kv_events_rekey_blocks_by_our_chain():
    fp = ModelFingerprint("m", "float32", 4, 2, 2, 8)
    tracker = PrefixTracker()
    follower = KVEventFollower("http://e0", "tcp://x", tracker, fp)
    tokens = list(range(12))
    ours = chain_hashes(fp, tokens)
    follower.apply({"type": "BlockStored", "block_hashes": [101, 102], "parent_block_hash": None,
                    "token_ids": tokens[:8], "block_size": 4})
    follower.apply({"type": "BlockStored", "block_hashes": [103], "parent_block_hash": 102,
                    "token_ids": tokens[8:], "block_size": 4})
    assert tracker.prefix_blocks("http://e0", ours) == 3
    follower.apply({"type": "BlockStored", "block_hashes": [200], "parent_block_hash": 999,  # unknown parent
                    "token_ids": [9, 9, 9, 9], "block_size": 4})
    assert 200 not in follower.ours
    follower.apply({"type": "BlockRemoved", "block_hashes": [102]})
    assert tracker.prefix_blocks("http://e0", ours) == 1
    follower.apply({"type": "AllBlocksCleared"})
    assert tracker.prefix_blocks("http://e0", ours) == 0
    follower.apply({"type": "BlockStored", "block_hashes": [ours[0]], "parent_block_hash": None,  # the pool's
                    "token_ids": tokens[:4], "block_size": 4, "medium": "STORAGE"})       # (the connector's)
    assert tracker.prefix_blocks("http://e0", ours) == 0


@pytest.mark.parametrize("engine_binds", [False, True], ids=["engine-connects", "engine-binds-wildcard"])
async def test_kv_events_over_zmq_feed_routing(engine_binds):
    """vLLM connects its PUB to a plain endpoint (the gateway binds it) and binds a wildcard one."""
    import msgspec
    import zmq
    import zmq.asyncio

    fp = ModelFingerprint("m", "float32", BLOCK, 2, 2, 8)
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    if engine_binds:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://*:{port}"
    else:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
    tracker = PrefixTracker()
    follower = KVEventFollower("http://127.0.0.1:8000", endpoint, tracker, fp)
    task = asyncio.create_task(follower.run())
    await asyncio.sleep(0.05)
    if not engine_binds:
        pub.connect(endpoint)
    tokens = list(range(2 * BLOCK))
    event = {"type": "BlockStored", "block_hashes": [b"a" * 8, b"b" * 8], "parent_block_hash": None,
             "token_ids": tokens, "block_size": BLOCK}
    try:
        for _ in range(100):  # a SUB misses what was sent before it connected: resend until seen
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [event], None])])
            await asyncio.sleep(0.02)
            if tracker.prefix_blocks("http://127.0.0.1:8000", chain_hashes(fp, tokens)) == 2:
                break
        assert tracker.prefix_blocks("http://127.0.0.1:8000", chain_hashes(fp, tokens)) == 2
    finally:
        task.cancel()
        pub.close(linger=0)


def test_a_token_with_empty_text_counts_as_the_first_token():
    """vLLM streams one chunk per token even when its text is empty (a special token, half a
    character): that is the first token; chat's opening role-only delta is not."""
    from conductor.gateway.flow import _has_token

    def event(choice: dict) -> bytes:
        return b"data: " + json.dumps({"choices": [choice]}).encode()

    assert _has_token(event({"index": 0, "text": "", "finish_reason": None}))
    assert _has_token(event({"index": 0, "delta": {"content": ""}}))
    assert not _has_token(event({"index": 0, "delta": {"role": "assistant", "content": ""}}))
    assert not _has_token(b": keep-alive")


async def test_long_prompts_are_tokenized_off_the_event_loop_to_the_same_ids(tmp_path, monkeypatch):
    """A long prompt's tokenization would stall every other request of the gateway: it runs on a
    worker thread with that thread's own tokenizer copy, and gives the ids the model's tokenizer gives."""
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from conductor.gateway import tokens as tokens_module
    from kvstore.integrations.vllm.tiny_model import build_tokenizer

    model_dir = build_tokenizer(str(tmp_path))
    with_template = AutoTokenizer.from_pretrained(model_dir)
    with_template.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with_template.save_pretrained(model_dir)
    where = []
    real = tokens_module.Tokens._local

    def spy(self, tok, kind, body):
        where.append(threading.current_thread().name)
        return real(self, tok, kind, body)

    monkeypatch.setattr(tokens_module.Tokens, "_local", spy)
    reference = AutoTokenizer.from_pretrained(model_dir)
    assert reference.chat_template

    def template_ids(messages: list) -> list[int]:
        ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    short = "the quick brown fox " * 10
    longs = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 200 for i in range(4)]
    p, d = FakeEngine("p0"), FakeEngine("d0")
    async with Rig([p], [d], model_dir=model_dir) as rig:
        tokens = rig.gateway.tokens
        got = await tokens.ids("completions", {"prompt": short}, rig.gateway.session, None, 5.0)
        assert got == reference(short).input_ids and where == ["MainThread"]
        where.clear()
        many = await asyncio.gather(*(tokens.ids("completions", {"prompt": text}, rig.gateway.session, None, 5.0)
                                      for text in longs))
        assert many == [reference(text).input_ids for text in longs]
        assert where and all(name.startswith("gw-tokenize") for name in where)
        status, _ = await rig.post("/v1/completions", completion(longs[0]))  # and through the front door
        assert status == 200 and d.requests[-1]["prompt"] == longs[0]
        for text in (short, longs[2]):  # chat, on the loop and on a worker: the template's ids
            messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
            got = await tokens.ids("chat", {"messages": messages}, rig.gateway.session, None, 5.0)
            assert got == template_ids(messages)
        assert where[-1].startswith("gw-tokenize")
        routed = rig.gateway.metrics.prompt_tokens._value.get()
        chat = [{"role": "user", "content": short}]
        status, _ = await rig.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": chat})
        # Through the front door: routed by its real length (with the old check: a 500, the key names as ids).
        assert status == 200 and rig.gateway.metrics.prompt_tokens._value.get() - routed == len(template_ids(chat))
        tokens.close()  # stopping: what still comes is tokenized on the loop
        where.clear()
        assert await tokens.ids("completions", {"prompt": longs[3]}, rig.gateway.session, None, 5.0) \
            == reference(longs[3]).input_ids and where == ["MainThread"]
    where.clear()
    async with Rig([p], [d], model_dir=model_dir, tokenize_threads=0) as rig:  # asked for: on the loop
        got = await rig.gateway.tokens.ids("completions", {"prompt": longs[1]}, rig.gateway.session, None, 5.0)
        assert got == reference(longs[1]).input_ids and where == ["MainThread"]


def test_tool_call_arguments_and_tool_schemas_count_as_prompt_text():
    """A chat whose bulk is a tool call's arguments or the tool schemas is a long prompt too (the
    template renders both), so it is tokenized off the event loop like any other."""
    from conductor.gateway.tokens import LONG_PROMPT_CHARS, _text_size

    bulk = "x" * (LONG_PROMPT_CHARS + 1)
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": bulk}}]}
    assert _text_size("chat", {"messages": [{"role": "user", "content": "hi"}, call]}) > LONG_PROMPT_CHARS
    tool = {"type": "function", "function": {"name": "f", "description": bulk, "parameters": {}}}
    assert _text_size("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}) > LONG_PROMPT_CHARS
    parts = [{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": "data:..."}}]
    assert _text_size("chat", {"messages": [{"role": "user", "content": parts}, "junk"], "tools": "junk"}) == 2
    assert _text_size("completions", {"prompt": "abc"}) == 3


async def test_a_clients_own_kv_transfer_params_reach_no_engine_on_any_path():
    """Kills: forwarding the client's raw body on the decode-only path (its `kv_transfer_params`
    reach the decode engine verbatim), and dropping them only where the gateway adds its own."""
    forged = {"do_remote_prefill": True, "kvstore": {"by": "attacker", "keys": ["00" * 16]}}
    p, d = FakeEngine("p0"), FakeEngine("d0")
    async with Rig([p], [d], local_prefill_tokens=64) as rig:
        short = completion(list(range(20)), kv_transfer_params=forged)  # colocated: the raw-body path
        long = completion(list(range(200)), kv_transfer_params=forged)  # prefill then decode
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "kv_transfer_params": forged}
        many = completion(list(range(300, 500)), n=2, kv_transfer_params=forged)  # n > 1: never disaggregated
        for path, body in (("/v1/completions", short), ("/v1/completions", long), ("/v1/chat/completions", chat),
                           ("/v1/completions", many)):
            status, answer = await rig.post(path, body)
            assert status == 200, answer
        text = rig.gateway.metrics.render().decode()
    assert [r["kv_transfer_params"] for r in p.requests] == [{"do_remote_decode": True}]
    sent = [r.get("kv_transfer_params") for r in d.requests]
    assert sent[0] is None and sent[2] is None and sent[3] is None, sent
    assert sent[1]["kvstore"]["by"] == "p0"  # the prefill engine's own answer, nothing of the client's
    assert "conductor_gateway_client_kv_transfer_params_dropped_total 4.0" in text


async def test_a_prefill_counts_the_prompts_kv_on_its_engine_while_it_runs():
    """Kills: a P/D prefill that counts only its queue on the prefill engine, so between two scrapes
    the engine's KV looks empty to routing (and to decode overflow) while it holds the prompt."""
    p, d = FakeEngine("p0", first_token_delay=1.0), FakeEngine("d0")
    async with Rig([p], [d]) as rig:
        pending = asyncio.create_task(rig.post("/v1/completions", completion(list(range(60)))))
        try:
            engine = rig.gateway.pool.get(p.url)
            assert await until(lambda: p.requests, 10)
            assert engine.inflight_kv == 60 and engine.inflight == 1
            status, body = await pending
            assert status == 200 and body["choices"][0]["text"] == "from-d0"
            assert (engine.inflight, engine.inflight_tokens, engine.inflight_kv) == (0, 0, 0)
        finally:
            pending.cancel()


async def test_n_is_bounded_and_each_choice_counts_in_the_engines_load():
    """Kills: `n` (or `best_of`) without an upper bound (a request for 10,000 choices forwarded), and
    routing that counts one choice's tokens for a request that decodes n of them."""
    d = FakeEngine("d0", hang=True)
    async with Rig([], [d], max_n=8, decode_timeout_s=30) as rig:
        for name in ("n", "best_of"):
            status, body = await rig.post("/v1/completions", completion("x", **{name: 9}))
            assert status == 400 and body["error"]["param"] == name and "at most 8" in body["error"]["message"]
        assert not d.requests
        pending = asyncio.create_task(rig.post("/v1/completions", completion(list(range(50)), n=4, max_tokens=10)))
        try:
            assert await until(lambda: d.requests)
            (engine,) = rig.gateway.pool.role("decode")
            assert engine.inflight_kv == 50 + 4 * 10
        finally:
            pending.cancel()


async def test_pd_an_overflow_that_fails_moves_to_the_engine_with_kv_room_not_the_full_decode():
    """Kills: an overflow route (the decode pool's KV full) whose prefill engine fails before its
    first token retried on the least busy decode engine, the full one the route passed over,
    instead of the other prefill engine with room."""
    p0 = FakeEngine("p0", kv_blocks=1000, kv_usage=0.1, fail_status=500)
    p1 = FakeEngine("p1", kv_blocks=1000, kv_usage=0.3)
    d = FakeEngine("d0", kv_blocks=1000, kv_usage=0.99)
    async with Rig([p0, p1], [d], overflow_kv_share=0.5) as rig:
        assert await until(lambda: all(e.kv_capacity for e in rig.gateway.pool.engines), 10)  # a load scrape
        status, body = await rig.post("/v1/completions", completion(list(range(40))))
        assert status == 200 and body["choices"][0]["text"] == "from-p1", body
        assert not d.requests and len(p1.requests) == 1 and "kv_transfer_params" not in p1.requests[0]
        assert 'conductor_gateway_retries_total{phase="decode"} 1.0' in rig.gateway.metrics.render().decode()


async def test_pd_a_full_decode_pool_overflows_onto_the_prefill_engine():
    """Kills: a gateway that, given the router core's overflow route (every decode engine's KV full,
    the prefill engine with room), still hands off to the full decode engine, runs a prefill with
    max_tokens 1 and then nothing, sends the prefill engine hand-off parameters, or leaves the
    request's load counted on an engine once it is answered."""
    p, d = FakeEngine("p0", kv_blocks=1000, kv_usage=0.1), FakeEngine("d0", kv_blocks=1000, kv_usage=0.99)
    async with Rig([p], [d], overflow_kv_share=0.5) as rig:
        assert await until(lambda: all(e.kv_capacity for e in rig.gateway.pool.engines), 10)  # a load scrape
        status, body = await rig.post("/v1/completions", completion(list(range(40))))
        assert status == 200 and body["choices"][0]["text"] == "from-p0", body
        (only,) = p.requests
        assert "kv_transfer_params" not in only and only["max_tokens"] == 8 and not d.requests
        assert 'conductor_gateway_route_reasons_total{reason="overflow"} 1.0' in rig.gateway.metrics.render().decode()
        assert all((e.inflight, e.inflight_tokens, e.inflight_kv) == (0, 0, 0) for e in rig.gateway.pool.engines)
        d.kv_usage = 0.1  # room again: handed off as before
        assert await until(lambda: rig.gateway.pool.get(d.url).kv_usage < 0.5, 10)
        status, body = await rig.post("/v1/completions", completion(list(range(40))))
        assert status == 200 and body["choices"][0]["text"] == "from-d0" and len(p.requests) == 2
