"""A store daemon's framed control wire (its same-host socket, and the same over TCP) against
clients that hold the secret but misbehave: a put that trickles its bytes, guessed reservation
tokens, a fingerprint that cannot name an index key, a reserve that could never fit; and, over TCP,
peers without the secret, a request for the NVMe tier's fd, a flood of connections from one
address. Real etcd, a real daemon in its own process, raw authenticated frames."""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
import uuid
from typing import Iterator

import numpy as np
import pytest

from kvstore import Client
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import TCP_SCHEME, Frames, connect, tcp_endpoint

FP = ModelFingerprint("local-abuse", "float16", 16, 2, 2, 64, kv_layout="bytes")
SECRET = "local-abuse-secret"


@pytest.fixture(params=["unix", "tcp"])
def node(request, etcd_server, spawn_daemon):
    """(daemon, a well-behaved client, the address of the daemon's wire: its same-host socket, or
    tcp://host:port)."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("abused", etcd_server.url, cluster, secret=SECRET, extra=["--timeout", "1"])
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        wire = client.links.local(daemon.name) if request.param == "unix" else client.links.wire(daemon.name)
        assert wire is not None
        yield daemon, client, wire.address


def raw(address: str) -> Frames:
    return connect(address, SECRET.encode(), "probe", 5.0)


def stored_blocks(client: Client, n: int, first: int, size: int = 4096) -> list[tuple[bytes, np.ndarray]]:
    items = [(h, np.full(size, i % 251, np.uint8)) for i, h in enumerate(external_hashes(range(first, first + n), FP))]
    client.put_many(items)
    return items


def reads_back(client: Client, items: list[tuple[bytes, np.ndarray]]) -> bool:
    outs = [np.zeros_like(d) for _, d in items]
    return all(client.get_many([h for h, _ in items], outs)) and \
        all(np.array_equal(o, d) for o, (_, d) in zip(outs, items))


def test_a_put_that_trickles_its_bytes_is_cut_off_at_its_deadline(node):
    """Each block arrives within the socket's timeout, but the put as a whole takes longer than the
    node's 1 s: the node stops receiving (its reservations could otherwise expire and be given to
    other blocks while bytes still land in them) and stores none of it."""
    daemon, client, address = node
    kept = stored_blocks(client, 8, 0)
    hashes = external_hashes(range(100, 105), FP)
    block = bytes([0xAA]) * 4096
    frames = raw(address)
    frames.send({"op": "put", "fp": FP.digest, "hashes": [h.hex() for h in hashes], "sizes": [4096] * 5,
                 "digests": [block_digest(h, block).hex() for h in hashes], "sync": False})
    cut_off = False
    try:
        for _ in hashes:
            frames.sock.sendall(block)
            time.sleep(0.6)
        reply = frames.recv(5.0)
        cut_off = not reply.get("ok")
    except (OSError, TimeoutError):  # closed by the node (reset, broken pipe, end of stream)
        cut_off = True
    assert cut_off
    assert client.contains(kept[0][0]) and not any(client.contains(h) for h in hashes)
    assert reads_back(client, kept)
    assert reads_back(client, stored_blocks(client, 4, 200))  # and it keeps serving


def test_reservation_tokens_cannot_be_guessed_by_another_client(node):
    """Tokens name reservations in commit and abort: a client aborting every small number must not
    release another's reservation while its bytes are on the way."""
    daemon, client, address = node
    h = external_hashes([300], FP)[0]
    owner, other = raw(address), raw(address)
    owner.send({"op": "reserve", "fp": FP.digest, "hashes": [h.hex()], "sizes": [4096]})
    reply = owner.recv(5.0)
    assert reply["ok"]
    other.send({"op": "abort", "tokens": list(range(1, 4097))})
    assert other.recv(5.0)["ok"]
    owner.send({"op": "commit", "fp": FP.digest, "tokens": [reply["slots"][0][0]], "digests": ["00" * 32],
                "sync": True})
    commit = owner.recv(5.0)
    # Still reserved: the commit (sync: checked before the answer) reaches the digest (nothing was
    # written), not "unknown or expired".
    assert commit["ok"] and commit["errors"][0].startswith("digest mismatch")


@pytest.mark.parametrize("fingerprint", ["\ud800", "a/b", "x" * 200, ""])
def test_a_fingerprint_that_cannot_name_an_index_key_is_refused_and_publishing_goes_on(node, fingerprint):
    daemon, client, address = node
    h = external_hashes([400], FP)[0]
    block = bytes(4096)
    frames = raw(address)
    frames.send({"op": "put", "fp": fingerprint, "hashes": [h.hex()], "sizes": [4096],
                 "digests": [block_digest(h, block).hex()], "sync": False}, [block])
    reply = frames.recv(5.0)
    assert not reply["ok"] and reply["code"] == "invalid"
    with Client(client.mirror.url, cluster=client.mirror.layout.cluster, fingerprint=FP, secret=SECRET,
                publish="sync") as syncing:
        items = [(h2, np.full(4096, 3, np.uint8)) for h2 in external_hashes([401, 402], FP)]
        syncing.put_many(items)  # published before it returns: the node's publisher is not stuck
        assert client.mirror.wait_until(lambda m: all(m.contains(FP, h2) for h2, _ in items), 15)


