"""CUDA regions without a second host hop (transfer/cuda_direct.py), on this CPU machine: a
region whose "device" tensor is a CPU tensor stands in for a CUDA region (its registered memory is
its host staging, as for a real one), so what is checked is the routing: an op between it and host
memory of this process copies device <-> that memory directly and never touches the staging;
every other op, and an op the native engine must refuse, takes the path it took before. The
device copies themselves run in scripts/gpu-check.sh on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from transfer import Engine, OutOfBounds, Read, ReadOnlyRegion, Write

torch = pytest.importorskip("torch")


@pytest.fixture
def engine():
    with Engine("cuda-direct", listen=None) as e:
        yield e


def standin(engine: Engine, device: "torch.Tensor"):
    """A CUDA region as Engine.register makes one, its device memory a CPU tensor: (region, staging)."""
    staging = torch.zeros(device.numel() * device.element_size(), dtype=torch.uint8)
    region = engine.register(staging, remote_access=False)
    region.kind, region._cuda_tensor = "cuda", device
    return region, staging


def test_device_to_host_and_back_skip_the_staging(engine):
    """Kills: the staged route (device -> staging -> host: the host gets the stale staging bytes)."""
    device = torch.arange(1 << 16, dtype=torch.int32)
    region, staging = standin(engine, device)
    host = engine.allocate(device.numel() * 4)
    results = engine.transfer([Write(region, 4096, host, 0, 8192), Write(region, 0, host, 8192, 4096)])
    assert [r.ok for r in results] == [True, True]
    landed = np.frombuffer(host.buffer, np.uint8)
    assert landed[:8192].tobytes() == device.view(torch.uint8)[4096:12288].numpy().tobytes()
    assert landed[8192:12288].tobytes() == device.view(torch.uint8)[:4096].numpy().tobytes()
    assert not staging.any()  # never went through the staging copy
    landed[:] = 9
    engine.transfer([Read(region, 0, host, 0, 1 << 16)])
    assert bool((device.view(torch.uint8)[:1 << 16] == 9).all()) and not staging.any()


def test_direct_and_native_ops_in_one_batch_report_in_order(engine):
    """Kills: results of a mixed batch shifted by the ops done before submission."""
    device = torch.full((4096,), 5, dtype=torch.uint8)
    region, _ = standin(engine, device)
    a, b = engine.allocate(4096), engine.register(np.zeros(4096, np.uint8), remote_access=False)
    np.frombuffer(a.buffer, np.uint8)[:] = 1
    batch = engine.submit([Write(a, 0, b, 0, 1024), Write(region, 0, a, 1024, 1024), Write(a, 2048, b, 2048, 512)])
    results = batch.wait(5)
    assert len(batch) == 3 and [r.bytes for r in results] == [1024, 1024, 512]
    assert len(batch.results()) == 3 and all(r.ok for r in batch.results())
    assert (np.frombuffer(a.buffer, np.uint8)[1024:2048] == 5).all()


def test_ops_the_engine_refuses_are_refused_as_before(engine):
    """Out of bounds, or into read-only memory: not copied directly, the native engine's typed
    error, nothing written. Kills: a direct copy that skips the bounds or read-only check."""
    device = torch.full((4096,), 3, dtype=torch.uint8)
    region, _ = standin(engine, device)
    host = engine.allocate(4096)
    with pytest.raises(OutOfBounds):
        engine.transfer([Write(region, 0, host, 2048, 4096)])
    readonly = engine.register(b"\0" * 4096, remote_access=False)
    with pytest.raises(ReadOnlyRegion):
        engine.transfer([Write(region, 0, readonly, 0, 4096)])
    assert not np.frombuffer(host.buffer, np.uint8).any()


def test_a_host_region_used_for_device_copies_is_released_cleanly(engine):
    """Its tensor view goes with it: unregistering does not leave its memory exported."""
    device = torch.full((4096,), 3, dtype=torch.uint8)
    region, _ = standin(engine, device)
    data = bytearray(4096)
    host = engine.register(data, remote_access=False)
    engine.transfer([Write(region, 0, host, 0, 4096)])
    assert host._host_tensor is not None and data[0] == 3
    engine.unregister(host)
    assert host._host_tensor is None
    data.extend(b"resizable again")  # no export of it left behind


def test_closing_the_engine_unpins_the_host_memory_it_pinned(monkeypatch):
    """Kills: Engine.close dropping its regions without cudaHostUnregister. The registration then
    outlives the mapping, and CUDA takes the next memory mapped at those addresses for pinned
    memory, copying through the old pages (on an H200: pageable copies at the pinned rate, then
    "resource already mapped")."""
    from transfer import cuda_direct

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, pointer, size, flags):
            calls.append(("register", pointer, size))
            return 0

        def cudaHostUnregister(self, pointer):
            calls.append(("unregister", pointer))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    engine = Engine("cuda-direct-close", listen=None)
    device = torch.full((4096,), 3, dtype=torch.uint8)
    region, _ = standin(engine, device)
    host, kept = engine.allocate(4096), engine.allocate(8192)
    engine.transfer([Write(region, 0, host, 0, 4096), Write(region, 0, kept, 0, 4096)])
    pointers = {cuda_direct.host_tensor(r).data_ptr() for r in (host, kept)}
    assert {(c[0], c[1]) for c in calls} == {("register", p) for p in pointers}
    engine.unregister(host)  # the one way that unpinned before
    engine.close()
    assert sorted(c[1] for c in calls if c[0] == "unregister") == sorted(pointers)
    assert not host._pinned and not kept._pinned
