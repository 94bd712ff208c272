"""The stand-in engine's pure parts (conductor/sim/engine): vLLM's prefix-cache rules, its
scheduling, the block hashes its KV events carry, the cost model, the fault flags."""
from __future__ import annotations

import importlib.util

import pytest

from conductor.sim.engine.engine import parse_fault
from conductor.sim.engine.hashing import external, none_hash, store_keys, vllm_block_hashes
from conductor.sim.engine.prefix_cache import BlockPool
from conductor.sim.engine.profile import H100_LLAMA3_8B, Chunk, get_profile
from conductor.sim.engine.scheduler import LOADING, RUNNING, Request, Scheduler
from conductor.sim.engine.store_link import block_bytes, fingerprint_for

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")
ROOT = none_hash("vllm-none-hash")


def small(**fields):
    return H100_LLAMA3_8B.with_overrides(block_size=4, **fields)


def request(rid: str, prompt: list[int], max_tokens: int = 2, **kw) -> Request:
    return Request(rid, list(prompt), max_tokens, 0.0, **kw)


def run(scheduler: Scheduler, steps: int = 100) -> list:
    finished = []
    for _ in range(steps):
        step = scheduler.schedule()
        if not step.scheduled:
            break
        finished += scheduler.complete(step)
    return finished


# ------------------------------------------------------------------ hashes
@needs_vllm
def test_block_hashes_are_vllms_own():
    """Kills: hashing blocks some other way than vLLM's sha256 over (parent, tokens, extra keys) from
    NONE_HASH, or publishing the wrong 64 bits (vllm-router's kv_aware keys on them)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    tokens = list(range(100, 116))
    ours = vllm_block_hashes(tokens, 4, None, 0, none_hash(), cache_salt="s")
    parent = None
    for i in range(4):
        extra = (("cache_salt", "s"),) if i == 0 else None
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[4 * i:4 * i + 4], extra)
        assert ours[i] == parent
    assert external(ours[-1]) == kv_cache_utils.maybe_convert_block_hash(ours[-1])


def test_a_chain_continues_where_it_stopped():
    """Kills: hashing the blocks a step adds without their parent (output blocks would collide)."""
    tokens = list(range(40))
    whole = vllm_block_hashes(tokens, 4, None, 0, ROOT)
    head = vllm_block_hashes(tokens[:16], 4, None, 0, ROOT)
    tail = vllm_block_hashes(tokens[16:], 4, head[-1], 4, ROOT)
    assert head + tail == whole and len(set(whole)) == 10


def test_store_keys_are_the_connectors():
    """Kills: keying the pool differently from the kvstore connector (engines with the connector and
    stand-ins would never share a block), or a tail key for a 1-token tail (the connector has none)."""
    from kvstore.keys import encode_extra_keys
    from kvstore.keys import chain_hashes, tail_hash

    fp = fingerprint_for(small(), 16384)
    tokens = list(range(50, 61))  # 2 full blocks of 4, a tail of 3
    full, tail = store_keys(fp, tokens, "salt")
    extras = [encode_extra_keys((("cache_salt", "salt"),))]
    assert full == chain_hashes(fp, tokens, extras=extras)
    assert tail == tail_hash(fp, tokens[8:], full[-1], None)
    assert store_keys(fp, tokens[:9])[1] is None


def test_block_bytes_depend_on_key_and_position():
    """Kills: block contents that a swapped or shifted block would pass (every load is checked)."""
    import numpy as np

    position = ((np.arange(64, dtype=np.uint32) * 131) >> 3).astype(np.uint8)
    a, b = block_bytes(b"a" * 16, 64, position), block_bytes(b"b" * 16, 64, position)
    assert not np.array_equal(a, b)
    assert not np.array_equal(a[:32], a[32:])


# ------------------------------------------------------------------ the prefix cache
def test_hit_leaves_one_token_to_compute():
    """Kills: a hit of the whole prompt (vLLM caps hits at n - 1 tokens, whole blocks)."""
    pool = BlockPool(16)
    s = Scheduler(small(), pool, ROOT)
    s.add(request("a", range(8), 1))
    run(s)
    again = request("b", range(8), 1)
    s.add(again)
    s.schedule()
    assert again.local_hit_tokens == 4  # (8 - 1) // 4 blocks
    s2 = Scheduler(small(), pool, ROOT)
    longer = request("c", range(9), 1)
    s2.add(longer)
    s2.schedule()
    assert longer.local_hit_tokens == 8


def test_lru_evicts_unreferenced_blocks_tail_first():
    """Kills: evicting a request's head before its tail, or evicting blocks still in use."""
    pool = BlockPool(4)
    s = Scheduler(small(num_gpu_blocks=4), pool, ROOT)
    s.add(request("a", range(100, 108), 1))  # two full blocks, then freed (reverse: tail first in line)
    run(s)
    pool.events.take()
    s.add(request("b", range(200, 208), 1))  # the 2 never-used blocks: nothing evicted
    run(s)
    events = pool.events.take()
    assert not [e for e in events if e[0] == "removed"]
    s.add(request("c", range(300, 304), 1))  # the LRU head now: a's tail block
    run(s)
    removed = [e[1][0] for e in pool.events.take() if e[0] == "removed"]
    head, tail = vllm_block_hashes(list(range(100, 108)), 4, None, 0, ROOT)
    assert tail in removed and head not in removed


