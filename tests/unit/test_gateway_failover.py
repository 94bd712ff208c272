"""The gateway when engines fail: retries, colocated fallback, rotation, timeouts, disconnects."""
from __future__ import annotations

import asyncio
import json

from kvstore_testing.fake_engines import FakeEngine, Rig, completion, until

LONG = list(range(64))  # long enough to be disaggregated


async def test_failed_prefill_moves_to_another_prefill_engine():
    """Kills "a failed prefill engine stays in the rotation". Health checks are 60 s apart: the
    failing engine still answers /health, and a check between two requests would bring it back."""
    bad, good, d = FakeEngine("p-bad", fail_status=500), FakeEngine("p-good"), FakeEngine("d0")
    async with Rig([bad, good], [d], policy="round_robin", health_interval_s=60) as rig:
        for _ in range(4):
            status, body = await rig.post("/v1/completions", completion(LONG))
            assert status == 200 and body["choices"][0]["text"] == "from-d0"
        assert all(r["kv_transfer_params"]["kvstore"]["by"] == "p-good" for r in d.requests)
        assert len(bad.requests) == 1  # then it left the rotation
        assert not rig.gateway.pool.get(bad.url).healthy or bad.healthy


async def test_all_prefills_failing_falls_back_to_colocated_decode():
    p0, p1, d = FakeEngine("p0", fail_status=503), FakeEngine("p1", fail_status=500), FakeEngine("d0")
    async with Rig([p0, p1], [d]) as rig:
        status, body = await rig.post("/v1/completions", completion(LONG))
    assert status == 200 and body["choices"][0]["text"] == "from-d0"
    assert len(p0.requests) == 1 and len(p1.requests) == 1
    assert "kv_transfer_params" not in d.requests[0]  # the decode engine prefilled itself


async def test_prefill_timeout_is_a_failure_too():
    """Kills "a prefill that timed out is not a failure": the engine would stay in the rotation
    and round-robin would send it the second request too. Health checks are 60 s apart here: the
    hung engine still answers /health, and a check between the two requests (0.1 s apart by
    default, easily reached on a loaded machine) put it back in the rotation before the second."""
    slow, fast, d = FakeEngine("p-slow", hang=True), FakeEngine("p-fast"), FakeEngine("d0")
    async with Rig([slow, fast], [d], prefill_timeout_s=0.5, policy="round_robin", health_interval_s=60) as rig:
        results = [await rig.post("/v1/completions", completion(LONG)) for _ in range(2)]
    assert all(status == 200 for status, _ in results)
    assert len(slow.requests) == 1 and slow.cancelled == 1  # timed out, and its request was dropped


async def test_decode_failure_before_first_token_is_retried_once_elsewhere():
    p = FakeEngine("p0")
    dead, live = FakeEngine("d-dead", die_after_chunks=0), FakeEngine("d-live")
    async with Rig([p], [dead, live], policy="round_robin") as rig:
        rig.gateway.pool.get(live.url).inflight += 5  # make the dead one the first choice
        async with rig.http.post(rig.url + "/v1/completions", json=completion(LONG, stream=True)) as resp:
            raw = (await resp.read()).decode()
        rig.gateway.pool.get(live.url).inflight -= 5
    assert resp.status == 200 and raw.rstrip().endswith("data: [DONE]")
    assert len(dead.requests) == 1 and len(live.requests) == 1
    assert live.requests[0]["kv_transfer_params"]["kvstore"]["by"] == "p0"  # the same hand-off, elsewhere


async def test_decode_failing_everywhere_gets_a_502_error_object():
    d0, d1 = FakeEngine("d0", fail_status=500), FakeEngine("d1", fail_status=500)
    async with Rig([], [d0, d1]) as rig:
        status, body = await rig.post("/v1/completions", completion("x"))
        assert status == 502 and body["error"]["code"] == "upstream_failed"
        assert len(d0.requests) + len(d1.requests) == 2  # one retry, not more
        await asyncio.sleep(0.3)
        status, body = await rig.post("/v1/completions", completion("x"))  # both failed: none healthy now?
        assert status in (502, 503) and "error" in body


async def test_decode_dying_mid_stream_ends_with_an_error_event():
    d = FakeEngine("d0", die_after_chunks=1)
    async with Rig([], [d]) as rig:
        async with rig.http.post(rig.url + "/v1/completions", json=completion("x", stream=True)) as resp:
            raw = (await resp.read()).decode()
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "from"
    assert "error" in json.loads(events[-1]) and "[DONE]" not in raw


