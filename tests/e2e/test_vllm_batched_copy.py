"""The connector's batched copy path (kv_batch.py): a step's blocks of a layer gathered into
registered staging with one tensor operation, and loads scattered back with one, on CPU tensors
that vLLM's own allocator lays out in every KV cache layout and kernel split, through host staging
(`staged=True`, the path device caches take) and through the connector under vLLM's real
Scheduler (model outputs mocked). Every check is byte for byte against an independent read of the
cache's storage (vllm_harness.physical_bytes).

Where a test names a broken variant ("Kills: ..."), that variant was applied to the code and the
test failed on it."""
from __future__ import annotations

import functools
import logging
import threading
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

import kvstore  # noqa: E402
from kvstore.errors import UnsupportedKVLayout  # noqa: E402
from kvstore.integrations.vllm import worker as connector_module  # noqa: E402  (KVCacheIO is made there)
from kvstore.integrations.vllm import kv_batch  # noqa: E402
from kvstore.integrations.vllm.connector import KVStoreConnector  # noqa: E402
from kvstore.integrations.vllm.kv_batch import BatchedKV, StagingUnavailable  # noqa: E402
from kvstore.integrations.vllm.kv_cache_io import KVCacheIO  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from vllm_harness import (BLOCK, Harness, allocate, fake_backend, full_spec, kv_cache_config,  # noqa: E402
                          layer_names, physical_bytes, vllm_config)
from vllm_harness import close_harness_stores  # noqa: E402,F401 - autouse: each test closes its stores

