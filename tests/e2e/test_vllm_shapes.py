"""Deployment shapes where a KV connector can give silently wrong output, each under vLLM's real
Scheduler (model outputs mocked) on CPU tensors built with the shapes and strides vLLM uses:
GPU layouts, kernel-block splitting, LoRA/multimodal/cache-salt keys, pipeline stages, TP and P/D
on a process-local store, hybrid memory, partial blocks, stale KV after reset, KV events and
Prometheus series."""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import kvstore  # noqa: E402
from kvstore.errors import UnsupportedDeployment  # noqa: E402
from kvstore.integrations.vllm.connector import KVStoreConnector  # noqa: E402
from kvstore.integrations.vllm.fingerprint import all_rank_fingerprints, fingerprint_from_vllm  # noqa: E402
from kvstore.integrations.vllm.request_keys import request_hashes  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from kvstore.keys import ModelFingerprint  # noqa: E402
from vllm_harness import BLOCK, HEAD, HEADS, Harness, kv_cache_config, vllm_config  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
CHANNELS = 2 * HEAD


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("shapes-model")))


BACKINGS: dict[int, torch.Tensor] = {}  # data_ptr -> the LBNHC allocation behind the layer views


def lbnhc(num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's default GPU layout: one allocation [layer, block, token, head, channel], each layer seen
    as the logical [block, head, token, channel] — a block's slice is not contiguous."""
    backing = torch.zeros(len(LAYERS), num_blocks, BLOCK, HEADS, CHANNELS)
    BACKINGS[backing.data_ptr()] = backing
    return {name: backing[i].permute(0, 2, 1, 3) for i, name in enumerate(LAYERS)}


def flash_attention(num_blocks: int) -> dict[str, torch.Tensor]:
    """FlashAttention's per-layer [2 (K, V), block, token, head, head size]: K and V are two runs."""
    return {name: torch.zeros(2, num_blocks, BLOCK, HEADS, HEAD) for name in LAYERS}


def kernel_split(num_blocks: int) -> dict[str, torch.Tensor]:
    """An attention kernel with half the scheduler's block size: twice as many, half-size blocks."""
    return {name: torch.zeros(2 * num_blocks, HEADS, BLOCK // 2, CHANNELS) for name in LAYERS}


def wait_running(h: Harness, request, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while request.status != RequestStatus.RUNNING and time.monotonic() < deadline:
        h.step()
        time.sleep(0.005)
    assert request.status == RequestStatus.RUNNING


def physical_block(h: Harness, layer: int, block_id: int) -> torch.Tensor:
    """A block's bytes of one layer, read independently of the connector's geometry code."""
    tensor = h.kv_caches[LAYERS[layer]]
    backing = BACKINGS.get(h.kv_caches[LAYERS[0]].data_ptr())
    if backing is not None:
        return backing[layer, block_id].reshape(-1)  # [token, head, channel] of one block: contiguous
    if tensor.shape[0] == 2:  # FlashAttention: K run then V run
        return torch.cat([tensor[0, block_id].reshape(-1), tensor[1, block_id].reshape(-1)])
    ratio = tensor.shape[0] // h.num_blocks  # kernel blocks per scheduler block
    return tensor[block_id * ratio:(block_id + 1) * ratio].reshape(-1)


LOAD_MODES = {"async": {"sync_load_blocks": 0}, "in-step": {},
              "layer-by-layer": {"layerwise_load_blocks": 1}}


@pytest.mark.parametrize("mode", list(LOAD_MODES))
@pytest.mark.parametrize("caches", [lbnhc, flash_attention, kernel_split], ids=["LBNHC", "flash", "kernel-split"])
def test_loads_land_in_gpu_layouts_and_kernel_blocks(model, caches, mode):
    h = Harness(model, caches=caches, **LOAD_MODES[mode])
    prompt = list(range(3, 3 + 3 * BLOCK + 5))
    data = h.seed_store(prompt, 3)
    request = h.add("r1", prompt)
    wait_running(h, request)
    block_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0]
    per_layer = h.block_bytes() // 4 // len(LAYERS)
    for i in range(3):
        for layer in range(len(LAYERS)):
            landed = physical_block(h, layer, block_ids[i])
            assert torch.equal(landed, torch.from_numpy(data[i][layer * per_layer:(layer + 1) * per_layer]))
    # Only the layer-by-layer load leaves the forward pass anything to wait for, layer by layer.
    assert (h.worker.totals.data.get("layer_wait_seconds", 0) > 0) == (mode == "layer-by-layer")
    assert h.worker.totals.data["loaded_blocks"] == 3 and not h.errors
    h.run_until_empty()


def block_major(num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout, two layers: [block, head, token, channel]."""
    return {name: torch.zeros(num_blocks, HEADS, BLOCK, CHANNELS) for name in LAYERS}


def test_layer_by_layer_loads_leave_the_new_token_kv_the_forward_wrote(model, monkeypatch):
    """vLLM writes a layer's new-token KV into the last, partly loaded block before that layer waits
    for its load: a load landing afterwards would overwrite it (or fail its checksum)."""
    h = Harness(model, caches=block_major, layerwise_load_blocks=1)
    prompt = list(range(9, 9 + 2 * BLOCK + 5))
    h.add("r1", prompt)
    h.run_until_empty()
    h.scheduler.reset_prefix_cache()
    read = h.worker._read

    def slow_read(blocks, progress=None):  # the forward runs ahead of the layer loads
        if progress is not None:
            time.sleep(0.3)
        return read(blocks, progress)

    monkeypatch.setattr(h.worker, "_read", slow_read)
    h.add("r2", prompt)
    last = {}

    def write_new_token(name: str, tensor: torch.Tensor) -> None:
        last[name] = h.scheduler.kv_cache_manager.get_block_ids("r2")[0][2]
        tensor[last[name]].fill_(7.0)

    h.step(before_layer=write_new_token)
    assert h.worker.totals.data["layer_wait_seconds"] > 0 and not h.errors
    assert h.worker.totals.data["hit_tokens"] == len(prompt) - 1
    for name, tensor in h.kv_caches.items():
        assert torch.all(tensor[last[name]] == 7.0)
    h.run_until_empty()


@pytest.mark.parametrize("caches", [lbnhc, flash_attention, kernel_split], ids=["LBNHC", "flash", "kernel-split"])
def test_saved_blocks_load_back_identical_in_gpu_layouts(model, caches):
    h = Harness(model, sync_load_blocks=0, caches=caches)
    torch.manual_seed(0)
    for tensor in h.kv_caches.values():  # "the forward pass": every slot holds distinct values
        tensor.copy_(torch.randn(tensor.shape))
    prompt = list(range(5, 5 + 2 * BLOCK + 3))
    h.add("r1", prompt)
    h.step()
    saved_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0][:3]  # 2 full blocks + the partial one
    expected = {i: [physical_block(h, i, b).clone() for b in saved_ids] for i in range(len(LAYERS))}
    h.run_until_empty()
    assert h.worker.totals.data["saved_blocks"] == 3
    for tensor in h.kv_caches.values():
        tensor.zero_()
    h.scheduler.reset_prefix_cache()  # vLLM's own cache is gone: the blocks must come from the store
    request = h.add("r2", prompt)
    wait_running(h, request)
    assert h.worker.totals.data["hit_tokens"] == len(prompt) - 1  # only the last token is left to compute
    loaded_ids = h.scheduler.kv_cache_manager.get_block_ids("r2")[0][:3]
    for i in range(len(LAYERS)):
        for want, b in zip(expected[i], loaded_ids):
            assert torch.equal(physical_block(h, i, b), want)
    h.run_until_empty()


def test_lora_multimodal_and_salt_are_part_of_the_key(model):
    h = Harness(model)
    connector = h.scheduler.connector
    prompt = list(range(7, 7 + 2 * BLOCK + 1))
    image = lambda ident: [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,  # noqa: E731
                                                 mm_position=PlaceholderRange(offset=4, length=8))]
    variants = {"plain": {}, "lora-a": {"lora_request": LoRARequest("a", 1, "/adapters/a")},
                "lora-b": {"lora_request": LoRARequest("b", 2, "/adapters/b")},
                "image-1": {"mm_features": image("img-1")}, "image-2": {"mm_features": image("img-2")},
                "salt": {"cache_salt": "tenant-7"}}
    from vllm import SamplingParams
    from vllm.v1.request import Request
    requests = {name: Request(name, prompt, SamplingParams(max_tokens=1), None, **kw) for name, kw in variants.items()}
    keys = {name: request_hashes(h.fingerprint, r) for name, r in requests.items()}
    assert len({tuple(k) for k in keys.values()}) == len(variants)  # every variant its own chain
    h.seed_store(prompt, 2, hashes=keys["lora-a"])  # KV computed under adapter a
    assert connector.get_num_new_matched_tokens(requests["lora-a"], 0)[0] == 2 * BLOCK
    for other in ("plain", "lora-b", "image-1", "salt"):
        assert connector.get_num_new_matched_tokens(requests[other], 0) == (0, False), other


def test_saves_carry_the_cache_salt_even_with_loading_off(model):
    h = Harness(model, load=False)
    prompt = list(range(9, 9 + 2 * BLOCK + 1))
    h.add("r1", prompt, cache_salt="tenant-9")
    h.run_until_empty()
    salted = request_hashes(h.fingerprint, SimpleNamespace(prompt_token_ids=prompt, cache_salt="tenant-9",
                                                           lora_request=None, mm_features=None, prompt_embeds=None))
    assert all(h.store.mirror.contains(h.fingerprint, k) for k in salted[:2])
    assert h.store.mirror.match(h.fingerprint, request_hashes(h.fingerprint, SimpleNamespace(
        prompt_token_ids=prompt, cache_salt=None, lora_request=None, mm_features=None, prompt_embeds=None))).length == 0


def _parallel_config(tp: int, pp: int, mla: bool = False) -> SimpleNamespace:
    model = SimpleNamespace(model="m", revision="", dtype="float16", tokenizer="t", use_mla=mla,
                            get_total_num_hidden_layers=lambda: 8, get_num_kv_heads=lambda p: 4,
                            get_head_size=lambda: 64)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                           device_config=SimpleNamespace(device_type="cuda"))


def test_pipeline_stages_and_tp_ranks_never_share_a_fingerprint():
    config = _parallel_config(tp=2, pp=2)
    stage0, stage1 = (fingerprint_from_vllm(config, 0, {}, pp) for pp in (0, 1))
    assert stage0.digest != stage1.digest  # two stages of 4 layers each: different layers, different blocks
    assert (stage0.layer_start, stage1.layer_start, stage0.num_layers) == (0, 4, 4)
    assert len({f.digest for f in all_rank_fingerprints(config)}) == 4
    # MLA: one latent cache for every TP rank, stored once per stage.
    mla = _parallel_config(tp=4, pp=1, mla=True)
    assert {f.digest for f in all_rank_fingerprints(mla)} == {fingerprint_from_vllm(mla, 3, {}, 0).digest}
    # Fingerprints without a pipeline keep the digests they always had.
    plain = ModelFingerprint("m", "float16", 16, 8, 4, 64)
    assert plain.canonical() == ModelFingerprint("m", "float16", 16, 8, 4, 64, pp_rank=0, pp_world_size=1).canonical()
    assert b"pp_rank" not in plain.canonical()


def test_scheduler_counts_only_blocks_every_rank_holds(model):
    h = Harness(model)
    connector = h.scheduler.connector
    other_rank = replace(h.fingerprint, tp_rank=1, tp_world_size=2)
    connector._rank_fingerprints = [h.fingerprint, other_rank]  # as on a TP=2 engine
    prompt = list(range(11, 11 + 3 * BLOCK + 1))
    h.seed_store(prompt, 3)  # rank 0 holds 3 blocks, rank 1 holds none
    from vllm import SamplingParams
    from vllm.v1.request import Request
    assert connector.get_num_new_matched_tokens(Request("x", prompt, SamplingParams(), None), 0) == (0, False)
    h.store.put_many([(k, np.zeros(h.block_bytes(), np.uint8)) for k in request_hashes(h.fingerprint, SimpleNamespace(
        prompt_token_ids=prompt, cache_salt=None, lora_request=None, mm_features=None, prompt_embeds=None))[:2]],
        fingerprint=other_rank)
    assert h.store.mirror.wait_until(lambda m: m.match(other_rank, connector._requests["x"].hashes).length == 2, 5)
    connector._requests.clear()
    assert connector.get_num_new_matched_tokens(Request("y", prompt, SamplingParams(), None), 0)[0] == 2 * BLOCK


def test_process_local_store_is_refused_where_it_cannot_be_shared(model):
    for role in ("kv_producer", "kv_consumer"):
        with pytest.raises(UnsupportedDeployment, match="etcd://"):
            KVStoreConnector(vllm_config(model, role), KVConnectorRole.SCHEDULER, kv_cache_config(8))
    config = vllm_config(model, "kv_both")
    config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(UnsupportedDeployment, match="TP/PP"):
        KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(8))
    # Explicitly in one process (the demo): allowed.
    KVStoreConnector(vllm_config(model, "kv_producer", process_local=True), KVConnectorRole.SCHEDULER,
                     kv_cache_config(8)).shutdown()


def test_hybrid_memory_is_refused_at_start(model):
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                               sliding_window=64)
    hybrid = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], window)])
    with pytest.raises(UnsupportedDeployment, match="hybrid"):
        KVStoreConnector(vllm_config(model), KVConnectorRole.SCHEDULER, hybrid)


def test_a_smaller_stored_block_is_not_a_hit():
    """A free-form block smaller than its destination is a miss, not half a block. Kills: a read
    that fills part of a larger buffer and calls it a hit. (Under a geometry fingerprint the size
    is refused up front: tests/integration/test_library_mode.py.)"""
    fp = ModelFingerprint("m", "float32", 4, 1, 1, 8, kv_layout="bytes")
    with kvstore.open("memory://partial-block", dram="16MiB", fingerprint=fp) as store:
        key = kvstore.chain_hashes(fp, [1, 2, 3, 4])[0]
        store.put_many([(key, np.full(4096, 7, np.uint8))])
        out = np.zeros(8192, np.uint8)
        assert store.get_many([key], [out]) == [False]  # half a block would be garbage in the second half
        exact = np.zeros(4096, np.uint8)
        assert store.get_many([key], [exact]) == [True] and (exact == 7).all()


def test_reset_cache_stops_serving_stale_kv(model):
    h = Harness(model)
    connector = h.scheduler.connector
    prompt = list(range(13, 13 + 2 * BLOCK + 1))
    h.seed_store(prompt, 2)
    from vllm import SamplingParams
    from vllm.v1.request import Request
    assert connector.get_num_new_matched_tokens(Request("a", prompt, SamplingParams(), None), 0)[0] == 2 * BLOCK
    assert connector.reset_cache() is True  # e.g. weights updated in place
    assert connector.get_num_new_matched_tokens(Request("b", prompt, SamplingParams(), None), 0) == (0, False)
    assert KVStoreConnector.requires_piecewise_for_cudagraph({}) is True  # saves run per layer


def test_saved_blocks_are_announced_as_kv_events_and_prometheus_series(model):
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    h = Harness(model)
    connector = h.scheduler.connector
    events: list = []
    take_events = connector.take_events

    def recording_take_events():  # vLLM's Scheduler takes them too, each step: keep every batch
        taken = list(take_events())
        events.extend(taken)
        return taken

    connector.take_events = recording_take_events
    prompt = list(range(17, 17 + 2 * BLOCK + 1))
    h.add("r1", prompt)
    h.run_until_empty()
    deadline = time.monotonic() + 5  # a block is announced once the index shows it
    stored: list = []
    while len(stored) < 2 and time.monotonic() < deadline:
        connector.take_events()
        stored = [e for e in events if type(e).__name__ == "BlockStored"]
        time.sleep(0.01)
    keys = request_hashes(h.fingerprint, SimpleNamespace(prompt_token_ids=prompt, cache_salt=None, lora_request=None,
                                                         mm_features=None, prompt_embeds=None))
    assert [e.block_hashes[0] for e in stored] == keys[:2]
    assert stored[1].parent_block_hash == keys[0] and stored[0].token_ids == prompt[:BLOCK]
    metrics = KVStoreConnector.build_prom_metrics(h.scheduler.vllm_config, {Gauge: Gauge, Counter: Counter,
                                                                           Histogram: Histogram},
                                                  ["engine"], {0: ["0"]})
    metrics.observe(h.worker.totals.data, 0)
    assert REGISTRY.get_sample_value("vllm:kvstore_saved_blocks_total", {"engine": "0"}) == 2
