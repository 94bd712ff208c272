"""The batched copy path's CUDA branches (device staging, the copy into the slot, the host-to-device
copy before a scatter, `index_copy_`), run on this CPU machine with CPU tensors standing in for the
device and streams and events that do nothing (CPU copies are synchronous): the offsets, ranges and
views of the device path, byte for byte in every layout and kernel split. What only a GPU can show
(stream ordering, pinned copies) is scripts/gpu-check.sh's."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from benchmarks import kv_copy
from kvstore.integrations.vllm.kv_batch import BatchedKV
from kvstore.integrations.vllm.kv_cache_io import KVCacheIO
from transfer import Engine


class Nothing:
    def wait_stream(self, other) -> None: ...

    def wait_event(self, event) -> None: ...

    def record(self, stream=None) -> None: ...

    def synchronize(self) -> None: ...


@pytest.fixture
def device_branches(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: Nothing())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Nothing())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Nothing())


def physical(block: torch.Tensor) -> torch.Tensor:
    order = sorted(range(block.dim()), key=lambda d: -block.stride(d))
    return block.permute(order).contiguous().view(-1).view(torch.uint8)


def on_device(batch: BatchedKV) -> BatchedKV:
    """Take the CUDA branches: device staging buffers (CPU memory here) and streams that do nothing."""
    batch.cuda = True
    batch._save_device = torch.zeros(batch.slot_bytes, dtype=torch.uint8)
    batch._load_device = torch.zeros(batch.slot_bytes, dtype=torch.uint8)
    batch._save_stream = batch._load_stream = Nothing()
    batch.ids = lambda ids, stream=None: torch.tensor(list(ids), dtype=torch.int64)
    return batch


@pytest.mark.parametrize("shape", list(kv_copy.SHAPES))
def test_the_device_branches_move_every_byte(device_branches, shape):
    """Save (device gather, one copy into the slot), load (one copy to the device, the scatters,
    a missing block never written) and a layer-by-layer load, every block compared with an
    independent read. Kills: a copy into the slot or onto the device that covers part of the
    used range, and a scatter of the device staging at another row stride."""
    layout, ratio = kv_copy.SHAPES[shape]
    with Engine("cuda-branches", listen=None) as engine:
        for block_tokens in (16, 64):
            caches = kv_copy.kv_caches(layout, 3, 12, 2, block_tokens, 128, "cpu", torch.bfloat16, ratio)
            kv_copy.fill_random(caches)
            names = list(caches)
            storage = torch.empty(0, dtype=torch.uint8).set_(caches[names[0]].untyped_storage())

            def stored(b: int) -> torch.Tensor:
                return torch.cat([physical(caches[n][b * ratio:(b + 1) * ratio]) for n in names])

            want = {b: stored(b) for b in range(12)}
            io = KVCacheIO(engine, caches, 12, [names], {n: ratio for n in names}, staged=True)
            batch = on_device(BatchedKV(io, engine, 4, layout))
            chosen, missing = [11, 0, 5, 3, 7], 3
            step, _ = batch.begin_save([(0, b, bytes([b]) * 16, False) for b in chosen])
            for layer in range(len(names)):
                step.gather_layer(layer)
            (saved,) = step.finish()
            saved.ready()
            for (_, row), b in zip(saved.blocks, chosen):
                assert np.array_equal(row, want[b].numpy()), (shape, block_tokens, "saved", b)
            saved.release()

            storage.zero_()

            def read(start: int, end: int, targets: list) -> list[bool]:
                for b, [(region, offset, length)] in zip(chosen[start:end], targets):
                    np.frombuffer(region.buffer, np.uint8)[offset:offset + length] = \
                        0xAB if b == missing else want[b].numpy()
                return [b != missing for b in chosen[start:end]]

            assert batch.load(0, chosen, read, timeout=5) == [b != missing for b in chosen]
            for b in range(12):
                expected = want[b] if b in chosen and b != missing else torch.zeros_like(want[b])
                assert torch.equal(stored(b), expected), (shape, block_tokens, "loaded", b)

            storage.zero_()
            lease = batch.layer_load(0, chosen[:4])
            per_layer = io.geometry[0].block_bytes
            for j, b in enumerate(chosen[:4]):
                for i, (region, offset, length) in enumerate(lease.targets[j]):
                    np.frombuffer(region.buffer, np.uint8)[offset:offset + length] = \
                        want[b].numpy()[i * per_layer:(i + 1) * per_layer]
            for layer in lease.layers:
                lease.scatter_layer(layer)
            lease.close(cancelled=False)
            for b in chosen[:4]:
                assert torch.equal(stored(b), want[b]), (shape, block_tokens, "layer by layer", b)
            batch.close(engine)
            io.close()
