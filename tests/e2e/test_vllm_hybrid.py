"""Hybrid models under vLLM's real Scheduler with its hybrid KV cache manager on (model outputs
mocked): a sliding-window group and a full-attention group, as gpt-oss and Gemma lay out their
layers. Each group is its own key namespace; the sliding-window group saves every block it
computes and loads only the ones inside the window vLLM keeps; a prefix counts only when every
group can serve it; a failed load is reported per request; P/D hands every group over.

Where a test names a broken variant ("Kills: ..."), that variant was applied to a throwaway copy
of the tree and the test failed on it."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvstore.integrations.vllm.groups import NULL_BLOCK  # noqa: E402
from kvstore.integrations.vllm.request_keys import request_keys  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from vllm_harness import BLOCK, HEAD, HEADS, Harness, full_spec, layer_names  # noqa: E402
from vllm_harness import close_harness_stores  # noqa: E402,F401 - autouse: each test closes its stores

WINDOW = 2 * BLOCK
SLIDING_LAYER, FULL_LAYER = layer_names(2)
SW, FULL = 0, 1  # group indexes


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("hybrid-model")))


def hybrid(model: str, **extra) -> Harness:
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                               sliding_window=WINDOW)
    h = Harness(model, groups=[(window, [SLIDING_LAYER]), (full_spec(), [FULL_LAYER])], **extra)
    assert not h.config.scheduler_config.disable_hybrid_kv_cache_manager  # vLLM kept HMA on with the connector
    assert len(h.scheduler.kv_cache_config.kv_cache_groups) == 2
    return h


def tables(h: Harness, req_id: str) -> tuple[list[int], ...]:
    return h.scheduler.kv_cache_manager.get_block_ids(req_id)


def wait_running(h: Harness, request: Request, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while request.status != RequestStatus.RUNNING and time.monotonic() < deadline and not request.is_finished():
        h.step()
        time.sleep(0.005)


def keys_of(h: Harness, prompt: list[int]) -> list[bytes]:
    full, tail = request_keys(h.scheduler.connector._chain, Request("k", prompt, SamplingParams(), None))
    return full + ([tail] if tail else [])


PROMPT = list(range(5, 5 + 6 * BLOCK + 5))  # 6 full blocks and a 5-token tail: 7 keys


def test_each_group_saves_its_blocks_and_a_load_restores_only_the_window_vllm_keeps(model):
    """Kills: loading a sliding-window group's null entries (the blocks before the window), and
    one key namespace for every group (the groups' blocks stored under each other's keys)."""
    h = hybrid(model, sync_load_blocks=0)
    torch.manual_seed(0)
    for tensor in h.kv_caches.values():  # "the forward pass": every slot distinct
        tensor.copy_(torch.randn(tensor.shape))
    h.add("r1", PROMPT)
    h.step()
    saved = tables(h, "r1")
    expected = {layer: [h.block(layer, b).clone() for b in saved[g][:7]] for g, layer in ((SW, SLIDING_LAYER),
                                                                                           (FULL, FULL_LAYER))}
    h.run_until_empty()
    assert h.worker.totals.data["saved_blocks"] == 14  # 7 blocks in each group
    for tensor in h.kv_caches.values():
        tensor.zero_()
    h.scheduler.reset_prefix_cache()
    request = h.add("r2", PROMPT)
    wait_running(h, request)
    loaded = tables(h, "r2")
    # 100 tokens come from the store: the full group needs all 7 blocks, the sliding-window group
    # only the blocks token 100 attends (69..99: blocks 4, 5, 6); vLLM holds null for 0..3.
    assert loaded[SW][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in loaded[SW][4:7]
    assert h.worker.totals.data["loaded_blocks"] == 7 + 3
    assert h.worker.totals.data["hit_tokens"] == len(PROMPT) - 1
    for i in range(7):
        assert torch.equal(h.block(FULL_LAYER, loaded[FULL][i]), expected[FULL_LAYER][i])
    for i in range(4, 7):
        assert torch.equal(h.block(SLIDING_LAYER, loaded[SW][i]), expected[SLIDING_LAYER][i])
    assert not h.errors and not h.failed_requests
    h.run_until_empty()


def test_a_prefix_counts_only_when_every_group_can_serve_it(model):
    """The full group holds every block, the sliding-window group lacks block 5: a load of 100 or
    96 tokens would need it, one of 80 tokens needs blocks 3 and 4 only (and nothing before the
    window). Kills: counting the prefix the full-attention group holds."""
    h = hybrid(model)
    keys = keys_of(h, PROMPT)
    h.seed_store(PROMPT, 7, hashes=keys, group=FULL)
    h.seed_store(PROMPT, 2, hashes=[keys[3], keys[4]], group=SW)  # no block before the window, no block 5
    connector = h.scheduler.connector
    assert connector.get_num_new_matched_tokens(Request("a", PROMPT, SamplingParams(), None), 0) == (5 * BLOCK, True)
    h.seed_store(PROMPT, 2, hashes=[keys[5], keys[6]], group=SW)
    connector._requests.clear()
    assert connector.get_num_new_matched_tokens(Request("b", PROMPT, SamplingParams(), None), 0)[0] == len(PROMPT) - 1


def test_a_failed_hybrid_load_is_recomputed_per_request(model):
    """vLLM refuses block-level load errors (invalid_block_ids) for models with several KV cache
    groups (it raises); failures go per request (failed_recving) and the request recomputes.
    Kills: reporting a hybrid model's failed blocks as invalid_block_ids."""
    h = hybrid(model)
    keys = keys_of(h, PROMPT)
    h.seed_store(PROMPT, 7, hashes=keys, group=FULL)
    h.seed_store(PROMPT, 3, hashes=keys[4:7], group=SW)
    daemon_store = h.store.daemon.store
    for _, slot in daemon_store.keys():  # the bytes rot under the index: every checksum must fail
        daemon_store.dram.region.buffer[slot.offset: slot.offset + 64] = bytes(64)
    request = h.add("r1", PROMPT)
    h.run_until_empty()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.failed_requests == {"r1"} and not h.errors
    assert h.worker.totals.data["load_failures"] == 10


