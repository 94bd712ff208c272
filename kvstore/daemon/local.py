"""The framed control wire of a store daemon, the one protocol of its store operations: an abstract
unix socket for clients on this host, and a TCP socket (TLS with the node's --tls-cert) for
clients elsewhere. Library mode calls the same handler in-process (`LocalControl.in_process`).

Who may connect: over the unix socket, processes of the daemon's own user (or root), checked with
SO_PEERCRED; over TCP, anyone, at most HANDSHAKES_PER_SOURCE of them per source (an IPv4 /24 or
IPv6 /64; HANDSHAKES in all) until they have authenticated, a handshake stalled past
transfer.listener.STALE_HANDSHAKE_S giving its slot to a newcomer at a cap. Both then pass the
Transfer Engine's handshake (both ends prove they know the cluster secret, or the client its
tenant's own secret; a relayed handshake yields nothing; `--insecure` has no secret). Every
control frame afterwards carries an HMAC under the session key over its sequence number
(`kvstore.wire`), so frames cannot be injected, replayed or reordered. Block bytes follow a `put`
frame raw; over TCP a tag under the session key, bound to that frame's sequence number, follows
them, so bytes altered on the way are refused before anything is sealed (and the authenticated
frame names each block's BLAKE3 digest, which the daemon verifies before sealing too). Without
TLS they travel in the clear. The NVMe tier's fd is only handed out over the unix socket.

A client authenticated as a tenant may name only that tenant's fingerprints (`tenant:...`) in a
put, reserve, commit, lookup, read, touch or remove (else code `denied`), and the slots it reserves or leases are
granted to its engine under its tenant-scoped identity only.

Admission: right after the handshake the node sends one frame, {ok: true}, or {ok: false, code:
busy, error} and closes: when the socket's MAX_CONNECTIONS authenticated connections are open, or
when the client's tenant holds its share of them (`connections=N` on its line of the tenants file;
by default an equal share, one left over for the cluster's own clients), so one tenant cannot take
every slot. A refused client knows why (kvstore.errors.ConnectionsExhausted) and waits for one of
its own connections to come free.

Requests (one reply frame each):
  put      {fp, hashes (hex), sizes, digests (hex), sync, repair?} + the bytes -> {records, errors, used, capacity}
           one round trip: reserve, receive straight into the DRAM arena, then (sync) verify, seal and
           publish before answering, or answer and leave verifying and publishing to the verifier
  reserve  {fp, hashes, sizes, peer?, repair?} -> {slots: [[token, region, offset, size] | null], used, capacity}:
           `peer` (the client engine's peer_id) is granted writes into the slots until they are
           committed, aborted or expire; only that engine's one-sided writes land there. `repair`:
           the blocks are repair copies, which never make room by evicting a block no other live
           node holds (refused as exhausted instead)
  commit   {fp, tokens, digests (hex), sync, hashes?, lease?: {size, count}, peer?} -> {records, errors, used,
           capacity, lease: [[token, region, offset, size]], lease_ttl}: `hashes` (hex, one per token)
           name the blocks written into leased slots; `lease` asks for slots for the next put (granted
           from free space only, maybe fewer or none), which that put writes before its commit names them
  abort    {tokens} -> {}
  touch    {fp, hashes (hex), corrupt (hex)} -> {}: blocks read (kept warm), and those a reader found
           corrupt (dropped)
  remove   {fp, hashes (hex)} -> {removed, revision}: the blocks dropped, gone from etcd when it answers
           (`revision`: one at or after their deletion, 0 where none was published)
  lookup   {fp, hashes} -> {records: [hex | null]}: where this node holds the blocks now
  read     {fp, hashes, codec?} -> {records: [hex | null]} + each held block's bytes: the wire codec
           (`Client(wire_codec="lz4")`, for readers on other hosts over slow links): a block is sent
           coded (kvstore.codec) when that gains at least 5 %, its record then naming the codec and
           the bytes sent; an NVMe block stored coded goes as it lies. At most READ_BYTES a request.
           The reader decodes and checks each block's digest over the raw bytes
  tier     {} -> {region, size, direct} and, over SCM_RIGHTS, a read-only fd of the NVMe tier file
           (opened O_RDONLY|O_DIRECT here, for this client alone)
  seals    {} -> {region, size} and, over SCM_RIGHTS, a read-only fd of the DRAM arena's seal table
           (kvstore.seals): same host only
  index    {q, count, ...} + `count` block hashes, raw -> a question to the host's one index mirror
           (kvstore.daemon.host_index): same host only
Errors: {ok: false, code: invalid|exhausted|refused|unavailable|denied, error} (denied: a tenant named
a fingerprint not its own); `busy` only in the admission frame.
"""
from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import ssl
import struct
import threading
import weakref
import time
from typing import Any, Callable, Sequence

