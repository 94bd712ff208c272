"""Never wrong KV: a block's key carries everything that made its bytes (the weights loaded, an
adapter's weights, an image's content, max_model_len where rope reads it, the tail block's
extras), and the connector saves what each block holds and never loads what landed too late.
Each test runs under vLLM's real Scheduler (model outputs mocked, harness of vllm_harness) and
names the broken variant it kills; each was seen failing on it."""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstore.integrations.vllm.fingerprint import fingerprint_from_vllm  # noqa: E402
from kvstore.integrations.vllm.identity import VERSION_ENV  # noqa: E402
from kvstore.integrations.vllm.request_keys import request_hashes, request_keys  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from vllm_harness import BLOCK, Harness, image_feature, plain_request, vllm_config, write_adapter  # noqa: E402
from vllm_harness import close_harness_stores  # noqa: E402,F401 - autouse: each test closes its stores

PROMPT = list(range(7, 7 + 2 * BLOCK + 9))  # two full blocks and a 9-token tail


@pytest.fixture
def model(tmp_path):
    return build_tiny_model(str(tmp_path / "model"))


def rewrite_weights(model: str, seed: int, tmp: str) -> None:
    """A fine-tune redeployed in place: other weights, the same path and config."""
    other = build_tiny_model(os.path.join(tmp, f"seed-{seed}"), seed=seed)
    for name in os.listdir(other):
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(other, name), os.path.join(model, name))


def matched(h: Harness, request: Request) -> int:
    return h.scheduler.connector.get_num_new_matched_tokens(request, 0)[0] or 0


def test_weights_rewritten_at_one_path_start_another_chain(model, tmp_path):
    """The weights loaded are part of every key: an engine restarted with new weights at the same
    path never loads the old weights' KV, while two engines on the same files share. Kills: a
    chain that starts from the model path and config alone (the default configuration's silent
    wrong output)."""
    old = Harness(model)
    twin = Harness(model, metadata=old.url)
    assert twin.chain == old.chain  # the same files: the same chain, KV shared
    old.seed_store(PROMPT, 2)
    assert matched(twin, Request("twin", PROMPT, SamplingParams(), None)) == 2 * BLOCK
    rewrite_weights(model, 1, str(tmp_path))
    new = Harness(model, metadata=old.url)  # the same store
    assert new.fingerprint == old.fingerprint and new.chain != old.chain
    assert matched(new, Request("new", PROMPT, SamplingParams(), None)) == 0


def test_a_reset_reads_the_weights_version_when_it_happens(model, tmp_path, monkeypatch):
    """vLLM calls reset_cache() with no argument: the version is read at reset time from
    weight_version_file (or KVSTORE_WEIGHT_VERSION), so engines that reset to the same named
    version share, and a reset with nothing new shares with no one. Kills: a reset that only
    takes its argument (always random under vLLM), and one that keeps the old chain when nothing
    new was named."""
    version = tmp_path / "weights-version"
    version.write_text("step-1\n")
    a = Harness(model, weight_version_file=str(version)).scheduler.connector
    b = Harness(model, weight_version_file=str(version)).scheduler.connector
    assert a.chain == b.chain
    before = a.chain
    a.reset_cache()  # nothing new named: keyed to this process
    assert a.chain not in (before, b.chain)
    version.write_text("step-2\n")  # the RL loop pushed new weights and names them
    a.reset_cache(), b.reset_cache()
    assert a.chain == b.chain != before
    assert Harness(model, weight_version_file=str(version)).chain == a.chain  # a restart on step 2
    monkeypatch.setenv(VERSION_ENV, "step-3")
    c = Harness(model).scheduler.connector
    monkeypatch.setenv(VERSION_ENV, "step-4")
    c.reset_cache()
    assert c.chain == Harness(model).chain != a.chain


def test_longrope_engines_with_another_max_model_len_never_share(model):
    """vLLM picks LongRoPE's long or short factors from max_model_len (and dynamic/YaRN rope read
    the max_position some models set from it): it is part of such a model's fingerprint, and of
    no other's. Kills: a fingerprint blind to max_model_len."""
    def digest(rope: dict | None, max_len: int) -> str:
        config = vllm_config(model)
        config.model_config.hf_text_config.rope_scaling = rope
        object.__setattr__(config.model_config, "max_model_len", max_len)
        return fingerprint_from_vllm(config).digest

    long = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [4.0] * 32,
            "original_max_position_embeddings": 512}
    assert digest(long, 1024) != digest(long, 256)  # 1024 > 512: long factors; 256: short
    assert digest({"rope_type": "dynamic", "factor": 2.0}, 1024) != digest({"rope_type": "dynamic", "factor": 2.0}, 256)
    assert digest(None, 1024) == digest(None, 256)  # plain rope: engines of any length share
    assert digest({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 512}, 1024) == \
        digest({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512}, 256)


