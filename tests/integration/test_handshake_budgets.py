"""Budgets outsiders cannot starve (security review: connections from 8 source addresses that never
authenticate filled the engine listener's 128 handshake slots, and a same-host client's get missed
too because the engine's unix socket shared that budget).

What holds now: the same-host socket has a budget of its own; over TCP an IPv4 /24 (IPv6 /64)
counts as one source and holds at most a sixteenth of the budget, in the engine's listener and in
the store's framed wire; at a cap, a handshake stalled past STALE_HANDSHAKE_S gives its slot to a
newcomer. Floods come from real sockets bound to 127.0.x.y. Each test names the variant it kills."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from typing import Iterator

import numpy as np
import pytest

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import tcp_endpoint
from transfer.auth import client_handshake
from transfer.listener import MAX_HANDSHAKES_PER_SOURCE, HandshakeBudget, Listener, source_of

from tests_support import until

SECRET = "budget-secret-0123456789"
FP = ModelFingerprint("budgets", "float16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 1 << 20


def content(h: bytes, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, size, dtype=np.uint8)


# --- accounting ------------------------------------------------------------------------------------
def test_addresses_of_one_ipv4_24_or_ipv6_64_are_one_source():
    """Variant killed: counting each address as a source (a host or subnet with many addresses
    takes the whole budget)."""
    assert {source_of(f"127.0.0.{i}") for i in range(2, 41)} == {"127.0.0.0/24"}
    assert source_of("127.0.1.2") != source_of("127.0.0.2")
    assert source_of("2001:db8:1:2::1") == source_of("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert source_of("2001:db8:1:3::1") != source_of("2001:db8:1:2::1")
    assert source_of("::ffff:10.1.2.3") == source_of("10.1.2.200") == "10.1.2.0/24"
    assert source_of("fe80::1%eth0") == "fe80::/64"
    assert source_of("not an address") == "not an address"


def shut_down(far: socket.socket) -> bool:
    """Whether the server end of this socketpair was shut down."""
    far.setblocking(False)
    try:
        return far.recv(1) == b""
    except BlockingIOError:
        return False


def test_a_budget_caps_each_source_and_makes_room_only_from_stalled_handshakes():
    """Variants killed: no per-source cap; eviction of fresh handshakes (a flood of new connections
    would push legitimate ones out mid-handshake); no eviction (stallers keep their slots for the
    whole handshake timeout)."""
    budget = HandshakeBudget(total=4, per_source=2, stale_after=1.0)  # no slot goes stale while the admits run
    pairs = [socket.socketpair() for _ in range(8)]
    conns = [near for near, _ in pairs]
    a1, a2 = budget.admit("a", conns[0]), budget.admit("a", conns[1])
    assert a1 and a2 and budget.admit("a", conns[2]) is None  # its cap, nothing stale: refused
    assert budget.admit("b", conns[3]) and budget.admit("c", conns[4])
    assert budget.admit("d", conns[5]) is None and budget.pending == 4  # the total, nothing stale
    assert not any(shut_down(far) for _, far in pairs)
    time.sleep(1.05)
    assert budget.admit("a", conns[6])  # its own source's oldest (stale) makes room
    assert shut_down(pairs[0][1]) and not shut_down(pairs[1][1])
    assert budget.by_source() == {"a": 2, "b": 1, "c": 1}
    budget.release("a", a1)  # the evicted one's handler lets go: nothing changes
    assert budget.pending == 4
    assert budget.admit("d", conns[7])  # at the total: the source holding the most gives its oldest stale one
    assert shut_down(pairs[1][1])
    assert budget.by_source() == {"a": 1, "b": 1, "c": 1, "d": 1} and budget.evicted == 2
    for near, far in pairs:
        near.close()
        far.close()


# --- the engine's listener --------------------------------------------------------------------------
def flood(host: str, port: int, sources: list[str], per_source: int) -> list[socket.socket]:
    """Connections that never say a word, from each address in `sources`."""
    out = []
    for address in sources:
        for _ in range(per_source):
            sock = socket.socket()
            sock.bind((address, 0))
            sock.settimeout(5)
            sock.connect((host, port))
            out.append(sock)
    return out


def still_open(socks: list[socket.socket]) -> list[socket.socket]:
    """Those the server has not closed."""
    alive = []
    for sock in socks:
        sock.setblocking(False)
        try:
            if sock.recv(1):
                alive.append(sock)
        except BlockingIOError:
            alive.append(sock)
        except OSError:
            pass
    return alive


@contextlib.contextmanager
def listener(**budgets) -> Iterator[tuple[Listener, str]]:
    """An engine's listener on its own (no data plane behind it), and its same-host socket's name."""
    unix = f"kvstore-test-{uuid.uuid4().hex}"
    lst = Listener("127.0.0.1", 0, unix, SECRET.encode(), "budgeted", lambda fd, tx, rx, peer: os.close(fd),
                   lambda: ([], []), 5.0, **budgets)
    try:
        yield lst, unix
    finally:
        lst.close()


def handshake(sock: socket.socket) -> None:
    client_handshake(sock, SECRET.encode(), "ctl", "legit", wire="plain", timeout=5)


def test_the_same_host_socket_keeps_a_budget_of_its_own_when_tcp_is_full():
    """Variant killed: one budget for both sockets (a TCP flood shuts same-host clients out)."""
    with listener(max_handshakes=8, max_per_source=2, stale_after=60) as (lst, unix_name):
        held = flood(lst.host, lst.port, [f"127.0.{i}.2" for i in range(1, 5)], 2)
        deadline = time.monotonic() + 5
        while lst.tcp_budget.pending < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lst.tcp_budget.pending == 8
        newcomer = flood(lst.host, lst.port, ["127.0.9.2"], 1)[0]  # TCP is full and nothing is stale
        with pytest.raises(OSError):
            handshake(newcomer)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.settimeout(5)
        unix.connect("\0" + unix_name)
        handshake(unix)  # the same-host socket still takes its own
        for sock in held + [newcomer, unix]:
            sock.close()


def test_a_stalled_handshake_gives_its_slot_to_a_newcomer_of_any_source():
    """Variant killed: no eviction: floods from more prefixes than the total holds (30 here) keep
    everyone out for a whole handshake timeout, over and over."""
    with listener(max_handshakes=16, max_per_source=4, stale_after=0.3) as (lst, _):
        held = flood(lst.host, lst.port, [f"127.0.{i}.2" for i in range(1, 31)], 1)
        time.sleep(0.4)
        # full: later ones were refused, or took a stalled one's slot (waited for: until the listener
        # has taken each from its backlog, it counts as open)
        assert until(lambda: len(still_open(held)) == 16, timeout=3)  # well inside the 5 s handshake timeout
        newcomer = flood(lst.host, lst.port, ["127.0.99.2"], 1)[0]
        handshake(newcomer)  # a stalled one makes room
        newcomer.close()
        for sock in held:
            sock.close()


def test_one_prefix_holds_at_most_its_share_of_the_engine_listener(spawn_peer):
    """Variant killed: per-address caps in the engine's listener (39 addresses of one /24 held 39 x
    16 slots, more than the whole budget)."""
    peer = spawn_peer(size=1 << 20, secret=SECRET, extra=["--handshake-timeout", "30"])
    desc = json.loads(peer.descriptor)
    held = flood(desc["host"], desc["port"], [f"127.0.0.{i}" for i in range(2, 41)], 2)
    try:  # one still in the listener's backlog counts as open until it is taken and refused
        assert until(lambda: len(still_open(held)) <= MAX_HANDSHAKES_PER_SOURCE)
    finally:
        for sock in held:
            sock.close()


# --- a store node under a flood ---------------------------------------------------------------------
def test_a_preauth_flood_of_the_engine_port_leaves_room_for_new_clients(etcd_server, spawn_daemon):
    """The review's scenario, harder: connections that never authenticate, from 39 addresses of
    the legitimate clients' own /24 and from 30 other /24s (more than the whole budget), hold the
    node's engine port. A new remote client still puts and gets (its connections from 127.0.0.1
    take stalled slots of its /24), and a same-host client's get still hits (its control
    connection goes through the same-host socket's own budget). Variants killed: no eviction at a
    cap (the /24 of the clients stays full), one budget for both sockets."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("flooded", etcd_server.url, cluster, secret=SECRET)
    hashes = external_hashes(range(4), FP)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET) as local:
        assert local.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        desc = json.loads(local.mirror.segments[daemon.name])
        held = flood(desc["host"], desc["port"], [f"127.0.0.{i}" for i in range(2, 41)], 2) + \
            flood(desc["host"], desc["port"], [f"127.0.{i}.2" for i in range(1, 31)], MAX_HANDSHAKES_PER_SOURCE)
        try:
            time.sleep(0.7)  # past STALE_HANDSHAKE_S: the flood is stalled, not slow
            with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport="tcp") as remote:
                assert remote.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
                assert remote.put_many([(h, content(h)) for h in hashes]) == 4  # engine writes: reserve, write, commit
                outs = [np.zeros(BLOCK, np.uint8) for _ in hashes]
                assert all(remote.get_many(hashes, outs))
                assert all(np.array_equal(o, content(h)) for o, h in zip(outs, hashes))
            assert local.mirror.wait_until(lambda m: all(m.lookup(FP.digest, h) for h in hashes), 10)
            outs = [np.zeros(BLOCK, np.uint8) for _ in hashes]
            assert all(local.get_many(hashes, outs))  # a new same-host connection, during the flood
            assert all(np.array_equal(o, content(h)) for o, h in zip(outs, hashes))
        finally:
            for sock in held:
                sock.close()


