"""Writes only where granted (security review: a client holding only the cluster secret, over TCP,
rewrote another client's stored block in DRAM and in the NVMe tier). A peer's one-sided writes
land only inside ranges its owner granted that peer's engine; the store grants a slot to the engine
its client named while the slot is reserved or leased, and the NVMe tier takes no remote write.

Each test names the broken variant it kills. Engines serving writes run in their own processes
(tests/helpers/peer_process.py, store daemons); the BlockStore tests at the end run one in this
process to reach its internals, over real sockets."""
from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
import time
import uuid
from array import array

import numpy as np
import pytest

from kvstore import Client
from kvstore.daemon.store import STILL_LANDING, BlockStore
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.wire import connect
from transfer import Engine, Read, ReadOnlyRegion, Write, WriteNotGranted
from transfer.auth import client_handshake
from transfer.ucx import UNSAFE_ENV
from transfer.ucx_routes import unavailable as ucx_unavailable
from tests_support import sha, until

SECRET = "grant-secret-0123456789"
FP = ModelFingerprint("write-grants", "float16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 1 << 20  # past the inline limits: puts of it go through the engine (reserve, write, commit)
REQ = struct.Struct("<IB3xQQQ")  # cpp/common.h ReqHeader
RESP = struct.Struct("<iIQ")  # cpp/common.h RespHeader
MAGIC, WRITE = 0x4B565431, 2


def content(h: bytes, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def garbage(size: int) -> bytearray:
    return bytearray(b"\xee" * size)


# --- the engine: the native check ------------------------------------------------------------------
@pytest.fixture
def owner(spawn_peer):
    return spawn_peer(size=1 << 20, secret=SECRET)


def client_engine(name: str, wire: str = "aead") -> Engine:
    return Engine(name, listen=None, secret=SECRET, wire=wire)


@pytest.mark.parametrize("wire", ["aead", "plain"])
def test_a_write_outside_every_grant_is_refused_and_lands_nowhere(owner, wire):
    """Variant killed: writes into an exported region land anywhere in it (no check, or a check on
    the region only, or one that takes a write reaching past its grant's end)."""
    before = owner.sha("granted")
    with client_engine("mallory", wire) as engine:
        peer = engine.connect(owner.descriptor, transport="tcp")
        region = peer.region(owner.regions["granted"])
        assert region.granted
        src = engine.register(garbage(1 << 16))
        with pytest.raises(WriteNotGranted):
            engine.transfer([Write(src, 0, region, 0, 4096)])
        assert owner.call(cmd="grant", peer=engine.peer_id, region="granted", offset=8192, length=8192) == {"ok": True}
        for offset, length in [(0, 4096), (4096, 8192), (12288, 8192), (16384, 4096), (8192, 8193)]:
            with pytest.raises(WriteNotGranted):  # before, straddling either end, after, one byte past
                engine.transfer([Write(src, 0, region, offset, length)])
        assert owner.sha("granted") == before
        engine.transfer([Write(src, 0, region, 8192, 8192)])  # inside: lands
        expected = owner.expected()
        expected[8192:16384] = 0xEE
        assert owner.sha("granted") == hashlib.sha256(expected.tobytes()).hexdigest()
        dst = engine.register(bytearray(4096))  # reads need no grant
        engine.transfer([Read(dst, 0, region, 0, 4096)])
        assert bytes(dst.buffer) == owner.expected()[:4096].tobytes()


def test_a_range_granted_to_another_engine_takes_none_of_this_ones_writes(owner):
    """Variant killed: grants keyed by region (or by nothing), so one client's slot is writable by
    every authenticated peer."""
    with client_engine("alice") as alice, client_engine("mallory") as mallory:
        assert alice.peer_id != mallory.peer_id
        owner.call(cmd="grant", peer=alice.peer_id, region="granted", offset=0, length=65536)
        before = owner.sha("granted", 0, 65536)
        theirs = mallory.connect(owner.descriptor, transport="tcp").region(owner.regions["granted"])
        src = mallory.register(garbage(65536))
        with pytest.raises(WriteNotGranted):
            mallory.transfer([Write(src, 0, theirs, 0, 65536)])
        assert owner.sha("granted", 0, 65536) == before
        mine = alice.connect(owner.descriptor, transport="tcp").region(owner.regions["granted"])
        alice.transfer([Write(alice.register(bytearray(65536)), 0, mine, 0, 65536)])
        assert owner.sha("granted", 0, 65536) != before


def test_a_grant_ends_at_its_revocation(owner):
    """Variant killed: revoke leaves the grant in place (or revokes another range), so a client
    keeps writing a slot after its commit, when it is someone else's block."""
    with client_engine("alice") as engine:
        region = engine.connect(owner.descriptor, transport="tcp").region(owner.regions["granted"])
        src = engine.register(garbage(4096))
        owner.call(cmd="grant", peer=engine.peer_id, region="granted", offset=0, length=4096)
        owner.call(cmd="grant", peer=engine.peer_id, region="granted", offset=4096, length=4096)
        engine.transfer([Write(src, 0, region, 0, 4096)])
        assert owner.call(cmd="revoke", peer=engine.peer_id, region="granted", offset=0, length=4096) == {"quiet": True}
        before = owner.sha("granted")
        with pytest.raises(WriteNotGranted):
            engine.transfer([Write(src, 0, region, 0, 4096)])
        assert owner.sha("granted") == before
        engine.transfer([Write(src, 0, region, 4096, 4096)])  # its neighbour is still granted
        assert owner.call(cmd="grant", peer=engine.peer_id, region="granted", offset=6000, length=10) == \
            {"error": "InvalidOp"}  # grants of one peer never overlap: the check stays one lookup


def test_a_region_that_takes_no_remote_write_refuses_them_and_still_serves_reads(owner):
    """Variant killed: the NVMe tier exported writable (the review's second finding)."""
    before = owner.sha("sealed")
    with client_engine("mallory") as engine:
        region = engine.connect(owner.descriptor, transport="tcp").region(owner.regions["sealed"])
        assert region.readonly
        src = engine.register(garbage(4096))
        owner.call(cmd="grant", peer=engine.peer_id, region="granted", offset=0, length=4096)
        assert owner.call(cmd="grant", peer=engine.peer_id, region="sealed", offset=0, length=4096) == \
            {"error": "InvalidOp"}  # not a region of grants: nobody writes it from outside
        with pytest.raises(ReadOnlyRegion):
            engine.transfer([Write(src, 0, region, 0, 4096)])
        dst = engine.register(bytearray(4096))
        engine.transfer([Read(dst, 0, region, 4096, 4096)])
        assert bytes(dst.buffer) == owner.expected()[4096:8192].tobytes()
    assert owner.sha("sealed") == before


@pytest.mark.skipif(ucx_unavailable() is not None, reason=str(ucx_unavailable()))
@pytest.mark.parametrize("tls", ["tcp", "sm"])
def test_over_ucx_a_granted_region_takes_writes_only_through_the_checked_route(spawn_peer, monkeypatch, tls):
    """Variant killed: a granted region exported over UCX with a writable rkey (UCX moves a peer's
    put without the owner seeing it, and over TCP it checks no rkey's access at all)."""
    monkeypatch.setenv("UCX_TLS", tls)  # what the owner process (ucx="auto") uses
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    if tls == "sm":
        monkeypatch.setenv(UNSAFE_ENV, "1")
    owner = spawn_peer(size=1 << 20, secret=SECRET)
    with Engine("ucx-client", listen=None, secret=SECRET, ucx=tls) as engine:
        peer = engine.connect(owner.descriptor, transport="ucx")
        assert peer.transport == "ucx"
        region = peer.region(owner.regions["granted"])
        assert (region.id in peer._ucx_keyed) == (tls == "sm")  # over TCP: no rkey at all
        src = engine.register(garbage(4096))
        with pytest.raises(WriteNotGranted):
            engine.transfer([Write(src, 0, region, 0, 4096)])
        if tls == "sm":  # its rkey reads only: a write forced onto the ucx route is refused
            failures, batch = engine._native.run(array("Q", [2, peer._ucx_route, src.id, 0, region.id, 0, 4096]), 5.0)
            assert failures == 1 and batch.statuses() == [4]
            del batch
        owner.call(cmd="grant", peer=engine.peer_id, region="granted", offset=0, length=4096)
        engine.transfer([Write(src, 0, region, 0, 4096)])  # over the engine's TCP streams, checked there
        dst = engine.register(bytearray(4096))
        before = engine.stats()["ucx_bytes"]
        engine.transfer([Read(dst, 0, region, 0, 4096)])
        assert bytes(dst.buffer) == bytes(garbage(4096))
        assert (engine.stats()["ucx_bytes"] > before) == (tls == "sm")  # reads keep UCX where it is safe
        for local in (src, dst):
            engine.unregister(local)


def raw_data_stream(descriptor: str, peer: str) -> socket.socket:
    """A plaintext data connection that authenticates as the engine `peer`."""
    desc = json.loads(descriptor)
    sock = socket.create_connection((desc["host"], desc["port"]), timeout=5)
    client_handshake(sock, SECRET.encode(), "data", "raw", wire="plain", timeout=5, peer=peer)
    sock.settimeout(5)
    return sock


def test_a_revoke_does_not_report_quiet_while_a_granted_write_is_still_landing(spawn_peer):
    """Variant killed: the check only at a write's header, with nothing held while its payload
    lands, so bytes admitted before a revoke (a commit, an expiry) land after it, on whoever's block
    the range is by then. Plain wire: the payload goes straight into the region."""
    owner = spawn_peer(size=1 << 20, secret=SECRET, extra=["--wire", "plain"])
    peer = uuid.uuid4().hex
    owner.call(cmd="grant", peer=peer, region="granted", offset=0, length=8192)
    sock = raw_data_stream(owner.descriptor, peer)
    try:
        sock.sendall(REQ.pack(MAGIC, WRITE, owner.regions["granted"], 0, 8192) + b"\xee" * 4096)
        # the header was checked, half the payload is in
        assert until(lambda: owner.sha("granted", 0, 4096) == sha(b"\xee" * 4096))
        assert owner.call(cmd="revoke", peer=peer, region="granted", offset=0, length=8192) == {"quiet": False}
        assert owner.call(cmd="landing", peer=peer, region="granted", offset=4096, length=10) == {"landing": True}
        sock.sendall(b"\xee" * 4096)
        status, _, _ = RESP.unpack(sock.recv(RESP.size, socket.MSG_WAITALL))
        assert status == 0  # admitted before the revoke: it lands, and is over now
        assert owner.call(cmd="landing", peer=peer, region="granted", offset=0, length=8192) == {"landing": False}
        landed = owner.sha("granted", 0, 8192)
        sock.sendall(REQ.pack(MAGIC, WRITE, owner.regions["granted"], 0, 4096) + b"\x11" * 4096)
        status, _, _ = RESP.unpack(sock.recv(RESP.size, socket.MSG_WAITALL))
        assert status == 12  # revoked: refused, and its payload discarded
        assert owner.sha("granted", 0, 8192) == landed
    finally:
        sock.close()


class GatedProxy:
    """Forwards TCP both ways; once `hold(n)` is called, lets n more client-to-server bytes through
    on each connection and holds the rest until `release()`."""

    def __init__(self, host: str, port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target = (host, port)
        self._budget: int | None = None
        self._open = threading.Event()
        self._open.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, n: int) -> None:
        self._budget = n
        self._open.clear()

    def release(self) -> None:
        self._budget = None
        self._open.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while data := src.recv(65536):
                while gated and self._budget is not None and len(data) > self._budget:
                    head, data = data[: self._budget], data[self._budget :]
                    dst.sendall(head)
                    self._budget = 0
                    self._open.wait()
                if gated and self._budget is not None:
                    self._budget -= len(data)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.server.close()


def test_an_encrypted_write_whose_bytes_arrive_after_the_revoke_is_refused(owner):
    """Variant killed: on AEAD streams (decrypted into a bounce buffer first) the grant checked at
    the header only: bytes that arrive after a revoke which found nothing landing yet are copied
    in all the same, on whoever's block the range is by then."""
    desc = json.loads(owner.descriptor)
    proxy = GatedProxy(desc["host"], desc["port"])
    try:
        via_proxy = dict(desc, port=proxy.port, unix=None)
        with client_engine("slow") as engine:
            region = engine.connect(via_proxy, transport="tcp", streams=1).region(owner.regions["granted"])
            owner.call(cmd="grant", peer=engine.peer_id, region="granted", offset=0, length=65536)
            before = owner.sha("granted", 0, 65536)
            proxy.hold(1000)  # the sealed header and the payload's first bytes, no more
            batch = engine.submit([Write(engine.register(garbage(65536)), 0, region, 0, 65536)])
            time.sleep(0.3)
            assert owner.call(cmd="revoke", peer=engine.peer_id, region="granted", offset=0, length=65536) == \
                {"quiet": True}  # admitted at its header, but nothing is being copied in yet
            proxy.release()
            with pytest.raises(WriteNotGranted):
                batch.wait(10)
            assert owner.sha("granted", 0, 65536) == before
    finally:
        proxy.close()


# --- the store: grants follow reservations and leases ---------------------------------------------
@pytest.fixture
def node(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("granting", etcd_server.url, cluster, secret=SECRET, dram="32MiB", disk="64MiB")
    return daemon, etcd_server.url, cluster


def store_client(url: str, cluster: str, transport: str = "tcp") -> Client:
    client = Client(url, cluster=cluster, fingerprint=FP, secret=SECRET, transport=transport)
    assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
    return client


def reads_back(client: Client, hashes: list[bytes], size: int = BLOCK) -> bool:
    outs = [np.zeros(size, np.uint8) for _ in hashes]
    return all(client.get_many(hashes, outs)) and all(np.array_equal(o, content(h, size)) for o, h in zip(outs, hashes))


def attacker(client: Client, name: str) -> tuple[Engine, object]:
    """An engine that holds the cluster secret and nothing else, connected to the node over TCP."""
    engine = client_engine("mallory")
    return engine, engine.connect(client.mirror.segments[name], transport="tcp")


def test_a_remote_client_cannot_rewrite_another_clients_block_in_dram_or_the_nvme_tier(node):
    """Variants killed: the daemon's DRAM arena exported writable by any peer (the review's finding:
    another client's committed block rewritten), and its NVMe tier exported writable."""
    daemon, url, cluster = node
    with store_client(url, cluster) as victim:
        hashes = external_hashes(range(48), FP)  # 48 MiB into 32 MiB of DRAM: the first ones go to NVMe
        for start in range(0, len(hashes), 8):
            assert victim.put_many([(h, content(h)) for h in hashes[start : start + 8]]) == 8
        def tiers() -> set[str]:
            return {rec.tier for h in hashes for rec in victim.mirror.lookup(FP.digest, h).values()}

        assert victim.mirror.wait_until(lambda m: tiers() == {"dram", "nvme"}, 10), tiers()
        records = {h: list(victim.mirror.lookup(FP.digest, h).values()) for h in hashes}
        engine, peer = attacker(victim, daemon.name)
        with engine:
            src = engine.register(garbage(BLOCK))
            hit = {"dram": 0, "nvme": 0}
            for h, found in records.items():
                if not found:
                    continue
                record = found[0]
                error = WriteNotGranted if record.tier == "dram" else ReadOnlyRegion
                with pytest.raises(error):
                    engine.transfer([Write(src, 0, peer.region(record.region), record.offset, record.size)])
                hit[record.tier] += 1
            assert hit["dram"] and hit["nvme"]
        kept = [h for h in hashes if records[h]]
        assert reads_back(victim, kept)


def test_a_reserved_slot_takes_writes_from_the_engine_it_was_reserved_for_until_its_commit(node):
    """Variants killed: reservations granted to no one or to every peer (the slot of a put in
    flight rewritten by another client before its commit), and grants kept past the commit (the
    block rewritten by its own writer once sealed, or by whoever holds the slot's grant)."""
    daemon, url, cluster = node
    with store_client(url, cluster) as alice:
        wire = alice.links.wire(daemon.name)
        frames = connect(wire.address, SECRET.encode(), "probe", 5.0)
        h = external_hashes([1000], FP)[0]
        frames.send({"op": "reserve", "fp": FP.digest, "hashes": [h.hex()], "sizes": [BLOCK],
                     "peer": alice.engine.peer_id})
        token, region, offset, _ = frames.recv(5.0)["slots"][0]
        engine, peer = attacker(alice, daemon.name)
        with engine:
            with pytest.raises(WriteNotGranted):  # alice's slot, mallory's write
                engine.transfer([Write(engine.register(garbage(BLOCK)), 0, peer.region(region), offset, BLOCK)])
            mine = alice.links.node(daemon.name).peer
            data = content(h)
            alice.engine.transfer([Write(alice.engine.register(data), 0, mine.region(region), offset, BLOCK)])
            frames.send({"op": "commit", "fp": FP.digest, "tokens": [token],
                         "digests": [block_digest(h, data).hex()], "sync": True})
            assert frames.recv(5.0)["errors"] == [""]
            for writer, route in ((alice.engine, mine), (engine, peer)):  # sealed: nobody's to write now
                with pytest.raises(WriteNotGranted):
                    writer.transfer([Write(writer.register(garbage(BLOCK)), 0, route.region(region), offset, BLOCK)])
        alice.mirror.wait_until(lambda m: m.lookup(FP.digest, h), 15)
        assert reads_back(alice, [h])


def test_an_aborted_or_leased_slot_is_granted_only_while_it_is_pending(node):
    """Variants killed: an abort that leaves the grant behind; leased slots granted to no one (a
    put into its own leased slots over TCP fails) or to anyone; a control path that drops the
    client's peer id."""
    daemon, url, cluster = node
    with store_client(url, cluster) as alice:
        wire = alice.links.wire(daemon.name)
        frames = connect(wire.address, SECRET.encode(), "probe", 5.0)
        frames.send({"op": "reserve", "fp": FP.digest, "hashes": [external_hashes([2000], FP)[0].hex()],
                     "sizes": [BLOCK], "peer": alice.engine.peer_id})
        token, region, offset, _ = frames.recv(5.0)["slots"][0]
        frames.send({"op": "abort", "tokens": [token]})
        assert frames.recv(5.0)["ok"]
        mine = alice.links.node(daemon.name).peer
        with pytest.raises(WriteNotGranted):
            alice.engine.transfer([Write(alice.engine.register(garbage(BLOCK)), 0, mine.region(region), offset, BLOCK)])
        first = external_hashes(range(3000, 3004), FP)
        assert alice.put_many([(h, content(h)) for h in first]) == 4  # its commit leases 4 slots
        leased = alice.links.leases.slots()
        assert len(leased) == 4
        engine, peer = attacker(alice, daemon.name)
        with engine:
            for slot in leased:
                with pytest.raises(WriteNotGranted):
                    engine.transfer([Write(engine.register(garbage(BLOCK)), 0, peer.region(slot.region),
                                           slot.offset, BLOCK)])
        calls = alice.stats["control_calls"]
        second = external_hashes(range(3004, 3008), FP)
        assert alice.put_many([(h, content(h)) for h in second]) == 4  # written into the leased slots
        assert alice.stats["control_calls"] - calls == 1  # no reserve: the lease was used, and writable
        assert reads_back(alice, first + second)


# --- the BlockStore's side: expiry and writes still landing -----------------------------------------
@pytest.fixture
def local_store():
    """A BlockStore over an engine of this process that exports its DRAM remote_writes="granted"
    (as the daemon does); the writer is another engine, over TCP and the plain wire."""
    owner = Engine("store", secret=SECRET, wire="plain")
    dram = owner.allocate(1 << 20, remote_writes="granted")
    store = BlockStore(owner, dram)
    writer = client_engine("writer", wire="plain")
    try:
        yield store, owner, writer, writer.connect(owner.export(), transport="tcp").region(dram.id)
    finally:
        writer.close()
        owner.close()


def test_an_expired_reservation_takes_no_more_writes(local_store):
    """Variant killed: expiry frees the slot but leaves its grant, so its old writer still writes
    into space the node gives to the next block."""
    store, _, writer, region = local_store
    store.reservation_timeout = 0.5
    h = external_hashes([1], FP)[0]
    (token, slot), = store.reserve(FP.digest, [h], [65536], peer=writer.peer_id)[0]
    src = writer.register(garbage(65536))
    writer.transfer([Write(src, 0, region, slot.offset, 65536)])
    time.sleep(0.6)
    store.reserve(FP.digest, external_hashes([2], FP), [4096])  # expires the first on its way
    assert token not in store._pending
    with pytest.raises(WriteNotGranted):
        writer.transfer([Write(src, 0, region, slot.offset, 65536)])
    assert owner_grants(store) == 0


def owner_grants(store: BlockStore) -> int:
    return store.engine.stats()["write_grants"]


def test_a_commit_while_its_bytes_still_land_fails_and_the_slot_is_not_reused_until_they_stop(local_store):
    """Variant killed: a slot whose revoke found a write still landing is sealed (its digest taken
    over bytes still changing) or freed at once (the late bytes land on the next block there)."""
    store, owner, writer, region = local_store
    h = external_hashes([3], FP)[0]
    (token, slot), = store.reserve(FP.digest, [h], [65536], peer=writer.peer_id)[0]
    sock = raw_data_stream(owner.export().to_json(), writer.peer_id)
    try:
        sock.sendall(REQ.pack(MAGIC, WRITE, region.id, slot.offset, 65536) + b"\xee" * 1000)
        memory = store.dram.region.host_view()
        assert until(lambda: bytes(memory[slot.offset:slot.offset + 1000]) == b"\xee" * 1000)  # landing now
        errors, _ = store.commit(FP.digest, [token], [block_digest(h, b"\xee" * 65536)])
        assert errors == [STILL_LANDING]
        used = store.dram.used
        later = store.reserve(FP.digest, external_hashes([4], FP), [65536], peer=writer.peer_id)[0]
        assert all(s.offset != slot.offset for _, s in later)  # the fenced range went to no one
        assert store.dram.used == used + 65536
        sock.sendall(b"\xee" * (65536 - 1000))
        status, _, _ = RESP.unpack(sock.recv(RESP.size, socket.MSG_WAITALL))
        assert status == 0
        store.reserve(FP.digest, external_hashes([5], FP), [4096])  # sweeps the fence on its way
        assert not store._fenced and store.dram.used == used + 4096  # its 64 KiB back, 4 KiB taken
    finally:
        sock.close()
