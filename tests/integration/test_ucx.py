"""The ucx route against a peer in another process: the transport matrix byte for byte, refusals, a peer
killed mid-transfer, a stalled peer, route selection. UCX_TLS values:
  tcp     RMA emulated by UCX over TCP (the target's worker answers)
  sm,tcp  shared memory on the host, but with peer-failure handling UCX still emulates RMA over tcp/lo
  sm      true one-sided RMA (cma: process_vm_readv/writev), only with the opt-in that accepts UCX
          aborting this process if the peer dies mid-transfer (UCX has no peer-failure handling there)
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests_support import sha, wait_until_stopped
from transfer import Engine, EngineClosed, OutOfBounds, PeerUnreachable, Read, ReadOnlyRegion, RemoteRegion, TransferTimeout, Write
from transfer.ucx import UNSAFE_ENV
from transfer.ucx_routes import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
TLS = ["tcp", "sm,tcp", "sm"]
TARGETS = ["shm", "numpy", "file"]


def use_tls(monkeypatch, tls: str) -> str:
    monkeypatch.setenv("UCX_TLS", tls)  # what the peer process (ucx="auto") will use
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    if tls == "sm":
        monkeypatch.setenv(UNSAFE_ENV, "1")
    return tls


@pytest.fixture(params=TLS)
def tls(request, monkeypatch) -> str:
    return use_tls(monkeypatch, request.param)


@pytest.fixture(params=[t for t in TLS if t != "sm"])
def stalling_tls(request, monkeypatch) -> str:
    """Where a stopped peer leaves ops in flight: over sm alone cma reads a stopped process at once."""
    return use_tls(monkeypatch, request.param)


@pytest.fixture
def engine(tls):
    with Engine("initiator", insecure=True, ucx=tls, stall_timeout=2.0) as e:
        yield e


def unaligned_ops(size: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    ops, offset = [], 3
    while True:
        length = int(rng.choice([1, 7, 4095, 4097, 65_537, 300_001, 1_048_583]))
        if offset + length > size:
            return ops
        ops.append((offset, length))
        offset += length + int(rng.integers(0, 9))


@pytest.mark.parametrize("target", TARGETS)
def test_write_lands_byte_for_byte(engine, spawn_peer, target):
    peer_proc = spawn_peer(size=4 << 20)
    peer = engine.connect(peer_proc.descriptor, transport="ucx")
    assert peer.transport == "ucx"
    remote = peer.region(peer_proc.regions[target])
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, peer_proc.size, dtype=np.uint8)
    local = engine.register(source)
    pairs = unaligned_ops(peer_proc.size, rng)
    before = engine.stats()["tcp_tx_bytes"]
    results = engine.transfer([Write(local, off, remote, off, n) for off, n in pairs])
    assert [r.bytes for r in results] == [n for _, n in pairs]
    # Memory targets move by UCX put (no byte on our TCP streams); file regions have no rkey: TCP streams.
    moved_by_tcp = engine.stats()["tcp_tx_bytes"] - before
    assert moved_by_tcp == (sum(n for _, n in pairs) if target == "file" else 0)
    expected = peer_proc.expected()
    for off, n in pairs:
        expected[off : off + n] = source[off : off + n]
    assert peer_proc.sha(target) == sha(expected)


def test_a_write_reported_done_has_landed_at_the_peer(engine, spawn_peer):
    # A put completes locally before its bytes reach the peer (UCX's tcp emulation buffers 4 MiB):
    # without the endpoint flush, 36 of 40 of these whole-region writes were not there yet.
    peer_proc = spawn_peer(size=4 << 20)
    remote = engine.connect(peer_proc.descriptor, transport="ucx").region(peer_proc.regions["shm"])
    rng = np.random.default_rng(1)
    for _ in range(12):
        source = rng.integers(0, 256, peer_proc.size, dtype=np.uint8)
        local = engine.register(source)
        engine.transfer([Write(local, 0, remote, 0, peer_proc.size)])
        assert peer_proc.sha("shm") == sha(source)
        engine.unregister(local)


@pytest.mark.parametrize("target", TARGETS)
def test_read_returns_peer_bytes(engine, spawn_peer, target):
    peer_proc = spawn_peer(size=4 << 20, seed=11)
    peer = engine.connect(peer_proc.descriptor, transport="ucx")
    remote = peer.region(peer_proc.regions[target])
    local = engine.register(np.zeros(peer_proc.size + 5, np.uint8))
    pairs = unaligned_ops(peer_proc.size, np.random.default_rng(3))
    engine.transfer([Read(local, off + 2, remote, off, n) for off, n in pairs])  # shifted: misplaced bytes fail
    got, expected = np.frombuffer(local.buffer, np.uint8), peer_proc.expected()
    for off, n in pairs:
        assert np.array_equal(got[off + 2 : off + 2 + n], expected[off : off + n]), (off, n)


def test_out_of_bounds_and_read_only_are_refused(engine, spawn_peer):
    peer_proc = spawn_peer(size=1 << 20, seed=4)
    peer = engine.connect(peer_proc.descriptor, transport="ucx")
    good = peer.region(peer_proc.regions["numpy"])
    frozen = peer.region(peer_proc.regions["readonly"])
    src = engine.register(np.full(8192, 0xEE, np.uint8))
    with pytest.raises(OutOfBounds):
        engine.transfer([Write(src, 0, good, good.size - 10, 11)])
    lying = RemoteRegion(peer, good.id, good.size * 2)  # a size the peer never advertised
    with pytest.raises(OutOfBounds):
        engine.transfer([Read(src, 0, lying, good.size, 16)])
    with pytest.raises(OutOfBounds):
        engine.transfer([Read(src, 8000, good, 0, 200)])  # past our own region
    with pytest.raises(ReadOnlyRegion):
        engine.transfer([Write(src, 0, frozen, 0, 16)])
    results = engine.submit([Read(src, 0, good, 0, 4096), Write(src, 0, frozen, 0, 8),
                             Read(src, 4096, good, 4096, 4096)]).wait(10, raise_on_error=False)
    assert [r.ok for r in results] == [True, False, True] and results[1].error == "read-only region"
    assert peer_proc.sha("readonly") == sha(peer_proc.expected()[:65536])
    assert peer_proc.sha("numpy") == sha(peer_proc.expected())
    assert sha(src.buffer) == sha(peer_proc.expected()[:8192])


def test_peer_killed_mid_transfer_fails_fast_and_engine_survives(engine, spawn_peer, tls):
    if tls == "sm":
        pytest.skip("UCX_TLS=sm has no peer-failure handling: UCX itself aborts the process (why it is opt-in)")
    victim = spawn_peer(size=16 << 20)
    survivor = spawn_peer(size=1 << 20, seed=2)
    peer = engine.connect(victim.descriptor, transport="ucx")
    remote = peer.region(victim.regions["numpy"])
    dst = engine.register(np.zeros(victim.size, np.uint8))
    batch = engine.submit([Read(dst, 0, remote, 0, victim.size) for _ in range(64)])  # 1 GiB
    time.sleep(0.05)
    victim.kill()
    started = time.monotonic()
    with pytest.raises((PeerUnreachable, TransferTimeout)):
        batch.wait(15)
    assert time.monotonic() - started < 5.0
    with pytest.raises(PeerUnreachable):
        engine.transfer([Read(dst, 0, remote, 0, 4096)])
    other = engine.connect(survivor.descriptor, transport="ucx")
    engine.transfer([Read(dst, 0, other.region(survivor.regions["numpy"]), 0, survivor.size)])
    assert sha(np.frombuffer(dst.buffer, np.uint8)[: survivor.size]) == sha(survivor.expected())


def test_a_peer_that_died_before_the_batch_is_refused_not_fatal(engine, spawn_peer, tls):
    """Over UCX_TLS=sm (no peer-failure handling) a copy into a dead process makes UCX abort this one,
    so the native route checks the peer's control socket once a batch and refuses instead."""
    victim = spawn_peer(size=1 << 20)
    peer = engine.connect(victim.descriptor, transport="ucx")
    remote = peer.region(victim.regions["numpy"])
    dst = engine.register(np.zeros(victim.size, np.uint8))
    engine.transfer([Read(dst, 0, remote, 0, 4096)])
    victim.kill()
    with pytest.raises(PeerUnreachable):
        engine.transfer([Read(dst, 0, remote, 0, 4096)], timeout=10)


