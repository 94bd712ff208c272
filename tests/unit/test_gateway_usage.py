"""Per-tier usage at the gateway against fake engines that answer like vLLM with the kvstore
connector: `usage.prompt_tokens_details.cached_tokens` on every answer, its split by tier summing to
it, the P/D convention (the prefill's cache hits, not the decode's hand-off), streams' usage chunks,
and the prefill-time and cost metrics."""
from __future__ import annotations

import json

from aiohttp import web

from conductor.gateway.usage import CachedSplit, settle
from kvstore_testing.fake_engines import MODEL, FakeEngine, Rig, completion

PROMPT = list(range(64))


class UsageEngine(FakeEngine):
    """A fake engine whose answers carry vLLM's usage (cached_tokens) and the connector's tier report."""

    def __init__(self, name: str, hits: dict | None, cached: int | None, **kw) -> None:
        super().__init__(name, **kw)
        self.hits, self.cached = hits, cached

    async def generate(self, request):
        body = await request.json()
        self.requests.append(body)
        details = {"cached_tokens": self.cached} if self.cached is not None else None
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                 "total_tokens": len(body["prompt"]) + 1, "prompt_tokens_details": details}
        params = {"kvstore_hits": dict(self.hits)} if self.hits is not None else None
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            params = {**(params or {}), "kvstore": {"fingerprint": "f", "num_blocks": 1}}
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                      "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                      "usage": usage, "kv_transfer_params": params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("a", "b"):
            await resp.write(b"data: " + json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": piece}]})
                             .encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            text = json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}).encode()
            await resp.write(b"data: " + text[:10])  # an event split across writes
            await resp.write(text[10:] + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def details(answer: dict) -> dict:
    return answer["usage"]["prompt_tokens_details"]


def events(raw: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]


async def test_a_whole_answer_carries_cached_tokens_split_by_tier():
    """Kills: the split taken as the engine reported it without device as the rest (no sum), the
    connector's report left in the client's answer."""
    d = UsageEngine("d0", {"device": 0, "host": 16, "disk": 16, "p2p": 0}, cached=48)
    async with Rig([], [d]) as rig:
        status, answer = await rig.post("/v1/completions", completion(PROMPT))
    assert status == 200
    got = details(answer)
    assert got["cached_tokens"] == 48 and got["cached_tokens_source"] == "engine"
    assert got["cached_tokens_by_tier"] == {"device": 16, "host": 16, "disk": 16, "p2p": 0}
    assert answer["kv_transfer_params"] is None  # the report was the gateway's, not the client's


async def test_pd_reports_the_prefills_hits_not_the_handoff():
    """vLLM's own P/D convention: the decode's hand-off tokens were computed for this request.
    Kills: the decode's (~100%) count reported, the report forwarded to the decode engine."""
    p = UsageEngine("p0", {"device": 16, "host": 16, "disk": 0, "p2p": 0}, cached=32)
    d = UsageEngine("d0", {"device": 0, "host": 0, "disk": 0, "p2p": 63}, cached=63)
    async with Rig([p], [d]) as rig:
        status, answer = await rig.post("/v1/completions", completion(PROMPT))
    assert status == 200
    assert details(answer)["cached_tokens"] == 32
    assert details(answer)["cached_tokens_by_tier"] == {"device": 16, "host": 16, "disk": 0, "p2p": 0}
    assert "kvstore_hits" not in d.requests[0]["kv_transfer_params"]


async def test_streams_complete_the_usage_chunk_and_sum_to_cached_tokens():
    """A stream whose client asked for usage gets the split in its final usage chunk (an event
    split across writes included); one whose client did not is asked for it anyway, for the
    metrics, and never sees it. Kills: the usage chunk passed on unchanged, a usage chunk the client
    did not ask for leaking out, streams left out of the metrics."""
    d = UsageEngine("d0", {"device": 0, "host": 32, "disk": 0, "p2p": 0}, cached=32)
    async with Rig([], [d], gpu_hour_price=4.0) as rig:
        status, _ = await rig.post("/v1/completions", completion(PROMPT))  # the engine reports tiers
        assert status == 200
        async with rig.http.post(rig.url + "/v1/completions", json=completion(
                PROMPT, stream=True, stream_options={"include_usage": True})) as resp:
            asked = await resp.read()
        async with rig.http.post(rig.url + "/v1/completions", json=completion(PROMPT, stream=True)) as resp:
            unasked = await resp.read()
        metrics = (await (await rig.http.get(rig.url + "/metrics")).read()).decode()
    usage = events(asked)[-1]["usage"]["prompt_tokens_details"]
    assert usage["cached_tokens"] == 32 == sum(usage["cached_tokens_by_tier"].values())
    assert usage["cached_tokens_source"] == "routing"  # vLLM streams no connector report
    assert asked.endswith(b"data: [DONE]\n\n")
    assert d.requests[2]["stream_options"] == {"include_usage": True}
    assert all("usage" not in e for e in events(unasked)) and unasked.endswith(b"data: [DONE]\n\n")
    assert "".join(e["choices"][0]["text"] for e in events(unasked)) == "ab"
    tiers = {line.split("tier=")[1].split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("conductor_gateway_cached_tokens_total{")}
    assert sum(tiers.values()) == 3 * 32  # every answer counted, the stream without usage too
    saved = [line for line in metrics.splitlines() if line.startswith("conductor_gateway_prefill_seconds_saved_total")]
    assert saved and float(saved[0].split()[-1]) > 0
    cost = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("conductor_gateway_prompt_cost_per_million_tokens")}
    assert 0 < cost["conductor_gateway_prompt_cost_per_million_tokens"] \
        < cost["conductor_gateway_prompt_cost_per_million_tokens_uncached"]


def test_every_split_sums_to_cached_tokens():
    """Kills: a split whose tiers miss tokens the engine counted (or count more)."""
    hits = {"device": 0, "host": 128, "disk": 256, "p2p": 0}
    cases = [settle(512, hits, None, 0, True), settle(None, hits, None, 0, True), settle(300, None, None, 128, True),
             settle(300, None, None, 999, True), settle(300, None, None, 0, False),
             settle(9, dict(hits), {"device": 5, "host": 0, "disk": 0, "p2p": 0}, 0, True)]
    for split in cases:
        assert isinstance(split, CachedSplit) and sum(split.tiers.values()) == split.cached_tokens
    assert cases[0].tiers["device"] == 128 and cases[4].tiers == {"device": 300, "host": 0, "disk": 0, "p2p": 0}
    assert settle(None, None, None, 0, True) is None
    assert MODEL