# Every layout vLLM allocates and every kernel split it allows (LHBNC and the block-outer layouts
# take no split: vLLM refuses it, or keeps whole blocks): (layout, the backend's kernel block size).
SHAPES = {"LBHNC": ("LBHNC", None), "LBNHC": ("LBNHC", None), "LHBNC": ("LHBNC", None), "BLHNC": ("BLHNC", None),
          "BLNHC": ("BLNHC", None), "LBHNC/2": ("LBHNC", BLOCK // 2), "LBHNC/4": ("LBHNC", BLOCK // 4),
          "LBNHC/2": ("LBNHC", BLOCK // 2), "LBNHC/4": ("LBNHC", BLOCK // 4)}
LAYERS = layer_names(3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("batched-model")))


def caches_for(model: str, shape: str, num_blocks: int = 12, layers: list[str] = LAYERS):
    """vLLM-allocated CPU caches in `shape`, every byte random; (caches, kernel blocks per block)."""
    layout, kernel = SHAPES[shape]
    config = vllm_config(model, layout=layout)
    kv_config = kv_cache_config(num_blocks, groups=[(full_spec(), layers)], config=config)
    caches = allocate(config, kv_config, fake_backend([kernel]) if kernel else fake_backend())
    ratio = next(iter(caches.values())).shape[0] // num_blocks
    assert ratio == (BLOCK // kernel if kernel else 1)
    storage = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    return caches, ratio


def block_bytes_of(caches, name: str, block_id: int, ratio: int) -> np.ndarray:
    """One layer's bytes of one scheduler block, read independently of the connector."""
    return physical_bytes(caches[name][block_id * ratio:(block_id + 1) * ratio]).numpy()


def stored_form(caches, names: list[str], block_id: int, ratio: int) -> np.ndarray:
    """A store block: each layer's bytes in physical order, layer after layer."""
    return np.concatenate([block_bytes_of(caches, name, block_id, ratio) for name in names])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_step_is_gathered_and_scattered_byte_for_byte_in_every_layout(model, shape):
    """A step's blocks (out of order, the first and the last block of the cache among them, more
    than a slot holds) gathered into registered staging, then loaded back into a zeroed cache in
    chunks, one of them missing from the store. Kills: an off-by-one block id, a scatter into a
    copy of the cache (a reshape of a non-contiguous view), a block stride of one kernel block
    instead of the scheduler block's (kernel splits), and a missing block scattered anyway."""
    caches, ratio = caches_for(model, shape)
    chosen = [11, 0, 5, 3, 7]
    want = {b: stored_form(caches, LAYERS, b, ratio) for b in range(12)}
    with kvstore.open(f"memory://batched-{shape.replace('/', '-')}", dram="16MiB") as store:
        io = KVCacheIO(store.engine, caches, 12, [LAYERS], {n: ratio for n in LAYERS}, staged=True)
        batch = BatchedKV(io, store.engine, capacity=4, layout=SHAPES[shape][0])
        step, overflow = batch.begin_save([(0, b, bytes([b]) * 16, False) for b in chosen])
        assert [b for _, b, _, _ in overflow] == [7]  # a slot holds 4: the fifth goes block by block
        for layer in range(len(LAYERS)):
            step.gather_layer(layer)
        (saved,) = step.finish()
        assert [h for h, _ in saved.blocks] == [bytes([b]) * 16 for b in chosen[:4]]
        for (_, row), b in zip(saved.blocks, chosen):
            assert np.array_equal(row, want[b]), (shape, b)
        saved.release()

        storage = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())
        storage.zero_()
        missing = 3
        reads = []

        def read(start: int, end: int, targets):  # the store, landing each block in its target row
            found = []
            for b, [(region, offset, length)] in zip(chosen[start:end], targets):
                reads.append(b)
                host = np.frombuffer(region.buffer, np.uint8)
                # a block that fails its digest leaves bytes in its row: they must never reach the cache
                host[offset:offset + length] = 0xAB if b == missing else want[b]
                found.append(b != missing)
            return found

        found = batch.load(0, chosen, read, timeout=5)
        assert reads == chosen and found == [b != missing for b in chosen]
        for b in range(12):
            expected = want[b] if b in chosen and b != missing else np.zeros_like(want[b])
            assert np.array_equal(stored_form(caches, LAYERS, b, ratio), expected), (shape, b)
        batch.close(store.engine)
        io.close()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_connector_saves_and_loads_through_staging_in_every_layout(model, shape, monkeypatch):
    """Through the connector under vLLM's Scheduler, caches handled as a device's (host staging):
    a prompt's blocks saved by the batched path and loaded into another request's blocks in a
    zeroed cache (asynchronously, in chunks of two blocks) give back every byte, and what the
    batched path stored is exactly what the per-block path stores (engines of either kind share
    blocks). Kills: a gather that writes a block's layers in another order than the stored form."""
    monkeypatch.setattr(connector_module, "KVCacheIO", functools.partial(KVCacheIO, staged=True))
    layout, kernel = SHAPES[shape]
    h = Harness(model, layout=layout, layers=2, backend=fake_backend([kernel]) if kernel else None,
                sync_load_blocks=0, staging_blocks=2)
    assert h.worker._batch is not None and not h.worker._io.on_host
    torch.manual_seed(0)
    for name, tensor in h.kv_caches.items():
        tensor.copy_(torch.randn(tensor.shape))
    prompt = list(range(5, 5 + 3 * BLOCK + 3))
    h.add("r1", prompt)
    h.step()
    saved_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0][:4]  # 3 full blocks + the partial one
    keys = h.scheduler.connector._requests["r1"].keys[:4]
    names = list(h.kv_caches)
    expected = {name: [h.block(name, b).clone() for b in saved_ids] for name in names}
    h.run_until_empty()
    assert h.worker.totals.data["saved_blocks"] == 4
    io = h.worker._io
    for block_id, block_hash in zip(saved_ids, keys):  # the stored bytes: the per-block path's form
        out = np.zeros(h.block_bytes(), np.uint8)
        assert h.store.get(block_hash, out, fingerprint=h.fingerprint)
        per_block = np.zeros_like(out)
        for layer in range(len(names)):
            io.stage_layer(layer, block_id, per_block)
        assert np.array_equal(out, per_block), block_id
    for tensor in h.kv_caches.values():
        tensor.zero_()
    h.scheduler.reset_prefix_cache()
    request = h.add("r2", prompt)
    deadline = time.monotonic() + 10
    while request.status.name != "RUNNING" and time.monotonic() < deadline:
        h.step()
        time.sleep(0.005)
    assert h.worker.totals.data["hit_tokens"] == len(prompt) - 1 and not h.errors
    loaded_ids = h.scheduler.kv_cache_manager.get_block_ids("r2")[0][:4]
    for name in names:
        for want, b in zip(expected[name], loaded_ids):
            assert torch.equal(h.block(name, b), want), (shape, name, b)
    h.run_until_empty()


@pytest.mark.parametrize("mode", [{"layerwise_load_blocks": 1}, {}])
def test_in_step_and_layer_by_layer_loads_through_staging(model, monkeypatch, mode):
    """In-step loads (whole, and layer by layer from a layer-major slot) land byte for byte."""
    monkeypatch.setattr(connector_module, "KVCacheIO", functools.partial(KVCacheIO, staged=True))
    h = Harness(model, layout="LBNHC", layers=3, **mode)
    prompt = list(range(3, 3 + 3 * BLOCK + 5))
    data = h.seed_store(prompt, 3)
    request = h.add("r1", prompt)
    deadline = time.monotonic() + 10
    while request.status.name != "RUNNING" and time.monotonic() < deadline:
        h.step()
    block_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0]
    names = list(h.kv_caches)
    per_layer = h.block_bytes() // len(names)
    for i in range(3):
        for layer, name in enumerate(names):
            want = data[i].view(np.uint8)[layer * per_layer:(layer + 1) * per_layer]
            assert np.array_equal(physical_bytes(h.block(name, block_ids[i])).numpy(), want)
    assert h.worker.totals.data["loaded_blocks"] == 3 and not h.errors
    h.run_until_empty()


