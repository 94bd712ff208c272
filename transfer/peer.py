"""A connected peer: authenticated control channel, TCP data streams, and (same host) the
peer's shared-memory regions mapped into this process so copies skip the network entirely."""
from __future__ import annotations

import mmap
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .auth import Channel, Session, client_handshake
from .descriptor import EngineDescriptor, host_id, unix_address
from .errors import EngineClosed, PeerUnreachable, ProtocolError, TransferError, TransferTimeout, UnknownRegion
from .listener import FDS_PER_MESSAGE
from .regions import Region, check_sealed, map_shared
from .ucx_routes import connect_ucx

TRANSPORTS = ("auto", "shm", "tcp", "ucx")


class PeerHost(Protocol):
    """What a peer needs of the engine that connects it: who it is (name, secret, tenant, wire mode), the
    native data plane and UCX node it adds routes to, and how the peer's shared memory, mapped
    here, is registered as a local region and dropped again. The engine passes itself."""

    name: str
    peer_id: str
    secret: bytes
    tenant: str
    wire: str
    _native: Any
    _ucx: Any

    def _register_view(self, obj: Any, size: int, *, readonly: bool, remote_access: bool, kind: str,
                       address: int | None = None) -> Region: ...

    def unregister(self, region: Region) -> None: ...


@dataclass(frozen=True)
class RemoteRegion:
    """A region exported by a peer. `size` is what the peer advertised; the peer re-checks."""

    peer: "Peer"
    id: int
    size: int
    shm: bool = False
    readonly: bool = False
    granted: bool = False  # the peer takes our writes only where it granted them to our peer_id


@dataclass
class _Mapped:
    region: Region
    mapping: mmap.mmap


def _connect_tcp(host: str, port: int, timeout: float) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise PeerUnreachable(f"cannot connect to {host}:{port}: {exc}") from exc


def _connect_unix(name: str, timeout: float) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(unix_address(name))
        return sock
    except OSError:
        sock.close()
        return None  # another network namespace or host: no shared memory


def _handshake(sock: socket.socket, engine: PeerHost, role: str, peer: str, timeout: float) -> Session:
    """client_handshake with socket failures as typed errors."""
    try:
        return client_handshake(sock, engine.secret, role, engine.name, wire=engine.wire, timeout=timeout,
                                peer=engine.peer_id, tenant=engine.tenant)
    except TransferError:
        raise  # AuthenticationFailed and ProtocolError say it better already
    except TimeoutError as exc:
        raise TransferTimeout(f"{peer} did not finish the handshake in time") from exc
    except OSError as exc:
        raise PeerUnreachable(f"handshake with {peer} failed: {exc}") from exc


def _dial(descriptor: EngineDescriptor, engine: PeerHost, role: str, timeout: float,
          unix: str | None = None) -> tuple[socket.socket, Session] | None:
    """Connect (TCP, or the same-host socket `unix`: None when it cannot be reached) + handshake.
    A server at a cap of concurrent handshakes closes new connections before saying anything; that
    case (and only that) is retried a few times."""
    for attempt in range(4):
        if unix is not None:
            sock = _connect_unix(unix, timeout)
            if sock is None:
                return None
        else:
            sock = _connect_tcp(descriptor.host, descriptor.port, timeout)
        try:
            return sock, _handshake(sock, engine, role, descriptor.name, timeout)
        except PeerUnreachable as exc:
            sock.close()
            if attempt == 3 or not isinstance(exc.__cause__, ConnectionError):
                raise
            time.sleep(0.02 * 4**attempt)
        except BaseException:
            sock.close()
            raise
    raise AssertionError("unreachable")