async def engine_health(rig, url: str, healthy: bool, timeout: float = 10.0) -> None:
    """Until the gateway's /health shows `url` as `healthy` (health rounds are timed: on a loaded
    machine a fixed sleep saw none)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with rig.http.get(rig.url + "/health") as resp:
            engines = {e["url"]: e["healthy"] for e in (await resp.json())["engines"]}
        if engines.get(url) == healthy or asyncio.get_running_loop().time() > deadline:
            return
        await asyncio.sleep(0.05)


async def test_dead_engine_leaves_the_rotation_and_comes_back():
    d0, d1 = FakeEngine("d0"), FakeEngine("d1")
    async with Rig([], [d0, d1], policy="round_robin") as rig:
        d0.healthy = False
        await engine_health(rig, d0.url, False)
        for _ in range(4):
            assert (await rig.post("/v1/completions", completion("x")))[0] == 200
        assert not d0.requests and len(d1.requests) == 4
        async with rig.http.get(rig.url + "/health") as resp:
            engines = {e["url"]: e["healthy"] for e in (await resp.json())["engines"]}
        assert engines == {d0.url: False, d1.url: True}
        d0.healthy = True
        await engine_health(rig, d0.url, True)
        for _ in range(4):
            await rig.post("/v1/completions", completion("x"))
        assert d0.requests  # back in the rotation


async def test_no_healthy_engine_is_a_503_not_a_hang():
    d = FakeEngine("d0", healthy=False)
    async with Rig([], [d]) as rig:
        status, body = await rig.post("/v1/completions", completion("x"))
        assert status == 503 and body["error"]["code"] == "no_engine"
        async with rig.http.get(rig.url + "/health") as resp:
            assert resp.status == 503


async def test_client_disconnect_cancels_upstream_requests():
    p, d = FakeEngine("p0"), FakeEngine("d0", stream_delay=5.0)
    async with Rig([p], [d], prefill_timeout_s=30) as rig:  # the hung prefill below is cancelled, not timed out
        async with rig.http.post(rig.url + "/v1/completions", json=completion(LONG, stream=True)) as resp:
            await resp.content.readany()  # the first token arrived; now the client walks away
        assert await until(lambda: d.cancelled)
        assert d.cancelled == 1
        # And while the prefill is still running:
        p.hang = True
        task = asyncio.create_task(rig.post("/v1/completions", completion(LONG)))
        while len(p.requests) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        assert await until(lambda: p.cancelled)
        assert p.cancelled == 1 and len(d.requests) == 1
        assert rig.gateway.pool.get(p.url).inflight == 0  # bookkeeping undone


async def test_engine_unreachable_is_skipped():
    p, d = FakeEngine("p0"), FakeEngine("d0")
    async with Rig([p], [d]) as rig:
        rig.gateway.pool.engines.append(type(rig.gateway.pool.engines[0])("http://127.0.0.1:9", "prefill", True))
        for _ in range(3):
            status, _ = await rig.post("/v1/completions", completion(LONG))
            assert status == 200


async def test_timeouts_bound_every_engine_call():
    d = FakeEngine("d0", hang=True)
    async with Rig([], [d], prefill_timeout_s=0.3) as rig:
        started = asyncio.get_running_loop().time()
        status, body = await rig.post("/v1/completions", completion("x"))
        assert status == 502 and asyncio.get_running_loop().time() - started < 5


async def test_colocated_prefills_in_flight_count_as_their_engines_queue():
    """Two new prompts at once: the second goes to the idle engine, not behind the first one."""
    # The first answer takes 5 s: under load the second request may reach the gateway a while after
    # the first was routed, and the first must still be in flight then (0.5 s was sometimes not).
    engines = [FakeEngine("d0", first_token_delay=5.0), FakeEngine("d1", first_token_delay=5.0)]
    async with Rig([], engines, prefill_timeout_s=30) as rig:
        first = asyncio.create_task(rig.post("/v1/completions", completion(list(range(400)))))
        assert await until(lambda: any(e.inflight for e in rig.gateway.pool.engines))  # the gateway routed it
        second = await rig.post("/v1/completions", completion(list(range(1000, 1400))))
        assert second[0] == 200 and (await first)[0] == 200
        assert [len(e.requests) for e in engines] == [1, 1]
        assert [(e.inflight, e.inflight_tokens) for e in rig.gateway.pool.engines] == [(0, 0), (0, 0)]


async def test_a_decode_retried_elsewhere_leaves_no_load_behind():
    engines = [FakeEngine("d0", fail_status=500), FakeEngine("d1")]
    async with Rig([], engines) as rig:
        status, _ = await rig.post("/v1/completions", completion(list(range(50))))
        assert status == 200 and len(engines[1].requests) == 1
        assert [(e.inflight, e.inflight_tokens) for e in rig.gateway.pool.engines] == [(0, 0), (0, 0)]
