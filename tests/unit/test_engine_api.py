"""The Transfer Engine API in one process: registration, local copies, files, errors."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from transfer import (Engine, EngineClosed, EngineDescriptor, InvalidOp, OutOfBounds, Read, ReadOnlyRegion,
                      TransferIOError, UnknownRegion, UnsupportedBuffer, Write)


@pytest.fixture
def engine():
    with Engine("unit", listen=None) as e:
        yield e


def test_registers_every_supported_buffer(engine):
    torch = pytest.importorskip("torch")
    objects = {
        "numpy": np.arange(100, dtype=np.float32).reshape(10, 10),
        "bytearray": bytearray(b"x" * 64),
        "memoryview": memoryview(bytearray(32)),
        "mmap": mmap.mmap(-1, 8192),
        "torch": torch.arange(50, dtype=torch.int64),
        "bytes": b"read only bytes",
    }
    sizes = {"numpy": 400, "bytearray": 64, "memoryview": 32, "mmap": 8192, "torch": 400, "bytes": 15}
    for name, obj in objects.items():
        region = engine.register(obj)
        assert region.size == sizes[name], name
        assert region.readonly == (name == "bytes"), name


def test_host_view_is_flat_bytes_whatever_the_array_shape(engine):
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    view = engine.register(array).host_view()
    assert view.format == "B" and view.ndim == 1 and len(view) == array.nbytes
    assert bytes(view[16:20]) == np.int32(4).tobytes()  # byte offsets, not rows


def test_rejects_what_cannot_be_registered(engine):
    with pytest.raises(UnsupportedBuffer):
        engine.register(np.arange(100).reshape(10, 10)[:, ::2])  # not contiguous
    with pytest.raises(UnsupportedBuffer):
        engine.register(object())
    with pytest.raises(UnsupportedBuffer):
        engine.register(bytearray())
    with pytest.raises(UnsupportedBuffer):
        engine.allocate(0)


def test_registered_bytearray_cannot_be_resized(engine):
    data = bytearray(1024)
    region = engine.register(data)
    with pytest.raises(BufferError):
        data.extend(b"more")
    engine.unregister(region)
    data.extend(b"more")  # released with the registration


def test_local_copies_between_regions(engine):
    torch = pytest.importorskip("torch")
    src_tensor = torch.arange(1 << 20, dtype=torch.int32)
    src = engine.register(src_tensor)
    dst = engine.allocate(src.size + 3)
    results = engine.transfer([Read(dst, 3, src, 0, src.size)])
    assert results[0].bytes == src.size
    copied = np.frombuffer(dst.buffer, np.uint8)[3:]
    assert np.array_equal(copied, src_tensor.numpy().view(np.uint8))
    back = torch.zeros_like(src_tensor)
    engine.transfer([Write(dst, 3, engine.register(back), 0, src.size)])
    assert torch.equal(back, src_tensor)


@pytest.mark.parametrize("aligned", [True, False])
def test_file_region_round_trip(engine, tmp_path, aligned):
    size = 8 << 20
    path = tmp_path / "tier.bin"
    tier = engine.register_file(path, size)
    assert os.path.getsize(path) == size  # preallocated up front
    raw = mmap.mmap(-1, size)  # page-aligned memory, so O_DIRECT can be used when aligned
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    np.frombuffer(raw, np.uint8)[:] = data
    mem = engine.register(raw)
    off, length = (4096, 4 << 20) if aligned else (4095, (4 << 20) + 3)
    engine.transfer([Write(mem, off, tier, off, length)])
    with open(path, "rb") as f:
        f.seek(off)
        assert f.read(length) == data[off : off + length].tobytes()
    out = engine.allocate(size)
    engine.transfer([Read(out, off, tier, off, length)])
    assert np.array_equal(np.frombuffer(out.buffer, np.uint8)[off : off + length], data[off : off + length])
    assert engine.stats()["file_bytes"] == 2 * length


def test_file_region_errors_are_typed(engine, tmp_path):
    with pytest.raises(TransferIOError):
        engine.register_file(tmp_path / "missing-dir" / "tier.bin", 4096)
    readonly_path = tmp_path / "small.bin"
    readonly_path.write_bytes(b"x" * 100)
    with pytest.raises(TransferIOError):
        engine.register_file(readonly_path, 4096, readonly=True)  # smaller than asked


def test_bounds_readonly_and_unknown_regions(engine):
    a = engine.allocate(4096)
    frozen = engine.register(b"z" * 4096)
    with pytest.raises(OutOfBounds):
        engine.transfer([Read(a, 4000, frozen, 0, 200)])
    with pytest.raises(OutOfBounds):
        engine.transfer([Read(a, 0, frozen, 4000, 200)])
    with pytest.raises(ReadOnlyRegion):
        engine.transfer([Write(a, 0, frozen, 0, 16)])
    with pytest.raises(ReadOnlyRegion):
        engine.transfer([Read(frozen, 0, a, 0, 16)])
    with pytest.raises(InvalidOp):
        engine.submit([Read(a, -1, frozen, 0, 16)])
    with pytest.raises(InvalidOp):
        engine.submit(["not an op"])  # type: ignore[list-item]
    engine.unregister(frozen)
    with pytest.raises(UnknownRegion):
        engine.submit([Read(a, 0, frozen, 0, 16)])
    with pytest.raises(UnknownRegion):
        engine.unregister(frozen)
    with Engine("other", listen=None) as other:
        with pytest.raises(UnknownRegion):
            engine.submit([Read(other.allocate(16), 0, a, 0, 16)])


def test_write_grants_are_checked_and_leave_the_owners_own_copies_alone(engine, tmp_path):
    """Grants apply to regions registered remote_writes="granted", name a peer id, stay inside
    the region and never overlap for one peer; the owner's own (local) copies into regions that
    refuse remote writes still land (the daemon's demotions into its NVMe tier)."""
    granted = engine.allocate(1 << 16, remote_writes="granted")
    tier = engine.register_file(tmp_path / "tier.bin", 1 << 16, remote_writes="none")
    anyone = engine.allocate(4096)
    peer = "ab" * 16
    with pytest.raises(ValueError):
        engine.allocate(4096, remote_writes="sometimes")
    with pytest.raises(InvalidOp):
        engine.grant(peer, anyone, 0, 16)  # anyone may write it: a grant means nothing there
    with pytest.raises(InvalidOp):
        engine.grant(peer, tier, 0, 16)  # no one may
    with pytest.raises(InvalidOp):
        engine.grant("", granted, 0, 16)
    for offset, length in [(-1, 16), (0, 0), (1 << 16, 1), ((1 << 16) - 8, 16)]:
        with pytest.raises(OutOfBounds):
            engine.grant(peer, granted, offset, length)
    engine.grant(peer, granted, 4096, 4096)
    with pytest.raises(InvalidOp):
        engine.grant(peer, granted, 8191, 2)  # overlaps
    engine.grant("cd" * 16, granted, 4096, 4096)  # another peer's grants are its own
    engine.grant(peer, granted, 8192, 4096)  # adjacent
    assert engine.stats()["write_grants"] == 3
    assert engine.revoke(peer, granted, 0, 1 << 16) and engine.stats()["write_grants"] == 1
    assert engine.revoke(peer, granted, 0, 16)  # nothing to revoke: quiet
    assert not engine.landing(peer, granted, 0, 1 << 16)
    src = engine.register(bytearray(b"q" * 4096))
    engine.transfer([Write(src, 0, tier, 0, 4096), Write(src, 0, granted, 0, 4096)])
    assert bytes(granted.buffer[:4]) == b"qqqq"


def test_peer_ids_are_random_and_not_published():
    with Engine("a", secret="s") as a, Engine("b", secret="s") as b:
        assert a.peer_id != b.peer_id and len(a.peer_id) == 32 and int(a.peer_id, 16) >= 0
        assert a.peer_id not in a.export().to_json()


def test_zero_length_ops_complete(engine):
    a, b = engine.allocate(16), engine.allocate(16)
    assert engine.transfer([Read(a, 16, b, 16, 0)])[0].ok


def test_closed_engine_refuses_work():
    engine = Engine("closing", listen=None)
    a = engine.allocate(4096)
    engine.close()
    with pytest.raises(EngineClosed):
        engine.submit([Read(a, 0, a, 0, 16)])
    with pytest.raises(EngineClosed):
        engine.allocate(16)
    with pytest.raises(EngineClosed):
        engine.export()


def test_descriptor_round_trip_and_validation():
    with Engine("listening", insecure=True) as engine:
        desc = engine.export()
        assert EngineDescriptor.from_json(desc.to_json()) == desc
        assert desc.host == "127.0.0.1"  # loopback unless asked otherwise
    with pytest.raises(ValueError):
        EngineDescriptor.parse({"name": "x"})
    with pytest.raises(ValueError):
        Engine("bad", listen="nonsense")


def test_cuda_regions_stage_through_host_memory(engine):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the staging path runs only where one exists")
    device_tensor = torch.arange(4096, dtype=torch.uint8, device="cuda")
    region = engine.register(device_tensor)
    assert region.kind == "cuda"
    host = engine.allocate(4096)
    engine.transfer([Write(region, 0, host, 0, 4096)])
    assert bytes(host.buffer) == bytes(range(256)) * 16
    np.frombuffer(host.buffer, np.uint8)[:] = 7
    engine.transfer([Read(region, 0, host, 0, 4096)])
    assert int(device_tensor.sum().item()) == 7 * 4096
