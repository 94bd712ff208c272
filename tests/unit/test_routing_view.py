"""The router's view of each engine's cache stays exact under churn (lost KV events, a restart, an
engine out of the rotation), and the affinity policy says which term decided each route."""
from __future__ import annotations

import asyncio

import pytest

from conductor.cost import CostModel
from conductor.gateway.kv_events import KVEventFollower
from conductor.gateway.pool import Pool
from conductor.gateway.prefix import PrefixTracker
from conductor.policies import InstanceView, RouteRequest, make_policy
from kvstore.keys import ModelFingerprint, chain_hashes

BLOCK = 4
URL = "http://127.0.0.1:8000"


def test_affinity_keeps_a_prefix_local_until_its_holder_is_too_busy():
    """Kills: a policy that spreads a prefix away from the engine holding it when that engine is
    only a little busier (kv_aware's win), one that never falls back to the pool however long the
    holder's queue, one blind to the decodes a colocated prefill stalls, and one that does not say
    which term decided."""
    cost = CostModel()
    policy = make_policy("affinity", cost)
    request = RouteRequest(prompt_tokens=10_000, global_prefix_tokens=8000)
    holder = InstanceView("holder", queue_ms=300, local_prefix_tokens=8000)
    idle = InstanceView("idle", queue_ms=0, local_prefix_tokens=0)
    pick = policy.choose(request, [idle, holder])
    assert (pick.instance, pick.reason, pick.loaded_tokens) == ("holder", "local", 0)
    # cache_global alone prefers the idle engine loading the prefix from the pool (tens of ms):
    assert make_policy("cache_global", cost).choose(request, [idle, holder]).instance == "idle"
    busy = InstanceView("holder", queue_ms=5_000, local_prefix_tokens=8000)
    pick = policy.choose(request, [idle, busy])
    assert (pick.instance, pick.reason, pick.loaded_tokens) == ("idle", "pool", 8000)
    nothing = RouteRequest(prompt_tokens=10_000)
    pick = policy.choose(nothing, [InstanceView("a", 300, 0), InstanceView("b", 10, 0)])
    assert (pick.instance, pick.reason) == ("b", "queue")
    # Colocated, a prefill stalls every decode running there: 40 decodes outweigh 300 ms of queue.
    pick = policy.choose(nothing, [InstanceView("a", 300, 0, decoding=2), InstanceView("b", 10, 0, decoding=40)])
    assert (pick.instance, pick.reason) == ("a", "queue")


def test_a_short_prefix_does_not_keep_a_long_prompt_waiting_at_home():
    """Kills: a stay-home slack taken as a share of the best predicted time alone. A long prompt's
    predicted time is seconds, so half of it kept 87k-token prompts 0.7 s behind another prompt at
    an engine holding one block more than idle engines (the fleet at load 1.2, 1 route in 5 placed
    behind 8k tokens or more than the emptiest engine had). Staying home is worth at most computing
    what home holds beyond the best engine; a long held prefix still keeps its request home."""
    cost = CostModel()
    policy = make_policy("affinity", cost)
    long_prompt = RouteRequest(prompt_tokens=80_000)
    home = InstanceView("home", queue_ms=700, local_prefix_tokens=512)
    idle = InstanceView("idle", queue_ms=0, local_prefix_tokens=0)
    assert policy.choose(long_prompt, [home, idle]).instance == "idle"
    session = InstanceView("home", queue_ms=700, local_prefix_tokens=60_000)
    assert policy.choose(long_prompt, [session, idle]).instance == "home"


def _stored(hashes: list[int], parent, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK}


def _wire(seq: int, events: list[dict]) -> list[bytes]:
    import msgspec

    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, events, None])]