def test_events_say_what_was_stored_removed_and_cleared():
    """Kills: BlockStored without the parent hash or the blocks' tokens (routers re-key from them)."""
    pool = BlockPool(8)
    s = Scheduler(small(num_gpu_blocks=8), pool, ROOT)
    s.add(request("a", range(9), 1))
    run(s)
    stored = [e for e in pool.events.take() if e[0] == "stored"]
    assert stored[0][1] == vllm_block_hashes(list(range(8)), 4, None, 0, ROOT)
    assert stored[0][2] is None and stored[0][3] == list(range(8))
    assert pool.reset() and pool.events.take() == [("cleared",)]


# ------------------------------------------------------------------ scheduling
def test_chunked_prefill_shares_the_budget_with_decodes():
    """Kills: a prefill taking more than max_num_batched_tokens, or decodes waiting behind a prefill."""
    s = Scheduler(small(max_num_batched_tokens=10, num_gpu_blocks=64), BlockPool(64), ROOT)
    s.add(request("short", range(3), 5))
    step = s.schedule()
    s.complete(step)
    s.add(request("long", range(1000, 1030), 1))
    step = s.schedule()
    assert [(r.rid, n) for r, n in step.scheduled] == [("short", 1), ("long", 9)]
    assert step.decodes == 1 and step.prefill == [Chunk(9, 0)]


def test_fifo_admission_stops_at_the_first_request_that_does_not_fit():
    """Kills: admitting a later, smaller request past one that waits for blocks (vLLM is FCFS)."""
    s = Scheduler(small(num_gpu_blocks=4, max_num_batched_tokens=100), BlockPool(4), ROOT)
    s.add(request("big", range(20), 1))  # 6 blocks: never fits now
    s.add(request("small", range(40, 43), 1))
    step = s.schedule()
    assert step.scheduled == [] and [r.rid for r in s.waiting] == ["big", "small"]


def test_a_request_out_of_blocks_preempts_the_last_running():
    """Kills: running out of KV blocks without preempting (or preempting the oldest request)."""
    s = Scheduler(small(num_gpu_blocks=4, max_num_batched_tokens=100), BlockPool(4), ROOT)
    first, second = request("first", range(7), 8), request("second", range(50, 57), 8)
    s.add(first)
    s.add(second)
    s.complete(s.schedule())  # both prefilled: 2 blocks each, all 4 used
    s.complete(s.schedule())  # token 8 of each: still in their second blocks
    step = s.schedule()  # first needs a third block: second goes
    assert second in step.preempted and second.status != RUNNING and s.stats["preemptions"] == 1
    assert [r.rid for r, _ in step.scheduled] == ["first"] and s.waiting[0] is second


class FakeConnector:
    def __init__(self, tokens: int) -> None:
        self.tokens, self.loads, self.saves = tokens, [], []

    def matched_tokens(self, request, local_tokens):
        return max(0, self.tokens - local_tokens)

    def start_load(self, request, local_tokens, tokens):
        self.loads.append((request.rid, local_tokens, tokens))

    def save(self, request, start, end, tail):
        self.saves.append((start, end, tail))


def test_connector_hits_load_async_then_the_rest_is_computed():
    """Kills: computing tokens the connector holds, or running a request before its load ends."""
    conn = FakeConnector(8)
    s = Scheduler(small(num_gpu_blocks=16), BlockPool(16), ROOT, conn)
    r = request("a", range(11), 1)
    s.add(r)
    assert s.schedule().scheduled == [] and r.status == LOADING and conn.loads == [("a", 0, 8)]
    s.loaded(r, 8)
    step = s.schedule()
    assert step.scheduled == [(r, 3)] and step.prefill == [Chunk(3, 8)]
    s.complete(step)
    assert s.stats["external_hits"] == 8 and conn.saves == [(0, 2, True)]


class HandOff:
    """A P/D decode's connector: the prefill's KV of all but the last prompt token, loaded async."""

    def __init__(self) -> None:
        self.pending: list[tuple[Request, int]] = []

    def matched_tokens(self, request, local_tokens):
        if request.kv_params is None:  # not a P/D decode
            return 0
        return max(0, request.num_prompt - 1 - local_tokens)

    def start_load(self, request, local_tokens, tokens):
        self.pending.append((request, tokens))

    def save(self, request, start, end, tail):
        pass