def test_a_reserve_that_could_never_fit_evicts_nothing(node):
    """20,000 one-byte blocks add up to 20 kB but take 4 KiB slots each (80 MB > 64 MiB): refused
    before a single stored block is evicted."""
    daemon, client, address = node
    kept = stored_blocks(client, 64, 500, 64 << 10)
    frames = raw(address)
    hashes = [os.urandom(16).hex() for _ in range(20_000)]
    frames.send({"op": "reserve", "fp": FP.digest, "hashes": hashes, "sizes": [1] * len(hashes)})
    reply = frames.recv(5.0)
    assert not reply["ok"] and reply["code"] == "exhausted"
    assert reads_back(client, kept)


@pytest.mark.parametrize("bad", [{"lease": "x"}, {"lease": {"size": 0, "count": 1}},
                                 {"lease": {"size": 4096, "count": -1}}, {"hashes": ["00"]},
                                 {"hashes": [os.urandom(16).hex()]}, {"repeat": True}],
                         ids=["not-a-dict", "size-0", "negative", "short-hash", "another-block", "token-twice"])
def test_a_commit_with_a_malformed_lease_or_names_is_invalid_and_takes_nothing(node, bad):
    """A commit whose lease request or block names are wrong is refused before anything is taken:
    the reservation it names still commits afterwards."""
    daemon, client, address = node
    bad = dict(bad)  # the parameter is shared by both wires' runs
    frames = raw(address)
    h = external_hashes([800], FP)[0]
    frames.send({"op": "reserve", "fp": FP.digest, "hashes": [h.hex()], "sizes": [4096]})
    token = frames.recv(5.0)["slots"][0][0]
    zeros = block_digest(h, bytes(4096)).hex()  # a fresh arena slot holds zeros
    if bad.pop("repeat", False):
        bad = {"tokens": [token, token], "digests": [zeros, zeros]}
    frames.send({"op": "commit", "fp": FP.digest, "tokens": [token], "digests": [zeros], **bad})
    reply = frames.recv(5.0)
    assert not reply["ok"] and reply["code"] == "invalid", reply
    frames.send({"op": "commit", "fp": FP.digest, "tokens": [token], "digests": [zeros], "sync": True})
    reply = frames.recv(5.0)
    assert reply["ok"] and reply["errors"] == [""] and reply["records"][0]


@contextlib.contextmanager
def frames_pair(timeout: float) -> Iterator[tuple[Frames, Frames]]:
    """Both ends of an authenticated-looking frame stream over a socketpair (no handshake)."""
    ours, theirs = socket.socketpair()
    try:
        yield Frames(ours, b"a" * 32, b"b" * 32, timeout), Frames(theirs, b"b" * 32, b"a" * 32, timeout)
    finally:
        ours.close()
        theirs.close()


@pytest.mark.timeout(20)
def test_an_idle_connection_ends_after_its_idle_limit():
    """A server's wait for the next request is bounded (the daemon's IDLE_S), so idle clients cannot
    hold every connection slot for good."""
    with frames_pair(0.1) as (_, server):
        started = time.monotonic()
        with pytest.raises(ConnectionAbortedError):
            server.recv(0.1, idle=0.5)
        assert time.monotonic() - started >= 0.5  # the idle limit, not the first socket timeout


@pytest.mark.timeout(20)
def test_a_call_given_longer_than_the_socket_timeout_waits_for_its_answer():
    """A sync put's answer comes after the node's publish: the client gives it several socket
    timeouts, and must not give up after the first."""
    with frames_pair(0.1) as (client, server):
        threading.Timer(0.3, lambda: server.send({"ok": True})).start()
        assert client.recv(5.0) == {"ok": True}


@pytest.mark.timeout(20)
def test_a_spinning_receive_reads_frames_that_come_before_during_or_after_the_spin():
    with frames_pair(1.0) as (client, server):
        server.send({"n": 1})
        assert client.recv(1.0, spin=0.01) == {"n": 1}  # already here
        threading.Timer(0.002, lambda: server.send({"n": 2})).start()
        assert client.recv(5.0, spin=0.5) == {"n": 2}  # during the spin
        threading.Timer(0.3, lambda: server.send({"n": 3})).start()
        assert client.recv(5.0, spin=0.001) == {"n": 3}  # after it: the usual blocking wait
        server.sock.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError):
            client.recv(1.0, spin=0.5)  # a closed peer ends the spin and the receive


@pytest.mark.timeout(20)
def test_wait_readable_returns_when_bytes_arrive_and_gives_up_after_its_spin():
    from transfer._native import wait_readable

    ours, theirs = socket.socketpair()
    try:
        assert not wait_readable(ours.fileno(), 0.001)  # nothing came: False after the spin
        threading.Timer(0.05, lambda: theirs.send(b"x")).start()
        started = time.monotonic()
        assert wait_readable(ours.fileno(), 10.0)
        assert time.monotonic() - started < 5.0  # it returned on the bytes, not at the end of its spin
    finally:
        ours.close()
        theirs.close()