def test_a_batch_that_outlives_its_engine_fails_and_never_touches_ucx_again(spawn_peer, stalling_tls):
    """The engine's close lets UCX go (ucxx destroys the worker): a batch still in flight then fails
    with EngineClosed, and waiting on it or dropping it later calls nothing of the dead worker."""
    peer_proc = spawn_peer(size=1 << 20)
    engine = Engine("short-lived", insecure=True, ucx=stalling_tls, stall_timeout=30.0)
    remote = engine.connect(peer_proc.descriptor, transport="ucx").region(peer_proc.regions["numpy"])
    dst = engine.register(np.zeros(peer_proc.size, np.uint8))
    os.kill(peer_proc.proc.pid, signal.SIGSTOP)
    wait_until_stopped(peer_proc.proc.pid)
    try:
        batch = engine.submit([Read(dst, 0, remote, 0, peer_proc.size)])
        assert not batch.done()
        engine.close()
        with pytest.raises(EngineClosed):
            batch.wait(5)
        del batch
    finally:
        os.kill(peer_proc.proc.pid, signal.SIGCONT)


def test_a_transfer_given_up_before_the_stall_time_leaves_no_late_bytes(spawn_peer, stalling_tls):
    """transfer(timeout) shorter than the stall time: the op is abandoned, its endpoint retired and its
    request waited out, so the peer resuming later writes nothing into the caller's buffer."""
    peer_proc = spawn_peer(size=1 << 20)
    with Engine("impatient", insecure=True, ucx=stalling_tls, stall_timeout=30.0) as engine:
        remote = engine.connect(peer_proc.descriptor, transport="ucx").region(peer_proc.regions["numpy"])
        buf = np.zeros(peer_proc.size, np.uint8)
        dst = engine.register(buf)
        os.kill(peer_proc.proc.pid, signal.SIGSTOP)
        wait_until_stopped(peer_proc.proc.pid)
        try:
            with pytest.raises(TransferTimeout):
                engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)], timeout=0.5)
        finally:
            os.kill(peer_proc.proc.pid, signal.SIGCONT)
        time.sleep(0.5)
        for _ in range(100):  # progress the worker as a late get would need
            engine._ucx.progress()
            time.sleep(0.002)
        assert not buf.any()
        engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)])  # over the peer's TCP streams now
        assert sha(buf) == sha(peer_proc.expected())


