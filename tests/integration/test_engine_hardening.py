"""Attacks on the Transfer Engine from the outside review (issue 10), each against a real peer
process: resizing shared memory, missing secrets, other local users, slow and relayed handshakes,
memory held through bounce buffers, failed allocations, and leaked connections."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests_support import sha, until
from transfer import Engine, InvalidOp, MissingSecret, PeerUnreachable, ProtocolError, Read, TransferError, Write
from transfer.auth import Channel, client_handshake
from transfer.regions import anonymous_shared, check_sealed

ROOT = Path(__file__).resolve().parents[2]
SECRET = "cluster-secret"


def proc_status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def grab_shared_fds(descriptor: str, secret: str) -> tuple[socket.socket, list[dict], list[int]]:
    """What an authenticated same-host peer receives: the region table and the memfds."""
    desc = json.loads(descriptor)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + desc["unix"])
    channel = Channel(sock, client_handshake(sock, secret.encode(), "ctl", "probe", wire="plain"))
    channel.send({"op": "regions"})
    reply = channel.recv()
    fds: list[int] = []
    while len(fds) < reply["fds"]:
        fds.extend(socket.recv_fds(sock, 1, 200)[1])
    return sock, reply["regions"], fds


# --- hole 1: shared memory a peer could shrink under us -------------------------------------------
def test_a_peer_cannot_shrink_exported_shared_memory(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20, secret=SECRET)
    before = peer_proc.sha("shm")
    sock, _table, fds = grab_shared_fds(peer_proc.descriptor, SECRET)
    try:
        assert fds
        for fd in fds:
            with pytest.raises(PermissionError):  # sealed: ftruncate is refused by the kernel
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1 << 40)
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()
    assert peer_proc.sha("shm") == before  # the owner touches every page: no SIGBUS
    assert peer_proc.proc.poll() is None


def test_shared_memory_from_a_peer_is_mapped_only_when_sealed():
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, 8192)
    with pytest.raises(ProtocolError, match="not sealed"):
        check_sealed(fd, 8192)
    os.close(fd)
    fd, mapping = anonymous_shared(8192, "sealed")
    check_sealed(fd, 8192)
    with pytest.raises(ProtocolError, match="bytes of shared memory"):
        check_sealed(fd, 8193)  # smaller than the region it claims to back
    mapping.close()
    os.close(fd)
    with pytest.raises(ProtocolError):
        check_sealed(os.open("/dev/null", os.O_RDONLY), 1)


# --- hole 2: no secret --------------------------------------------------------------------------
def test_a_listening_engine_needs_a_secret_or_an_explicit_insecure():
    with pytest.raises(MissingSecret):
        Engine("no-secret")
    with Engine("explicit", insecure=True) as engine:
        assert engine.insecure and engine.wire == "plain"
    with Engine("initiator", listen=None) as engine:  # nothing listens: nothing to protect
        assert engine.insecure
    with Engine("secured", secret=SECRET) as engine:
        assert not engine.insecure and engine.wire == "aead"


def test_kvstore_serve_generates_a_private_secret_unless_insecure(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("KVSTORE_SECRET", None)
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--node", "n1", "--metadata", "memory://gen",
           "--cluster", "gen", "--dram", "4MiB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        hello = json.loads(proc.stdout.readline())
        secret_file = tmp_path / ".kvstore" / "gen.secret"
        assert secret_file.stat().st_mode & 0o777 == 0o600
        secret = secret_file.read_text().strip()
        assert len(secret) >= 32
        with Engine("nobody", listen=None) as engine:
            with pytest.raises(PermissionError):  # AuthenticationFailed: no secret, no access
                engine.connect(hello["engine"], transport="tcp")
        with Engine("member", listen=None, secret=secret) as engine:
            assert engine.connect(hello["engine"], transport="tcp").wire == "aead"
    finally:
        proc.kill()
        proc.wait(10)
    assert "generated a cluster secret" in proc.stderr.read()


def test_other_local_users_are_refused_on_the_same_host_socket(spawn_peer):
    """Even a process that somehow holds the secret is refused when it runs as another user."""
    peer_proc = spawn_peer(size=1 << 20, secret=SECRET)
    desc = json.loads(peer_proc.descriptor)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to nobody, then try the unix socket
        result = "refused"
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect("\0" + desc["unix"])
            client_handshake(sock, SECRET.encode(), "ctl", "other-user", wire="plain", timeout=5)
            result = "accepted"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result = f"refused: {type(exc).__name__}"
        finally:
            os.write(write_end, result.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        result = f.read()
    os.waitpid(pid, 0)
    assert result.startswith("refused"), result
    with Engine("same-user", listen=None, secret=SECRET) as engine:  # our own user still gets in
        assert engine.connect(peer_proc.descriptor, transport="shm").transport == "shm"


# --- hole 3: pre-auth exhaustion ----------------------------------------------------------------
def test_slow_handshakes_are_cut_off_and_cannot_starve_others(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20, secret=SECRET, extra=["--handshake-timeout", "1.5"])
    desc = json.loads(peer_proc.descriptor)
    threads_before = proc_status(peer_proc.proc.pid, "Threads")
    slow: list[socket.socket] = []
    for _ in range(60):  # from the legitimate client's own /24: it gets in by taking a stalled one's slot
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(5)
        sock.connect((desc["host"], desc["port"]))
        slow.append(sock)
    stop = threading.Event()

    def trickle() -> None:  # one byte at a time, well inside any per-recv timeout
        frame = b"\x10\x00\x00\x00" + b'{"hello":2,"role"'
        for i in range(len(frame)):
            for sock in slow:
                try:
                    sock.send(frame[i : i + 1])
                except OSError:
                    pass
            if stop.wait(0.3):
                return

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        time.sleep(0.8)  # past STALE_HANDSHAKE_S (0.5 s)
        assert proc_status(peer_proc.proc.pid, "Threads") - threads_before <= 20  # capped per /24 (16)
        started = time.monotonic()
        with Engine("legit", listen=None, secret=SECRET) as engine:
            peer = engine.connect(peer_proc.descriptor, transport="tcp", timeout=5)
            dst = engine.allocate(4096)
            engine.transfer([Read(dst, 0, peer.region(peer_proc.regions["numpy"]), 0, 4096)])
        assert time.monotonic() - started < 3.0
        # One deadline for the whole handshake: every trickling connection is gone by ~1.5 s.
        deadline = time.monotonic() + 4.0
        for sock in slow:
            assert closed_by_server(sock, max(0.1, deadline - time.monotonic()))
    finally:
        stop.set()
        for sock in slow:
            sock.close()


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except OSError:
        return False


def test_accept_backs_off_when_out_of_descriptors(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20, secret=SECRET, extra=["--handshake-timeout", "30", "--spare-fds", "4"])
    desc = json.loads(peer_proc.descriptor)
    held = []
    for i in range(16):  # several source addresses so the per-source cap is not what stops them
        sock = socket.socket()
        sock.bind((f"127.0.0.{10 + i % 4}", 0))
        sock.connect((desc["host"], desc["port"]))
        held.append(sock)
    try:
        time.sleep(0.5)
        before = cpu_seconds(peer_proc.proc.pid)
        time.sleep(2.0)
        used = cpu_seconds(peer_proc.proc.pid) - before
        assert used < 0.4, f"accept loop spun on EMFILE: {used:.2f} s of CPU in 2 s"
    finally:
        for sock in held:
            sock.close()


# --- hole 4: relayed handshake, injected frames --------------------------------------------------
class Relay:
    """A party without the secret between a client and its server: relays both directions and,
    when told to, injects a forged write into every client-to-server stream."""

    def __init__(self, host: str, port: int, forged: bytes) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target, self.forged = (host, port), forged
        self.inject = threading.Event()
        self.injected = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_server: bool) -> None:
        done = False
        src.settimeout(0.05)
        while True:
            if to_server and self.inject.is_set() and not done:
                done = True
                try:
                    dst.sendall(self.forged)
                    self.injected += 1
                except OSError:
                    pass
            try:
                data = src.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("wire", ["aead", "plain"])
def test_relayed_handshake_cannot_inject_writes(spawn_peer, wire):
    """aead: an injected frame is detected and nothing lands. plain: the documented trade-off of
    the trusted-network mode (checked so the README's threat model stays true)."""
    peer_proc = spawn_peer(size=1 << 20, secret=SECRET, extra=["--wire", "plain"])
    before = peer_proc.sha("numpy")
    desc = json.loads(peer_proc.descriptor)
    relay = Relay(desc["host"], desc["port"], raw_write(peer_proc.regions["numpy"]))
    relayed = dict(desc, port=relay.port, host_id="elsewhere")  # the victim dials the relay
    try:
        with Engine("victim", listen=None, secret=SECRET, wire=wire) as engine:
            peer = engine.connect(relayed, transport="tcp", streams=1)
            assert peer.wire == wire
            dst = engine.allocate(4096)
            remote = peer.region(peer_proc.regions["numpy"])
            engine.transfer([Read(dst, 0, remote, 0, 4096)])  # the relay passes honest traffic
            relay.inject.set()
            assert until(lambda: relay.injected >= 2)
            if wire == "aead":
                time.sleep(0.3)  # time for a write that got through to land, before looking
    finally:
        relay.close()
    if wire == "aead":
        assert peer_proc.sha("numpy") == before
    else:  # the peer's data thread applies it in its own time
        assert until(lambda: peer_proc.sha("numpy") != before)


class FlipRelay(Relay):
    """The same relay, injecting nothing: once `flip` is set, it flips one bit of the next bytes the
    server sends."""

    def __init__(self, host: str, port: int) -> None:
        self.flip = threading.Event()
        self.flipped = False
        super().__init__(host, port, b"")

    def _pump(self, src: socket.socket, dst: socket.socket, to_server: bool) -> None:
        try:
            while data := src.recv(65536):
                if not to_server and self.flip.is_set() and not self.flipped:
                    self.flipped = True
                    data = bytes([data[0] ^ 0x10]) + data[1:]
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.mark.parametrize("wire", ["aead", "plain"])
def test_a_peer_whose_stream_broke_is_not_alive(spawn_peer, wire):
    """A corrupted reply breaks its stream for good (aead: the tag fails; plain: the header no
    longer matches the request), while the peer's control connection stays up. Kills: `Peer.alive`
    looking at the control connection only: a store client then kept the peer and failed every
    later read from that node, recomputing forever, until something reset its connections."""
    peer_proc = spawn_peer(size=1 << 20, secret=SECRET, extra=["--wire", "plain"])
    desc = json.loads(peer_proc.descriptor)
    relay = FlipRelay(desc["host"], desc["port"])
    relayed = dict(desc, port=relay.port, host_id="elsewhere")
    try:
        with Engine("victim", listen=None, secret=SECRET, wire=wire, stall_timeout=5.0) as engine:
            peer = engine.connect(relayed, transport="tcp", streams=1)
            dst = engine.allocate(64 << 10)
            remote = peer.region(peer_proc.regions["numpy"])
            engine.transfer([Read(dst, 0, remote, 0, 64 << 10)])
            assert peer.alive
            relay.flip.set()
            with pytest.raises(TransferError):
                engine.transfer([Read(dst, 0, remote, 0, 64 << 10)])
            assert relay.flipped and not peer.alive
            peer.close()
            again = engine.connect(relayed, transport="tcp", streams=1)  # what a store client does
            engine.transfer([Read(dst, 0, again.region(peer_proc.regions["numpy"]), 0, 64 << 10)])
            assert sha(dst.buffer) == peer_proc.sha("numpy", 0, 64 << 10)
    finally:
        relay.close()


def raw_write(region: int, offset: int = 0, length: int = 4096) -> bytes:
    import struct

    return struct.pack("<IB3xQQQ", 0x4B565431, 2, region, offset, length) + b"\xff" * length


def test_encrypted_streams_move_bytes_intact(spawn_peer):
    peer_proc = spawn_peer(size=4 << 20, secret=SECRET)
    with Engine("a", listen=None, secret=SECRET, streams=3, stripe_bytes=64 << 10) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp")
        assert peer.wire == "aead"
        src = engine.register(np.random.default_rng(4).integers(0, 256, peer_proc.size, dtype=np.uint8))
        expected = peer_proc.expected()
        for name in ("numpy", "file", "shm"):
            remote = peer.region(peer_proc.regions[name])
            engine.transfer([Write(src, 7, remote, 7, 1_000_003), Write(src, 2 << 20, remote, 2 << 20, 5)])
            want = expected.copy()
            want[7 : 7 + 1_000_003] = np.frombuffer(src.buffer, np.uint8)[7 : 7 + 1_000_003]
            want[2 << 20 : (2 << 20) + 5] = np.frombuffer(src.buffer, np.uint8)[2 << 20 : (2 << 20) + 5]
            assert peer_proc.sha(name) == sha(want)
            dst = engine.allocate(peer_proc.size)
            engine.transfer([Read(dst, 0, remote, 0, peer_proc.size)])
            assert sha(dst.buffer) == sha(want)


# --- hole 5: bounce memory ----------------------------------------------------------------------
def test_bounce_memory_is_bounded_per_engine(spawn_peer):
    size = 16 << 20
    peer_proc = spawn_peer(size=size, extra=["--bounce-limit", str(32 << 20)])
    pid = peer_proc.proc.pid
    with Engine("a", listen=None, streams=12, stripe_bytes=1 << 30) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp")
        remote = peer.region(peer_proc.regions["file"])
        dst = engine.allocate(size)
        engine.transfer([Read(dst, 0, remote, 0, 4096)])
        peak_before = proc_status(pid, "VmHWM") << 10
        results = engine.submit([Read(dst, 0, remote, 0, size) for _ in range(36)]).wait(60)
        assert all(r.ok for r in results)
        grown = (proc_status(pid, "VmHWM") << 10) - peak_before
    assert grown < 64 << 20, f"serving side grew by {grown >> 20} MiB for a 32 MiB bounce budget"


# --- hole 6: allocation failures ----------------------------------------------------------------
def test_failed_allocation_in_a_serving_thread_fails_the_op_not_the_process(spawn_peer, monkeypatch):
    size = 16 << 20  # one 16 MiB piece: one 16 MiB bounce buffer
    # Big blocks always as fresh mappings and one arena: no address space malloc reserved earlier
    # can serve them, so the cap below really makes them fail.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    peer_proc = spawn_peer(size=size)
    with Engine("a", listen=None, streams=1, stripe_bytes=1 << 30) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp")
        remote = peer.region(peer_proc.regions["file"])
        dst = engine.allocate(size)
        engine.transfer([Read(dst, 0, remote, 0, 4096)])

        def command(message: dict) -> None:
            peer_proc.proc.stdin.write(json.dumps(message) + "\n")
            peer_proc.proc.stdin.flush()
            assert json.loads(peer_proc.proc.stdout.readline()) == {"ok": True}

        command({"cmd": "limit_as", "extra_mib": 4})  # a 16 MiB bounce buffer cannot be had now
        try:
            with pytest.raises(PeerUnreachable):
                engine.transfer([Read(dst, 0, remote, 0, size)], timeout=20)
        finally:
            command({"cmd": "limit_as", "extra_mib": None})
    assert peer_proc.proc.poll() is None
    assert peer_proc.sha("numpy") == sha(peer_proc.expected())  # still alive and serving
    with Engine("b", listen=None) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp")
        dst = engine.allocate(size)
        engine.transfer([Read(dst, 0, peer.region(peer_proc.regions["file"]), 0, size)])
        assert sha(dst.buffer) == sha(peer_proc.expected())


# --- hole 7 -------------------------------------------------------------------------------------
def test_finished_connections_are_released_at_once(spawn_peer):
    peer_proc = spawn_peer(size=1 << 20)
    pid = peer_proc.proc.pid
    baseline = open_fds(pid)
    with Engine("a", listen=None) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp", streams=4)
        dst = engine.allocate(4096)
        engine.transfer([Read(dst, 0, peer.region(peer_proc.regions["numpy"]), 0, 4096)])
        assert open_fds(pid) >= baseline + 4
        peer.close()
    deadline = time.monotonic() + 5
    while open_fds(pid) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds(pid) == baseline  # not only when the next connection arrives


def test_region_unregistered_under_a_stalled_op_is_released_later(spawn_peer):
    import signal

    from tests_support import wait_until_stopped

    peer_proc = spawn_peer(size=4 << 20)
    with Engine("a", listen=None, stall_timeout=20) as engine:
        peer = engine.connect(peer_proc.descriptor, transport="tcp", streams=1)
        remote = peer.region(peer_proc.regions["numpy"])
        dst = engine.allocate(peer_proc.size)
        os.kill(peer_proc.proc.pid, signal.SIGSTOP)
        wait_until_stopped(peer_proc.proc.pid)
        try:
            batch = engine.submit([Read(dst, 0, remote, 0, peer_proc.size)])
            engine.unregister(dst, wait=0.2)  # the op still holds it: parked, not freed
            assert engine._graveyard == [dst]
        finally:
            os.kill(peer_proc.proc.pid, signal.SIGCONT)
        batch.wait(20)
        other = engine.allocate(4096)
        deadline = time.monotonic() + 5
        while engine._graveyard and time.monotonic() < deadline:
            engine.transfer([Read(other, 0, remote, 0, 4096)])  # any later call sweeps
            time.sleep(0.01)
        assert engine._graveyard == []
        assert dst._shm_fd is None


def test_non_integer_offsets_are_invalid_ops():
    with Engine("a", listen=None) as engine:
        src, dst = engine.allocate(4096), engine.allocate(4096)
        for bad in (Read(dst, 0.5, src, 0, 16), Write(src, 0, dst, "0", 16), Read(dst, 0, src, 0, None)):
            with pytest.raises(InvalidOp):
                engine.transfer([bad])


@pytest.mark.parametrize("frame", [
    b'{"hello":2,"role":"ctl","name":"x","nonce":5,"wire":"aead"}',
    b'{"hello":2,"role":"data","name":"x","nonce":"zz","wire":"weird"}',
    b"[" * 3000 + b"]" * 3000,
    b'"just a string"',
    b"\xff\xfe not json",
])
def test_malformed_hellos_end_only_their_connection(spawn_peer, frame):
    import struct

    peer_proc = spawn_peer(size=1 << 20, secret=SECRET)
    desc = json.loads(peer_proc.descriptor)
    with socket.create_connection((desc["host"], desc["port"]), timeout=5) as sock:
        sock.sendall(struct.pack("<I", len(frame)) + frame)
        assert closed_by_server(sock, 5)
    with Engine("a", listen=None, secret=SECRET) as engine:  # the listener is still serving
        assert engine.connect(peer_proc.descriptor, transport="tcp").wire == "aead"
