"""Deployment shapes where a KV connector can give silently wrong output, each under vLLM's real
Scheduler (model outputs mocked) on CPU tensors laid out by vLLM's own allocator: every KV cache
layout, kernel-block splitting, LoRA/multimodal/prompt-embeds/cache-salt keys, partial blocks,
pipeline stages and ranks, TP and P/D on a process-local store, context parallelism, unsupported
KV cache groups, stale KV after a weight update, config the fingerprint must cover, layout
mismatches, late layer-by-layer loads, KV events and Prometheus series.

Where a test names a broken variant ("Kills: ..."), that variant was applied to a throwaway copy
of the tree and the test failed on it."""
from __future__ import annotations

import time
import uuid
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import kvstore  # noqa: E402
from kvstore.errors import UnsupportedDeployment, UnsupportedKVLayout  # noqa: E402
from kvstore.index.host_mirror import HostIndexMirror  # noqa: E402
from kvstore.integrations.vllm import parallel  # noqa: E402
from kvstore.integrations.vllm.connector import KVStoreConnector  # noqa: E402
from kvstore.integrations.vllm.fingerprint import all_rank_fingerprints, fingerprint_from_vllm  # noqa: E402
from kvstore.integrations.vllm.kv_cache_io import KVCacheIO  # noqa: E402
from kvstore.integrations.vllm.request_keys import request_hashes, request_keys  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from kvstore.keys import ModelFingerprint  # noqa: E402
from vllm_harness import (BLOCK, HEAD, HEADS, Harness, allocate, fake_backend, full_spec, kv_cache_config,  # noqa: E402
                          image_feature, layer_names, physical_bytes, plain_request, vllm_config, write_adapter)
from vllm_harness import close_harness_stores  # noqa: E402,F401 - autouse: each test closes its stores

LAYERS = layer_names(2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("shapes-model")))