def test_retiring_the_endpoint_while_other_threads_transfer(engine, spawn_peer, tls):
    """A failed batch retires its endpoint (closing it, destroying its rkeys) while other threads
    may be issuing ops on it: they finish, fail cleanly or move to TCP, never touch a dead handle
    (this crashed the process in about half of such rounds before the native route waited out ops
    being issued)."""
    import threading

    peer_proc = spawn_peer(size=1 << 20)
    dsts = [engine.register(np.zeros(peer_proc.size, np.uint8)) for _ in range(2)]
    outcomes: list[str] = []
    for _ in range(4):
        peer = engine.connect(peer_proc.descriptor, transport="ucx")
        remote = peer.region(peer_proc.regions["numpy"])
        stop = threading.Event()

        def work(dst) -> None:
            while not stop.is_set():
                try:
                    engine.transfer([Read(dst, k * 64, remote, k * 64, 64) for k in range(8000)], timeout=10)
                    outcomes.append("ok")
                except PeerUnreachable:
                    outcomes.append("unreachable")

        threads = [threading.Thread(target=work, args=(d,)) for d in dsts]
        for t in threads:
            t.start()
        time.sleep(0.3)
        peer.retire_ucx()
        time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        engine.transfer([Read(dsts[0], 0, remote, 0, peer_proc.size)])  # TCP streams after the retire
        assert sha(dsts[0].buffer) == sha(peer_proc.expected())
        peer.close()
    assert "ok" in outcomes