class Peer:
    """Handle on a remote engine; obtain one with `Engine.connect`."""

    def __init__(self, engine: PeerHost, descriptor: EngineDescriptor, transport: str, streams: int,
                 timeout: float) -> None:
        self._channel: Channel | None = None
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        self.descriptor = descriptor
        self._engine = engine
        self._timeout = timeout
        self._lock = threading.Lock()
        self._remote: dict[int, RemoteRegion] = {}
        self._mapped: dict[int, _Mapped] = {}
        self._closed = False
        self._ctl = self._open_control(transport)
        self.transport = "shm" if self._ctl.family == socket.AF_UNIX else "tcp"
        fds: list[int] = []
        keys: list[tuple[bytes, bytes]] = []
        try:
            for _ in range(max(1, streams)):
                sock, session = _dial(descriptor, engine, "data", timeout)
                fds.append(sock.fileno())
                keys.append(session.native_keys)
                sock.settimeout(None)
                sock.detach()
            self.wire = session.wire
            self._native_id = engine._native.add_peer(fds, keys if session.wire == "aead" else [])
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._ctl.close()
            raise
        self._ucx = None  # the UCX endpoint when the route is ucx (transfer/ucx.py)
        self._ucx_route = 0  # its native route id while it serves
        self._ucx_keyed: set[int] = set()  # peer regions the native route has an rkey for
        self._ucx_reads_only: set[int] = set()  # ... that take our writes over TCP only (granted regions)
        try:
            self._ucx = connect_ucx(engine._ucx, descriptor, transport, self.transport == "shm")
            if self._ucx is not None:
                self.transport = "ucx"
                watch = -1 if self._ucx.error_handling else self._ctl.fileno()
                self._ucx_route = engine._native.add_ucx_peer(engine._ucx.worker.handle, self._ucx.handle, watch)
            self.refresh()
        except BaseException:
            self.close()
            raise

    def _open_control(self, transport: str) -> socket.socket:
        d = self.descriptor
        same_host = d.host_id == host_id() and d.unix is not None
        if transport == "shm" and not same_host:
            raise PeerUnreachable(f"{d.name} is not on this host: shared memory is unavailable")
        dialed = None
        if same_host and transport not in ("tcp", "ucx") and d.unix:
            dialed = _dial(d, self._engine, "ctl", self._timeout, unix=d.unix)
        if dialed is None and transport == "shm":
            raise PeerUnreachable(f"cannot reach {d.name}'s same-host control socket")
        sock, session = dialed or _dial(d, self._engine, "ctl", self._timeout)
        self._channel = Channel(sock, session)
        return sock

    @property
    def name(self) -> str:
        return self.descriptor.name

    def refresh(self) -> None:
        """Fetch the peer's exported regions again (and map new shared-memory ones)."""
        with self._lock:
            self._check_open()
            try:
                self._ctl.settimeout(self._timeout)
                self._channel.send({"op": "regions"})
                reply = self._channel.recv()
                fds: list[int] = []
                while len(fds) < int(reply.get("fds", 0)):
                    _, got, _, _ = socket.recv_fds(self._ctl, 1, FDS_PER_MESSAGE)
                    if not got:
                        raise ProtocolError("peer announced shared-memory descriptors but sent none")
                    fds.extend(got)
            except (OSError, ValueError) as exc:
                raise PeerUnreachable(f"control request to {self.name} failed: {exc}") from exc
            try:
                self._apply_table(reply.get("regions", []), fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _apply_table(self, table: list[dict], fds: list[int]) -> None:
        fd_iter = iter(fds)
        for entry in table:
            rid, size, shm = int(entry["id"]), int(entry["size"]), bool(entry.get("shm"))
            readonly = bool(entry.get("readonly"))
            fd = next(fd_iter) if shm and fds else None
            if rid not in self._mapped and fd is not None:
                check_sealed(fd, size)  # an unsealed fd could be truncated under us (SIGBUS)
                mapping = map_shared(fd, size, writable=not readonly)
                local = self._engine._register_view(mapping, size, readonly=readonly, remote_access=False, kind="shm")
                self._mapped[rid] = _Mapped(local, mapping)
            granted = entry.get("writes") == "granted"
            self._remote[rid] = RemoteRegion(self, rid, size, shm=rid in self._mapped, readonly=readonly,
                                             granted=granted)
            if self._ucx_route and isinstance(entry.get("ucx"), dict):
                address = int(entry["ucx"]["addr"])
                self._ucx.advertise(rid, address, size, bytes.fromhex(str(entry["ucx"]["rkey"])))
                memory = self._ucx.rkey(rid)
                if memory is not None:  # a granted region's rkey reads only: its writes go over TCP
                    self._engine._native.ucx_key(self._ucx_route, rid, address, size, memory.handle,
                                                 readonly or granted)
                    self._ucx_keyed.add(rid)
                    if granted and not readonly:
                        self._ucx_reads_only.add(rid)

    def region(self, region_id: int) -> RemoteRegion:
        """The peer's exported region `region_id` (refreshing the table once if it is new)."""
        if region_id not in self._remote:
            self.refresh()
        try:
            return self._remote[region_id]
        except KeyError:
            raise UnknownRegion(f"{self.name} exports no region {region_id}") from None

    def regions(self) -> list[RemoteRegion]:
        return sorted(self._remote.values(), key=lambda r: r.id)

    def route(self, region: RemoteRegion, local: Region, write: bool = False) -> tuple[int, int]:
        """(native route, region id): 0 and a local mapping for shared memory, the ucx route when
        both sides are mapped with UCX (not for writes into a granted region: the owner checks
        those, which it cannot do for RDMA), else the TCP peer. Shared-memory routes cannot see the
        peer die, so the caller checks `alive` once a batch (the native ucx route checks for itself)."""
        if self._closed:
            raise EngineClosed(f"peer {self.name} was closed")
        mapped = self._mapped.get(region.id)
        if mapped is not None:
            return 0, mapped.region.id
        if self._ucx_route and local._ucx is not None and region.id in self._ucx_keyed and \
                not (write and region.id in self._ucx_reads_only):
            return self._ucx_route, region.id
        return self._native_id, region.id

    def retire_ucx(self) -> None:
        """Stop using the UCX endpoint after an op on it failed or stalled (TCP streams carry on)."""
        route, self._ucx_route = self._ucx_route, 0  # new ops take the TCP streams from here on
        if not route:
            return
        self._engine._native.remove_ucx_peer(route)  # returns once no op is being issued on it
        self._ucx.retire("an op on it failed or stalled")

    def stream_bytes(self) -> list[int]:
        """Payload bytes each TCP stream to this peer has carried (how evenly ops were striped)."""
        return list(self._engine._native.peer_stream_bytes(self._native_id))

    @property
    def alive(self) -> bool:
        """False once the peer closed its control connection (it died or shut down), or once a data
        stream broke (a corrupted or forged frame, a stall): a broken stream never carries another
        op, so a caller that keeps the peer would fail every op on it while the peer itself is well;
        it should connect again."""
        if self._closed or not self._engine._native.peer_alive(self._native_id):
            return False
        try:
            readable, _, _ = select.select([self._ctl], [], [], 0)  # (a poll object is not thread-safe)
            if readable and not self._lock.locked():
                return self._ctl.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (OSError, ValueError):
            return False
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"peer {self.name} was closed")

    def close(self) -> None:
        """Drop the streams and the mappings of the peer's memory."""
        if self._closed:
            return
        self._closed = True
        self._engine._native.remove_peer(self._native_id)
        for mapped in self._mapped.values():
            try:
                self._engine.unregister(mapped.region)
                mapped.mapping.close()
            except (TransferError, BufferError):
                pass  # an op still holds it; the mapping goes when the engine does
        self._mapped.clear()
        if self._ucx is not None:
            route, self._ucx_route = self._ucx_route, 0
            if route:
                self._engine._native.remove_ucx_peer(route)  # before the endpoint and its rkeys go
            self._ucx.close()
        self._ctl.close()

    def __repr__(self) -> str:
        return f"Peer({self.name!r}, transport={self.transport!r}, regions={len(self._remote)})"
