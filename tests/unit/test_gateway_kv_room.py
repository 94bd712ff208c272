"""The gateway keeps requests off engines whose KV cache they would overflow: what an engine reports
(`vllm:cache_config_info`, `vllm:kv_cache_usage_perc`) and what the gateway itself has sent there."""
from __future__ import annotations

from conductor.gateway.pool import Pool, parse_load
from conductor.gateway.prefix import PrefixTracker
from conductor.gateway.route import Router
from kvstore.keys import ModelFingerprint, chain_hashes

FP = ModelFingerprint("m", "bfloat16", 16, 2, 2, 8)


def pool(*roles: str) -> Pool:
    p = Pool([f"http://p{i}" for i, r in enumerate(roles) if r == "prefill"],
             [f"http://d{i}" for i, r in enumerate(roles) if r == "decode"])
    for e in p.engines:
        e.healthy = True
    return p


def test_capacity_comes_from_cache_config_info():
    """Kills: a KV capacity read from the wrong labels (or none at all: the check never engages)."""
    text = ('vllm:cache_config_info{block_size="128",cache_dtype="auto",num_gpu_blocks="3390",engine="0"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    assert parse_load(text) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.25, "kv_capacity": 3390 * 128.0}
    assert "kv_capacity" not in parse_load('vllm:kv_cache_usage_perc{engine="0"} 0.25\n')


def test_a_cached_prefix_does_not_pull_a_request_onto_a_full_engine():
    """Kills: cache-aware routing that piles requests onto the engine holding the prefix until it
    preempts (the fleet benchmark at load 1.2: ours 60-97 preemptions per engine, round-robin 9-78)."""
    p = pool("decode", "decode")
    hot, cold = p.engines
    tracker = PrefixTracker()
    prompt = list(range(320))
    hashes = chain_hashes(FP, prompt)
    tracker.add(hot.url, hashes)  # the whole prompt is cached there
    router = Router(p, tracker, FP, block_tokens=16, local_prefill_tokens=0)
    for e in (hot, cold):
        e.kv_capacity = 10_000
    assert router.route(hashes, 320, 100).decode is hot  # room everywhere: the cache wins
    hot.kv_usage = 0.93  # 9,300 of 10,000 tokens used: 420 more would overflow
    assert router.route(hashes, 320, 100).decode is cold
    hot.kv_usage = 0.0
    hot.inflight_kv = 9_300  # sent by this gateway since the last scrape: counts the same
    assert router.route(hashes, 320, 100).decode is cold
    cold.inflight_kv = 9_500  # both full: the cache-aware pick again, not a refusal
    assert router.route(hashes, 320, 100).decode is hot


def test_colocated_a_full_engine_with_the_shorter_queue_still_takes_a_request():
    """Kills: colocated routing kept to the engines with KV room. With many engines near full at once
    that sent every request to the few with room, behind their prefill queues, while engines whose
    decodes free KV every step sat idle (the fleet at load 1.2: 19 % of routes placed behind 8k or
    more prompt tokens beyond the emptiest engine's, 10 % without the filter)."""
    p = pool("decode", "decode")
    full, roomy = p.engines
    router = Router(p, PrefixTracker(), FP, block_tokens=16, local_prefill_tokens=0, policy="affinity")
    for e in p.engines:
        e.kv_capacity = 100_000
    full.kv_usage = 0.93
    roomy.inflight, roomy.inflight_tokens = 1, 40_000  # a long prompt still to compute
    assert router.route(chain_hashes(FP, list(range(320))), 320, 100).decode is full
    roomy.inflight = roomy.inflight_tokens = 0  # equally fast: the emptier cache
    assert router.route(chain_hashes(FP, list(range(320))), 320, 100).decode is roomy


def test_pd_decode_goes_where_the_kv_cache_has_room():
    """Kills: picking a P/D decode engine by request count alone (a few long prompts fill its cache)."""
    p = pool("prefill", "decode", "decode")
    _, d1, d2 = p.engines
    router = Router(p, PrefixTracker(), FP, block_tokens=16, local_prefill_tokens=0)
    for e in (d1, d2):
        e.kv_capacity = 100_000
    d1.inflight, d1.inflight_kv = 1, 60_000  # one long prompt
    d2.inflight, d2.inflight_kv = 3, 3_000  # three short ones
    route = router.route(chain_hashes(FP, list(range(64))), 64, 16)
    assert route.prefill is not None and route.decode is d2


def test_equally_fast_engines_share_the_load():
    """Kills: a colocated pick that always takes the engine holding the prefix, however busy, when the
    pool gives every engine the prefix within tens of ms (its decodes pay for every prefill placed
    there), or one that spreads even onto an engine with a prefill queue."""
    from conductor.cost import CostModel

    p = pool("decode", "decode")
    hot, idle = p.engines
    tracker = PrefixTracker()
    prompt = list(range(320))
    hashes = chain_hashes(FP, prompt)
    tracker.add(hot.url, hashes)

    class Mirror:  # the pool holds the whole prompt too
        def match(self, fingerprint, hashes):
            return type("Match", (), {"length": len(hashes), "stale": False})()

    router = Router(p, tracker, FP, mirror=Mirror(), block_tokens=16, local_prefill_tokens=0, cost=CostModel())
    hot.inflight = 3  # decoding there
    assert router.route(hashes, 320, 100).decode is idle
    assert router.route(hashes, 320, 100, session="s").decode is hot  # a session keeps its own rules
    idle.inflight_tokens = 50_000  # a long prefill queued there: not equally fast any more
    assert router.route(hashes, 320, 100).decode is hot


def test_pd_a_full_decode_pool_overflows_onto_the_prefill_engine_within_its_share():
    """Kills: a P/D request sent to wait for decode KV while its prefill engine has room to decode
    it (the fleet at load 0.9: every decode engine's KV at 96-100 % at its peak, the prefill
    engines' 4-8 % full on average), an overflow taken while a decode engine still has room, one that
    fills a prefill engine past its share or past the 95 % headroom (its prefills then wait for
    blocks), and one taken when the operator turned it off (share 0)."""
    p = pool("prefill", "decode")
    pre, dec = p.engines
    hashes = chain_hashes(FP, list(range(640)))
    for e in p.engines:
        e.kv_capacity = 100_000
    router = Router(p, PrefixTracker(), FP, block_tokens=16, local_prefill_tokens=0, overflow_kv_share=0.5)
    route = router.route(hashes, 640, 200)
    assert route.prefill is pre and route.decode is dec  # decode KV to spare: disaggregated
    dec.inflight_kv = 99_500  # the decode pool is full
    route = router.route(hashes, 640, 200)
    assert route.prefill is None and route.decode is pre and route.reason == "overflow"
    pre.inflight_kv = 49_500  # 840 more would take the prefill engine past half its KV
    route = router.route(hashes, 640, 200)
    assert route.prefill is pre and route.decode is dec
    pre.inflight_kv = 94_500  # a share of 1 still keeps the headroom the decode engines keep (95 %)
    whole = Router(p, PrefixTracker(), FP, block_tokens=16, local_prefill_tokens=0, overflow_kv_share=1.0)
    assert whole.route(hashes, 640, 200).decode is dec
    pre.inflight_kv = 0
    off = Router(p, PrefixTracker(), FP, block_tokens=16, local_prefill_tokens=0, overflow_kv_share=0.0)
    assert off.route(hashes, 640, 200).decode is dec
