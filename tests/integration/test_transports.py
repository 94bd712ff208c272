"""Cross-process transfers over each transport, verified byte for byte on the owning side."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests_support import sha

from transfer import Engine, Read, Write

TRANSPORTS = ["shm", "tcp"]
TARGETS = ["shm", "numpy", "file"]


@pytest.fixture
def engine():
    with Engine("initiator", insecure=True, streams=4, stripe_bytes=64 * 1024) as e:
        yield e


def unaligned_ops(size: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Non-overlapping (offset, length) pairs with odd offsets and lengths, covering most of size."""
    ops, offset = [], 3
    while True:
        length = int(rng.choice([1, 7, 4095, 4097, 65_537, 300_001, 1_048_583]))
        if offset + length > size:
            return ops
        ops.append((offset, length))
        offset += length + int(rng.integers(0, 9))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("target", TARGETS)
def test_write_lands_byte_for_byte(engine, spawn_peer, transport, target):
    peer_proc = spawn_peer(size=4 << 20)
    peer = engine.connect(peer_proc.descriptor, transport=transport)
    assert peer.transport == transport
    remote = peer.region(peer_proc.regions[target])
    assert remote.shm == (transport == "shm" and target == "shm")
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, peer_proc.size, dtype=np.uint8)
    local = engine.register(source)
    expected = peer_proc.expected()
    pairs = unaligned_ops(peer_proc.size, rng)
    results = engine.transfer([Write(local, off, remote, off, n) for off, n in pairs])
    assert [r.bytes for r in results] == [n for _, n in pairs]
    for off, n in pairs:
        expected[off : off + n] = source[off : off + n]
    assert peer_proc.sha(target) == sha(expected)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("target", TARGETS)
def test_read_returns_peer_bytes(engine, spawn_peer, transport, target):
    peer_proc = spawn_peer(size=4 << 20, seed=11)
    peer = engine.connect(peer_proc.descriptor, transport=transport)
    remote = peer.region(peer_proc.regions[target])
    local = engine.allocate(peer_proc.size + 5)
    pairs = unaligned_ops(peer_proc.size, np.random.default_rng(3))
    # Land each piece at a shifted local offset so misplaced bytes cannot pass.
    engine.transfer([Read(local, off + 2, remote, off, n) for off, n in pairs])
    got = np.frombuffer(local.buffer, np.uint8)
    expected = peer_proc.expected()
    for off, n in pairs:
        assert np.array_equal(got[off + 2 : off + 2 + n], expected[off : off + n]), (off, n)


def test_large_op_striped_across_streams(engine, spawn_peer):
    size = 24 << 20
    peer_proc = spawn_peer(size=size, seed=5)
    peer = engine.connect(peer_proc.descriptor, transport="tcp", streams=3)
    remote = peer.region(peer_proc.regions["numpy"])
    length = size - 12_345  # not a multiple of the stripe or the page
    src = engine.register(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8))
    before = engine.stats()["tcp_tx_bytes"]
    engine.transfer([Write(src, 12_345, remote, 12_345, length)])
    assert engine.stats()["tcp_tx_bytes"] - before == length
    per_stream = peer.stream_bytes()
    assert len(per_stream) == 3 and sum(per_stream) == length
    assert min(per_stream) >= length // 6, per_stream  # every stream carried a fair share of the one op
    expected = peer_proc.expected()
    expected[12_345:] = np.frombuffer(src.buffer, np.uint8)[12_345:]
    assert peer_proc.sha("numpy") == sha(expected)
    dst = engine.allocate(size)
    engine.transfer([Read(dst, 1, remote, 0, size - 1)])
    assert sha(np.frombuffer(dst.buffer, np.uint8)[1:]) == sha(expected[: size - 1])


def test_many_small_ops_in_one_batch(engine, spawn_peer):
    peer_proc = spawn_peer(size=8 << 20, seed=9)
    peer = engine.connect(peer_proc.descriptor, transport="tcp", streams=2)
    remote = peer.region(peer_proc.regions["shm"])
    dst = engine.allocate(peer_proc.size)
    n = 4000
    ops = [Read(dst, i * 2048, remote, i * 2048, 2048 - (i % 5)) for i in range(n)]
    results = engine.submit(ops).wait(30)
    assert all(r.ok for r in results)
    got, expected = np.frombuffer(dst.buffer, np.uint8), peer_proc.expected()
    for i in range(0, n, 97):
        off, length = i * 2048, 2048 - (i % 5)
        assert np.array_equal(got[off : off + length], expected[off : off + length])


def test_same_host_shm_moves_no_tcp_bytes(engine, spawn_peer):
    peer_proc = spawn_peer(size=1 << 20)
    peer = engine.connect(peer_proc.descriptor)  # auto
    assert peer.transport == "shm"
    remote = peer.region(peer_proc.regions["shm"])
    dst = engine.allocate(peer_proc.size)
    engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)])
    stats = engine.stats()
    assert stats["local_bytes"] == peer_proc.size and stats["tcp_rx_bytes"] == 0
    assert sha(dst.buffer) == sha(peer_proc.expected())


def test_await_batch(engine, spawn_peer):
    peer_proc = spawn_peer(size=1 << 20)
    peer = engine.connect(peer_proc.descriptor, transport="tcp")
    dst = engine.allocate(peer_proc.size)

    async def fetch():
        return await engine.submit([Read(dst, 0, peer.region(peer_proc.regions["numpy"]), 0, peer_proc.size)])

    results = asyncio.run(fetch())
    assert results[0].ok and sha(dst.buffer) == sha(peer_proc.expected())


def test_odd_pieces_into_and_out_of_a_peers_shared_memory(engine, spawn_peer):
    """Same-host copies of pieces of odd sizes and offsets into a peer's mapped region land whole,
    and read back as written."""
    peer_proc = spawn_peer(size=4 << 20, seed=5)
    remote = engine.connect(peer_proc.descriptor, transport="shm").region(peer_proc.regions["shm"])
    rng = np.random.default_rng(1)
    source = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    local = engine.register(source)
    pieces = [(0, 1 << 20), (1 << 20, (2 << 20) - 5), ((3 << 20) - 5, 5)]
    engine.submit([Write(local, off, remote, off, n) for off, n in pieces]).wait(10)
    landed = engine.allocate(3 << 20)
    engine.submit([Read(landed, off, remote, off, n) for off, n in pieces]).wait(10)
    assert bytes(landed.host_view()) == source.tobytes()
    expected = peer_proc.expected()
    expected[: 3 << 20] = source
    assert peer_proc.sha("shm") == sha(expected)
