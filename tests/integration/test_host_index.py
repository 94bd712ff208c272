"""One index mirror per host: clients with `index="host"` ask the host's daemon about blocks and
keep only the cluster's nodes themselves (real etcd, daemons in their own processes)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import uuid

import numpy as np
import pytest

from kvstore import Client
from kvstore.errors import InvalidConfig, InvalidRequest
from kvstore.index import IndexMirror
from kvstore.index.host_mirror import HostIndexMirror
from kvstore.keys import ModelFingerprint, chain_hashes, external_hashes
from tests_support import until

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def cluster(etcd_server, spawn_daemon):
    name = uuid.uuid4().hex[:8]
    daemons = [spawn_daemon(f"node{i}", etcd_server.url, name) for i in range(2)]
    own = Client(etcd_server.url, cluster=name, fingerprint=FP, timeout=2.0)
    assert own.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
    host = Client(etcd_server.url, cluster=name, fingerprint=FP, timeout=2.0, index="host")
    yield name, daemons, own, host
    host.close()
    own.close()


def test_a_hosts_clients_ask_its_one_index_and_keep_no_blocks(cluster):
    """Kills: a host-index client that still loads the cluster's blocks itself (its memory and start
    per process), and lookups whose records skip the client's seal check."""
    _, daemons, own, host = cluster
    assert isinstance(host.mirror, HostIndexMirror) and host.mirror.host == "node0"
    hashes = chain_hashes(FP, list(range(16 * 12)))
    assert host.put_many([(h, content(h)) for h in hashes]) == 12
    outs = [np.zeros(BLOCK, np.uint8) for _ in hashes]
    assert all(host.get_many(hashes, outs))  # at once: the put's answer went to the host index
    assert all(np.array_equal(o, content(h)) for o, h in zip(outs, hashes))
    assert host.match_prefix(hashes + external_hashes([1], FP)) == 12 and host.contains(hashes[5])
    assert host.mirror.members.block_count == 0 and host.mirror.block_count == 12  # held by node0, not here
    assert own.mirror.wait_until(lambda m: m.block_count == 12, 10)
    assert host.mirror.node_prefix_lengths(FP, hashes) == own.mirror.node_prefix_lengths(FP, hashes)
    # Blocks another process put are there through the host's watch.
    more = external_hashes(range(100, 104), FP)
    own.put_many([(h, content(h)) for h in more])
    assert host.mirror.wait_until(lambda m: all(m.contains(FP, h) for h in more), 10)
    # A record the host index hands out is checked here: one that is not its node's is refused.
    assert host.mirror.lookup(FP, more[0])
    wrong = HostIndexMirror.lookup_many.__get__(host.mirror)
    assert wrong(FP, [more[0]], verifier=_refuse_all()) == [{}] and host.mirror.refused_records == 1
    assert host.remove(more) == len(more) and not any(host.contains(h) for h in more)


class _refuse_all:
    def check(self, *args) -> bool:
        return False


def test_a_host_index_that_stops_answering_is_said_once_and_replaced(cluster, caplog):
    """Kills: a client whose host daemon died answering 'nothing cached' (or stale) for good, or
    raising on every question, instead of saying so once and keeping a mirror of its own."""
    _, daemons, own, host = cluster
    hashes = external_hashes(range(8), FP)
    own.put_many([(h, content(h)) for h in hashes], replicas=2)  # node1 keeps a copy of each
    assert own.mirror.wait_until(lambda m: all(len(m.lookup(FP, h)) == 2 for h in hashes), 10)
    assert until(lambda: host.match_prefix(hashes) == 8, 10)  # from the host's shared table
    assert host.mirror._view is not None
    survivors = hashes
    daemons[0].kill()  # SIGKILL: its table's stamp is still fresh, no code of it runs again
    with caplog.at_level(logging.WARNING, logger="kvstore.index.host_mirror"):
        host.match_prefix(hashes)
        assert isinstance(host.mirror.own, IndexMirror)
        assert host.mirror.own.wait_loaded(10)
        assert all(host.contains(h) for h in survivors)
        host.match_prefix(hashes)
    said = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_matches_come_from_the_hosts_shared_table_and_follow_removals(cluster):
    """Kills: a shared table the mirror does not tell of removals (a worker would plan loads of
    blocks gone from every node), and matches that still go over the socket."""
    _, _, own, host = cluster
    hashes = external_hashes(range(900, 916), FP)
    host.put_many([(h, content(h)) for h in hashes])
    misses = host.mirror.table_misses
    assert host.match_prefix(hashes) == 16  # the put's answer reached the table before it returned
    assert host.mirror._view is not None and host.mirror.table_misses == misses
    assert own.mirror.wait_until(lambda m: m.contains(FP, hashes[-1]), 10)
    assert own.remove(hashes[8:9]) == 1
    assert until(lambda: host.match_prefix(hashes) == 8, 10)
    assert host.mirror.table_misses == misses


