"""vLLM's real Scheduler plus a worker-side KVStoreConnector over KV cache tensors that vLLM's own
allocator lays out (any KV cache layout, kernel-block splitting, several KV cache groups), model
outputs mocked (no forward pass): the connector's whole call sequence, in one process, in seconds."""
from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.hashing import sha256
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

from kvstore.integrations.vllm.connector import KVStoreConnector
from kvstore.integrations.vllm.plan import prompt_hashes
from kvstore.integrations.vllm.store import store_for

BLOCK, HEADS, HEAD = 16, 2, 64
LAYER = "model.layers.0.self_attn.attn"
CPU_LAYOUT = "LBHNC"  # what vLLM resolves on the CPU: each layer's blocks [heads, tokens, K|V channels]


def layer_names(count: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(count)]


def full_spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)


def fake_backend(kernel_block_sizes: Sequence[int | MultipleOf] = (MultipleOf(BLOCK),)) -> type:
    """An attention backend as vLLM's kernel-block selection sees it (its supported kernel block sizes)."""
    sizes = list(kernel_block_sizes)

    class Backend:
        @staticmethod
        def get_supported_kernel_block_sizes(spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
            return sizes

        @staticmethod
        def get_name() -> str:
            return "HARNESS"

    return Backend


class FakeAttention(AttentionLayerBase):
    """What vLLM's forward context holds per attention layer: here, only its backend."""

    def __init__(self, backend: type) -> None:
        self.backend = backend

    def get_attn_backend(self) -> type:
        return self.backend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        return None


def vllm_config(model: str, role: str = "kv_both", layout: str | None = CPU_LAYOUT, batch_tokens: int = 1024,
                **extra) -> VllmConfig:
    url = extra.pop("metadata", f"memory://sched-{uuid.uuid4().hex[:8]}")
    kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_role=role,
                          kv_connector_module_path="kvstore.integrations.vllm.connector",
                          kv_connector_extra_config={"metadata": url, "dram": "64MiB", **extra},
                          kv_load_failure_policy="recompute")
    config = VllmConfig(model_config=ModelConfig(model=model, dtype="float32", max_model_len=1024, seed=0),
                        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=batch_tokens,
                                                         max_model_len=1024, is_encoder_decoder=False),
                        device_config=DeviceConfig("cpu"), kv_transfer_config=kv)
    config.cache_config.kv_cache_layout = layout  # what the engine core resolves before allocating
    return config


def kv_cache_config(num_blocks: int, layers: list[str] | None = None,
                    groups: list[tuple[KVCacheSpec, list[str]]] | None = None,
                    config: VllmConfig | None = None) -> KVCacheConfig:
    """vLLM's KVCacheConfig: with `config`, placed by vLLM's own allocator logic (tensors with their
    layer and block strides); without, groups only (scheduler-side tests)."""
    group_specs = [KVCacheGroupSpec(names, spec) for spec, names in (groups or [(full_spec(), layers or [LAYER])])]
    if config is None:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=group_specs)
    config.cache_config.num_gpu_blocks_override = num_blocks
    placed = get_kv_cache_config_from_groups(config, group_specs, available_memory=1 << 40)
    assert placed.num_blocks == num_blocks
    return placed


def allocate(config: VllmConfig, kv_config: KVCacheConfig, backend: type) -> dict[str, torch.Tensor]:
    """The KV cache tensors vLLM's worker allocates (its allocate_kv_cache, kernel blocks per backend),
    and the forward context entries that name each layer's backend."""
    context = config.compilation_config.static_forward_context
    for group in kv_config.kv_cache_groups:
        for name in group.layer_names:
            context[name] = FakeAttention(backend)
    attn_groups = [[type("G", (), {"backend": backend, "kv_cache_spec": g.kv_cache_spec})] for g in
                   kv_config.kv_cache_groups]
    kernel_sizes = prepare_kernel_block_sizes(kv_config, attn_groups)
    layout = KVCacheLayout[config.cache_config.kv_cache_layout]
    return allocate_kv_cache(kv_config, torch.device("cpu"), layout, kernel_sizes)