def test_prefill_and_decode_hand_every_group_over(model):
    """Kills: a decode that loads one group's blocks only (the other group's attention would read
    whatever its blocks held)."""
    prefill = hybrid(model, role="kv_producer", process_local=True)
    torch.manual_seed(1)
    for tensor in prefill.kv_caches.values():
        tensor.copy_(torch.randn(tensor.shape))
    prefill.scheduler.add_request(Request("p1", PROMPT, SamplingParams(
        temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}), None,
        block_hasher=prefill.block_hasher))
    expected: dict[int, list[torch.Tensor]] = {}

    def capture(name: str, tensor: torch.Tensor) -> None:  # during the forward: the request still holds its blocks
        if not expected:
            produced = tables(prefill, "p1")
            expected.update({g: [prefill.block(layer, b).clone() for b in produced[g][:7]]
                             for g, layer in ((SW, SLIDING_LAYER), (FULL, FULL_LAYER))})

    prefill.step(before_layer=capture)
    prefill.run_until_empty()
    params = {o.request_id: o.kv_transfer_params for outs in prefill.outputs for eco in outs.values()
              for o in eco.outputs if o.finished}["p1"]
    assert params["kvstore"]["num_tokens"] == len(PROMPT) - 1 and "mac" in params["kvstore"]
    decode = hybrid(model, role="kv_consumer", process_local=True, metadata=prefill.url)
    request = Request("d1", PROMPT, SamplingParams(temperature=0, max_tokens=2,
                                                   extra_args={"kv_transfer_params": params}), None,
                      block_hasher=decode.block_hasher)
    decode.scheduler.add_request(request)
    wait_running(decode, request)
    loaded = tables(decode, "d1")
    for i in range(7):
        assert torch.equal(decode.block(FULL_LAYER, loaded[FULL][i]), expected[FULL][i])
    for i in range(4, 7):
        assert torch.equal(decode.block(SLIDING_LAYER, loaded[SW][i]), expected[SW][i])
    assert decode.worker.totals.data["hit_tokens"] == len(PROMPT) - 1
    decode.run_until_empty()