def test_a_host_without_a_daemon_is_one_clear_error_or_an_own_mirror(etcd_server):
    """Kills: index='host' on a host with no daemon of the cluster hanging or answering 'nothing
    cached' from nowhere; 'auto' then keeps its own mirror."""
    empty = uuid.uuid4().hex[:8]
    with pytest.raises(InvalidConfig, match="no kvstore serve daemon"):
        Client(etcd_server.url, cluster=empty, fingerprint=FP, timeout=2.0, index="host")
    with Client(etcd_server.url, cluster=empty, fingerprint=FP, timeout=2.0, index="auto") as auto:
        assert isinstance(auto.mirror, IndexMirror)
    with pytest.raises(InvalidConfig, match="index must be"):
        Client(etcd_server.url, cluster=empty, fingerprint=FP, index="shared")
    with pytest.raises(InvalidConfig, match="transport='tcp'"):
        Client(etcd_server.url, cluster=empty, fingerprint=FP, index="host", transport="tcp")


class CuttableRelay:
    """A TCP relay in front of etcd for one daemon: `cut()` closes its connections and refuses
    new ones, so that daemon loses etcd while every other process keeps it."""

    def __init__(self, port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"etcd://127.0.0.1:{self.server.getsockname()[1]}"
        self.target, self.socks, self.closed = ("127.0.0.1", port), [], False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
                if self.closed:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        self.closed = True  # (a listening socket closed under a blocked accept() keeps accepting)
        for sock in [self.server, *self.socks]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_a_stale_host_index_is_answered_as_stale(etcd_server, spawn_daemon):
    """Kills: a client taking the host index's answers as current while the host's mirror has lost
    etcd (the reply's `stale` dropped): its prefix matches would be planned as loads from a view
    nobody can vouch for. This process's own view of the nodes stays current throughout."""
    relay = CuttableRelay(int(etcd_server.url.rsplit(":", 1)[1]))
    name = uuid.uuid4().hex[:8]
    spawn_daemon("node0", relay.url, name, lease_ttl=60)  # its records outlive the cut
    with Client(etcd_server.url, cluster=name, fingerprint=FP, timeout=2.0, index="host") as client:
        hashes = external_hashes(range(4), FP)
        client.put_many([(h, content(h)) for h in hashes])
        match = client.mirror.match(FP, hashes)
        assert match.length == 4 and not match.stale and not client.mirror.stale
        relay.cut()
        assert until(lambda: client.mirror.match(FP, hashes).stale, 20)
        assert client.mirror.stale and not client.mirror.members.stale


def test_a_put_is_in_the_host_index_before_etcd_has_it(fresh_etcd, spawn_daemon):
    """Kills: a put's answer not told to the host index (the putting process, and every other one
    on the host, then missed the block until the node's publish came back through etcd's watch).
    etcd is frozen meanwhile, so only the put's own answer can make the block known."""
    name = uuid.uuid4().hex[:8]
    spawn_daemon("node0", fresh_etcd.url, name, lease_ttl=60)
    with Client(fresh_etcd.url, cluster=name, fingerprint=FP, timeout=2.0, index="host") as writer, \
            Client(fresh_etcd.url, cluster=name, fingerprint=FP, timeout=2.0, index="host") as reader:
        hashes = external_hashes(range(4), FP)
        assert reader.match_prefix(hashes) == 0  # the host index starts at its first question
        os.kill(fresh_etcd.proc.pid, signal.SIGSTOP)
        try:
            assert writer.put_many([(h, content(h)) for h in hashes]) == 4
            assert all(reader.contains(h) for h in hashes) and writer.match_prefix(hashes) == 4
            out = np.zeros(BLOCK, np.uint8)
            assert reader.get(hashes[2], out) and np.array_equal(out, content(hashes[2]))
        finally:
            os.kill(fresh_etcd.proc.pid, signal.SIGCONT)


def test_bad_index_questions_get_one_line_each(cluster):
    """Kills: an index question over TCP answered (the host index is the host's: another host's
    process would read it over the network), a hash count the frame does not back read as
    whatever follows, and an unknown question answered as some other one."""
    _, _, _, host = cluster
    ask = {"op": "index", "q": "match", "fp": FP.digest}
    with pytest.raises(InvalidRequest, match="count"):
        host.links.control("node0").call({**ask, "count": -1})
    with pytest.raises(InvalidRequest, match="unknown question"):
        host.links.control("node0").call({**ask, "q": "everything", "count": 1}, [b"\0" * 16])
    with pytest.raises(InvalidRequest, match="same host"):
        host.links.wire("node0").call({**ask, "count": 1}, [b"\0" * 16])
    reply, _ = host.links.control("node0").call({**ask, "count": 2}, [b"\1" * 32])
    assert reply["length"] == 0 and reply["stale"] is False


def test_the_host_index_takes_only_sealed_records_of_registered_nodes(cluster):
    """Kills: a `learn` that lists whatever a process sends for every process on the host (a
    record of a node that does not exist, or without its node's seal: others would be sent to it;
    made-up node names also filled the index's node numbers until its watch died)."""
    _, _, own, host = cluster
    h = external_hashes([500], FP)[0]
    host.put_many([(h, content(h))])
    (node, record), = host.mirror.lookup(FP, h).items()
    raw = host.links.control(node).call({"op": "index", "q": "lookup", "fp": FP.digest, "count": 1}, [h])[0]
    hexed = raw["records"][0][node]
    other = external_hashes([501], FP)[0]
    learn = {"op": "index", "q": "learn", "fp": FP.digest, "count": 1}
    ask = host.links.control(node).call
    assert ask({**learn, "node": "no-such-node", "records": [hexed]}, [other])[0]["learned"] == 0
    assert ask({**learn, "node": node, "records": [hexed]}, [other])[0]["learned"] == 0  # sealed for another hash
    assert not host.contains(other)
    assert ask({**learn, "node": node, "records": [hexed]}, [h])[0]["learned"] == 1


def test_questions_of_any_size_or_shape_are_answered_as_an_own_mirror_would(cluster, monkeypatch):
    """Kills: prompts longer than one question sent whole (past the host's limit, or a lookup reply
    past a frame's: a get raised), hashes that are not 16 bytes sent anyway (the host waited for
    bytes never coming, or took the next request's bytes as them), a refused question or a slow
    wait taken for a dead host (the process then kept a mirror of its own for good)."""
    from kvstore.index import host_mirror

    _, _, own, host = cluster
    assert host.match_prefix(external_hashes(range(70_000), FP)) == 0  # more than one question may name
    monkeypatch.setattr(host_mirror, "CHUNK", 5)
    monkeypatch.setattr(host_mirror, "LOOKUP_CHUNK", 3)
    hashes = chain_hashes(FP, list(range(16 * 12)))
    host.put_many([(h, content(h)) for h in hashes[:7]], replicas=2)  # the two nodes part after block 7
    host.put_many([(h, content(h)) for h in hashes[7:]])
    assert own.mirror.wait_until(lambda m: m.block_count == 12, 10)
    assert host.match_prefix(hashes) == 12 and host.match_prefix(hashes[:7] + [b"short"] + hashes[7:]) == 7
    assert host.mirror.node_prefix_lengths(FP, hashes) == own.mirror.node_prefix_lengths(FP, hashes)
    mixed = hashes[:4] + [b"x" * 17] + hashes[4:]  # answers land at their own places around a non-hash
    assert host.mirror.lookup_many(FP, mixed) == own.mirror.lookup_many(FP, mixed)
    assert not host.contains(b"short") and host.get(b"short", np.zeros(BLOCK, np.uint8)) is False
    with pytest.raises(InvalidRequest):
        host.mirror._question({"q": "no-such-question"})
    assert host.mirror.wait_for_revision(10**12, timeout=3.0) is False  # longer than the client's timeout
    assert host.mirror.own is None and host.match_prefix(hashes) == 12


def test_a_put_answer_that_comes_after_the_blocks_removal_is_not_taken(cluster):
    """Kills: a learn taken after the watch had already applied the replica's deletion (a put's
    answer overtaken by a remove or an eviction): the host index would list a block no node holds,
    for every process on the host, with no later event to unlist it."""
    _, _, _, host = cluster
    h = external_hashes([900], FP)[0]
    host.put_many([(h, content(h))])
    (node,) = host.mirror.lookup(FP, h)
    sealed = host.links.control(node).call({"op": "index", "q": "lookup", "fp": FP.digest, "count": 1}, [h])[0]
    record = sealed["records"][0][node]
    assert host.remove([h]) == 1 and not host.contains(h)  # its deletion's event applied by the host
    late = {"op": "index", "q": "learn", "fp": FP.digest, "node": node, "records": [record], "count": 1}
    assert host.links.control(node).call(late, [h])[0]["learned"] == 0
    assert not host.contains(h)


def test_a_daemon_older_than_host_indexes_makes_its_clients_keep_their_own(cluster, monkeypatch):
    """Kills: a client of a daemon that does not know the `index` op (a rolling upgrade) raising
    on every put and get, instead of keeping a mirror of its own."""
    from kvstore.errors import WrongSize

    _, _, own, host = cluster
    hashes = external_hashes(range(700, 703), FP)
    own.put_many([(h, content(h)) for h in hashes])
    assert own.mirror.wait_until(lambda m: m.block_count == 3, 10)

    def old_daemon(node, message, attachments, timeout):
        raise WrongSize(f"{node}: unknown op 'index'")

    monkeypatch.setattr(host.mirror, "_ask", old_daemon)
    monkeypatch.setattr(host.mirror, "_open_table", lambda node: old_daemon(node, {}, (), None))
    monkeypatch.setattr(host.mirror, "_view", None)
    host.match_prefix(hashes)
    assert isinstance(host.mirror.own, IndexMirror) and host.mirror.own.wait_loaded(10)
    # The putter learnt its blocks from the put's reply; etcd may get them after the new mirror's
    # snapshot (publishing is asynchronous: seen on a loaded machine), and its watch brings them then.
    assert host.mirror.own.wait_until(lambda m: m.block_count == 3, 10)
    assert host.match_prefix(hashes) == 3