def test_an_adapter_retrained_in_place_never_shares_its_old_keys(model, tmp_path):
    """An adapter's key carries its weights' digest. Retrained in place (same name, same path):
    a restarted engine keys it anew; an engine that still runs the old one (vLLM loads an adapter
    once per id) neither saves nor loads for it until vLLM reloads it (load_inplace). Kills: an
    adapter keyed by name and path only."""
    path = write_adapter(str(tmp_path / "adapter"), seed=1)
    h = Harness(model)
    lora = lambda **kw: LoRARequest("support-bot", 1, path, **kw)  # noqa: E731
    request = lambda rid, **kw: Request(rid, PROMPT, SamplingParams(), None, lora_request=lora(**kw))  # noqa: E731
    old_keys = request_hashes(h.chain, request("a"), sources=h.scheduler.connector._sources)
    assert len(old_keys) == 2
    h.seed_store(PROMPT, 2, hashes=old_keys)
    assert matched(h, request("b")) == 2 * BLOCK
    time.sleep(0.01)  # a new mtime even on coarse clocks
    write_adapter(path, seed=2)  # retrained in place
    restarted = Harness(model, metadata=h.url)
    new_keys = request_hashes(restarted.chain, request("c"), sources=restarted.scheduler.connector._sources)
    assert len(new_keys) == 2 and new_keys != old_keys
    assert matched(restarted, request("d")) == 0
    h.scheduler.connector._requests.clear()
    assert request_keys(h.chain, request("e"), sources=h.scheduler.connector._sources) == ([], None)
    assert matched(h, request("f")) == 0  # still running the old adapter, or the new: unknown
    reloaded = request_keys(h.chain, request("g", load_inplace=True), sources=h.scheduler.connector._sources)
    assert reloaded[0] == new_keys


def test_an_image_is_keyed_by_its_content_never_by_a_client_uuid(model):
    """A multimodal item is keyed by a digest of its processed inputs. One the scheduler cannot
    see (vLLM's caches left it out) under a client's multi_modal_uuids entry is neither saved nor
    loaded, from its block on, unless the operator trusts identifiers. Kills: keying an item by
    vLLM's identifier (a reused uuid loads another image's KV)."""
    h = Harness(model)
    sources = h.scheduler.connector._sources
    prompt = list(range(9, 9 + 3 * BLOCK + 4))
    at = BLOCK + 3  # the image sits in block 1

    def keys(*features) -> tuple[list[bytes], bytes | None]:
        return request_keys(h.chain, plain_request(prompt, mm_features=list(features)), sources=sources)

    cat, dog = keys(image_feature("uuid-7", 1, at)), keys(image_feature("uuid-7", 2, at))
    assert cat[0][0] == dog[0][0] and cat[0][1:] != dog[0][1:]  # same uuid, other pixels: other KV
    assert keys(image_feature("uuid-8", 1, at)) == cat  # same pixels under another uuid: shared
    unseen = keys(image_feature("uuid-7", None, at))
    assert unseen == ([cat[0][0]], None)  # block 0 keyed; from the image's block on, nothing
    trusting = Harness(model, trust_multimodal_identifiers=True)
    trusted = request_keys(trusting.chain, plain_request(prompt, mm_features=[image_feature("uuid-7", None, at)]),
                           sources=trusting.scheduler.connector._sources)
    assert len(trusted[0]) == 3  # the operator's opt-in: keyed by the identifier
    # Another engine's KV stored under the uuid (a trusting engine saved it): never loaded here,
    # and this engine would save only the block before the image.
    h.seed_store(prompt, 3, hashes=trusted[0])
    request = Request("r1", prompt, SamplingParams(), None, mm_features=[image_feature("uuid-7", None, at)])
    assert matched(h, request) == BLOCK  # the block before the image only
    assert len(h.scheduler.connector._state(request).keys) == 1