def serve_pd_decodes(num_blocks: int, count: int, prompt: int, max_tokens: int, steps: int = 400) -> list[Request]:
    """`count` P/D decode requests on `num_blocks` blocks of 4; each load lands the step after it starts."""
    conn = HandOff()
    s = Scheduler(small(num_gpu_blocks=num_blocks, max_num_batched_tokens=64), BlockPool(num_blocks), ROOT, conn)
    reqs = [request(f"r{i}", range(100 * i, 100 * i + prompt), max_tokens, kv_params={"kvstore": {}})
            for i in range(count)]
    for r in reqs:
        s.add(r)
    for _ in range(steps):
        landed, conn.pending = conn.pending, []
        for r, tokens in landed:
            s.loaded(r, tokens)
        s.complete(s.schedule())
    return reqs


def test_pd_decodes_that_preempt_each_other_never_deadlock():
    """Kills: one FIFO waiting queue for every waiting request (the stand-in's P/D stall): a preempted
    decode at its head, holding no blocks, stops admission while the loaded requests behind it hold
    the blocks it waits for; vLLM drains its block-holding waiting requests first."""
    reqs = serve_pd_decodes(num_blocks=6, count=4, prompt=7, max_tokens=12)  # one alone fits (5 blocks)
    assert [r.finished_reason for r in reqs] == ["length"] * 4
    assert sum(r.preemptions for r in reqs) > 0  # the case this is about: decodes grew and preempted


def test_async_loads_leave_room_for_the_prompts_in_flight():
    """Kills: starting an async load whenever its own blocks are free: three loads take all six
    blocks, and none can get the block its last prompt token needs (vLLM admits a load only into
    the free blocks less what the other in-flight prefills still need)."""
    reqs = serve_pd_decodes(num_blocks=6, count=3, prompt=9, max_tokens=8)
    assert [r.finished_reason for r in reqs] == ["length"] * 3


def test_a_loaded_request_is_admitted_before_a_preempted_one():
    """Kills: a loaded request queued behind a preempted one (vLLM schedules block holders first)."""
    conn = HandOff()
    s = Scheduler(small(num_gpu_blocks=64), BlockPool(64), ROOT, conn)
    loaded, preempted = request("loaded", range(9), 2, kv_params={}), request("pre", range(50, 57), 2)
    s.add(loaded)
    s.schedule()  # its load starts
    s.waiting.appendleft(preempted)  # as _preempt leaves a victim: at the head, no blocks
    s.loaded(loaded, 8)
    step = s.schedule()
    assert [r.rid for r, _ in step.scheduled] == ["loaded", "pre"]


# ------------------------------------------------------------------ the cost model
def test_roofline_prefill_and_decode():
    """Kills: a cost model where longer prompts or bigger batches cost less, or decode is compute-bound."""
    p = get_profile("h100-llama3-8b")
    assert 20 < p.prefill_ms(1000, 1000) < p.prefill_ms(4000, 4000) < p.prefill_ms(16000, 16000)
    assert p.prefill_ms(100, 4000) < p.prefill_ms(4000, 4000)  # a cached prefix is not recomputed
    one, many = p.step_ms([], [1000]), p.step_ms([], [1000] * 64)
    assert 5 < one < 10 and one < many < 64 * one  # batching amortizes the weight reads
    assert p.transfer_ms(10_000) == pytest.approx(1.0 + 10_000 * 131072 / 40e9 * 1e3)


def test_cost_model_matches_the_routers_view():
    """Kills: the gateway and simulator predicting prefills with other costs than the engines run."""
    from conductor.cost import CostModel

    p = get_profile("h100-llama3-8b")
    cost = CostModel.from_dict(p.cost_model())
    for n in (500, 4000, 8000):  # one chunk each: the roofline's compute side
        assert cost.prefill_ms(n, n) == pytest.approx(p.step_ms([Chunk(n, 0)]) - p.step_overhead_ms, rel=0.02)


# ------------------------------------------------------------------ flags
@pytest.mark.parametrize("spec, says", [("melt:0:1", "kind must be one of"), ("slow:0", "expected slow:ENGINE:FACTOR"),
                                        ("error:0:2", "RATE must be between"), ("down:x:1", "ENGINE must be an integer"),
                                        ("slow:0:0", "FACTOR must be above 0")])
def test_bad_fault_specs_say_what_is_wrong(spec, says):
    """Kills: a mistyped --fault silently ignored (a fault run without its fault)."""
    with pytest.raises(ValueError, match=says):
        parse_fault(spec, {})