from transfer import TransferError
from transfer.auth import server_handshake
from transfer.descriptor import unix_address, unix_socket_name, unlink_unix
from transfer.listener import STALE_HANDSHAKE_S, HandshakeBudget, peer_uid, source_of

from ..access import Tenants
from ..codec import check_codec
from ..errors import InvalidRequest, KVStoreError
from ..spin import spin_for
from ..wire import NEXT_REQUEST_SPIN_S, AttachmentsAltered, Frames, MalformedFrame
from ..keys import HASH_BYTES
from .host_index import MAX_HASHES, HostIndex, split_hashes
from .operations import OpFailed, Sealed, StoreOperations, check_fingerprint, check_hashes, check_ints

log = logging.getLogger(__name__)
MAX_ATTACHMENT = 256 << 20
MAX_CONNECTIONS = 256  # authenticated connections, on each of the two sockets
# TCP connections still in their handshake: anyone can open them, so they get a budget of their own
# (as the engine's listener does), apart from authenticated clients' slots. A source is an IPv4 /24
# or IPv6 /64 and holds at most a sixteenth of it; stalled handshakes make room (HandshakeBudget).
HANDSHAKES = 256
HANDSHAKES_PER_SOURCE = 16
# An idle connection is closed after this long, so clients' pools cannot hold every slot for good
# (clients drop pooled connections idle for half of it: kvstore.client.local_node.POOLED_IDLE_S).
IDLE_S = 120.0
OPS = ("put", "reserve", "commit", "abort", "touch", "remove", "tier", "seals", "lookup", "read", "index")
READ_BYTES = 64 << 20  # raw bytes one `read` may ask for (a client splits larger gets)


ATTACHMENTS = "_attachments"  # a reply's key for bytes sent after it (never sent as a field)


class SameHostWriter:
    """The process at the other end of a unix connection, which maps the arena and may write the
    slots reserved or leased to it at any time, until it exits (BlockStore taints the extents
    of its expired slots until `gone()`). Held through a pidfd: a pid reused by another process
    never passes for it."""

    def __init__(self, pidfd: int) -> None:
        self._pidfd = pidfd
        weakref.finalize(self, os.close, pidfd)

    @classmethod
    def of(cls, conn: socket.socket) -> "SameHostWriter | None":
        """The peer process of `conn`, or None where it cannot be held (no pidfd here)."""
        try:
            pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            return cls(os.pidfd_open(pid))
        except (OSError, AttributeError):
            return None

    def gone(self) -> bool:
        """Whether the process has exited (its pidfd reads as ready then)."""
        poller = select.poll()  # not select(): a daemon's descriptors may be numbered past 1024
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))


