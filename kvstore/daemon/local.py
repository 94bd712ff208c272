"""The framed control wire of a store daemon: an abstract unix socket for clients on this host,
and (unless gRPC runs over TLS) a TCP socket beside the gRPC one for clients elsewhere.

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
frame names each block's BLAKE3 digest, which the daemon verifies before sealing too). They still
travel in the clear: run gRPC over TLS, which turns this TCP socket off, where they must not be
read. The NVMe tier's fd is only handed out over the unix socket.

A client authenticated as a tenant may name only that tenant's fingerprints (`tenant:...`) in a
put, reserve, commit or lookup (else code `denied`), and the slots it reserves or leases are
granted to its engine under its tenant-scoped identity only.

Admission: right after the handshake the node sends one frame, {ok: true}, or {ok: false, code:
busy, error} and closes: when the socket's MAX_CONNECTIONS authenticated connections are open, or
when the client's tenant holds its share of them (`connections=N` on its line of the tenants file;
by default an equal share, one left over for the cluster's own clients), so one tenant cannot take
every slot. A refused client knows why (kvstore.errors.ConnectionsExhausted) and uses gRPC instead.

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
Errors: {ok: false, code: invalid|exhausted|refused|unavailable|denied, error} (denied: a tenant named
a fingerprint not its own); `busy` only in the admission frame.
"""
from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import struct
import threading
import weakref
import time
from typing import Any, Callable

from transfer import TransferError
from transfer.auth import PEER_ID, scoped_peer, server_handshake
from transfer.descriptor import unix_address, unix_socket_name, unlink_unix
from transfer.listener import STALE_HANDSHAKE_S, HandshakeBudget, peer_uid, source_of

from ..access import Tenants, denied
from ..codec import check_codec
from ..errors import AllocationFailed, InvalidRequest, KVStoreError, MetadataError
from ..index.signatures import RecordSigner
from ..integrity import DIGEST_BYTES, DIGEST_NAME
from ..spin import spin_for
from ..wire import NEXT_REQUEST_SPIN_S, AttachmentsAltered, Frames, MalformedFrame
from .store import MAX_BLOCK_BYTES, BlockStore, Update

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
OPS = ("put", "reserve", "commit", "abort", "tier", "seals", "lookup", "read")
READ_BYTES = 64 << 20  # raw bytes one `read` may ask for (a client splits larger gets)


ATTACHMENTS = "_attachments"  # a reply's key for bytes sent after it (never sent as a field)


class _Invalid(Exception):
    pass


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


def _hashes(values: Any) -> list[bytes]:
    if not isinstance(values, list):
        raise _Invalid("hashes: a list of hex strings")
    try:
        out = [bytes.fromhex(v) for v in values]
    except (TypeError, ValueError):
        raise _Invalid("hashes: hex strings") from None
    if any(len(h) != 16 for h in out):
        raise _Invalid("hashes: every hash is 16 bytes")
    return out


def _digests(values: Any, n: int) -> list[bytes]:
    """`n` block digests, hex on the wire; an older client's integer checksums are refused by name."""
    if not isinstance(values, list) or len(values) != n or not all(isinstance(v, str) for v in values):
        raise _Invalid(f"digests: {n} hex strings of {DIGEST_BYTES} bytes ({DIGEST_NAME}); a client that "
                       "sends 'checksums' is older than this node")
    try:
        out = [bytes.fromhex(v) for v in values]
    except ValueError:
        raise _Invalid("digests: hex strings") from None
    if any(len(d) != DIGEST_BYTES for d in out):
        raise _Invalid(f"digests: {DIGEST_BYTES} bytes each")
    return out


def _peer(request: dict, tenant: str) -> str:
    """The client engine's identity a reserve or commit names: its peer id, scoped by the tenant the
    connection authenticated as ("" when none)."""
    peer = request.get("peer")
    if peer is None or peer == "":
        return ""
    if not isinstance(peer, str) or not PEER_ID.fullmatch(peer):
        raise _Invalid("peer: the client engine's peer_id, 32 hex digits")
    return scoped_peer(tenant, peer)


class _Denied(Exception):
    pass


def _ints(values: Any, what: str, n: int, limit: int = 2**64 - 1) -> list[int]:
    if not isinstance(values, list) or len(values) != n or \
            not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= limit for v in values):
        raise _Invalid(f"{what}: {n} integers in 0..{limit}")
    return values


