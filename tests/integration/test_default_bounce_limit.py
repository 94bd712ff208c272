"""The Transfer Engine's default bounce-buffer budget (transfer.engine.DEFAULT_BOUNCE_LIMIT, 256 MiB;
cpp/aead.h BounceBudget), as an engine started with no bounce_limit has it: peers that ask for file
reads and then read their answers slowly hold their bounce buffers; once those fill the budget,
the next op is refused with 'peer busy' after the stall time (instead of the serving process
growing without bound), and it goes through once they let go. The peer runs in its own process."""
from __future__ import annotations

import socket
import struct
import threading
import time

import json

import numpy as np
import pytest

from transfer import Engine, PeerBusy, Read
from transfer.auth import client_handshake
from transfer.engine import DEFAULT_BOUNCE_LIMIT

OP_BYTES = 64 << 20  # the largest op a file region bounces (cpp/tcp.cpp kMaxFileOp)
MAGIC, READ = 0x4B565431, 1  # cpp/common.h kMagic ("KVT1"), kRead


def proc_status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class SlowReader:
    """A data connection (plain wire, an insecure peer) that asks for one 64 MiB read of a file
    region, and then takes its answer a trickle at a time: the server holds a 64 MiB bounce buffer
    for it all along, and never sees it stall."""

    def __init__(self, host: str, port: int, region: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        client_handshake(self.sock, b"", "data", "slow-reader", wire="plain", timeout=10)
        self.sock.sendall(struct.pack("<IB3xQQQ", MAGIC, READ, region, 0, OP_BYTES))
        status, _, length = struct.unpack("<iIQ", self._exact(16))
        assert (status, length) == (0, OP_BYTES)  # admitted: its bounce buffer is taken
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "closed"
            out += chunk
        return out

    def _trickle(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.sock.recv(256 << 10)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(5)


@pytest.mark.timeout(120)
def test_the_default_bounce_limit_is_hit_and_the_next_op_refused_cleanly(spawn_peer):
    """Kills: an engine whose default bounce budget does not bound what peers make it hold (a
    default far above 256 MiB, or none): the fifth 64 MiB read was then served too, and the serving
    side grew by another 64 MiB for every peer that asked. At the default, four slow readers hold
    it all; a read of one page waits the stall time and is refused (PeerBusy), the peer's process
    grows by no more than the budget, keeps serving, and the same read goes through once they let go."""
    assert DEFAULT_BOUNCE_LIMIT == 4 * OP_BYTES  # what this test fills
    peer_proc = spawn_peer(size=OP_BYTES, stall=2.0)  # insecure (plain wire); the engine's default budget
    pid = peer_proc.proc.pid
    descriptor = peer_proc.descriptor
    card = json.loads(descriptor)
    host, port = card["host"], card["port"]
    file_region = peer_proc.regions["file"]
    with Engine("reader", listen=None, stall_timeout=10.0) as engine:
        peer = engine.connect(descriptor, transport="tcp")
        remote = peer.region(file_region)
        dst = engine.allocate(4096)
        engine.transfer([Read(dst, 0, remote, 0, 4096)])
        before = proc_status(pid, "VmRSS") << 10
        slow = []
        try:
            for _ in range(DEFAULT_BOUNCE_LIMIT // OP_BYTES):
                slow.append(SlowReader(host, port, file_region))
            started = time.monotonic()
            with pytest.raises(PeerBusy):
                engine.transfer([Read(dst, 0, remote, 0, 4096)], timeout=30)
            waited = time.monotonic() - started
            assert 1.5 <= waited < 15, waited  # the peer's stall time (2 s), then the refusal
            grown = (proc_status(pid, "VmRSS") << 10) - before
            assert grown < DEFAULT_BOUNCE_LIMIT + (48 << 20), f"grew {grown >> 20} MiB"
        finally:
            for reader in slow:
                reader.close()
        deadline = time.monotonic() + 20
        while True:  # their buffers go back as their connections end
            try:
                engine.transfer([Read(dst, 0, remote, 0, 4096)], timeout=30)
                break
            except PeerBusy:
                assert time.monotonic() < deadline
        expected = np.frombuffer(peer_proc.expected()[:4096].tobytes(), np.uint8)
        assert np.array_equal(np.frombuffer(dst.buffer, np.uint8), expected)
    assert peer_proc.proc.poll() is None