class AttachmentStream:
    """A put's block bytes handed over in this process (library mode): read from the caller's
    buffers, in order, where the wire's put reads them off its socket."""

    def __init__(self, attachments: Sequence) -> None:
        self._parts = [memoryview(a).cast("B") for a in attachments]
        self._at = 0  # bytes taken from the first part left

    def _take(self, n: int, into: memoryview | None) -> None:
        done = 0
        while done < n:
            if not self._parts:
                raise ConnectionError("a put announced more block bytes than it sent")
            part = self._parts[0]
            step = min(n - done, len(part) - self._at)
            if into is not None:
                into[done : done + step] = part[self._at : self._at + step]
            done, self._at = done + step, self._at + step
            if self._at == len(part):
                self._parts.pop(0)
                self._at = 0

    def recv_into(self, view: memoryview, deadline: float) -> None:
        self._take(len(view), view)

    def discard(self, n: int, deadline: float) -> None:
        self._take(n, None)

    def attachments_end(self, deadline: float) -> None:
        if self._parts:
            raise ConnectionError("a put sent more block bytes than it announced")


def _hexes(values: Any, what: str) -> list[bytes]:
    """A list of hex strings as bytes (what they must hold is the operation's to check)."""
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise OpFailed("invalid", f"{what}: a list of hex strings"
                       + ("; a client that sends 'checksums' is older than this node" if what == "digests" else ""))
    try:
        return [bytes.fromhex(v) for v in values]
    except ValueError:
        raise OpFailed("invalid", f"{what}: hex strings") from None


def _sealed(sealed: Sealed, lease: bool = False) -> dict:
    """A commit's or put's reply."""
    reply = {"ok": True, "records": [r.hex() if r else None for r in sealed.records], "errors": sealed.errors,
             "stored": sealed.stored, "used": sealed.used, "capacity": sealed.capacity}
    if lease:
        reply["lease"] = [[token, slot.tier.region.id, slot.offset, slot.size] for token, slot in sealed.lease]
        reply["lease_ttl"] = sealed.lease_ttl
    return reply


