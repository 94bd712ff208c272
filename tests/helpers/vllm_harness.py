"""vLLM's real Scheduler plus a worker-side KVStoreConnector over fake KV tensors, model outputs
mocked (no forward pass): the connector's whole call sequence, in one process, in seconds."""
from __future__ import annotations

import time
import uuid
from typing import Callable

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvstore.integrations.vllm.connector import KVStoreConnector
from kvstore.integrations.vllm.plan import prompt_hashes
from kvstore.integrations.vllm.store import store_for

BLOCK, HEADS, HEAD = 16, 2, 64
LAYER = "model.layers.0.self_attn.attn"


def cpu_layout(num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU attention layout: [blocks, heads, block size, 2 * head size], block-major."""
    return {LAYER: torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD)}


def vllm_config(model: str, role: str = "kv_both", **extra) -> VllmConfig:
    url = extra.pop("metadata", f"memory://sched-{uuid.uuid4().hex[:8]}")
    kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_role=role,
                          kv_connector_module_path="kvstore.integrations.vllm.connector",
                          kv_connector_extra_config={"metadata": url, "dram": "64MiB", **extra},
                          kv_load_failure_policy="recompute")
    return VllmConfig(model_config=ModelConfig(model=model, dtype="float32", max_model_len=1024, seed=0),
                      cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                      scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024,
                                                       max_model_len=1024, is_encoder_decoder=False),
                      device_config=DeviceConfig("cpu"), kv_transfer_config=kv)


def kv_cache_config(num_blocks: int, layers: list[str] | None = None) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers or [LAYER], spec)])


class Harness:
    """A Scheduler plus a worker-side connector over fake KV tensors (CPU layout unless given)."""

    def __init__(self, model: str, num_blocks: int = 64, role: str = "kv_both",
                 caches: Callable[[int], dict[str, torch.Tensor]] = cpu_layout, **extra) -> None:
        config = vllm_config(model, role, **extra)
        self.url = config.kv_transfer_config.kv_connector_extra_config["metadata"]
        config.cache_config.num_gpu_blocks = num_blocks
        self.kv_caches = caches(num_blocks)
        self.kv_cache_config = kv_cache_config(num_blocks, list(self.kv_caches))
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
                                   log_stats=True)
        self.worker = KVStoreConnector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv = next(iter(self.kv_caches.values()))
        self.worker.register_kv_caches(self.kv_caches)
        self.store = store_for({"metadata": self.url})
        self.fingerprint = self.worker.fingerprint
        self.num_blocks = num_blocks
        self.errors: set[int] = set()
        self.outputs: list = []
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(BLOCK, sha256)  # what the engine gives each request

    def block_bytes(self) -> int:
        return self.worker._io.block_bytes

    def seed_store(self, prompt: list[int], blocks: int, hashes: list[bytes] | None = None) -> list[np.ndarray]:
        hashes = (hashes or prompt_hashes(self.fingerprint, prompt))[:blocks]
        data = [np.full(self.block_bytes() // 4, float(i + 1), np.float32) for i in range(blocks)]
        self.store.put_many(list(zip(hashes, data)), fingerprint=self.fingerprint)
        assert self.store.mirror.wait_until(lambda m: all(m.lookup(self.fingerprint, h) for h in hashes), 5)
        return data

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 3, **request_kwargs) -> Request:
        request = Request(req_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), None,
                          block_hasher=self.block_hasher, **request_kwargs)
        self.scheduler.add_request(request)
        return request

    def step(self, before_layer: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """One engine step; `before_layer(name, tensor)` plays vLLM writing the layer's new-token KV
        (it does so before the layer waits for its load)."""
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        for name, tensor in self.kv_caches.items():  # the forward pass, layer after layer
            if before_layer is not None:
                before_layer(name, tensor)
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, tensor, None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.errors |= errors
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[7] for _ in ids],
                                   kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                                                         finished_recving=recving,
                                                                         invalid_block_ids=errors))
        self.outputs.append(self.scheduler.update_from_output(out, output))

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