def test_kv_events_carry_the_group_and_its_kind(model):
    """Kills: events that name group 0 and full attention for every block (a router would count a
    sliding-window block as a full-attention prefix)."""
    h = hybrid(model)
    connector = h.scheduler.connector
    events: list = []
    take_events = connector.take_events
    connector.take_events = lambda: (lambda taken: (events.extend(taken), taken)[1])(list(take_events()))
    h.add("r1", PROMPT)
    h.run_until_empty()
    deadline = time.monotonic() + 5
    while len([e for e in events if type(e).__name__ == "BlockStored"]) < 12 and time.monotonic() < deadline:
        connector.take_events()
        time.sleep(0.01)
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
    assert kinds == {(SW, "sliding_window", WINDOW), (FULL, "full_attention", None)}
    assert len(stored) == 12  # 6 full blocks per group (the partial tail is not announced)
    keys = keys_of(h, PROMPT)
    assert sorted(e.block_hashes[0] for e in stored if e.group_idx == FULL) == sorted(keys[:6])
    assert np.unique([e.block_size for e in stored]).tolist() == [BLOCK]


def test_a_model_of_sliding_window_layers_only_loads_just_its_window(model):
    """Mistral-7B-v0.1 style: every layer slides, one group. Its fingerprint names the group (a
    full-size cache of the same model, HMA off, is other bytes), and a load restores only the window."""
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                               sliding_window=WINDOW)
    h = Harness(model, groups=[(window, layer_names(2))], sync_load_blocks=0)
    assert "sliding_window" in h.worker.group_fingerprints[0].kv_layout
    h.add("r1", PROMPT)
    h.run_until_empty()
    assert h.worker.totals.data["saved_blocks"] == 7
    h.scheduler.reset_prefix_cache()
    request = h.add("r2", PROMPT)
    wait_running(h, request)
    assert tables(h, "r2")[0][:4] == [NULL_BLOCK] * 4
    assert h.worker.totals.data["loaded_blocks"] == 3 and h.worker.totals.data["hit_tokens"] == len(PROMPT) - 1
    h.run_until_empty()


def test_a_prefix_vllm_serves_itself_saves_no_block_the_window_dropped(model):
    """vLLM's own prefix cache serves a prompt's prefix: the sliding-window group then holds null
    entries (block 0, shared by every request) for the blocks before the window. Blocks the store
    lacks are saved only from the blocks vLLM holds. Kills: saving a null entry, whatever block 0
    holds, under the sliding-window group's key of that position (a later load restores it as KV)."""
    h = hybrid(model)
    torch.manual_seed(3)
    for tensor in h.kv_caches.values():
        tensor.copy_(torch.randn(tensor.shape))
    h.add("r1", PROMPT)
    h.run_until_empty()
    keys, window_fp = keys_of(h, PROMPT), h.worker.group_fingerprints[SW]
    # The store loses the sliding-window group's blocks (evicted, a node gone); vLLM keeps its own.
    assert h.store.remove(keys, fingerprint=window_fp) == 7
    assert h.store.mirror.wait_until(lambda m: not any(m.contains(window_fp, k) for k in keys), 5)
    saved_before = h.worker.totals.data["saved_blocks"]
    h.add("r2", PROMPT)
    h.step()
    held = tables(h, "r2")[SW]
    assert held[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in held[4:7]  # vLLM's own hit: 96 tokens
    h.run_until_empty()
    assert [h.store.mirror.contains(window_fp, k) for k in keys] == [False] * 4 + [True] * 3
    assert h.worker.totals.data["saved_blocks"] - saved_before == 3