class LocalControl:
    """The daemon's same-host socket (see module docstring)."""

    def __init__(self, name: str, secret: bytes, ops: StoreOperations,
                 observe: Callable[[str, float], None], tier_reader: Callable[[], tuple[int, bool]] | None,
                 timeout: float,
                 tcp_host: str | None = None, tcp_port: int = 0, tenants: dict[str, bytes] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.name, self._secret, self.ops = name, secret, ops
        self.host_index: HostIndex | None = None  # the host's one index mirror (kvstore.daemon.host_index)
        self.tls = tls  # the TCP socket speaks TLS (the node's --tls-cert) when set
        self._node, self.store = ops.node, ops.store
        self._tenants = tenants  # name -> secret of the tenants that may connect besides the cluster
        # Records in replies go sealed, byte for byte as the node publishes them (clients echo them
        # into their mirrors).
        self._signer, self._observe = ops.signer, observe
        self._self_writer: SameHostWriter | None = None  # this process, for in_process() puts
        self._tier_reader, self._timeout = tier_reader, timeout
        self._allowed_uids = {os.geteuid(), 0}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.name = unix_socket_name(name)  # a path in $KVSTORE_SOCKET_DIR, else abstract
        self._sock.bind(unix_address(self.name))
        self._sock.listen(128)
        self._tcp: socket.socket | None = None
        self.tcp_address: str | None = None  # host:port of the TCP socket, when there is one
        if tcp_host is not None:
            family = socket.AF_INET6 if ":" in tcp_host else socket.AF_INET
            self._tcp = socket.socket(family, socket.SOCK_STREAM)
            self._tcp.bind((tcp_host, tcp_port))
            self._tcp.listen(128)
            port = self._tcp.getsockname()[1]
            self.tcp_address = f"[{tcp_host}]:{port}" if family == socket.AF_INET6 else f"{tcp_host}:{port}"
        # TCP connections in their handshake, per source
        self.handshakes = HandshakeBudget(HANDSHAKES, HANDSHAKES_PER_SOURCE, min(STALE_HANDSHAKE_S, timeout / 2))
        self._open = {False: 0, True: 0}  # authenticated connections: unix (False), TCP (True)
        self._tenant_open: dict[tuple[bool, str], int] = {}  # the same, per (socket, tenant)
        self._refused_logged = 0.0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvs-local-{self._node}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        selector = selectors.DefaultSelector()
        for sock in (self._sock, self._tcp):
            if sock is not None:
                selector.register(sock, selectors.EVENT_READ)
        while not self._closed.is_set():
            for key, _ in selector.select(timeout=0.2):
                try:
                    conn, addr = key.fileobj.accept()  # type: ignore[union-attr]
                except OSError as exc:
                    if self._closed.is_set():
                        break
                    log.warning("%s: accept failed: %s", self._node, exc)
                    self._closed.wait(0.1)
                    continue
                admitted = self._admit(conn, None if key.fileobj is self._sock else str(addr[0]))
                if admitted is not None:
                    threading.Thread(target=self._serve, args=(conn, *admitted), daemon=True).start()
        selector.close()

    def _admit(self, conn: socket.socket, address: str | None) -> tuple[str, int] | None:
        """Take a new connection (None: refused and closed). Returns its source and handshake
        ticket: "" and 0 for the unix socket (a process of an allowed user, counted as open at
        once), the peer's /24 or /64 over TCP (counted as handshaking until it has authenticated)."""
        if address is None:
            try:
                uid = peer_uid(conn)
            except OSError:
                uid = -1
            why = "" if uid in self._allowed_uids else f"uid {uid}"
        else:
            why = ""
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        source, ticket = "", 0
        if not why and address is not None:
            source = source_of(address)
            ticket = self.handshakes.admit(source, conn)
            if ticket is None:
                why = f"too many handshakes from {source}"
        with self._lock:
            if not why and address is None:
                if self._open[False] >= MAX_CONNECTIONS:
                    why = "too many open"
                else:
                    self._open[False] += 1
            if not why:
                self._conns.add(conn)
        if why:
            self._refused(why)
            conn.close()
            return None
        return source, ticket

    def _refused(self, why: str) -> None:
        """Log a refused connection, at most every 10 s (a flood must not flood the log too)."""
        now = time.monotonic()
        if now - self._refused_logged > 10:
            self._refused_logged = now
            log.warning("%s: refused a control connection (%s)", self._node, why)

    def _handshake_over(self, source: str, ticket: int, authenticated: bool) -> bool:
        """A TCP connection's handshake ended: it leaves the handshake budget and, authenticated,
        takes an open slot if one is left (whether it did)."""
        self.handshakes.release(source, ticket)
        with self._lock:
            if not authenticated or self._open[True] >= MAX_CONNECTIONS:
                return False
            self._open[True] += 1
            return True

    def _tenant_share(self, remote: bool, tenant: str) -> str | None:
        """Take one of `tenant`'s connections on this socket; why not (None: taken, or no tenant)."""
        if not tenant:
            return None
        share = self._tenants.connections(tenant, MAX_CONNECTIONS) if isinstance(self._tenants, Tenants) \
            else max(1, MAX_CONNECTIONS // (len(self._tenants or ()) + 1))
        with self._lock:
            held = self._tenant_open.get((remote, tenant), 0)
            if held >= share:
                return (f"tenant {tenant!r} holds its share of {share} connections to {self._node}'s "
                        f"{'TCP wire' if remote else 'same-host socket'} (of {MAX_CONNECTIONS}): close idle ones, "
                        "or wait for one to come free")
            self._tenant_open[(remote, tenant)] = held + 1
        return None

    def _tenant_left(self, remote: bool, tenant: str) -> None:
        with self._lock:
            held = self._tenant_open.pop((remote, tenant), 0) - 1
            if held > 0:
                self._tenant_open[(remote, tenant)] = held

    def _serve(self, conn: socket.socket, source: str, ticket: int) -> None:
        remote = bool(source)  # over TCP: no descriptors to hand out
        counted = not remote  # holds an open slot (a TCP connection once it has authenticated)
        tenant = None  # the tenant whose share this connection holds a slot of
        raw = conn  # kept open: stalled handshakes and close() shut it down (TLS wraps a duplicate)
        try:
            try:
                if remote and self.tls is not None:
                    conn.settimeout(self._timeout)
                    conn = self.tls.wrap_socket(raw.dup(), server_side=True)  # TLS handshake first
                session = server_handshake(conn, self._secret, self._node, wire="plain", timeout=self._timeout,
                                           tenants=self._tenants)
            except BaseException:
                if remote:
                    self._handshake_over(source, ticket, authenticated=False)
                raise
            if remote:
                counted = self._handshake_over(source, ticket, authenticated=True)
            frames = Frames(conn, session.tx, session.rx, self._timeout, sealed=remote)  # TCP: attachments tagged
            # Admitted or refused, in a frame: a refused client knows why and waits, instead
            # of meeting a closed connection it cannot tell from a dead node.
            why, reason = (None, "") if counted else (f"{self._node} has all {MAX_CONNECTIONS} connections of its "
                                                       f"{'TCP wire' if remote else 'same-host socket'} open", "full")
            if why is None:
                why, reason = self._tenant_share(remote, session.tenant), "tenant"
                if why is None and session.tenant:
                    tenant = session.tenant
            if why is not None:
                self.store._count(f"wire_connections_refused_{reason}")
                self._refused(why)
                frames.send({"ok": False, "code": "busy", "error": why})
                return
            frames.send({"ok": True})
            writer = None if remote else SameHostWriter.of(conn)  # whose late writes its expired slots wait out
            while not self._closed.is_set():
                try:
                    request = frames.recv(self._timeout, idle=IDLE_S, spin=spin_for(NEXT_REQUEST_SPIN_S))
                except MalformedFrame as exc:
                    frames.send({"ok": False, "code": "invalid", "error": str(exc)})
                    continue
                op = str(request.get("op"))
                reply, fd = self._answer(op, request, frames, session.tenant, writer, remote)
                attachments = reply.pop(ATTACHMENTS, ())
                if fd is not None:
                    try:
                        frames.send(reply)
                        socket.send_fds(conn, [b"F"], [fd])
                    finally:
                        os.close(fd)
                else:
                    frames.send(reply, attachments)
                if not reply.get("ok") and op in ("put", "index"):
                    break  # its bytes may still be in the stream: the client opens a new connection
        except Exception as exc:  # noqa: BLE001 - a client that leaves or misbehaves ends only its connection
            log.debug("%s: same-host connection ended: %s", self._node, exc)
        finally:
            with self._lock:
                self._conns.discard(raw)
                if counted:
                    self._open[remote] -= 1
            if tenant is not None:
                self._tenant_left(remote, tenant)
            conn.close()
            raw.close()

    def _answer(self, op: str, request: dict, frames: Any, tenant: str, writer: SameHostWriter | None,
                remote: bool) -> tuple[dict, int | None]:
        """The reply to one request, failures included (and a descriptor to send after it),
        counted in the metrics before it goes out: whoever got the answer also sees it there."""
        started = time.perf_counter()
        try:
            if remote and op in ("tier", "seals", "index"):
                raise OpFailed("invalid", f"the {op} op is only answered on the same host")
            reply, fd = self._handle(op, request, frames, time.monotonic() + self._timeout, tenant, writer)
        except OpFailed as exc:
            reply, fd = {"ok": False, "code": exc.code, "error": str(exc)}, None
        except KVStoreError as exc:
            failed = self.ops.failure(exc)
            reply, fd = {"ok": False, "code": failed.code, "error": str(failed)}, None
        self._observe(f"{'wire' if remote else 'local'}_{op}" if op in OPS else "local_other",
                      time.perf_counter() - started)
        return reply, fd

    def in_process(self, request: dict, attachments: Sequence = ()) -> tuple[dict, int | None, list]:
        """One request from a client in this very process (library mode): what the unix socket
        would answer, without the socket, the framing or the session. Returns the reply, the
        descriptor it hands over (the caller's to close) and the bytes a `read` sends after it."""
        if self._self_writer is None:
            self._self_writer = SameHostWriter(os.pidfd_open(os.getpid()))
        reply, fd = self._answer(str(request.get("op")), request, AttachmentStream(attachments), "",
                                 self._self_writer, remote=False)
        return reply, fd, list(reply.pop(ATTACHMENTS, ()))

    def _handle(self, op: str, request: dict, frames: Frames, deadline: float, tenant: str = "",
                writer: SameHostWriter | None = None) -> tuple[dict, int | None]:
        """The reply to one request (and a descriptor to send after it): decoded here, done by the
        store operations (kvstore.daemon.operations), encoded back."""
        ops, fingerprint = self.ops, request.get("fp", "")
        if op == "put":
            return self._put(request, frames, deadline, tenant), None
        if op == "reserve":
            reserved = ops.reserve(fingerprint, _hexes(request.get("hashes"), "hashes"), request.get("sizes"),
                                   tenant=tenant, peer=request.get("peer"), repair=bool(request.get("repair")),
                                   writer=writer)
            return {"ok": True, "slots": [None if s is None else [t, s.tier.region.id, s.offset, s.size]
                                          for t, s in reserved.slots],
                    "used": reserved.used, "capacity": reserved.capacity}, None
        if op == "commit":
            lease = request.get("lease") or {}
            if not isinstance(lease, dict):
                raise OpFailed("invalid", "lease: {size, count}")
            hashes = request.get("hashes")
            sealed = ops.commit(fingerprint, request.get("tokens") or [], _hexes(request.get("digests"), "digests"),
                                tenant=tenant, sync=bool(request.get("sync")),
                                hashes=None if hashes is None else _hexes(hashes, "hashes"),
                                lease_size=lease.get("size", 1), lease_count=lease.get("count", 0),
                                peer=request.get("peer"), writer=writer)
            return _sealed(sealed, lease=True), None
        if op == "lookup":
            records = ops.lookup(fingerprint, _hexes(request.get("hashes"), "hashes"), tenant=tenant)
            return {"ok": True, "records": [r.hex() if r else None for r in records]}, None
        if op == "read":
            return self._read(check_fingerprint(fingerprint, tenant), request), None
        if op == "abort":
            ops.abort(request.get("tokens") or [])
            return {"ok": True}, None
        if op == "touch":
            ops.touch(fingerprint, _hexes(request.get("hashes"), "hashes"),
                      _hexes(request.get("corrupt", []), "corrupt"), tenant=tenant)
            return {"ok": True}, None
        if op == "remove":
            removed = ops.remove(fingerprint, _hexes(request.get("hashes"), "hashes"), tenant=tenant)
            return {"ok": True, "removed": removed.count, "revision": removed.revision}, None
        if op == "index":
            hashes = self._index_hashes(request, frames, deadline)  # first: they follow the frame
            if self.host_index is None:
                raise OpFailed("invalid", f"{self._node} keeps no host index")
            if request.get("q") == "table":
                return self.host_index.table(tenant)
            return self.host_index.answer(request, tenant, hashes), None
        if op == "tier":
            return self._tier()
        if op == "seals":
            seals = self.store.seals
            return {"ok": True, "region": self.store.dram.region.id, "size": self.store.dram.region.size,
                    "incarnation": seals.incarnation}, seals.reader_fd()
        raise OpFailed("invalid", f"unknown op {op[:40]!r}")

    @staticmethod
    def _index_hashes(request: dict, frames: Any, deadline: float) -> list[bytes]:
        """The block hashes an `index` question sends after its frame: `count` of them, raw."""
        count = request.get("count", 0)
        if not isinstance(count, int) or not 0 <= count <= MAX_HASHES:  # (the stream is lost: it closes)
            raise OpFailed("invalid", f"count: the hashes sent after the frame, 0 to {MAX_HASHES}")
        if not count:
            return []
        raw = bytearray(count * HASH_BYTES)
        frames.recv_into(memoryview(raw), deadline)
        frames.attachments_end(deadline)
        return split_hashes(bytes(raw))

    def _read(self, fingerprint: str, request: dict) -> dict:
        """The `read` op: records and bytes (coded where that gains) of the blocks held here. The
        bytes go as attachments after the reply (`_serve` pops them)."""
        hashes = check_hashes(_hexes(request.get("hashes"), "hashes"))
        try:
            codec = check_codec(request.get("codec"))
        except InvalidRequest as exc:
            raise OpFailed("invalid", str(exc)) from None
        records, parts, total = [], [], 0
        for h in hashes:
            try:
                found = self.store.read_stored((fingerprint, h), codec)
            except TransferError:  # an NVMe read failed: a miss (the reader tries another replica)
                found = None
            if found is None or total + found[0].size > READ_BYTES:
                records.append(None)  # not held (or past the request's budget: a miss the reader re-asks)
                continue
            record, data = found
            total += record.size
            records.append(self._signer.encode(fingerprint, h, record).hex())
            parts.append(data)
        self.store._count("wire_read_blocks", len(parts))
        self.store._count("wire_read_sent_bytes", sum(len(p) for p in parts))
        self.store._count("wire_read_raw_bytes", total)
        return {"ok": True, "records": records, ATTACHMENTS: parts}

    def _put(self, request: dict, frames: Frames, deadline: float, tenant: str = "") -> dict:
        """Reserve, receive the bytes straight into the arena (and, over TCP, check their tag),
        verify, seal: one round trip."""
        sizes = check_ints(request.get("sizes"), "sizes")  # (invalid: the stream is lost, the connection closes)
        total = sum(sizes)
        if total > MAX_ATTACHMENT:
            raise OpFailed("invalid", "the blocks of one put at most 256 MiB")
        try:
            fingerprint, hashes, sizes, digests, reserved = self.ops.begin_put(
                request.get("fp"), _hexes(request.get("hashes"), "hashes"), sizes,
                _hexes(request.get("digests"), "digests"), tenant=tenant, repair=bool(request.get("repair")))
        except OpFailed as exc:
            if exc.code != "invalid":
                frames.discard(total, deadline)  # then answered and closed, as every refused put
            raise
        slots = reserved.slots
        # Done receiving well before the reservations could expire: an expired slot is given to
        # another block, and bytes still arriving for it would land on that block.
        deadline = min(deadline, time.monotonic() + self.store.reservation_timeout / 2)
        arena = self.store.dram.region.buffer
        try:
            for (token, slot), size in zip(slots, sizes):
                if slot is None:
                    frames.discard(size, deadline)
                else:
                    frames.recv_into(arena[slot.offset : slot.offset + size], deadline)
            if slots:
                frames.attachments_end(deadline)  # TCP: their tag, before anything is sealed
        except BaseException as exc:
            self.ops.abort([t for t, s in slots if s is not None])
            if isinstance(exc, AttachmentsAltered):
                counters = self.store.counters
                counters["wire_attachments_refused"] = counters.get("wire_attachments_refused", 0) + 1
                log.warning("%s: refused a put over TCP whose block bytes were altered in flight", self._node)
            raise
        # sync: verified and published before the answer
        return _sealed(self.ops.finish_put(fingerprint, hashes, slots, digests, sync=bool(request.get("sync"))))

    def _tier(self) -> tuple[dict, int | None]:
        nvme = self.store.nvme
        if nvme is None or self._tier_reader is None:
            return {"ok": False, "code": "refused", "error": f"{self._node} has no NVMe tier"}, None
        fd, direct = self._tier_reader()
        return {"ok": True, "region": nvme.region.id, "size": nvme.region.size, "direct": direct}, fd

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)
        self._sock.close()
        unlink_unix(self.name)
        if self._tcp is not None:
            self._tcp.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
