"""Bounded fuzz of the Transfer Engine's wire protocol (hypothesis): random handshake frames,
random data-plane requests on an authenticated plaintext stream, and random bytes on an encrypted
one. The serving engine must stay up, never touch bytes outside what a valid op names, and keep
serving honest peers."""
from __future__ import annotations

import os
import socket
import struct

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from transfer import Engine, Read  # noqa: E402
from transfer.auth import client_handshake  # noqa: E402

SECRET = b"fuzz-secret"
SIZE = 64 << 10
FUZZ = settings(max_examples=int(os.environ.get("KVT_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server():
    """An engine exporting one writable region between two unexported guard regions."""
    engine = Engine("fuzz-target", secret=SECRET, wire="plain", handshake_timeout=1.0, stall_timeout=1.0)
    guard_lo = engine.register(np.full(SIZE, 0xA5, np.uint8), remote_access=False)
    target = engine.register(np.zeros(SIZE, np.uint8))
    frozen = engine.register(bytes(SIZE))
    guard_hi = engine.register(np.full(SIZE, 0x5A, np.uint8), remote_access=False)
    yield engine, target, frozen, (guard_lo, guard_hi)
    engine.close()


def endpoint(engine: Engine) -> tuple[str, int]:
    d = engine.export()
    return d.host, d.port


def still_serves(engine: Engine, target) -> None:
    with Engine("honest", listen=None, secret=SECRET) as client:
        peer = client.connect(engine.export(), transport="tcp", streams=1)
        dst = client.allocate(16)
        client.transfer([Read(dst, 0, peer.region(target.id), 0, 16)])


def drain(sock: socket.socket) -> None:
    sock.settimeout(10)  # until the server closes it (a second's stall timeout; more on a loaded machine)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


@FUZZ
@given(prefix=st.binary(max_size=64), body=st.one_of(
    st.binary(max_size=512),
    st.dictionaries(st.sampled_from(["hello", "role", "name", "nonce", "wire", "mac"]),
                    st.one_of(st.none(), st.integers(), st.text(max_size=80), st.lists(st.integers(), max_size=3)),
                    max_size=6).map(lambda d: __import__("json").dumps(d).encode())))
def test_random_handshake_frames_never_authenticate(server, prefix, body):
    engine, target, _frozen, _guards = server
    with socket.create_connection(endpoint(engine), timeout=2) as sock:
        try:
            sock.sendall(prefix + struct.pack("<I", len(body)) + body + os.urandom(48))
        except OSError:
            pass
        drain(sock)
    assert bytes(target.buffer) == bytes(SIZE)  # nothing a stranger sends writes anything


header = st.tuples(
    st.sampled_from([0x4B565431, 0x4B565431, 0x4B565431, 0, 0xFFFFFFFF]),  # mostly the right magic
    st.sampled_from([1, 2, 2, 0, 3, 255]),
    st.integers(0, 8),  # region ids: ours, guards, unknown
    st.one_of(st.integers(0, SIZE + 16), st.integers(2**64 - SIZE, 2**64 - 1), st.integers(0, 2**64 - 1)),
    st.one_of(st.integers(0, 4096), st.integers(2**64 - 4096, 2**64 - 1), st.integers(0, 2**64 - 1)),
)


@FUZZ
@given(requests=st.lists(header, min_size=1, max_size=6))
def test_random_requests_on_an_authenticated_stream_stay_in_bounds(server, requests):
    engine, target, frozen, guards = server
    before_guards = [bytes(g.buffer) for g in guards]
    np.frombuffer(target.buffer, np.uint8)[:] = 0
    expected = np.zeros(SIZE, np.uint8)
    with socket.create_connection(endpoint(engine), timeout=2) as sock:
        client_handshake(sock, SECRET, "data", "fuzzer", wire="plain", timeout=2)
        wire = b""
        for magic, opcode, region, offset, length in requests:
            payload = b""
            if opcode == 2 and length <= 4096:
                payload = bytes([(offset + length) % 251 + 1]) * length
            wire += struct.pack("<IB3xQQQ", magic, opcode, region, offset, length) + payload
            valid = magic == 0x4B565431 and opcode == 2 and region == target.id and length <= 4096 and \
                offset + length <= SIZE
            if valid:
                expected[offset : offset + length] = np.frombuffer(payload, np.uint8)
            if magic != 0x4B565431 or opcode not in (1, 2) or (opcode == 2 and length > 4096):
                break  # the server drops the link here (or waits for a payload we never send)
        try:
            sock.sendall(wire)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        drain(sock)
    assert [bytes(g.buffer) for g in guards] == before_guards
    assert bytes(frozen.buffer) == bytes(SIZE)
    assert np.array_equal(np.frombuffer(target.buffer, np.uint8), expected)


@FUZZ
@given(noise=st.binary(min_size=1, max_size=2048))
def test_random_bytes_on_an_encrypted_stream_are_rejected(server, noise):
    engine, target, _frozen, _guards = server
    np.frombuffer(target.buffer, np.uint8)[:] = 0
    with socket.create_connection(endpoint(engine), timeout=2) as sock:
        session = client_handshake(sock, SECRET, "data", "fuzzer", wire="aead", timeout=2)
        assert session.wire == "aead"
        try:
            sock.sendall(noise + bytes(64))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        drain(sock)
    assert bytes(target.buffer) == bytes(SIZE)


def test_the_engine_still_serves_after_the_fuzz(server):
    engine, target, _frozen, _guards = server
    still_serves(engine, target)
    assert engine._native.serving() <= 1