class LocalControl:
    """The daemon's same-host socket (see module docstring)."""

    def __init__(self, name: str, secret: bytes, node: str, store: BlockStore,
                 publish: Callable[[list[Update], bool], None], accepting: Callable[[], bool],
                 observe: Callable[[str, float], None], tier_reader: Callable[[], tuple[int, bool]] | None,
                 timeout: float,
                 tcp_host: str | None = None, tcp_port: int = 0, tenants: dict[str, bytes] | None = None,
                 signer: RecordSigner | None = None) -> None:
        self.name, self._secret, self._node, self.store = name, secret, node, store
        self._tenants = tenants  # name -> secret of the tenants that may connect besides the cluster
        # Records in replies go sealed, byte for byte as the node publishes them (clients echo them
        # into their mirrors).
        self._signer = signer or RecordSigner(secret, "default", node, tenants)
        self._publish, self._accepting, self._observe = publish, accepting, observe
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
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvs-local-{node}", daemon=True)
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
                        "or call over gRPC")
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
        try:
            try:
                session = server_handshake(conn, self._secret, self._node, wire="plain", timeout=self._timeout,
                                           tenants=self._tenants)
            except BaseException:
                if remote:
                    self._handshake_over(source, ticket, authenticated=False)
                raise
            if remote:
                counted = self._handshake_over(source, ticket, authenticated=True)
            frames = Frames(conn, session.tx, session.rx, self._timeout, sealed=remote)  # TCP: attachments tagged
            # Admitted or refused, in a frame: a refused client knows why and goes to gRPC, instead
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
                deadline = time.monotonic() + self._timeout
                started = time.perf_counter()
                op = str(request.get("op"))
                try:
                    if remote and op in ("tier", "seals"):
                        raise _Invalid(f"the {op} fd is only handed out on the same host")
                    reply, fd = self._handle(op, request, frames, deadline, session.tenant, writer)
                except _Invalid as exc:
                    reply, fd = {"ok": False, "code": "invalid", "error": str(exc)}, None
                except _Denied as exc:
                    reply, fd = {"ok": False, "code": "denied", "error": str(exc)}, None
                except KVStoreError as exc:
                    reply, fd = self._error(exc), None
                # Counted before the reply goes out: whoever got the answer also sees it in the metrics.
                self._observe(f"{'wire' if remote else 'local'}_{op}" if op in OPS else "local_other",
                              time.perf_counter() - started)
                attachments = reply.pop(ATTACHMENTS, ())
                if fd is not None:
                    try:
                        frames.send(reply)
                        socket.send_fds(conn, [b"F"], [fd])
                    finally:
                        os.close(fd)
                else:
                    frames.send(reply, attachments)
                if not reply.get("ok") and op == "put":
                    break  # its bytes may still be in the stream: the client opens a new connection
        except Exception as exc:  # noqa: BLE001 - a client that leaves or misbehaves ends only its connection
            log.debug("%s: same-host connection ended: %s", self._node, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
                if counted:
                    self._open[remote] -= 1
            if tenant is not None:
                self._tenant_left(remote, tenant)
            conn.close()

    def _usage(self) -> dict[str, int]:
        return {"used": self.store.dram.used, "capacity": self.store.dram.capacity}

    def _records(self, fingerprint: str, hashes: list[bytes]) -> list[str | None]:
        return self._hex(fingerprint, hashes, self.store.records(fingerprint, hashes))

    def _hex(self, fingerprint: str, hashes, records) -> list[str | None]:
        """Each record sealed, encoded, in hex (None where there is none)."""
        encode = self._signer.encode
        return [None if r is None else encode(fingerprint, h, r).hex() for h, r in zip(hashes, records)]

    def _handle(self, op: str, request: dict, frames: Frames, deadline: float, tenant: str = "",
                writer: SameHostWriter | None = None) -> tuple[dict, int | None]:
        fingerprint = request.get("fp", "")
        if op == "put":
            return self._put(request, frames, deadline, tenant), None
        if op in ("reserve", "commit", "lookup", "read"):
            if not isinstance(fingerprint, str):
                raise _Invalid("fp: a string")
            refused = denied(tenant, fingerprint)
            if refused is not None:
                raise _Denied(refused)
        if op == "reserve":
            if not self._accepting():
                return {"ok": False, "code": "refused", "error": f"{self._node} is draining"}, None
            hashes = _hashes(request.get("hashes"))
            sizes = _ints(request.get("sizes"), "sizes", len(hashes), MAX_BLOCK_BYTES)
            try:
                slots, updates = self.store.reserve(fingerprint, hashes, sizes, _peer(request, tenant),
                                                    repair=bool(request.get("repair")), writer=writer)
            except (AllocationFailed, InvalidRequest) as exc:
                return self._error(exc), None
            if updates:
                self._publish(updates, False)
            return {"ok": True, "slots": [None if s is None else [t, s.tier.region.id, s.offset, s.size]
                                          for t, s in slots], **self._usage()}, None
        if op == "commit":
            tokens = _ints(request.get("tokens"), "tokens", len(request.get("tokens") or []))
            digests = _digests(request.get("digests"), len(tokens))
            hashes = _hashes(request["hashes"]) if request.get("hashes") is not None else None
            lease = request.get("lease") or {}
            if not isinstance(lease, dict):
                raise _Invalid("lease: {size, count}")
            size, count = _ints([lease.get("size", 1), lease.get("count", 0)], "lease size and count", 2, MAX_BLOCK_BYTES)
            return self._commit(fingerprint, tokens, digests, bool(request.get("sync")), hashes, size, count,
                                _peer(request, tenant), writer), None
        if op == "lookup":
            return {"ok": True, "records": self._records(fingerprint, _hashes(request.get("hashes")))}, None
        if op == "read":
            return self._read(fingerprint, request), None
        if op == "abort":
            self.store.abort(_ints(request.get("tokens"), "tokens", len(request.get("tokens") or [])))
            return {"ok": True}, None
        if op == "tier":
            return self._tier()
        if op == "seals":
            seals = self.store.seals
            return {"ok": True, "region": self.store.dram.region.id, "size": self.store.dram.region.size,
                    "incarnation": seals.incarnation}, seals.reader_fd()
        raise _Invalid(f"unknown op {op[:40]!r}")

    def _read(self, fingerprint: str, request: dict) -> dict:
        """The `read` op: records and bytes (coded where that gains) of the blocks held here. The
        bytes go as attachments after the reply (`_serve` pops them)."""
        hashes = _hashes(request.get("hashes"))
        try:
            codec = check_codec(request.get("codec"))
        except InvalidRequest as exc:
            raise _Invalid(str(exc)) from None
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

    def _error(self, exc: Exception) -> dict:
        if isinstance(exc, AllocationFailed):
            if exc.updates:
                self._publish(exc.updates, False)
            return {"ok": False, "code": "exhausted", "error": str(exc)}
        if isinstance(exc, InvalidRequest):
            return {"ok": False, "code": "invalid", "error": str(exc)}
        if isinstance(exc, MetadataError):
            return {"ok": False, "code": "unavailable", "error": f"metadata service: {exc}"}
        return {"ok": False, "code": "refused", "error": str(exc)}

    def _commit(self, fingerprint: str, tokens: list[int], digests: list[bytes], sync: bool,
                hashes: list[bytes] | None, lease_size: int, lease_count: int, peer: str = "",
                writer: SameHostWriter | None = None) -> dict:
        records: list = []
        fresh: list = []
        named: list = []
        try:
            # Verified now only when the client waits for publication; else by the verifier, after the answer.
            errors, updates, leased = self.store.commit_and_lease(
                fingerprint, tokens, digests, lease_size=lease_size, records=records, fresh=fresh, verify=sync,
                hashes=hashes, lease_count=lease_count if self._accepting() else 0, peer=peer, writer=writer,
                named=named)
        except InvalidRequest as exc:
            return self._error(exc)
        if updates:
            try:
                self._publish(updates, sync)
            except (MetadataError, KVStoreError) as exc:
                return self._error(exc)
        return {"ok": True, "records": self._hex(fingerprint, named, records), "errors": errors,
                "stored": sum(fresh),
                "lease": [[token, slot.tier.region.id, slot.offset, slot.size] for token, slot in leased],
                "lease_ttl": self.store.reservation_timeout, **self._usage()}

    def _put(self, request: dict, frames: Frames, deadline: float, tenant: str = "") -> dict:
        """Reserve, receive the bytes straight into the arena (and, over TCP, check their tag),
        verify, seal: one round trip."""
        fingerprint = request.get("fp")
        hashes = _hashes(request.get("hashes"))
        sizes = _ints(request.get("sizes"), "sizes", len(hashes), MAX_BLOCK_BYTES)
        digests = _digests(request.get("digests"), len(hashes))
        total = sum(sizes)
        if not isinstance(fingerprint, str) or total > MAX_ATTACHMENT:
            raise _Invalid("fp: a string; the blocks of one put at most 256 MiB")  # the stream is lost: close
        refused = denied(tenant, fingerprint)
        if refused is not None:
            frames.discard(total, deadline)  # then answered and closed, as every refused put
            return {"ok": False, "code": "denied", "error": refused}
        try:
            if not self._accepting():
                frames.discard(total, deadline)
                return {"ok": False, "code": "refused", "error": f"{self._node} is draining: it takes no new blocks"}
            slots, updates = self.store.reserve(fingerprint, hashes, sizes, repair=bool(request.get("repair")))
        except (AllocationFailed, InvalidRequest) as exc:
            frames.discard(total, deadline)
            return self._error(exc)
        if updates:
            self._publish(updates, False)
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
            self.store.abort([t for t, s in slots if s is not None])
            if isinstance(exc, AttachmentsAltered):
                counters = self.store.counters
                counters["wire_attachments_refused"] = counters.get("wire_attachments_refused", 0) + 1
                log.warning("%s: refused a put over TCP whose block bytes were altered in flight", self._node)
            raise
        sync = bool(request.get("sync"))  # verified and published before the answer
        errors, records, updates, stored = self.store.commit_reserved(fingerprint, hashes, slots, digests, sync)
        if updates:
            try:
                self._publish(updates, sync)
            except (MetadataError, KVStoreError) as exc:
                return self._error(exc)
        return {"ok": True, "records": self._hex(fingerprint, hashes, records), "errors": errors,
                "stored": stored, **self._usage()}

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