def physical_bytes(view: torch.Tensor) -> torch.Tensor:
    """A view's bytes in storage order, read independently of the connector's geometry code."""
    element = view.element_size()
    storage = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
    index = torch.arange(storage.numel() // element)
    offsets = torch.as_strided(index, view.shape, view.stride(), view.storage_offset()).reshape(-1).sort().values
    byte_offsets = (offsets[:, None] * element + torch.arange(element)).reshape(-1)
    return storage[byte_offsets]


def plain_request(prompt: list[int], **kwargs) -> SimpleNamespace:
    """A request as request_keys reads it: tokens, and none of the extras unless given."""
    fields = dict(cache_salt=None, lora_request=None, mm_features=None, prompt_embeds=None)
    fields.update(kwargs)
    return SimpleNamespace(prompt_token_ids=prompt, **fields)


def write_adapter(path: str, seed: int, rank: int = 4, hidden: int = 128) -> str:
    """A LoRA adapter directory as PEFT writes one (config + safetensors weights of a Llama's
    q/v projections), its weights drawn from `seed`; rewritten in place when it exists."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
                   "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": None}, f)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=g) * 0.05
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def image_feature(identifier: str, seed: int | None, offset: int, length: int = 8):
    """One image of a request as vLLM's scheduler holds it: its identifier (a content hash, or a
    client's multi_modal_uuids entry), its placeholder tokens and, unless `seed` is None (vLLM's
    caches can leave them out), its processed inputs."""
    from vllm.multimodal.inputs import (MultiModalFeatureSpec, MultiModalFieldElem, MultiModalKwargsItem,
                                        MultiModalSharedField, PlaceholderRange)

    data = None
    if seed is not None:
        pixels = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed))
        data = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(pixels, MultiModalSharedField(batch_size=1))})
    return MultiModalFeatureSpec(data=data, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


_opened: list[tuple[str, str]] = []  # (url, cluster) of stores harnesses opened: closed after each test


@pytest.fixture(autouse=True)
def close_harness_stores():
    """Each harness opens a store private to this process (an embedded daemon with its own DRAM
    arena, threads and sockets): closed after its test, or dozens pile up in one pytest process and
    later tests find no node with room ('no store node took the blocks')."""
    yield
    from kvstore.integrations.vllm.store import close_store

    while _opened:
        close_store(*_opened.pop())


class Harness:
    """A Scheduler plus a worker-side connector over vLLM-allocated CPU tensors."""

    def __init__(self, model: str, num_blocks: int = 64, role: str = "kv_both", layout: str = CPU_LAYOUT,
                 groups: list[tuple[KVCacheSpec, list[str]]] | None = None, layers: int = 1,
                 backend: type | None = None, batch_tokens: int = 1024, **extra) -> None:
        config = vllm_config(model, role, layout, batch_tokens, **extra)
        self.config = config
        self.url = config.kv_transfer_config.kv_connector_extra_config["metadata"]
        config.cache_config.num_gpu_blocks = num_blocks
        groups = groups or [(full_spec(), layer_names(layers))]
        self.kv_cache_config = kv_cache_config(num_blocks, groups=groups, config=config)
        self.kv_caches = allocate(config, self.kv_cache_config, backend or fake_backend())
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
                                   log_stats=True)
        self.worker = KVStoreConnector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv = next(iter(self.kv_caches.values()))
        self.worker.register_kv_caches(self.kv_caches)
        extra = config.kv_transfer_config.kv_connector_extra_config
        self.store = store_for(extra)  # the same store (and cluster) the connector uses
        store = (self.url, str(extra.get("cluster", "default")))
        if store not in _opened:
            _opened.append(store)
        self.fingerprint = self.worker.fingerprint
        self.chain = self.scheduler.connector.chain  # what block keys chain from (the weights' identity in it)
        self.num_blocks = num_blocks
        self.errors: set[int] = set()
        self.failed_requests: set[str] = set()
        self.outputs: list = []
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(BLOCK, sha256)  # what the engine gives each request

    def block_bytes(self, group: int = 0) -> int:
        return self.worker._io.block_bytes[group]

    def block(self, name: str, block_id: int) -> torch.Tensor:
        """One scheduler block of one layer (its kernel blocks), as vLLM's attention reads it."""
        tensor = self.kv_caches[name]
        ratio = tensor.shape[0] // self.num_blocks
        return tensor[block_id * ratio:(block_id + 1) * ratio]

    def seed_store(self, prompt: list[int], blocks: int, hashes: list[bytes] | None = None,
                   group: int = 0) -> list[np.ndarray]:
        hashes = (hashes or prompt_hashes(self.chain, prompt))[:blocks]
        data = [np.full(self.block_bytes(group) // 4, float(i + 1), np.float32) for i in range(blocks)]
        fingerprint = self.worker.group_fingerprints[group]
        self.store.put_many(list(zip(hashes, data)), fingerprint=fingerprint)
        assert self.store.mirror.wait_until(lambda m: all(m.lookup(fingerprint, h) for h in hashes), 5)
        return data

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 3, **request_kwargs) -> Request:
        request = Request(req_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), None,
                          block_hasher=self.block_hasher, **request_kwargs)
        self.scheduler.add_request(request)
        return request

    def step(self, before_layer: Callable[[str, torch.Tensor], None] | None = None,
             forward: Callable[[SchedulerOutput], None] | None = None) -> None:
        """One engine step; `before_layer(name, tensor)` plays vLLM writing the layer's new-token KV
        (it does so before the layer waits for its load); `forward(scheduler_output)` plays the
        whole forward pass writing the KV of what it computes (before any layer saves)."""
        out = self.scheduler.schedule()
        if forward is not None:
            forward(out)
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        for name, tensor in self.kv_caches.items():  # the forward pass, layer after layer
            if before_layer is not None:
                before_layer(name, tensor)
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, tensor, None)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.errors |= errors
        self.failed_requests |= results.failed_recving
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        # A chunk that leaves part of the prompt to compute samples nothing (vLLM's runner drops it).
        sampled = [[7] if self._prompt_done(r) else [] for r in ids]
        output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled,
                                   kv_connector_output=KVConnectorOutput(
                                       finished_sending=results.finished_sending or None,
                                       finished_recving=results.finished_recving or None,
                                       failed_recving=results.failed_recving, invalid_block_ids=errors))
        self.outputs.append(self.scheduler.update_from_output(out, output))

    def _prompt_done(self, req_id: str) -> bool:
        request = self.scheduler.requests.get(req_id)
        return request is None or request.num_computed_tokens >= request.num_prompt_tokens

    def run_until_empty(self, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while self.scheduler.has_requests() and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)  # asynchronous loads finish on their own thread
        assert self.worker.flush_saves(10)
        assert_empty(self)


def assert_empty(h: Harness) -> None:
    s = h.scheduler
    assert not s.has_requests() and s.get_num_unfinished_requests() == 0
    assert len(s.requests) == 0 and not s.running and not s.waiting
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == h.num_blocks - 1  # all but the null block
    assert not h.worker._in_flight and not h.worker._abandoned and not h.worker._staged
    connector = s.connector
    assert not connector._requests and not connector._loading and not connector._loads and not connector._sync_loads
    assert not connector._load_plans and not connector._load_failed and not connector._remote_waits
