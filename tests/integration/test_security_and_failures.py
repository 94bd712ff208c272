"""Authentication, bounds checks on the owning side, and peers that die or stall mid-batch."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import time

import numpy as np
import pytest

from tests_support import sha, wait_until_stopped
from transfer import (AuthenticationFailed, Engine, OutOfBounds, PeerUnreachable,
                      Read, ReadOnlyRegion, RemoteRegion, TransferTimeout, UnknownRegion, Write)
from transfer.auth import recv_frame, send_frame


def test_right_secret_connects_and_moves_bytes(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20, secret="cluster-secret")
    with Engine("a", listen=None, secret="cluster-secret") as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp")
        dst = engine.allocate(4096)
        engine.transfer([Read(dst, 0, peer.region(peer_proc.regions["numpy"]), 0, 4096)])
        assert sha(dst.buffer) == sha(peer_proc.expected()[:4096])


@pytest.mark.parametrize("secret", [None, "wrong-secret"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_wrong_or_missing_secret_is_refused_and_touches_nothing(spawn_peer, secret, transport):
    peer_proc = spawn_peer(size=1 << 20, secret="cluster-secret")
    before = {name: peer_proc.sha(name) for name in ("shm", "numpy", "file")}
    with Engine("intruder", listen=None, secret=secret) as engine:
        with pytest.raises(AuthenticationFailed):
            engine.connect(peer_proc.descriptor, transport=transport)
    assert {name: peer_proc.sha(name) for name in before} == before


def raw_write(region: int, offset: int = 0, length: int = 4096) -> bytes:
    """A plaintext data-plane write request, as an attacker would forge it."""
    return struct.pack("<IB3xQQQ", 0x4B565431, 2, region, offset, length) + b"\xff" * length


def closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except OSError:
        return False


@pytest.mark.parametrize("proof", ["forged", "none"])
def test_server_refuses_a_client_that_fails_the_challenge(spawn_peer, proof):
    """A hand-made client that ignores the server's verdict: the server itself must refuse it
    (the client-side check cannot save us here) and never serve its data requests."""
    peer_proc = spawn_peer(size=1 << 20, secret="cluster-secret")
    before = peer_proc.sha("numpy")
    desc = json.loads(peer_proc.descriptor)
    with socket.create_connection((desc["host"], desc["port"]), timeout=5) as sock:
        send_frame(sock, {"hello": 2, "role": "data", "name": "mallory", "nonce": os.urandom(32).hex(),
                          "wire": "plain"})
        recv_frame(sock)  # the server's hello
        if proof == "forged":
            send_frame(sock, {"mac": os.urandom(32).hex()})
            assert recv_frame(sock).get("ok") is False
        try:  # carry on as if accepted: raw data requests straight after
            sock.sendall(raw_write(peer_proc.regions["numpy"]) * 4)
        except OSError:
            pass
        assert closed_by_server(sock)
    assert peer_proc.sha("numpy") == before


def test_out_of_bounds_and_unknown_regions_are_refused_by_the_owner(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20)
    before = {name: peer_proc.sha(name) for name in ("shm", "numpy", "file", "readonly", "private")}
    with Engine("a", listen=None) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp")
        src = engine.register(np.full(2 << 20, 0xAB, np.uint8))
        size = peer_proc.size
        # Lie about the sizes on our side so only the owner's checks stand in the way.
        for name in ("numpy", "file", "shm"):
            huge = RemoteRegion(peer, peer_proc.regions[name], size * 4)
            for op in (Write(src, 0, huge, size - 100, 200), Write(src, 0, huge, size + 1, 10),
                       Write(src, 0, huge, 2**63, 1), Read(src, 0, huge, size, 1),
                       # offset + length wraps past 2**64 to a small number: only an overflow-safe check stops it
                       Write(src, 0, huge, 2**64 - 100, 200), Read(src, 0, huge, 2**64 - 4096, 8192)):
                with pytest.raises(OutOfBounds):
                    engine.transfer([op])
        for rid in (999_999, peer_proc.regions["private"]):
            with pytest.raises(UnknownRegion):
                engine.transfer([Write(src, 0, RemoteRegion(peer, rid, size), 0, 16)])
        with pytest.raises(UnknownRegion):
            peer.region(peer_proc.regions["private"])  # not exported, so not even listed
        with pytest.raises(ReadOnlyRegion):
            engine.transfer([Write(src, 0, peer.region(peer_proc.regions["readonly"]), 0, 16)])
        # The connection survives refusals: a valid op right after still works.
        dst = engine.allocate(4096)
        engine.transfer([Read(dst, 0, peer.region(peer_proc.regions["numpy"]), 0, 4096)])
        assert sha(dst.buffer) == sha(peer_proc.expected()[:4096])
    assert {name: peer_proc.sha(name) for name in before} == before


def test_mixed_batch_reports_each_op(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20)
    with Engine("a", listen=None) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp")
        dst = engine.allocate(8192)
        good = peer.region(peer_proc.regions["numpy"])
        bad = RemoteRegion(peer, good.id, good.size * 2)
        results = engine.submit([Read(dst, 0, good, 0, 4096), Read(dst, 4096, bad, good.size, 16),
                                 Read(dst, 4096, good, 4096, 4096)]).wait(10, raise_on_error=False)
        assert [r.ok for r in results] == [True, False, True]
        assert results[1].error == "out of bounds"


def test_peer_killed_mid_transfer_fails_fast_and_engine_survives(spawn_peer):
    victim = spawn_peer(size=16 << 20)
    survivor = spawn_peer(size=1 << 20, seed=2)
    with Engine("a", listen=None, stall_timeout=5.0) as engine:
        peer = engine.connect(victim.descriptor, transport="tcp", streams=2)
        remote = peer.region(victim.regions["numpy"])
        dst = engine.allocate(victim.size)
        # 2 GiB of reads: far longer than the kill delay below.
        batch = engine.submit([Read(dst, 0, remote, 0, victim.size) for _ in range(128)])
        time.sleep(0.05)
        victim.kill()
        started = time.monotonic()
        with pytest.raises(PeerUnreachable):
            batch.wait(10)
        assert time.monotonic() - started < 5.0
        assert not peer.alive
        with pytest.raises(PeerUnreachable):
            engine.transfer([Read(dst, 0, remote, 0, 4096)])
        other = engine.connect(survivor.descriptor, transport="tcp")
        engine.transfer([Read(dst, 0, other.region(survivor.regions["numpy"]), 0, survivor.size)])
        assert sha(np.frombuffer(dst.buffer, np.uint8)[: survivor.size]) == sha(survivor.expected())


def test_dead_shm_peer_is_reported(spawn_peer):
    victim = spawn_peer(size=1 << 20)
    with Engine("a", listen=None) as engine:
        peer = engine.connect(victim.descriptor, transport="shm")
        remote = peer.region(victim.regions["shm"])
        dst = engine.allocate(4096)
        engine.transfer([Read(dst, 0, remote, 0, 4096)])
        victim.kill()
        deadline = time.monotonic() + 5
        while peer.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PeerUnreachable):
            engine.transfer([Read(dst, 0, remote, 0, 4096)])


def test_stalled_peer_times_out_within_the_stall_timeout(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20)
    with Engine("a", listen=None, stall_timeout=1.0) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp", streams=1)
        remote = peer.region(peer_proc.regions["numpy"])
        dst = engine.allocate(peer_proc.size)
        os.kill(peer_proc.proc.pid, signal.SIGSTOP)
        wait_until_stopped(peer_proc.proc.pid)  # the signal is only queued: the peer may still serve
        try:
            started = time.monotonic()
            with pytest.raises(TransferTimeout):
                engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)], timeout=10)
            assert 0.9 < time.monotonic() - started < 4.0
        finally:
            os.kill(peer_proc.proc.pid, signal.SIGCONT)


def test_unreachable_peer_gets_a_typed_error():
    with Engine("a", listen=None) as engine:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()
        desc = {"name": "ghost", "host": "127.0.0.1", "port": port, "host_id": "elsewhere"}
        with pytest.raises(PeerUnreachable):
            engine.connect(desc, timeout=2)