def test_one_prefix_holds_at_most_its_share_of_the_store_wire_and_a_newcomer_still_uses_it(etcd_server,
                                                                                          spawn_daemon):
    """Variants killed: per-address caps on the store's framed wire over TCP (39 addresses of one
    /24 held a slot each, past the prefix's share), and no eviction there (a new client's calls
    left to gRPC for as long as the flood holds)."""
    cluster = uuid.uuid4().hex[:8]
    # A 30 s handshake timeout (the daemon's --timeout): the flood's connections must be refused or
    # evicted, not merely timed out by the time the counts are read.
    daemon = spawn_daemon("wire-flooded", etcd_server.url, cluster, secret=SECRET, extra=["--timeout", "30"])
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport="tcp") as probe:
        assert probe.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        host, port = tcp_endpoint("tcp://" + json.loads(probe.mirror.segments[daemon.name])["kvstore_wire"])
    held = flood(host, port, [f"127.0.0.{i}" for i in range(2, 41)], 2)
    try:
        time.sleep(0.7)  # past STALE_HANDSHAKE_S: the flood is stalled, not slow
        assert until(lambda: len(still_open(held)) <= 16)  # each taken from the backlog, the excess refused
        with Client(etcd_server.url, cluster=cluster, fingerprint=FP, secret=SECRET, transport="tcp") as newcomer:
            assert newcomer.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
            small = external_hashes(range(100, 104), FP)
            assert newcomer.put_many([(h, content(h, 4096)) for h in small]) == 4
            assert newcomer.stats["wire_puts"] == 1  # over the wire, not gRPC
    finally:
        for sock in held:
            sock.close()