def test_bytes_already_here_are_read_even_past_the_deadline():
    """The deadline bounds waiting, not reading: a put whose bytes all arrived while the node was
    busy reserving still lands."""
    with frames_pair(1.0) as (client, server):
        client.sock.sendall(b"x" * 4096)
        time.sleep(0.05)
        into = bytearray(4096)
        server.recv_into(memoryview(into), time.monotonic() - 1.0)
        assert into == b"x" * 4096
        with pytest.raises(TimeoutError):  # and nothing more is waited for
            server.recv_into(memoryview(bytearray(1)), time.monotonic() - 1.0)


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b"[" * 100_000], ids=["text", "array", "deep"])
def test_an_authentic_frame_that_is_not_a_json_object_gets_invalid_and_the_connection_goes_on(node, payload):
    daemon, client, address = node
    frames = raw(address)
    signed = struct.pack("<I", len(payload)) + payload + frames._tag(frames._tx, frames._sent, payload)
    frames._sent += 1
    frames.sock.sendall(signed)
    reply = frames.recv(5.0)
    assert not reply["ok"] and reply["code"] == "invalid"
    h = external_hashes([600], FP)[0]
    frames.send({"op": "lookup", "fp": FP.digest, "hashes": [h.hex()]})  # the same connection still serves
    assert frames.recv(5.0) == {"ok": True, "records": [None]}


@pytest.fixture
def tcp_wire(etcd_server, spawn_daemon):
    """(a well-behaved client, the daemon's control wire over TCP, the cluster)."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("wired", etcd_server.url, cluster, secret=SECRET)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport="tcp") as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        wire = client.links.wire(daemon.name)
        assert wire is not None and wire.address.startswith(TCP_SCHEME)
        yield client, wire.address, cluster


def test_the_tcp_wire_takes_no_one_without_the_secret(tcp_wire):
    client, address, _ = tcp_wire
    kept = stored_blocks(client, 4, 0)
    for secret in (b"wrong-secret", b""):
        with pytest.raises(Exception):
            frames = connect(address, secret, "eve", 5.0)
            frames.send({"op": "lookup", "fp": FP.digest, "hashes": [h.hex() for h, _ in kept]})
            frames.recv(5.0)
    host, port = tcp_endpoint(address)
    with socket.create_connection((host, port), timeout=5) as sock:  # a frame without a handshake
        sock.sendall(struct.pack("<I", 15) + b'{"op":"lookup"}')
        try:
            answer = sock.recv(4096)
        except ConnectionResetError:
            answer = b""
        assert answer == b""  # closed unanswered
    assert reads_back(client, kept)


def test_the_tcp_wire_hands_out_no_descriptor(tcp_wire):
    """The NVMe tier's fd is for processes on the node's own host: over TCP, `tier` is refused."""
    _, address, _ = tcp_wire
    frames = raw(address)
    frames.send({"op": "tier"})
    reply = frames.recv(5.0)
    assert reply["ok"] is False and reply["code"] == "invalid" and "same host" in reply["error"]


def test_connections_that_never_authenticate_cannot_shut_clients_out(tcp_wire, etcd_server):
    """Anyone can open TCP connections and stall in the handshake: one address holds at most
    HANDSHAKES_PER_SOURCE of them, and they never take authenticated clients' slots. A new client
    from that address, refused a handshake slot, tries again within its timeout and gets a
    stalled one's slot. Kills: a client that gives up at the first closed handshake."""
    from kvstore.daemon.local import HANDSHAKES_PER_SOURCE

    client, address, cluster = tcp_wire
    host, port = tcp_endpoint(address)
    held = [socket.create_connection((host, port), timeout=5) for _ in range(HANDSHAKES_PER_SOURCE)]
    try:
        extra = socket.create_connection((host, port), timeout=5)
        extra.settimeout(5)
        try:
            assert extra.recv(1) == b""  # closed by the node at once
        except ConnectionResetError:
            pass
        extra.close()
        assert reads_back(client, stored_blocks(client, 2, 100))  # its pooled, authenticated wire
        with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET,
                    transport="tcp") as newcomer:
            assert newcomer.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
            assert reads_back(newcomer, stored_blocks(newcomer, 2, 200))
    finally:
        for sock in held:
            sock.close()


def test_many_authenticated_connections_from_one_address_are_served(tcp_wire):
    """Busy clients on one host pool many connections: past the handshake, one address is not capped."""
    client, address, _ = tcp_wire
    kept = stored_blocks(client, 2, 300)
    conns = [raw(address) for _ in range(80)]
    try:
        for frames in conns:
            frames.send({"op": "lookup", "fp": FP.digest, "hashes": [h.hex() for h, _ in kept]})
        assert all(all(frames.recv(5.0)["records"]) for frames in conns)
    finally:
        for frames in conns:
            frames.sock.close()
