"""The connector under vLLM's real Scheduler, model outputs mocked (no forward pass): async loads,
a failed load leading to recompute, an abort during a load, preemption — and the scheduler ends
empty every time."""
from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvstore.integrations.vllm.connector import KVStoreConnector  # noqa: E402
from kvstore.integrations.vllm.plan import prompt_hashes  # noqa: E402
from kvstore.integrations.vllm.store import store_for  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402

BLOCK, HEADS, HEAD = 16, 2, 64
LAYER = "model.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("sched-model")))


class Harness:
    """A Scheduler plus a worker-side connector over one fake KV tensor."""

    def __init__(self, model: str, num_blocks: int = 64, **extra) -> None:
        self.url = f"memory://sched-{uuid.uuid4().hex[:8]}"
        kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                              kv_connector_module_path="kvstore.integrations.vllm.connector",
                              kv_connector_extra_config={"metadata": self.url, "dram": "64MiB", **extra},
                              kv_load_failure_policy="recompute")
        config = VllmConfig(model_config=ModelConfig(model=model, dtype="float32", max_model_len=1024, seed=0),
                            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024,
                                                             max_model_len=1024, is_encoder_decoder=False),
                            device_config=DeviceConfig("cpu"), kv_transfer_config=kv)
        config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
                                   log_stats=True)
        self.worker = KVStoreConnector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv = torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD)
        self.worker.register_kv_caches({LAYER: self.kv})
        self.store = store_for({"metadata": self.url})
        self.fingerprint = self.worker.fingerprint
        self.num_blocks = num_blocks
        self.errors: set[int] = set()
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(BLOCK, sha256)  # what the engine gives each request

    def block_bytes(self) -> int:
        return self.kv[0].numel() * 4

    def seed_store(self, prompt: list[int], blocks: int) -> list[np.ndarray]:
        hashes = prompt_hashes(self.fingerprint, prompt)[:blocks]
        data = [np.full(self.block_bytes() // 4, float(i + 1), np.float32) for i in range(blocks)]
        self.store.put_many(list(zip(hashes, data)), fingerprint=self.fingerprint)
        assert self.store.mirror.wait_until(lambda m: all(m.lookup(self.fingerprint, h) for h in hashes), 5)
        return data

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
        request = Request(req_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), None,
                          block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        self.worker.save_kv_layer(LAYER, self.kv, None)
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
        self.scheduler.update_from_output(out, output)

    def run_until_empty(self, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while self.scheduler.has_requests() and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)  # asynchronous loads finish on their own thread
        assert_empty(self)


def assert_empty(h: Harness) -> None:
    s = h.scheduler
    assert not s.has_requests() and s.get_num_unfinished_requests() == 0
    assert len(s.requests) == 0 and not s.running and not s.waiting
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == h.num_blocks - 1  # all but the null block
    assert not h.worker._in_flight and not h.worker._abandoned and not h.worker._staged
    connector = s.connector
    assert not connector._requests and not connector._loading and not connector._loads and not connector._sync_loads
    assert not connector._load_plans and not connector._load_failed


def test_async_load_lands_in_the_kv_cache_then_everything_drains(model):
    h = Harness(model, sync_load_blocks=0)  # force the asynchronous path
    prompt = list(range(3, 3 + 4 * BLOCK + 5))
    h.seed_store(prompt, 4)
    request = h.add("r1", prompt)
    h.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    deadline = time.monotonic() + 10  # the first load also opens the connection to the store
    while request.status != RequestStatus.RUNNING and time.monotonic() < deadline:
        h.step()
        time.sleep(0.005)
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens >= 4 * BLOCK
    block_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0]
    for i in range(4):
        assert torch.all(h.kv[block_ids[i]].reshape(-1) == float(i + 1))
    h.run_until_empty()
    assert h.worker.totals.data["loaded_blocks"] == 4


def test_failed_load_leads_to_recompute_not_garbage(model):
    h = Harness(model, sync_load_blocks=0)
    prompt = list(range(3, 3 + 3 * BLOCK + 2))
    h.seed_store(prompt, 3)
    daemon_store = h.store.daemon.store
    for _, slot in daemon_store.keys():  # the bytes rot under the index: every checksum must fail
        daemon_store.dram.region.buffer[slot.offset : slot.offset + 64] = bytes(64)
    request = h.add("r1", prompt)
    h.run_until_empty()
    assert request.is_finished() and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(h.errors) == 3 and h.worker.totals.data["load_failures"] == 3


def test_abort_during_load_frees_everything(model):
    h = Harness(model, sync_load_blocks=0)
    prompt = list(range(3, 3 + 2 * BLOCK + 3))
    h.seed_store(prompt, 2)
    gate = threading.Event()
    original = h.store.get_many

    def slow_get_many(*args, **kwargs):
        gate.wait(10)
        return original(*args, **kwargs)

    h.store.get_many = slow_get_many
    try:
        request = h.add("r1", prompt)
        h.step()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        h.scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
        h.step()
        assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < h.num_blocks - 1  # still held
        gate.set()
        h.run_until_empty()
    finally:
        h.store.get_many = original


def test_preemption_resumes_and_drains(model):
    h = Harness(model, num_blocks=12)
    prompts = {f"r{i}": list(range(10 + 50 * i, 10 + 50 * i + 4 * BLOCK)) for i in range(2)}
    requests = [h.add(rid, p, max_tokens=40) for rid, p in prompts.items()]
    h.run_until_empty()
    assert all(r.is_finished() for r in requests)
    assert sum(r.num_preemptions for r in requests) >= 1