async def test_a_restarted_engine_and_a_gap_without_replay_drop_the_view():
    """Kills: a follower that applies batches whatever their numbers (after a restart the old blocks
    stay credited; after lost BlockRemoved events, blocks the engine evicted stay credited)."""
    fp = ModelFingerprint("m", "float32", BLOCK, 2, 2, 8)
    tracker = PrefixTracker()
    follower = KVEventFollower(URL, "tcp://x", tracker, fp)
    tokens = list(range(2 * BLOCK))
    ours = chain_hashes(fp, tokens)
    await follower.receive(_wire(0, [_stored([1, 2], None, tokens)]))
    assert tracker.prefix_blocks(URL, ours) == 2
    await follower.receive(_wire(0, [_stored([7], None, [50, 51, 52, 53])]))  # numbers start again: a restart
    assert tracker.prefix_blocks(URL, ours) == 0 and follower.resets == 1
    await follower.receive(_wire(1, [_stored([1, 2], None, tokens)]))
    assert tracker.prefix_blocks(URL, ours) == 2
    await follower.receive(_wire(5, []))  # batches 2-4 lost, no replay socket: no credit beats wrong credit
    assert tracker.prefix_blocks(URL, ours) == 0 and follower.resets == 2


async def test_lost_batches_are_replayed_from_the_engine():
    """Kills: a follower that skips a gap (the BlockRemoved it lost keeps an evicted block credited)
    instead of fetching the batches from the engine's replay socket. Real ZMQ sockets: the
    stand-in engines' publisher, whose batches 1-2 are lost on the wire."""
    from conductor.sim.engine.events import BlockRemoved, BlockStored, Publisher

    fp = ModelFingerprint("m", "float32", BLOCK, 2, 2, 8)
    tracker = PrefixTracker()
    publisher = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    replay = asyncio.create_task(publisher.serve_replay())
    follower = KVEventFollower(URL, publisher.endpoint, tracker, fp, replay=publisher.replay_endpoint)
    tokens = list(range(3 * BLOCK))
    ours = chain_hashes(fp, tokens)

    def stored(hashes, parent, toks):
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=BLOCK,
                           lora_id=None, medium="GPU", lora_name=None)

    try:
        publisher.publish([stored([1, 2], None, tokens[:2 * BLOCK])], send=False)  # 0: lost
        publisher.publish([stored([3], 2, tokens[2 * BLOCK:])], send=False)  # 1: lost
        publisher.publish([BlockRemoved(block_hashes=[3], medium="GPU")], send=False)  # 2: lost
        await follower.receive([b"", (0).to_bytes(8, "big"), publisher.buffer[0][1]])
        assert tracker.prefix_blocks(URL, ours) == 2
        publisher.publish([stored([9], None, [40, 41, 42, 43])])  # 3: arrives, after a gap (1-2)
        await follower.receive([b"", (3).to_bytes(8, "big"), publisher.buffer[-1][1]])
        assert follower.replayed == 2 and follower.resets == 0
        assert tracker.prefix_blocks(URL, ours) == 2  # block 3 was stored, then removed: not credited
    finally:
        replay.cancel()
        await asyncio.gather(replay, return_exceptions=True)
        publisher.close()


async def test_an_engine_out_of_the_rotation_loses_its_credit():
    """Kills: a gateway that keeps crediting an engine with its old blocks after a health check found
    it gone (it comes back empty when it restarts)."""
    import aiohttp

    pool = Pool([], ["http://127.0.0.1:9"], timeout=0.5)  # nothing listens on the discard port
    tracker = PrefixTracker()
    pool.on_down = lambda engine: tracker.clear(engine.url)
    engine = pool.engines[0]
    tracker.add(engine.url, [b"a", b"b"])
    engine.healthy = engine.answered = True
    async with aiohttp.ClientSession() as session:
        await pool.check(session, engine)
    assert not engine.healthy and tracker.prefix_blocks(engine.url, [b"a", b"b"]) == 0


def test_policy_parameters_reach_the_policy_and_bad_ones_are_refused():
    """Kills: parameters in a policy's name parsed and dropped (a sweep over them would measure one
    policy under several names), and a misspelt one taken silently."""
    cost = CostModel()
    request = RouteRequest(prompt_tokens=10_000, global_prefix_tokens=8000)
    holder = InstanceView("holder", queue_ms=300, local_prefix_tokens=8000)
    idle = InstanceView("idle", queue_ms=0, local_prefix_tokens=0)
    assert make_policy("affinity", cost).choose(request, [idle, holder]).instance == "holder"
    assert make_policy("affinity(stay_ms=0,stay_share=0)", cost).choose(request, [idle, holder]).instance == "idle"
    for bad in ("affinity(stay=1)", "affinity(stay_ms=soon)", "round_robin(stay_ms=1)", "affinity(stay_ms=1"):
        with pytest.raises(ValueError):
            make_policy(bad, cost)