def test_extras_only_in_the_tail_block_key_the_tail(model, tmp_path):
    """The trailing partial block is keyed with its own extras: an image only in the tail, a
    prompt shorter than a block with a salt or an adapter. Kills: a tail key without its extras
    (the same tail tokens under another image, salt or adapter load the first one's KV)."""
    h = Harness(model)
    sources = h.scheduler.connector._sources
    tail_at = 2 * BLOCK + 2  # the image lies inside the 9-token tail
    with_image = lambda seed: plain_request(PROMPT, mm_features=[image_feature(f"img-{seed}", seed, tail_at, 4)])  # noqa: E731
    full_a, tail_a = request_keys(h.chain, with_image(1), sources=sources)
    full_b, tail_b = request_keys(h.chain, with_image(2), sources=sources)
    assert full_a == full_b and tail_a is not None and tail_a != tail_b
    h.store.put_many([(k, np.zeros(h.block_bytes(), np.uint8)) for k in full_a + [tail_a]], fingerprint=h.fingerprint)
    assert h.store.mirror.wait_until(lambda m: m.contains(h.fingerprint, tail_a), 5)
    image = lambda seed: [image_feature(f"img-{seed}", seed, tail_at, 4)]  # noqa: E731
    assert matched(h, Request("a", PROMPT, SamplingParams(), None, mm_features=image(1))) == len(PROMPT) - 1
    assert matched(h, Request("b", PROMPT, SamplingParams(), None, mm_features=image(2))) == 2 * BLOCK
    short = PROMPT[:BLOCK // 2]  # a prompt shorter than one block: its only key is a tail key
    adapter = write_adapter(str(tmp_path / "adapter"), seed=3)
    tails = {name: request_keys(h.chain, plain_request(short, **kw), sources=sources)[1] for name, kw in {
        "plain": {}, "salt-a": {"cache_salt": "a"}, "salt-b": {"cache_salt": "b"},
        "lora": {"lora_request": LoRARequest("x", 1, adapter)}}.items()}
    assert None not in tails.values() and len(set(tails.values())) == 4


def test_a_mid_prefill_preemption_saves_what_each_block_holds(model):
    """A long prompt is preempted mid-prefill (chunked prefill, a small KV cache): its blocks are
    freed and it resumes with another block table. Every block saved must hold that block's own
    KV. The forward here writes into each block a value derived from its key, so the store's
    bytes can be checked block by block. Kills: saves after the preemption reading the freed
    block ids (the old table, extended instead of replaced)."""
    # 7 usable blocks, 20 tokens a step: r1 (4 blocks and 5 tokens) is admitted while r0 decodes;
    # r0 then takes a block r1's prefill needs, and r1 is preempted mid-prefill.
    h = Harness(model, num_blocks=8, batch_tokens=20)
    prompts = {"r0": list(range(500, 500 + 2 * BLOCK - 2)), "r1": list(range(20, 20 + 4 * BLOCK + 5))}
    keys = {rid: request_hashes(h.chain, plain_request(p)) for rid, p in prompts.items()}
    requests = {rid: h.add(rid, p, max_tokens=40 if rid == "r0" else 2) for rid, p in prompts.items()}
    value = lambda key: float(int.from_bytes(key[:3], "little") % 99991 + 1)  # noqa: E731

    def forward(out) -> None:  # the KV each computed block ends up with: its key's value
        for rid in out.num_scheduled_tokens:  # schedule() already counted this step's tokens as computed
            done = min(requests[rid].num_computed_tokens, len(prompts[rid]))
            table = h.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            for i in range(done // BLOCK):
                for name in h.kv_caches:
                    h.block(name, table[i]).fill_(value(keys[rid][i]))

    mid_prefill = False
    deadline = time.monotonic() + 30
    while h.scheduler.has_requests() and time.monotonic() < deadline:
        computed, preemptions = requests["r1"].num_computed_tokens, requests["r1"].num_preemptions
        h.step(forward=forward)
        mid_prefill |= requests["r1"].num_preemptions > preemptions and computed < len(prompts["r1"])
    assert mid_prefill, "the test needs r1 preempted mid-prefill"
    assert h.worker.flush_saves(10)
    stored = [k for k in keys["r1"] if h.store.mirror.contains(h.fingerprint, k)]
    assert len(stored) == 4  # every full block of r1, before and after its preemption
    for key in stored:
        out = np.empty(h.block_bytes(), np.uint8)
        assert h.store.get_many([key], [out], fingerprint=h.fingerprint) == [True]
        assert np.all(out.view(np.float32) == value(key)), "a saved block holds another block's KV"


def test_a_layer_load_that_lands_after_its_deadline_inside_the_step_is_still_failed(model, monkeypatch):
    """The forward gave up on layer 0 (its deadline passed) and went on; the load then lands
    while the step is still running (layer 1 computes). The step's blocks must be reported
    failed, and the late load must not write into the cache. Kills: a failure forgotten because
    the load completed before the step ended, and a late write that lands inside the step."""
    h = Harness(model, layers=2, layerwise_load_blocks=1, layer_load_timeout_s=0.3)
    prompt = list(range(40, 40 + 3 * BLOCK))
    h.seed_store(prompt, 3)
    get_many = h.store.get_many
    landed = []

    def late_get_many(*args, **kwargs):  # lands 0.6 s in: after layer 0's deadline, inside the step
        if kwargs.get("on_stage") is not None:
            time.sleep(0.6)
            result = get_many(*args, **kwargs)
            landed.append(time.monotonic())
            return result
        return get_many(*args, **kwargs)

    monkeypatch.setattr(h.store, "get_many", late_get_many)
    request = h.add("r1", prompt)
    names = list(h.kv_caches)

    def compute(name: str, tensor: torch.Tensor) -> None:
        for block_id in h.scheduler.kv_cache_manager.get_block_ids("r1")[0][:2]:
            h.block(name, block_id).fill_(-3.0)  # what this forward holds in the blocks
        if name == names[1]:  # layer 1 computes until the load has landed
            end = time.monotonic() + 5
            while not landed and time.monotonic() < end:
                time.sleep(0.01)
            assert landed, "the load never landed inside the step"

    h.step(before_layer=compute)
    ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0][:2]
    assert set(ids) <= h.errors, (ids, h.errors)
    for name in names:
        for block_id in ids:
            assert torch.all(h.block(name, block_id) == -3.0), "the late load wrote into the cache"
    assert request.num_computed_tokens < len(prompt)  # the step's output was dropped
    monkeypatch.setattr(h.store, "get_many", get_many)
    h.run_until_empty()