def test_a_failed_staging_allocation_falls_back_block_by_block(model, monkeypatch, caplog):
    """Registered staging that cannot be allocated (pinned memory exhausted) costs speed, never
    a start-up failure or a wrong byte: one warning, the `staging_fallbacks` metric, and the
    per-block path. Kills: a worker that fails to start when its staging cannot be allocated."""
    def no_staging(*args, **kwargs):
        raise StagingUnavailable("pinned host memory: out of memory (test)")

    monkeypatch.setattr(kv_batch.Slot, "__init__", no_staging)
    monkeypatch.setattr(connector_module, "KVCacheIO", functools.partial(KVCacheIO, staged=True))
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm.kv_batch"):
        h = Harness(model, layout="LBNHC", layers=2, sync_load_blocks=0)
    assert h.worker._batch is None and h.worker.totals.data["staging_fallbacks"] == 1
    torch.manual_seed(1)
    for tensor in h.kv_caches.values():
        tensor.copy_(torch.randn(tensor.shape))
    prompt = list(range(8, 8 + 2 * BLOCK + 3))
    h.add("r1", prompt)
    h.step()
    ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0][:3]
    expected = {name: [h.block(name, b).clone() for b in ids] for name in h.kv_caches}
    h.run_until_empty()
    for tensor in h.kv_caches.values():
        tensor.zero_()
    h.scheduler.reset_prefix_cache()
    request = h.add("r2", prompt)
    deadline = time.monotonic() + 10
    while request.status.name != "RUNNING" and time.monotonic() < deadline:
        h.step()
        time.sleep(0.005)
    loaded = h.scheduler.kv_cache_manager.get_block_ids("r2")[0][:3]
    for name in h.kv_caches:
        for want, b in zip(expected[name], loaded):
            assert torch.equal(h.block(name, b), want)
    h.run_until_empty()
    warnings = [r for r in caplog.records if "block by block" in r.getMessage()]
    assert len(warnings) == 1 and h.worker.totals.data["staging_fallbacks"] == 1


def test_saves_never_wait_for_a_slot(model):
    """With both save slots in the store's hands (its writes stalled), the next step's saves go
    block by block and the forward does not wait. Kills: a save path that waits for a slot."""
    h = Harness(model, layers=2, save_queue_mib=64)
    gate = threading.Event()
    put_many = h.store.put_many

    def stalled(*args, **kwargs):
        gate.wait(20)
        return put_many(*args, **kwargs)

    h.store.put_many = stalled
    try:
        for i in range(3):  # three prompts, one step each: two fill the slots, the third finds none
            h.add(f"r{i}", list(range(100 * i, 100 * i + 2 * BLOCK + 3)), max_tokens=1)
            started = time.monotonic()
            h.step()
            assert time.monotonic() - started < 5
        assert not h.worker._batch.save_pool.slots()  # both slots wait for the store
    finally:
        gate.set()
        h.store.put_many = put_many
    h.run_until_empty()
    assert h.worker.totals.data["saved_blocks"] == 9 and h.worker.totals.data["dropped_blocks"] == 0
    assert len(h.worker._batch.save_pool.slots()) == 2  # given back once stored


def test_a_layout_the_gather_cannot_express_is_refused_at_start_naming_it(model):
    """A cache whose blocks' runs are not equally spaced cannot be gathered with one operation:
    refused when the worker registers its caches, naming the layout, never copied wrong. Kills:
    a worker that starts with such caches (a grid taken without checking it against the runs)."""
    config = vllm_config(model)
    kv_config = kv_cache_config(4, groups=[(full_spec(), LAYERS[:1])], config=config)
    allocate(config, kv_config, fake_backend())  # the layer's attention backend, in the forward context
    # [blocks, 3 heads, 2 tokens, 1 channel], heads 5 and tokens 7 elements apart: equal runs at 0, 5, 7, 10, 12
    # and 17, which no grid of equal strides enumerates
    storage = torch.zeros(4 * 32, dtype=torch.float32)
    odd = storage.as_strided((4, 3, 2, 1), (32, 5, 7, 1))
    worker = KVStoreConnector(config, KVConnectorRole.WORKER, kv_config)
    with pytest.raises(UnsupportedKVLayout, match="LBHNC"):
        worker.register_kv_caches({LAYERS[0]: odd})
    worker.shutdown()