def wait_running(h: Harness, request, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while request.status != RequestStatus.RUNNING and time.monotonic() < deadline:
        h.step()
        time.sleep(0.005)
    assert request.status == RequestStatus.RUNNING


def layer_bytes(h: Harness, name: str, block_id: int) -> torch.Tensor:
    """One layer's bytes of one scheduler block, in storage order (independent of the connector)."""
    return physical_bytes(h.block(name, block_id))


# vLLM's layouts: the CPU's LBHNC, GPU ones (LBNHC: a block's [H, N, C] permuted, not contiguous;
# BLNHC/BLHNC: every layer of a block side by side; LHBNC: heads outside blocks, one run per head),
# and a kernel that splits each 16-token block into two 8-token kernel blocks.
LAYOUTS = {"LBHNC": ("LBHNC", None), "LBNHC": ("LBNHC", None), "BLNHC": ("BLNHC", None), "BLHNC": ("BLHNC", None),
           "LHBNC": ("LHBNC", None), "kernel-split": ("LBHNC", [BLOCK // 2]),
           "kernel-split-LBNHC": ("LBNHC", [BLOCK // 2])}
LOAD_MODES = {"async": {"sync_load_blocks": 0}, "in-step": {}, "layer-by-layer": {"layerwise_load_blocks": 1}}


def harness(model: str, shape: str, **extra) -> Harness:
    layout, kernel = LAYOUTS[shape]
    return Harness(model, layout=layout, layers=2, backend=fake_backend(kernel) if kernel else None, **extra)


def test_an_engine_on_a_cluster_mirrors_only_the_models_it_looks_up(model, etcd_server, spawn_daemon):
    """Kills: the connector's store client mirroring every model of the cluster (every vLLM worker
    held the whole index, about 240 B per block of every model), and a mirror scoped short of what
    the connector looks up (its lookups raise NotMirrored: the save-then-load below fails)."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("mirror-scope", etcd_server.url, cluster)
    other = ModelFingerprint("another-model", "float32", 16, 2, 2, 64, kv_layout="bytes")
    with kvstore.Client(etcd_server.url, cluster=cluster, fingerprint=other, timeout=5) as client:
        client.put_many([(h, np.full(4096, 1, np.uint8)) for h in kvstore.external_hashes(range(8), other)])
        assert client.mirror.wait_until(lambda m: m.block_count == 8, 10)
    h = Harness(model, metadata=etcd_server.url, cluster=cluster, sync_load_blocks=0)
    try:
        scoped_engine_round_trip(h)
    finally:
        h.worker.shutdown()
        h.scheduler.connector.shutdown()


def test_an_engine_asks_the_host_index_and_keeps_no_mirror(model, etcd_server, spawn_daemon):
    """Kills: the connector's `"index": "host"` not reaching its client (every worker keeps a whole
    mirror); and the connector's match, lookups and saves through the host index are checked end
    to end: a prompt saved, then loaded back by its scheduler."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("host-index", etcd_server.url, cluster)
    h = Harness(model, metadata=etcd_server.url, cluster=cluster, sync_load_blocks=0, index="host")
    try:
        mirror = h.worker.worker_side.store.mirror
        assert isinstance(mirror, HostIndexMirror) and mirror.members.block_count == 0
        prompt = list(range(9, 9 + 2 * BLOCK + 3))
        h.add("r1", prompt)
        h.run_until_empty()
        assert mirror.wait_until(lambda m: m.block_count == 3, 10) and mirror.members.block_count == 0
        h.scheduler.reset_prefix_cache()
        request = h.add("r2", prompt)
        wait_running(h, request)
        assert h.worker.totals.data["hit_tokens"] == len(prompt) - 1
        h.run_until_empty()
    finally:
        h.worker.shutdown()
        h.scheduler.connector.shutdown()


def scoped_engine_round_trip(h: Harness) -> None:
    mirror = h.worker.worker_side.store.mirror
    assert mirror is h.scheduler.connector.scheduler_side.store.mirror  # one client for both sides
    assert mirror.wait_loaded(10) and mirror.block_count == 0  # the other model's blocks are not held
    prompt = list(range(9, 9 + 2 * BLOCK + 3))
    h.add("r1", prompt)
    h.run_until_empty()
    assert mirror.wait_until(lambda m: m.block_count == 3, 10)  # 2 full blocks and the partial one
    h.scheduler.reset_prefix_cache()
    request = h.add("r2", prompt)
    wait_running(h, request)
    assert h.worker.totals.data["hit_tokens"] == len(prompt) - 1
    h.run_until_empty()


@pytest.mark.parametrize("mode", list(LOAD_MODES))
@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_loads_land_in_every_layout_and_kernel_split(model, shape, mode):
    h = harness(model, shape, **LOAD_MODES[mode])
    prompt = list(range(3, 3 + 3 * BLOCK + 5))
    data = h.seed_store(prompt, 3)
    request = h.add("r1", prompt)
    wait_running(h, request)
    block_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0]
    per_layer = h.block_bytes() // len(LAYERS)
    for i in range(3):
        for layer, name in enumerate(LAYERS):
            want = torch.from_numpy(data[i].view(np.uint8)[layer * per_layer:(layer + 1) * per_layer])
            assert torch.equal(layer_bytes(h, name, block_ids[i]), want)
    # Only the layer-by-layer load leaves the forward pass anything to wait for, layer by layer.
    assert (h.worker.totals.data.get("layer_wait_seconds", 0) > 0) == (mode == "layer-by-layer")
    assert h.worker.totals.data["loaded_blocks"] == 3 and not h.errors
    h.run_until_empty()


def test_layer_by_layer_loads_leave_the_new_token_kv_the_forward_wrote(model, monkeypatch):
    """vLLM writes a layer's new-token KV into the last, partly loaded block before that layer waits
    for its load: a load landing afterwards would overwrite it (or fail its checksum)."""
    h = Harness(model, layers=2, layerwise_load_blocks=1)
    prompt = list(range(9, 9 + 2 * BLOCK + 5))
    h.add("r1", prompt)
    h.run_until_empty()
    h.scheduler.reset_prefix_cache()
    get_many = h.store.get_many

    def slow_get_many(*args, **kwargs):  # the forward runs ahead of the layer loads
        if kwargs.get("on_stage") is not None:
            time.sleep(0.3)
        return get_many(*args, **kwargs)

    monkeypatch.setattr(h.store, "get_many", slow_get_many)
    h.add("r2", prompt)
    last = {}

    def write_new_token(name: str, tensor: torch.Tensor) -> None:
        last[name] = h.scheduler.kv_cache_manager.get_block_ids("r2")[0][2]
        h.block(name, last[name]).fill_(7.0)

    h.step(before_layer=write_new_token)
    assert h.worker.totals.data["layer_wait_seconds"] > 0 and not h.errors
    assert h.worker.totals.data["hit_tokens"] == len(prompt) - 1
    for name in LAYERS:
        assert torch.all(h.block(name, last[name]) == 7.0)
    h.run_until_empty()


def test_a_layer_load_past_its_deadline_fails_the_step_and_never_writes_late(model, monkeypatch):
    """wait_for_layer_load gives up on a layer that has not landed: the step's blocks must be
    reported failed (vLLM then drops the step's output and recomputes), and the load, still
    running, must never write into those blocks afterwards (vLLM recomputes into them or gives
    them to another request). Kills: a timeout that only stops waiting (no failure reported), and
    a late load that lands in the cache after the deadline."""
    h = Harness(model, layers=2, layerwise_load_blocks=1, layer_load_timeout_s=0.3)
    prompt = list(range(40, 40 + 3 * BLOCK))  # 3 full blocks: 2 load layer by layer
    data = h.seed_store(prompt, 3)
    get_many = h.store.get_many
    landed = []

    def late_get_many(*args, **kwargs):  # the store answers long after the forward gave up
        if kwargs.get("on_stage") is not None:
            time.sleep(1.0)
            result = get_many(*args, **kwargs)
            landed.append(time.monotonic())
            return result
        return get_many(*args, **kwargs)

    monkeypatch.setattr(h.store, "get_many", late_get_many)
    request = h.add("r1", prompt)
    h.step()  # the forward waits 0.3 s for layer 0, gives up: the step's blocks fail
    ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0][:2]
    assert set(ids) <= h.errors, (ids, h.errors)
    assert h.worker.totals.data["load_failures"] >= 2
    for name in LAYERS:  # vLLM recomputes into the blocks: play that
        for block_id in ids:
            h.block(name, block_id).fill_(-3.0)
    deadline = time.monotonic() + 5
    while not landed and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert landed, "the slow load never finished"
    for name in LAYERS:
        for block_id in ids:
            assert torch.all(h.block(name, block_id) == -3.0), "the cancelled load wrote into the cache"
    assert request.num_computed_tokens < len(prompt)  # the output of the failed step was not kept
    monkeypatch.setattr(h.store, "get_many", get_many)
    h.run_until_empty()
    assert data


@pytest.mark.parametrize("shape", ["LBHNC", "LBNHC", "BLNHC", "LHBNC", "kernel-split"])
def test_saved_blocks_load_back_identical_in_every_layout(model, shape):
    h = harness(model, shape, sync_load_blocks=0)
    torch.manual_seed(0)
    for name in LAYERS:  # "the forward pass": every slot holds distinct values
        tensor = h.kv_caches[name]
        tensor.copy_(torch.randn(tensor.shape))
    prompt = list(range(5, 5 + 2 * BLOCK + 3))
    h.add("r1", prompt)
    h.step()
    saved_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0][:3]  # 2 full blocks + the partial one
    expected = {name: [h.block(name, b).clone() for b in saved_ids] for name in LAYERS}
    h.run_until_empty()
    assert h.worker.totals.data["saved_blocks"] == 3
    for name in LAYERS:
        h.kv_caches[name].zero_()
    h.scheduler.reset_prefix_cache()  # vLLM's own cache is gone: the blocks must come from the store
    request = h.add("r2", prompt)
    wait_running(h, request)
    assert h.worker.totals.data["hit_tokens"] == len(prompt) - 1  # only the last token is left to compute
    loaded_ids = h.scheduler.kv_cache_manager.get_block_ids("r2")[0][:3]
    for name in LAYERS:
        for want, b in zip(expected[name], loaded_ids):
            assert torch.equal(h.block(name, b), want)
    h.run_until_empty()


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC"])
def test_the_device_path_copies_into_the_cache_not_into_a_reshaped_copy(model, layout):
    """Device caches go through host staging (KVCacheIO with staging; here on CPU tensors in layouts
    whose block view is not contiguous). Kills: a copy through `reshape`/`view(-1)` of the block,
    which silently writes into a temporary copy, and a stage that reads a reshaped copy out of order."""
    config = vllm_config(model, layout=layout)
    kv_config = kv_cache_config(8, groups=[(full_spec(), LAYERS)], config=config)
    caches = allocate(config, kv_config, fake_backend())
    assert not h_block(caches[LAYERS[0]], 3).is_contiguous()  # what makes a reshape copy
    with kvstore.open("memory://device-path", dram="16MiB") as store:
        io = KVCacheIO(store.engine, caches, 8, [LAYERS], staged=True)
        assert not io.on_host
        data = np.random.default_rng(1).integers(0, 255, io.block_bytes[0], dtype=np.uint8)
        io.write_block(0, 3, data)
        per_layer = io.block_bytes[0] // len(LAYERS)
        for layer, name in enumerate(LAYERS):
            assert torch.equal(physical_bytes(h_block(caches[name], 3)),
                               torch.from_numpy(data[layer * per_layer:(layer + 1) * per_layer]))
            assert not torch.any(h_block(caches[name], 2).view(torch.uint8)) and \
                not torch.any(h_block(caches[name], 4).view(torch.uint8))  # neighbours untouched
        staged = np.zeros(io.block_bytes[0], np.uint8)
        for layer in range(len(LAYERS)):
            io.stage_layer(layer, 3, staged)
        assert np.array_equal(staged, data)
        io.close()


def h_block(tensor: torch.Tensor, block_id: int) -> torch.Tensor:
    return tensor[block_id]


def test_the_block_dimension_comes_from_vllm_not_from_a_coincidental_size(model):
    """vLLM lays each layer out as [kernel blocks, heads, tokens, channels]: with a kernel that
    halves each block and as many heads as blocks, a dimension of size num_blocks exists that is
    not the block dimension. Kills: taking the first dimension whose size equals num_blocks (or a
    multiple of it) instead of vLLM's block dimension and the backend's kernel block size."""
    heads, blocks = 8, 8
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=torch.float32)
    h = Harness(model, num_blocks=blocks, groups=[(spec, LAYERS)], backend=fake_backend([BLOCK // 2]))
    tensor = h.kv_caches[LAYERS[0]]
    assert tensor.shape[0] == 2 * blocks and tensor.shape[1] == blocks  # heads == blocks: the trap
    prompt = list(range(60, 60 + 2 * BLOCK + 1))
    data = h.seed_store(prompt, 2)
    request = h.add("r1", prompt)
    wait_running(h, request)
    block_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0]
    per_layer = h.block_bytes() // len(LAYERS)
    assert h.block_bytes() == 2 * BLOCK * heads * 2 * HEAD * 4  # 2 layers x block x heads x K|V x fp32
    for i in range(2):
        for layer, name in enumerate(LAYERS):
            want = torch.from_numpy(data[i].view(np.uint8)[layer * per_layer:(layer + 1) * per_layer])
            assert torch.equal(layer_bytes(h, name, block_ids[i]), want)
    h.run_until_empty()


def test_a_cache_whose_backend_vllm_does_not_name_is_refused(model):
    """The kernel block size comes from the layer's attention backend: without one, refuse rather
    than guess. Kills: a worker that starts without the check."""
    config = vllm_config(model)
    kv_config = kv_cache_config(8, groups=[(full_spec(), LAYERS)], config=config)
    caches = allocate(config, kv_config, fake_backend())
    config.compilation_config.static_forward_context.clear()
    worker = KVStoreConnector(config, KVConnectorRole.WORKER, kv_config)
    with pytest.raises(UnsupportedKVLayout, match="does not guess"):
        worker.register_kv_caches(caches)
    worker.shutdown()


def test_a_worker_layout_other_than_the_one_its_blocks_are_keyed_by_is_refused(model):
    """The fingerprint names the KV cache layout (a block's bytes follow it). Kills: a worker
    accepting caches in another layout than its fingerprint's."""
    config = vllm_config(model, layout="LBHNC")
    kv_config = kv_cache_config(8, groups=[(full_spec(), LAYERS)], config=config)
    worker = KVStoreConnector(config, KVConnectorRole.WORKER, kv_config)
    assert worker.fingerprint.kv_layout.endswith(":LBHNC")
    config.cache_config.kv_cache_layout = "LBNHC"  # what this worker's caches turn out to be
    caches = allocate(config, kv_cache_config(8, groups=[(full_spec(), LAYERS)], config=config), fake_backend())
    with pytest.raises(UnsupportedKVLayout, match="VLLM_KV_CACHE_LAYOUT"):
        worker.register_kv_caches(caches)
    worker.shutdown()


def test_lora_multimodal_prompt_embeds_and_salt_are_part_of_the_key(model, tmp_path):
    """Kills: dropping prompt embeddings (or any of vLLM's extra keys) from the block keys."""
    h = Harness(model)
    connector = h.scheduler.connector
    prompt = list(range(7, 7 + 2 * BLOCK + 1))
    image = lambda ident, seed: [image_feature(ident, seed, offset=4)]  # noqa: E731
    embeds = lambda seed: torch.randn(len(prompt), 128, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    adapter = lambda name, seed: write_adapter(str(tmp_path / name), seed)  # noqa: E731
    variants = {"plain": {}, "lora-a": {"lora_request": LoRARequest("a", 1, adapter("a", 1))},
                "lora-b": {"lora_request": LoRARequest("b", 2, adapter("b", 2))},
                "image-1": {"mm_features": image("img-1", 1)}, "image-2": {"mm_features": image("img-2", 2)},
                "salt": {"cache_salt": "tenant-7"}, "embeds-1": {"prompt_embeds": embeds(1)},
                "embeds-2": {"prompt_embeds": embeds(2)}}
    requests = {name: Request(name, prompt, SamplingParams(max_tokens=1), None, **kw) for name, kw in variants.items()}
    keys = {name: request_hashes(h.chain, r) for name, r in requests.items()}
    assert all(len(k) == 2 for k in keys.values())
    assert len({tuple(k) for k in keys.values()}) == len(variants)  # every variant its own chain
    same = Request("embeds-1-again", prompt, SamplingParams(max_tokens=1), None, prompt_embeds=embeds(1))
    assert request_hashes(h.chain, same) == keys["embeds-1"]  # the same embeddings: the same KV
    h.seed_store(prompt, 2, hashes=keys["lora-a"])  # KV computed under adapter a
    assert connector.get_num_new_matched_tokens(requests["lora-a"], 0)[0] == 2 * BLOCK
    for other in ("plain", "lora-b", "image-1", "salt", "embeds-1"):
        assert connector.get_num_new_matched_tokens(requests[other], 0) == (0, False), other


def test_the_partial_block_key_depends_on_its_whole_prefix(model):
    """The same trailing tokens behind two different prefixes are different KV. Kills: keying the
    tail block without the hash of the block before it."""
    h = Harness(model)
    tail = [9, 8, 7, 6, 5]
    a, b = list(range(10, 10 + BLOCK)) + tail, list(range(30, 30 + BLOCK)) + tail
    full_a, tail_a = request_keys(h.chain, plain_request(a))
    full_b, tail_b = request_keys(h.chain, plain_request(b))
    assert full_a != full_b and tail_a != tail_b
    # Stored for prompt a (its full block and its tail): prompt b finds neither.
    h.store.put_many([(k, np.zeros(h.block_bytes(), np.uint8)) for k in full_a + [tail_a]], fingerprint=h.fingerprint)
    assert h.store.mirror.wait_until(lambda m: m.contains(h.fingerprint, tail_a), 5)
    connector = h.scheduler.connector
    # All of a but its last token (vLLM computes that one) comes from the store, the tail included.
    assert connector.get_num_new_matched_tokens(Request("a", a, SamplingParams(), None), 0)[0] == len(a) - 1
    assert connector.get_num_new_matched_tokens(Request("b", b, SamplingParams(), None), 0) == (0, False)


def test_saves_carry_the_cache_salt_even_with_loading_off(model):
    h = Harness(model, load=False)
    prompt = list(range(9, 9 + 2 * BLOCK + 1))
    h.add("r1", prompt, cache_salt="tenant-9")
    h.run_until_empty()
    salted = request_hashes(h.chain, SimpleNamespace(prompt_token_ids=prompt, cache_salt="tenant-9",
                                                           lora_request=None, mm_features=None, prompt_embeds=None))
    assert all(h.store.mirror.contains(h.fingerprint, k) for k in salted[:2])
    assert h.store.mirror.match(h.fingerprint, request_hashes(h.chain, plain_request(prompt))).length == 0


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


def test_a_worker_rank_is_read_from_vllm_never_guessed(monkeypatch):
    """A worker of a TP/PP world whose rank cannot be read must not take itself for rank 0 (it
    would save its own layers' KV under stage 0's fingerprint). Kills: falling back to rank 0 on
    any exception."""
    import vllm.distributed as distributed

    monkeypatch.setattr(distributed, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(distributed, "get_pp_group", lambda: SimpleNamespace(rank_in_group=1))
    assert parallel.worker_ranks(2, 2) == (1, 1)

    def no_group():
        raise AssertionError("pipeline model parallel group is not initialized")

    monkeypatch.setattr(distributed, "get_pp_group", no_group)
    with pytest.raises(UnsupportedDeployment, match="rank"):
        parallel.worker_ranks(1, 2)
    assert parallel.worker_ranks(1, 1) == (0, 0)  # a world of one has nothing to read


def test_scheduler_counts_only_blocks_every_rank_holds(model):
    h = Harness(model)
    connector = h.scheduler.connector
    other_rank = replace(h.fingerprint, tp_rank=1, tp_world_size=2)
    connector.rank_group_fingerprints = [[h.fingerprint], [other_rank]]  # as on a TP=2 engine
    prompt = list(range(11, 11 + 3 * BLOCK + 1))
    h.seed_store(prompt, 3)  # rank 0 holds 3 blocks, rank 1 holds none
    assert connector.get_num_new_matched_tokens(Request("x", prompt, SamplingParams(), None), 0) == (0, False)
    h.store.put_many([(k, np.zeros(h.block_bytes(), np.uint8)) for k in request_hashes(
        h.chain, plain_request(prompt))[:2]], fingerprint=other_rank)
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


def _finished_params(h: Harness, req_id: str) -> dict | None:
    return {o.request_id: o.kv_transfer_params for outs in h.outputs for eco in outs.values()
            for o in eco.outputs if o.finished}[req_id]


def _remote_decode_request(h: Harness, req_id: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(req_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
                   None, block_hasher=h.block_hasher)


def test_kv_both_on_a_private_store_returns_no_handoff_params(model):
    """A kv_both engine on an embedded/memory:// store asked for a remote decode: no decode in
    another process can reach that store, so no parameters (the decode would wait, then recompute).
    Kills: returning hand-off parameters from a private store."""
    h = Harness(model, role="kv_both")
    prompt = list(range(31, 31 + 2 * BLOCK + 4))
    h.scheduler.add_request(_remote_decode_request(h, "p1", prompt))
    h.run_until_empty()
    assert "kvstore" not in (_finished_params(h, "p1") or {})
    shared = Harness(model, role="kv_both", process_local=True)  # prefill and decode share this process
    shared.scheduler.add_request(_remote_decode_request(shared, "p2", prompt))
    shared.run_until_empty()
    assert _finished_params(shared, "p2")["kvstore"]["num_blocks"] == 2


def test_an_aborted_prefill_promises_nothing(model):
    """Kills: returning hand-off parameters for a prefill that did not succeed (aborted)."""
    h = Harness(model, role="kv_producer", process_local=True)
    prompt = list(range(41, 41 + 2 * BLOCK + 4))
    connector = h.scheduler.connector
    returned = {}
    finish = connector.request_finished_all_groups

    def recording(request, block_ids):
        returned[request.request_id] = finish(request, block_ids)
        return returned[request.request_id]

    connector.request_finished_all_groups = recording
    h.scheduler.add_request(_remote_decode_request(h, "p1", prompt, max_tokens=8))
    h.step()
    h.scheduler.finish_requests(["p1"], RequestStatus.FINISHED_ABORTED)
    h.run_until_empty()
    assert "kvstore" not in (returned["p1"][1] or {})
    h.scheduler.add_request(_remote_decode_request(h, "p2", prompt))  # the same prefill, run to the end
    h.run_until_empty()
    assert returned["p2"][1]["kvstore"]["num_blocks"] == 2


@pytest.mark.parametrize("field_name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_start(model, field_name):
    """With DCP/PCP a scheduler block covers block_size x dcp tokens, sharded over ranks by token.
    Kills: starting anyway (every load and save would land at the wrong positions)."""
    config = vllm_config(model)
    object.__setattr__(config.parallel_config, field_name, 2)
    with pytest.raises(UnsupportedDeployment, match="context-parallel-size 1"):
        KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(8))


def test_cache_groups_kvstore_cannot_restore_exactly_are_refused_with_what_to_set(model):
    """Kills: starting with a Mamba or chunked-local group (its blocks would be saved and loaded as
    if they were attention KV)."""
    full = full_spec()
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 16)), dtypes=(torch.float32, torch.float32))
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                                        attention_chunk_size=64)
    for spec, remedy in ((mamba, "Mamba.*--kv-transfer-config"), (chunked, "--disable-hybrid-kv-cache-manager")):
        hybrid = kv_cache_config(8, groups=[(full, [LAYERS[0]]), (spec, [LAYERS[1]])])
        with pytest.raises(UnsupportedDeployment, match=remedy):
            KVStoreConnector(vllm_config(model), KVConnectorRole.SCHEDULER, hybrid)
    assert issubclass(KVStoreConnector, SupportsHMA)  # vLLM keeps its hybrid KV cache manager on


def test_a_smaller_stored_block_is_not_a_hit():
    """A free-form block smaller than its destination is a miss, not half a block, unless the caller
    asks how much was filled (get_into). Kills: a read that fills part of a larger buffer and calls
    it a hit, and get_into reporting a block that fits in a larger buffer as a miss. (Under a geometry fingerprint the size
    is refused up front: tests/integration/test_library_mode.py.)"""
    fp = ModelFingerprint("m", "float32", 4, 1, 1, 8, kv_layout="bytes")
    with kvstore.open("memory://partial-block", dram="16MiB", fingerprint=fp) as store:
        key = kvstore.chain_hashes(fp, [1, 2, 3, 4])[0]
        store.put_many([(key, np.full(4096, 7, np.uint8))])
        out = np.zeros(8192, np.uint8)
        assert store.get_many([key], [out]) == [False]  # half a block would be garbage in the second half
        exact = np.zeros(4096, np.uint8)
        assert store.get_many([key], [exact]) == [True] and (exact == 7).all()
        # Asked how much it filled, a larger buffer takes the block at its start (Mooncake's get_into).
        assert store.get_into(key, out) == 4096 and (out[:4096] == 7).all() and not out[4096:].any()
        assert store.get_into(kvstore.chain_hashes(fp, [9, 9, 9, 9])[0], out) == 0


def test_reset_cache_starts_a_chain_no_other_process_shares(model):
    """After an in-place weight update (reset_cache) the keys chain from the new weights' version:
    a version the caller names, else a random one. Kills: a per-process reset counter (two engines
    that reset once each would share keys under different weights; a restarted engine would match
    the chain it saved before its reset)."""
    first, second = Harness(model), Harness(model)
    prompt = list(range(13, 13 + 2 * BLOCK + 1))
    a, b = first.scheduler.connector, second.scheduler.connector
    first.seed_store(prompt, 2)
    assert a.get_num_new_matched_tokens(Request("a", prompt, SamplingParams(), None), 0)[0] == 2 * BLOCK
    assert a.reset_cache() is True  # e.g. weights updated in place, no version named
    assert a.get_num_new_matched_tokens(Request("b", prompt, SamplingParams(), None), 0) == (0, False)
    assert b.reset_cache() is True
    assert a._chain.digest != b._chain.digest  # each reset once, with their own weights
    keys_a = request_hashes(a._chain, plain_request(prompt))
    assert keys_a != request_hashes(b._chain, plain_request(prompt))
    # A restarted engine starts from its configured weights: never from another's post-reset chain.
    restarted = Harness(model).scheduler.connector
    assert restarted._chain.digest not in (a._chain.digest, b._chain.digest)
    # A version named by the caller (the same weights pushed to every engine) is shared on purpose.
    a.reset_cache("rl-step-42"), b.reset_cache("rl-step-42")
    assert a._chain.digest == b._chain.digest
    named = Harness(model, weight_version="rl-step-42").scheduler.connector
    assert named._chain.digest == a._chain.digest
    assert KVStoreConnector.requires_piecewise_for_cudagraph({}) is True  # saves run per layer


def test_the_fingerprint_covers_quantization_overrides_and_kv_scales(model):
    """Two engines of one model path configured differently must not share KV. Kills: a
    fingerprint blind to quantization, hf_overrides (rope scaling, window) or the KV-scale scheme."""
    base = fingerprint_from_vllm(vllm_config(model)).digest

    def with_model(**changes) -> str:
        config = vllm_config(model)
        for key, value in changes.items():
            object.__setattr__(config.model_config, key, value)
        return fingerprint_from_vllm(config).digest

    assert with_model() == base
    assert with_model(quantization="fp8") != base
    assert with_model(hf_overrides={"rope_theta": 1234.0}) != base
    config = vllm_config(model)
    config.model_config.hf_text_config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    assert fingerprint_from_vllm(config).digest != base
    config = vllm_config(model)
    config.model_config.hf_text_config.quantization_config = {"kv_cache_scheme": {"type": "float", "num_bits": 8}}
    assert fingerprint_from_vllm(config).digest != base
    # Scales each engine computes from its own first batch cannot be shared at all.
    config = vllm_config(model)
    object.__setattr__(config.cache_config, "cache_dtype", "fp8")
    object.__setattr__(config.cache_config, "calculate_kv_scales", True)
    with pytest.raises(UnsupportedDeployment, match="calculate_kv_scales"):
        KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(8))


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
    keys = request_hashes(h.chain, plain_request(prompt))
    assert [e.block_hashes[0] for e in stored] == keys[:2]
    assert stored[1].parent_block_hash == keys[0] and stored[0].token_ids == prompt[:BLOCK]
    assert {(e.group_idx, e.kv_cache_spec_kind) for e in stored} == {(0, "full_attention")}
    metrics = KVStoreConnector.build_prom_metrics(h.scheduler.vllm_config, {Gauge: Gauge, Counter: Counter,
                                                                           Histogram: Histogram},
                                                  ["engine"], {0: ["0"]})
    metrics.observe(h.worker.totals.data, 0)
    assert REGISTRY.get_sample_value("vllm:kvstore_saved_blocks_total", {"engine": "0"}) == 2


def test_hits_are_attributed_to_the_tier_that_served_them(model, tmp_path):
    """vLLM's per-source hit counts: blocks only an NVMe tier holds are DISK, blocks in DRAM are
    HOST, a hand-off is P2P. Kills: every store hit reported as HOST (NVMe hits never DISK)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    h = Harness(model, dram="256KiB", disk=str(tmp_path / "nvme"), disk_size="8MiB")
    cold = list(range(100, 100 + 3 * BLOCK + 4))
    h.seed_store(cold, 3)
    for i in range(6):  # newer blocks push the cold prompt's out of DRAM, down to the NVMe tier
        h.seed_store(list(range(1000 + 200 * i, 1000 + 200 * i + 3 * BLOCK)), 3)
    keys = request_hashes(h.chain, plain_request(cold))[:3]
    assert h.store.mirror.wait_until(
        lambda m: all({r.tier for r in m.lookup(h.fingerprint, k).values()} == {"nvme"} for k in keys), 10)
    hot = list(range(1000 + 200 * 5, 1000 + 200 * 5 + 3 * BLOCK + 4))  # the last seeded: still in DRAM
    for prompt, source in ((cold, CacheHitSource.DISK), (hot, CacheHitSource.HOST)):
        stats = h.scheduler.connector_prefix_cache_stats  # what vLLM asked the connector at admission
        before = dict(stats.hits_by_source)
        h.add(f"r-{source.value}", prompt)
        h.step()
        got = {s: n - before.get(s, 0) for s, n in stats.hits_by_source.items() if n != before.get(s, 0)}
        assert got == {source: 3 * BLOCK}, got
    h.run_until_empty()