def test_stalled_peer(engine, spawn_peer, tls):
    """tcp, sm+tcp: UCX emulates RMA with the target's help, so a stopped target times out in the
    stall time. sm: RMA is truly one-sided (cross-memory attach), so a stopped target is still read."""
    peer_proc = spawn_peer(size=1 << 20)
    peer = engine.connect(peer_proc.descriptor, transport="ucx")
    remote = peer.region(peer_proc.regions["numpy"])
    dst = engine.register(np.zeros(peer_proc.size, np.uint8))
    os.kill(peer_proc.proc.pid, signal.SIGSTOP)
    wait_until_stopped(peer_proc.proc.pid)
    try:
        started = time.monotonic()
        if tls != "sm":
            with pytest.raises(TransferTimeout):
                engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)], timeout=10)
            assert 1.9 < time.monotonic() - started < 6.0
            os.kill(peer_proc.proc.pid, signal.SIGCONT)
            time.sleep(0.5)  # the resumed peer answers; the retired endpoint must drop the late bytes
            assert not np.frombuffer(dst.buffer, np.uint8).any()
            engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)])  # on the peer's TCP streams now
            assert sha(dst.buffer) == sha(peer_proc.expected())
        else:
            engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)], timeout=10)
            assert sha(dst.buffer) == sha(peer_proc.expected())
    finally:
        os.kill(peer_proc.proc.pid, signal.SIGCONT)


def test_auto_route(engine, spawn_peer, tls):
    """Same host: shm first. ucx over tcp alone is never picked by auto (only RDMA or shared memory)."""
    peer_proc = spawn_peer(size=1 << 20)
    assert engine.connect(peer_proc.descriptor).transport == "shm"
    via_network = engine.connect(peer_proc.descriptor, transport="tcp")
    assert via_network.transport == "tcp"


def test_shared_memory_only_ucx_needs_the_opt_in(spawn_peer, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "sm")
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    peer_proc = spawn_peer(size=1 << 20)
    with Engine("cautious", insecure=True, ucx="sm") as engine:
        with pytest.raises(PeerUnreachable, match="peer-failure handling"):
            engine.connect(peer_proc.descriptor, transport="ucx")


def test_forced_ucx_against_a_peer_without_ucx(spawn_peer, monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    peer_proc = spawn_peer(size=1 << 20)  # no RDMA device here and UCX_TLS unset: no ucx route
    with Engine("plain", insecure=True, ucx="tcp") as engine:
        with pytest.raises(PeerUnreachable, match="no UCX route"):
            engine.connect(peer_proc.descriptor, transport="ucx")
        assert engine.connect(peer_proc.descriptor, transport="auto").transport == "shm"


def test_cuda_regions_over_ucx(engine, spawn_peer):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: CUDA <-> CUDA and CUDA <-> host over ucx need a GPU")
    if not engine._ucx.cuda:
        pytest.skip("this UCX build has no CUDA support: CUDA regions use the pinned staging copy")
    peer_proc = spawn_peer(size=1 << 20, seed=6)
    peer = engine.connect(peer_proc.descriptor, transport="ucx")
    remote = peer.region(peer_proc.regions["numpy"])
    device = torch.zeros(peer_proc.size, dtype=torch.uint8, device="cuda")
    region = engine.register(device)
    assert region._ucx is not None and region._ucx.cuda  # device memory mapped itself, no bounce
    engine.transfer([Read(region, 0, remote, 0, peer_proc.size)])  # host (peer) -> CUDA
    assert sha(device.cpu().numpy()) == sha(peer_proc.expected())
    device.add_(1)
    engine.transfer([Write(region, 0, remote, 0, peer_proc.size)])  # CUDA -> host (peer)
    assert peer_proc.sha("numpy") == sha((peer_proc.expected() + 1).astype(np.uint8))
    other = torch.zeros_like(device)
    mirror = engine.register(other)
    with Engine("gpu-peer", insecure=True, ucx=engine._ucx.tls) as second:  # CUDA <-> CUDA
        target = second.register(torch.zeros_like(device))
        link = engine.connect(second.export(), transport="ucx")
        engine.transfer([Write(region, 0, link.region(target.id), 0, peer_proc.size)])
        engine.transfer([Read(mirror, 0, link.region(target.id), 0, peer_proc.size)])
    assert torch.equal(other, device)
