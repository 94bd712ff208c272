"""What outside traffic may hold at the gateway, over real sockets: connection caps (in all and per
source network), header and body deadlines, unauthenticated clients, and bad input answered 400/413
with the OpenAI error object, never 500. Each test's docstring names the broken variant it kills.

Flood connections come from 127.0.0.x (one /24); the legitimate client from 127.0.1.1 or further."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from conductor.gateway.guard import MAX_HEADER_BYTES, describe, source_of
from kvstore_testing.fake_engines import MODEL, FakeEngine, Rig, closed, completion, raw_request, read_answer, until

ROOT = Path(__file__).resolve().parents[2]
LEGIT = "127.0.1.1"  # another /24 than the flood's 127.0.0.x
HALF = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nX-Slo"  # never finished
FLOOD = {"max_connections": 32, "max_connections_per_source": 8, "header_timeout_s": 60.0, "shed_after_s": 60.0}


def whole(path: str = "/health", method: str = "GET", body: bytes = b"", headers: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(body)}\r\n{headers}\r\n").encode() + body


async def fate(reader: asyncio.StreamReader) -> int:
    """503 (refused with an answer), 0 (closed or reset), or -1: still open, nothing said (admitted)."""
    try:
        status, _, _ = await read_answer(reader, timeout=0.5)
        return status
    except asyncio.TimeoutError:
        return -1


async def flood_then_legit(sources: list[str]) -> None:
    async with Rig([], [FakeEngine("d0")], source=LEGIT, **FLOOD) as rig:
        conns = [await raw_request(rig.port, HALF, source) for source in sources]
        fates = await asyncio.gather(*(fate(reader) for reader, _ in conns))
        try:
            assert fates.count(-1) == 8 and set(fates) <= {-1, 0, 503}, fates  # the /24's share, no more
            assert rig.gateway.guard.open == 8
            assert rig.gateway.guard.by_source == {source_of(("127.0.0.9", 0)): 8}
            started = time.monotonic()
            status, body = await asyncio.wait_for(rig.post("/v1/completions", completion("hello")), 5)
            assert status == 200 and body["choices"][0]["text"] == "from-d0"
            assert time.monotonic() - started < 5
            flood = source_of(("127.0.0.9", 0))
            assert rig.gateway.guard.by_source[flood] == 8  # the flood still holds its share: nothing was evicted
        finally:
            for _, writer in conns:
                writer.close()


async def test_slowloris_from_one_source_leaves_room_for_others():
    """Kills: no per-source cap (40 half-sent requests from 127.0.0.2 take all 32 slots and the
    legitimate request from 127.0.1.1 is refused), and no cap at all (the flood holds 40)."""
    await flood_then_legit(["127.0.0.2"] * 40)


async def test_slowloris_from_many_addresses_of_one_24_counts_as_one_source():
    """Kills: a per-source cap keyed by the whole address (127.0.0.2..20, two connections each,
    stay under a per-address cap of 8 and take all 32 slots)."""
    await flood_then_legit([f"127.0.0.{i}" for i in range(2, 21) for _ in range(2)])


async def test_a_slowloris_from_many_networks_is_shed_oldest_first_and_legitimate_requests_get_in():
    """Kills: a total cap that only evicts idle keep-alive connections (half-sent requests from 16
    /24s hold every slot and each legitimate request gets a 503), shedding the newest connection
    instead of the oldest, and shedding a request that is being answered."""
    slow = FakeEngine("d0", hang=True)
    async with Rig([], [slow], source=LEGIT, max_connections=32, max_connections_per_source=2,
                   header_timeout_s=60.0, shed_after_s=0.3, decode_timeout_s=30) as rig:
        answered = asyncio.create_task(rig.post("/v1/completions", completion("held at the engine")))
        assert await until(lambda: slow.requests)  # one request in flight: never shed
        conns = [await raw_request(rig.port, HALF, f"127.0.{net}.{host}") for net in range(10, 26) for host in (1, 2)]
        try:
            assert await until(lambda: rig.gateway.guard.open == 32)  # 31 half-sent + the one answered
            await asyncio.sleep(0.4)  # the half-sent ones are past shed_after_s
            slow.hang = False
            for _ in range(3):  # one new connection (kept alive for the next two)
                status, body = await asyncio.wait_for(rig.post("/v1/completions", completion("hello")), 5)
                assert status == 200 and body["choices"][0]["text"] == "from-d0"
            # The oldest half-sent connection went, with a 408 that says why; the others stay.
            status, _, body = await read_answer(conns[0][0], timeout=2)
            assert status == 408 and json.loads(body)["error"]["code"] == "connection_shed"
            # The 33rd connection came while every half-sent one was younger than shed_after_s: refused.
            assert [await fate(reader) for reader, _ in (conns[1], conns[-2], conns[-1])] == [-1, -1, 503]
            assert not answered.done()  # still at the engine, not shed
            text = rig.gateway.metrics.render().decode()
            assert "conductor_gateway_connections_shed_total 1.0" in text
        finally:
            answered.cancel()
            for _, writer in conns:
                writer.close()


async def test_connections_over_the_total_cap_get_503_retry_after_and_admitted_ones_finish():
    """Kills: no total cap (all ten connections admitted), a refusal that starts a request handler
    (the server tracks it) or hangs instead of answering at once, refusals that starve the requests
    already admitted, and slots never given back."""
    sources = [f"127.0.{i}.1" for i in range(1, 11)]  # ten /24s: the per-source cap is not what bites
    async with Rig([], [FakeEngine("d0")], max_connections=6, max_connections_per_source=2,
                   header_timeout_s=60.0, shed_after_s=60.0) as rig:
        conns = [await raw_request(rig.port, b"", source) for source in sources]
        started = time.monotonic()
        answers = await asyncio.gather(*(fate(reader) for reader, _ in conns))
        try:
            assert answers == [-1] * 6 + [503] * 4, answers
            assert time.monotonic() - started < 2
            assert rig.gateway.guard.open == 6 and len(rig.gateway._runner.server.connections) == 6
            for reader, writer in conns[6:]:
                assert await closed(reader, 2)
            # What was admitted finishes: each of the six sends its whole request now.
            for reader, writer in conns[:6]:
                writer.write(whole("/v1/completions", "POST", json.dumps(completion("hi")).encode()))
            results = await asyncio.gather(*(read_answer(reader) for reader, _ in conns[:6]))
            assert [status for status, _, _ in results] == [200] * 6
        finally:
            for _, writer in conns:
                writer.close()
        assert await until(lambda: rig.gateway.guard.open == 0)  # closed connections give their slots back
        assert rig.gateway.guard.open == 0 and rig.gateway.guard.by_source == {}


async def test_refusal_is_a_503_with_retry_after_and_the_error_object():
    """Kills: refusing with a bare close only, or without Retry-After / the OpenAI error object."""
    async with Rig([], [FakeEngine("d0")], max_connections=1, header_timeout_s=60.0, shed_after_s=60.0) as rig:
        first = await raw_request(rig.port, b"", "127.0.1.1")
        for _ in range(250):  # until the gateway holds it (a fixed 0.1 s can be too short under load)
            if rig.gateway.guard.open == 1:
                break
            await asyncio.sleep(0.02)
        reader, writer = await raw_request(rig.port, b"", "127.0.2.1")
        try:
            status, headers, body = await read_answer(reader, timeout=2)
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            error = json.loads(body)["error"]
            assert error["code"] == "too_many_connections" and error["type"] == "service_unavailable"
            assert set(error) == {"message", "type", "param", "code"}
            assert await closed(reader, 2)
            text = rig.gateway.metrics.render().decode()  # (the one slot is taken: no GET /metrics)
            assert 'conductor_gateway_connections_refused_total{cap="total"} 1.0' in text
        finally:
            first[1].close()
            writer.close()


async def test_half_sent_headers_are_closed_after_the_header_timeout():
    """Kills: no header deadline (aiohttp's own keep-alive timer, here 30 s, an hour by default,
    is all that closes a connection that never finishes its headers)."""
    async with Rig([], [FakeEngine("d0")], header_timeout_s=0.5, keepalive_timeout_s=30.0) as rig:
        started = time.monotonic()
        half = await raw_request(rig.port, HALF)
        silent = await raw_request(rig.port, b"")  # connected, sent nothing
        try:
            for reader, _ in (half, silent):
                status, _, body = await read_answer(reader, timeout=5)
                assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
                assert await closed(reader, 2)
            assert 0.4 < time.monotonic() - started < 4
            assert rig.gateway.guard.open == 0
        finally:
            for _, writer in (half, silent):
                writer.close()


async def test_header_deadline_covers_each_request_on_a_kept_alive_connection_and_nothing_else():
    """Kills: a deadline only for a connection's first request (the second one's headers trickle
    for the whole keep-alive time), a deadline started when an answer ends (an idle keep-alive
    connection would be cut after the header timeout), and one on the whole connection (a request
    that takes longer than the header timeout would be cut)."""
    slow = FakeEngine("d0", first_token_delay=1.0)
    async with Rig([], [slow], header_timeout_s=0.5, keepalive_timeout_s=30.0) as rig:
        reader, writer = await raw_request(rig.port, whole("/v1/completions", "POST",
                                                           json.dumps(completion("x")).encode()))
        try:
            assert (await read_answer(reader))[0] == 200  # 1 s in the engine: past the header timeout
            await asyncio.sleep(1.0)  # idle, kept alive, longer than the header timeout
            writer.write(whole("/health"))
            assert (await read_answer(reader))[0] == 200
            started = time.monotonic()
            writer.write(HALF)  # the next request never finishes its headers
            assert (await read_answer(reader, timeout=5))[0] == 408
            assert await closed(reader, 2) and time.monotonic() - started < 4
        finally:
            writer.close()


async def test_header_bytes_are_bounded():
    """Kills: no bound on one request's header bytes (aiohttp buffers up to 128 lines of 8 KiB each,
    1 MiB a connection, until the header deadline)."""
    async with Rig([], [FakeEngine("d0")], header_timeout_s=3.0) as rig:
        lines = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(MAX_HEADER_BYTES // 1000 + 10))
        reader, writer = await raw_request(rig.port, b"GET /health HTTP/1.1\r\nHost: gw\r\n" + lines)
        try:
            status, _, body = await read_answer(reader, timeout=2)
            assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
            assert await closed(reader, 2)
        finally:
            writer.close()


async def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes():
    """Kills: no body deadline (the handler waits on the body for as long as the client likes)."""
    async with Rig([], [FakeEngine("d0")], body_timeout_s=0.5, header_timeout_s=5.0) as rig:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{\"model\": "
        reader, writer = await raw_request(rig.port, head)
        started = time.monotonic()
        try:
            status, headers, body = await read_answer(reader, timeout=5)
            assert status == 408 and json.loads(body)["error"]["code"] == "body_timeout"
            assert headers.get("connection") == "close"
            assert await closed(reader, 2) and time.monotonic() - started < 4
        finally:
            writer.close()


async def test_unauthenticated_clients_hold_nothing_past_the_header_timeout():
    """Kills: keep-alive after a 401 (or after an unauthenticated /health), and reading or
    lingering over the body of an unauthenticated request (here it never comes: 30 s of body
    timeout, aiohttp's 10 s lingering)."""
    async with Rig([], [FakeEngine("d0")], api_keys=["k3y"], header_timeout_s=1.0, body_timeout_s=30.0,
                   keepalive_timeout_s=30.0) as rig:
        started = time.monotonic()
        reader, writer = await raw_request(rig.port, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                                                     b"Content-Length: 100000\r\n\r\n{")
        try:
            status, headers, body = await read_answer(reader)
            assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
            assert headers.get("connection") == "close"
            assert await closed(reader, 2) and time.monotonic() - started < 3
        finally:
            writer.close()
        for request in (whole("/health"), whole("/v1/models")):  # whole requests, no key: answered, closed
            reader, writer = await raw_request(rig.port, request)
            try:
                status, headers, _ = await read_answer(reader)
                assert status in (200, 401) and headers.get("connection") == "close"
                assert await closed(reader, 2)
            finally:
                writer.close()
        reader, writer = await raw_request(rig.port, whole("/v1/models", headers="Authorization: Bearer k3y\r\n"))
        try:  # with the key: kept alive
            assert (await read_answer(reader))[0] == 200
            writer.write(whole("/v1/models", headers="Authorization: Bearer k3y\r\n"))
            assert (await read_answer(reader))[0] == 200
        finally:
            writer.close()


async def test_idle_keep_alive_connections_make_room_at_a_cap_but_busy_ones_do_not():
    """Kills: refusing new clients while the slots are held by idle keep-alive connections (no
    eviction), and evicting connections that are mid-request."""
    async with Rig([], [FakeEngine("d0")], max_connections=2, max_connections_per_source=0,
                   header_timeout_s=60.0, keepalive_timeout_s=60.0) as rig:
        one = await raw_request(rig.port, whole(), "127.0.1.1")
        assert (await read_answer(one[0]))[0] == 200
        two = await raw_request(rig.port, whole(), "127.0.2.1")
        assert (await read_answer(two[0]))[0] == 200
        three = await raw_request(rig.port, whole(), "127.0.3.1")  # both idle: the oldest goes
        try:
            assert (await read_answer(three[0]))[0] == 200
            assert await closed(one[0], 2) and not await closed(two[0], 0.2)
            three[1].write(HALF)  # busy now
            two[1].write(HALF)
            for _ in range(250):  # until the gateway has read both (a fixed 0.1 s can be too short under load)
                if not rig.gateway.guard.idle:
                    break
                await asyncio.sleep(0.02)
            four = await raw_request(rig.port, b"", "127.0.4.1")
            assert await fate(four[0]) == 503  # nobody idle: refused
            four[1].close()
        finally:
            for conn in (one, two, three):
                conn[1].close()
    async with Rig([], [FakeEngine("d0")], max_connections=10, max_connections_per_source=1,
                   header_timeout_s=60.0, keepalive_timeout_s=60.0) as rig:
        one = await raw_request(rig.port, whole(), "127.0.0.2")
        assert (await read_answer(one[0]))[0] == 200
        two = await raw_request(rig.port, whole(), "127.0.0.3")  # same /24, at its cap: its idle one goes
        try:
            assert (await read_answer(two[0]))[0] == 200 and await closed(one[0], 2)
            assert rig.gateway.guard.open == 1
        finally:
            one[1].close()
            two[1].close()


async def test_the_caps_shrink_to_fit_the_descriptor_limit(monkeypatch):
    """Kills: admitting more connections than `ulimit -n` leaves descriptors for (EMFILE then stops
    accept() for everyone, and engine calls fail)."""
    import conductor.gateway.app as app

    monkeypatch.setattr(app, "descriptor_room", lambda: 100)
    async with Rig([], [FakeEngine("d0")], max_connections=4096, max_connections_per_source=512) as rig:
        assert (rig.gateway.guard.max_connections, rig.gateway.guard.per_source) == (100, 12)
    monkeypatch.setattr(app, "descriptor_room", lambda: None)
    async with Rig([], [FakeEngine("d0")], max_connections=4096, max_connections_per_source=512) as rig:
        assert (rig.gateway.guard.max_connections, rig.gateway.guard.per_source) == (4096, 512)


def test_sources_are_ipv4_24s_and_ipv6_64s():
    """Kills: keying sources by the whole address, by a wrong prefix, or IPv4-mapped IPv6 apart from IPv4."""
    assert source_of(("10.1.2.3", 5)) == source_of(("10.1.2.250", 6)) != source_of(("10.1.3.3", 5))
    assert source_of(("::ffff:10.1.2.9", 5, 0, 0)) == source_of(("10.1.2.3", 5))
    assert source_of(("2001:db8::1", 1, 0, 0)) == source_of(("2001:db8::ffff:1:2", 1, 0, 0))
    assert source_of(("2001:db8::1", 1, 0, 0)) != source_of(("2001:db8:0:1::1", 1, 0, 0))
    assert source_of(("fe80::1%lo", 1, 0, 1)) == source_of(("fe80::2", 1, 0, 1))
    assert source_of(None) is None and source_of(("not an address", 1)) is None
    assert describe(source_of(("10.1.2.3", 5))) == "10.1.2.0/24"
    assert describe(source_of(("2001:db8::1", 1, 0, 0))) == "2001:db8::/64"


# ---------------------------------------------------------------- bad input: 400/413, never 500
def nest(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


BAD_FIELDS = [  # (body change, the param named); each row kills the gateway without that check
    ({"max_tokens": "abc"}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": [8]}, "max_tokens"),
    ({"max_completion_tokens": "8"}, "max_completion_tokens"), ({"max_completion_tokens": -2}, "max_completion_tokens"),
    ({"n": "2"}, "n"), ({"n": 0}, "n"), ({"n": -3}, "n"), ({"n": 1.5}, "n"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": -0.5}, "temperature"), ({"temperature": True}, "temperature"),
    ({"temperature": {"v": 1}}, "temperature"),
    ({"top_p": "x"}, "top_p"), ({"top_p": -0.1}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"prompt": 5}, "prompt"), ({"prompt": None}, "prompt"), ({"prompt": {}}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [-1, 2]}, "prompt"), ({"prompt": [2 ** 40]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"), ({"prompt": [True]}, "prompt"), ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"), ({"prompt": [5, 2 ** 32]}, "prompt"), ({"prompt": [[1], [2, False]]}, "prompt"),
    ({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"), ({"stream": {}}, "stream"),
    ({"user": [1]}, "user"), ({"user": {"id": 1}}, "user"), ({"cache_salt": 7}, "cache_salt"),
    ({"stream_options": "x"}, "stream_options"), ({"model": 5}, "model"), ({"model": None}, "model"),
]
BAD_MESSAGES = ["hi", {}, [], ["x"], [{"content": "hi"}], [{"role": 1, "content": "hi"}],
                [{"role": "user", "content": 5}], [{"role": "user", "content": {"text": "x"}}]]


async def assert_error(rig: Rig, path: str, data, status: int, param: str | None = None, code: str | None = None):
    got, body = await rig.post(path, data)
    assert got == status, (str(data)[:80], got, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, (str(data)[:80], error)
    if code is not None:
        assert error["code"] == code, (str(data)[:80], error)


async def no_500(rig: Rig) -> None:
    async with rig.http.get(rig.url + "/metrics") as resp:
        text = await resp.text()
    assert 'status="500"' not in text
    assert (await rig.post("/v1/completions", completion("still here")))[0] == 200


async def test_malformed_values_are_400_with_the_field_named():
    """Kills: each missing type or range check (the row's field): without it the value reaches
    int() (a 500), chain_hashes (a 500 for token ids out of u32), the router (an unhashable
    `user`: a 500) or the engine (here a fake that answers 200)."""
    d = FakeEngine("d0")
    async with Rig([], [d]) as rig:
        for change, param in BAD_FIELDS:
            await assert_error(rig, "/v1/completions", {**completion("x"), **change}, 400, param)
        for messages in BAD_MESSAGES:
            await assert_error(rig, "/v1/chat/completions", {"model": MODEL, "messages": messages}, 400, "messages")
        await assert_error(rig, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                         "content": "x"}], "temperature": -1}, 400, "temperature")
        assert not d.requests  # none of it reached the engine
        for fine in ({"max_tokens": None}, {"max_tokens": 0}, {"temperature": 0}, {"top_p": 1},
                     {"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3]]}, {"stream": None}, {"n": 2},
                     {"temperature": 1.5}):
            status, body = await rig.post("/v1/completions", {**completion("x"), **fine})
            assert status == 200, (fine, body)
        status, _ = await rig.post("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": None,
                                                                           "tool_calls": []}]})
        assert status == 200
        await no_500(rig)


async def test_bad_json_deep_json_and_missing_bodies_are_400():
    """Kills: no depth limit (JSON nested past Python's recursion limit is a RecursionError, a 500;
    nested 65 deep reaches the engine), a depth limit off by one (64 deep refused), NaN/Infinity
    accepted (forwarded as invalid JSON), and an empty body reported as anything but a 400."""
    d = FakeEngine("d0")
    async with Rig([], [d]) as rig:
        # The body itself is level 1: 65 levels; "[x]": more brackets than levels, so the depth is walked.
        deep = json.dumps({**completion("[x]"), "tools": nest(64)})
        await assert_error(rig, "/v1/completions", deep, 400, code="too_deep")
        very_deep = '{"model": "tiny", "prompt": ' + "[" * 200_000 + "]" * 200_000 + "}"
        await assert_error(rig, "/v1/completions", very_deep, 400, code="too_deep")
        await assert_error(rig, "/v1/chat/completions", "[" * 100_000, 400)
        for raw, code in ((b"", "missing_body"), (b"  \n", "missing_body"), (b"{not json", "invalid_json"),
                          (b'{"model": "tiny", "prompt": "x", "max_tokens": NaN}', "invalid_json"),
                          (b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', "invalid_json"),
                          (b"\xff\xfe\x00{", "invalid_json"), (b"[1, 2]", None), (b'"a string"', None)):
            await assert_error(rig, "/v1/completions", raw, 400, code=code)
        async with rig.http.post(rig.url + "/v1/completions") as resp:  # no body at all
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "missing_body"
        assert not d.requests
        status, _ = await rig.post("/v1/completions", json.dumps({**completion("[x]"), "tools": nest(63)}))
        assert status == 200  # exactly at the limit: fine
        await no_500(rig)


async def test_bodies_over_the_size_limit_are_413_read_or_not():
    """Kills: a body size limit only on the declared Content-Length (a chunked body streams past
    it) or only while reading (a declared oversize body is read before it is refused)."""
    async with Rig([], [FakeEngine("d0")], max_body_bytes=4096) as rig:
        await assert_error(rig, "/v1/completions", json.dumps(completion("x" * 10_000)), 413, code="body_too_large")

        async def chunks():
            for _ in range(10):
                yield b" " * 1000

        async with rig.http.post(rig.url + "/v1/completions", data=chunks()) as resp:  # chunked: no length
            assert resp.status == 413 and (await resp.json())["error"]["code"] == "body_too_large"
        # Declared too large: refused before a byte of it is read (here none is ever sent).
        reader, writer = await raw_request(rig.port, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                                                     b"Content-Length: 100000000\r\n\r\n")
        try:
            status, _, body = await read_answer(reader, timeout=2)
            assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
        finally:
            writer.close()
        await no_500(rig)


async def test_malformed_http_gets_the_error_object_and_the_connection_closes(caplog):
    """Kills: aiohttp's own text answer (and a logged traceback per stranger's bad bytes) for a
    request it cannot parse."""
    async with Rig([], [FakeEngine("d0")]) as rig:
        for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: abc\r\n\r\n",
                    b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n"):
            reader, writer = await raw_request(rig.port, raw)
            try:
                status, headers, body = await read_answer(reader)
                assert status == 400 and headers["content-type"].startswith("application/json"), (raw, body)
                assert json.loads(body)["error"]["code"] == "malformed_http"
                assert await closed(reader, 2)
            finally:
                writer.close()
        await no_500(rig)
    assert not [r for r in caplog.records if r.exc_info]


# ---------------------------------------------------------------- settings
def test_limits_come_from_flags_and_the_config_file(tmp_path, capsys):
    """Kills: flags parsed but not passed into the gateway's config, a config file that rejects the
    new keys, and nonsense values accepted (a zero cap or timeout)."""
    from conductor.cli import build_parser, main
    from conductor.gateway import GatewayConfig
    from conductor.gateway.serve import config_from

    args = build_parser().parse_args(["serve", "--decode", "http://e:1", "--max-connections", "7",
                                      "--max-connections-per-source", "0", "--header-timeout-s", "2.5",
                                      "--body-timeout-s", "4", "--keepalive-timeout-s", "9",
                                      "--max-body-bytes", "1000", "--max-json-depth", "12"])
    config = config_from(args)
    assert (config.max_connections, config.max_connections_per_source, config.header_timeout_s,
            config.body_timeout_s, config.keepalive_timeout_s, config.max_body_bytes, config.max_json_depth) \
        == (7, 0, 2.5, 4.0, 9.0, 1000, 12)
    path = tmp_path / "gw.json"
    path.write_text(json.dumps({"decode": ["http://e:1"], "max_connections": 9, "header_timeout_s": 3}))
    config = config_from(build_parser().parse_args(["serve", "--config", str(path), "--max-connections", "11"]))
    assert (config.max_connections, config.header_timeout_s, config.max_connections_per_source) == (11, 3, 512)
    defaults = GatewayConfig(decode=["http://e:1"]).validate()
    assert (defaults.header_timeout_s, defaults.body_timeout_s, defaults.keepalive_timeout_s,
            defaults.max_connections, defaults.max_connections_per_source, defaults.max_json_depth) \
        == (10.0, 30.0, 75.0, 4096, 512, 64)
    for bad in (["--max-connections", "0"], ["--header-timeout-s", "0"], ["--max-connections-per-source", "-1"],
                ["--body-timeout-s", "soon"], ["--overflow-kv-share", "1.5"], ["--overflow-kv-share", "nan"]):
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--decode", "http://e:1", *bad])
        assert exited.value.code == 2
    capsys.readouterr()
    for field, value in (("header_timeout_s", 0), ("keepalive_timeout_s", float("inf")), ("max_connections", 0),
                         ("max_json_depth", "9"), ("max_connections_per_source", -1), ("body_timeout_s", True),
                         ("overflow_kv_share", 1.5), ("overflow_kv_share", -0.1), ("overflow_kv_share", "half")):
        with pytest.raises(ValueError, match=field):
            GatewayConfig(decode=["http://e:1"], **{field: value}).validate()


async def test_conductor_serve_honours_the_flags():
    """Kills: `conductor serve` running the gateway without the limit flags (the defaults: 10 s
    header timeout, 4096 connections) - the gateway as a subprocess, over real sockets."""
    from kvstore_testing import processes

    d = FakeEngine("d0")
    async with Rig([], [d]):  # (its gateway unused: the fake engine's server)
        proc = processes.spawn([sys.executable, "-m", "conductor.cli", "serve", "--decode", d.url,
                                "--max-connections", "3", "--max-connections-per-source", "0",
                                "--header-timeout-s", "2", "--listen", "127.0.0.1:0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(ROOT))
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            port = int(json.loads(line)["listen"].rsplit(":", 1)[1])
            started = time.monotonic()
            held = [await raw_request(port, HALF, f"127.0.{i}.1") for i in range(1, 4)]
            over = await raw_request(port, b"", "127.0.9.1")
            # 2 s of header timeout: long enough that the three stay held while the fourth connects
            # on a loaded machine (0.5 s was not always), far below the default 10 s.
            assert (await read_answer(over[0], timeout=5))[0] == 503
            for reader, _ in held:
                assert (await read_answer(reader, timeout=7))[0] == 408
            assert time.monotonic() - started < 9
            for _, writer in [*held, over]:
                writer.close()
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=completion("x")) as resp:
                    assert resp.status == 200
        finally:
            await asyncio.to_thread(processes.stop, proc)
