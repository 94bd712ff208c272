"""The Transfer Engine: register memory, export it, connect to peers, move bytes in batches."""
from __future__ import annotations

import logging
import os
import secrets
import threading
import uuid
from array import array
from typing import Any, Callable, Mapping, Sequence

from . import _native
from .auth import TENANT_NAME, TENANT_RULE, WIRE_MODES
from .batch import Batch
from .cuda_direct import copy_direct, unpin
from .descriptor import EngineDescriptor, host_id, unix_socket_name
from .errors import (
    EngineClosed,
    InvalidOp,
    MissingSecret,
    OutOfBounds,
    PeerUnreachable,
    TransferIOError,
    UnknownRegion,
    UnsupportedBuffer,
)
from .listener import Listener
from .ops import WRITE, Op, OpResult, Read, Write
from .peer import Peer, RemoteRegion
from .regions import Region, anonymous_shared, buffer_view
from .ucx_routes import direct_cuda, start_ucx, ucx_exports

log = logging.getLogger("transfer.engine")
DEFAULT_STREAMS = 4
# Threads copying a local or same-host batch: half the CPUs this process may use, 2 to 8. One
# thread's memcpy is well under a big host's memory bandwidth: on a 16-CPU H200 host, 8 workers
# took a 1 GiB hand-off's store read and load from 124 to 74 ms (2 workers).
DEFAULT_LOCAL_WORKERS = max(2, min(8, len(os.sched_getaffinity(0)) // 2))
DEFAULT_STRIPE = 256 * 1024
DEFAULT_BOUNCE_LIMIT = 256 << 20  # bytes of bounce buffers the serving side may hold at once
UCX_ROUTE = 1 << 31  # native route ids of UCX endpoints (cpp/engine.h kUcxRoute)
# Who may write a region over a data connection (cpp/grants.h RemoteWrites): "any" authenticated
# peer, anywhere in it; only inside ranges "granted" to that peer (Engine.grant); "none" (read-only
# to peers). Same-host peers that map shared memory write it directly: they are trusted by uid.
REMOTE_WRITES = {"any": 0, "granted": 1, "none": 2}


def _stage_in(cuda_reads: list[Read]) -> Callable[[], None]:
    """CUDA destinations: staged host bytes -> device, once the reads landed."""
    def stage_in() -> None:
        for op in cuda_reads:
            op.local.sync_to_device(op.local_offset, op.length)
    return stage_in


def _remote_writes(mode: str) -> int:
    try:
        return REMOTE_WRITES[mode]
    except (KeyError, TypeError):
        raise ValueError(f"remote_writes must be one of {tuple(REMOTE_WRITES)}, not {mode!r}") from None


def _split_endpoint(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"listen must look like 'host:port', not {listen!r}")
    return host.strip("[]"), int(port)


class Engine:
    """One per process. Listens on `listen` (loopback by default; None = initiator only).

    A listening engine needs the cluster `secret` unless `insecure=True` says, explicitly, that
    anyone who can reach it may read and write what it exports. `wire` picks how TCP data streams
    travel: "aead" (authenticated and encrypted per frame; the default with a secret) or "plain"
    (trusted networks only; the default when insecure). The stronger of both ends' choices wins.
    An initiator-only engine without a secret can reach only insecure peers.

    `peer_id` is who this engine is to the engines it connects to: 128 random bits sent in every
    handshake (proven with the rest of it by the cluster secret), never published. An owner lets
    a peer write parts of a region registered with remote_writes="granted" by granting them to
    that peer's id (`grant`/`revoke`); the peer tells the owner its id over the owner's own
    control plane (a store client names it in its reserve and commit requests).

    `tenant`: this engine authenticates to the engines it connects to as that tenant, `secret`
    being the tenant's own secret (a store daemon given its tenants checks it, and scopes the
    grants it makes to that tenant). `tenants` (name -> secret): the tenants a listening engine
    accepts besides holders of its cluster `secret`; their peer identity, and so their grants,
    are scoped by tenant (transfer.auth.scoped_peer)."""

    def __init__(self, name: str | None = None, *, listen: str | None = "127.0.0.1:0",
                 secret: str | bytes | None = None, insecure: bool = False, wire: str | None = None,
                 stall_timeout: float = 10.0, streams: int = DEFAULT_STREAMS, stripe_bytes: int = DEFAULT_STRIPE,
                 local_workers: int = DEFAULT_LOCAL_WORKERS, handshake_timeout: float = 5.0, ucx: str | None = "auto",
                 bounce_limit: int = DEFAULT_BOUNCE_LIMIT, tenant: str = "",
                 tenants: Mapping[str, str | bytes] | None = None) -> None:
        self.name = name or f"engine-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.peer_id = secrets.token_hex(16)
        self.secret = secret.encode() if isinstance(secret, str) else (secret or b"")
        if tenant and (not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant)):
            raise ValueError(f"tenant must be {TENANT_RULE}, not {str(tenant)[:80]!r}")
        if tenant and not self.secret:
            raise MissingSecret(f"engine {self.name} is tenant {tenant!r} but has no secret: pass that tenant's secret")
        self.tenant = tenant
        accepted = {str(k): v.encode() if isinstance(v, str) else bytes(v) for k, v in (tenants or {}).items()}
        if tenant:
            accepted[tenant] = self.secret  # engines of its own tenant reach it by naming it
        if not self.secret and listen is not None and not insecure:
            raise MissingSecret(f"engine {self.name} listens on {listen} but has no cluster secret: pass "
                                "secret=... (or insecure=True to let anyone who reaches it use its regions)")
        self.insecure = not self.secret
        self.wire = wire or ("plain" if self.insecure else "aead")
        if self.wire not in WIRE_MODES:
            raise ValueError(f"wire must be one of {WIRE_MODES}, not {wire!r}")
        self.stall_timeout = stall_timeout
        self._timeout = stall_timeout * 2 + 5  # a batch's default wait: past every op's stall time
        self.streams = streams
        self._native = _native.Engine(int(stall_timeout * 1000), stripe_bytes, local_workers, bounce_limit)
        self._ucx = start_ucx(ucx, self.name)  # optional; `ucx` and $UCX_TLS say which UCX transports
        self._regions: dict[int, Region] = {}
        self._peers: list[Peer] = []
        self._graveyard: list[Region] = []  # unregistered while ops still used them
        self._orphans: list[_native.Batch] = []  # failed ucx batches whose cancelled requests still ran
        self._lock = threading.Lock()
        self._closed = False
        self._listener: Listener | None = None
        if listen is not None:
            host, port = _split_endpoint(listen)
            self._unix_name = unix_socket_name(f"kvstore-{uuid.uuid4().hex}")  # a path in $KVSTORE_SOCKET_DIR
            self._listener = Listener(host, port, self._unix_name, self.secret, self.name,
                                      self._native.serve, self._export_table, handshake_timeout, wire=self.wire,
                                      tenants=accepted or None)

    # --- regions -------------------------------------------------------------------------
    def register(self, obj: Any, *, remote_access: bool = True, remote_writes: str = "any") -> Region:
        """Register a torch tensor (CPU, or CUDA via host staging), numpy array, bytearray,
        memoryview, mmap or bytes (read-only). The object stays alive while registered.
        `remote_writes`: "any", "granted" or "none" (REMOTE_WRITES)."""
        view = buffer_view(obj)
        kind = "cuda" if view.cuda_tensor is not None else "memory"
        region = self._register_view(view.keepalive, view.nbytes, readonly=view.readonly,
                                     remote_access=remote_access, kind=kind, address=view.address,
                                     remote_writes=remote_writes)
        region._cuda_tensor = view.cuda_tensor
        if view.cuda_tensor is not None and self._ucx is not None:
            direct_cuda(self._ucx, region, view.cuda_tensor)  # the device memory itself, or nothing
            self._set_ucx_mapping(region)
        return region

    def _set_ucx_mapping(self, region: Region) -> None:
        """Tell the native route what UCX mapped for `region` (memh, memory type, address)."""
        mapped = region._ucx
        self._native.set_ucx_memh(region.id, mapped.memh if mapped else 0, bool(mapped and mapped.cuda),
                                  mapped.address if mapped else 0)

    def allocate(self, size: int, *, remote_access: bool = True, remote_writes: str = "any") -> Region:
        """A new zeroed shared-memory region; same-host peers map it and copy directly (whatever
        `remote_writes` says: they are trusted by uid), remote peers write it as `remote_writes`
        says."""
        if size <= 0:
            raise UnsupportedBuffer(f"cannot allocate {size} bytes")
        _remote_writes(remote_writes)
        try:
            fd, mapping = anonymous_shared(size, self.name)
        except OSError as exc:
            raise TransferIOError(f"cannot allocate {size} bytes of shared memory: {exc}") from exc
        region = self._register_view(mapping, size, readonly=False, remote_access=remote_access, kind="shm",
                                     remote_writes=remote_writes)
        region._shm_fd = fd
        return region

    def register_file(self, path: str | os.PathLike[str], size: int, *, readonly: bool = False,
                      remote_access: bool = True, remote_writes: str = "any") -> Region:
        """A file-backed region (NVMe tier): created and preallocated to `size` if needed.
        remote_writes="none" keeps writes to it this engine's own (peers may still read it)."""
        self._check_open()
        if size <= 0:
            raise UnsupportedBuffer(f"cannot register a file region of {size} bytes")
        mode = _remote_writes(remote_writes)
        try:
            rid = self._native.register_file(os.fspath(path), size, readonly, remote_access, mode)
        except RuntimeError as exc:
            raise TransferIOError(str(exc)) from exc
        region = Region(rid, size, "file", readonly, remote_access, remote_writes=remote_writes)
        with self._lock:
            self._regions[rid] = region
        return region

    def _register_view(self, obj: Any, size: int, *, readonly: bool, remote_access: bool, kind: str,
                       address: int | None = None, remote_writes: str = "any") -> Region:
        self._check_open()
        mode = _remote_writes(remote_writes)
        keepalive = obj
        if address is None:
            view = buffer_view(obj)
            address, keepalive = view.address, view.keepalive
        rid = self._native.register_memory(address, size, readonly, remote_access, mode)
        buffer = keepalive if isinstance(keepalive, memoryview) else None
        region = Region(rid, size, kind, readonly, remote_access, buffer=buffer, _keepalive=keepalive,
                        remote_writes=remote_writes)
        if self._ucx is not None:
            # Nothing of ours sees a peer's UCX write: regions whose remote writes we check export a
            # read-only rkey, and none at all where UCX would not enforce that (over TCP).
            region._ucx = self._ucx.try_map(address, size, readonly=readonly,
                                            exported=remote_access and ucx_exports(self._ucx, remote_writes),
                                            remote_write=remote_writes == "any")
            self._set_ucx_mapping(region)
        with self._lock:
            self._regions[rid] = region
        return region

    def unregister(self, region: Region, *, wait: float | None = None) -> None:
        """Stop serving `region`; waits (bounded) for in-flight ops that still use it."""
        with self._lock:
            if self._regions.get(region.id) is not region:
                raise UnknownRegion(f"region {region.id} is not registered with {self.name}")
            del self._regions[region.id]
        self._sweep_graveyard()
        if not self._native.unregister(region.id, self.stall_timeout if wait is None else wait):
            # In-flight ops still point at it: keep the memory alive rather than free it under them
            # (released by a later sweep once the native side lets go of it).
            with self._lock:
                self._graveyard.append(region)
            return
        self._release(region)

    def _sweep_graveyard(self) -> None:
        """Release regions whose timed-out unregister has since drained."""
        with self._lock:
            if not self._graveyard:
                return
            done = [r for r in self._graveyard if self._native.released(r.id)]
            self._graveyard = [r for r in self._graveyard if r not in done]
        for region in done:
            self._release(region)

    def _release(self, region: Region) -> None:
        with self._lock:  # the export table dups fds under this lock: never a closed (reused) number
            if region._shm_fd is not None:
                os.close(region._shm_fd)
                region._shm_fd = None
        unpin(region)  # (its tensor holds an export of the memoryview released next)
        if isinstance(region._keepalive, memoryview):
            try:
                region._keepalive.release()
            except BufferError:
                pass  # the caller still holds views of it; the memory lives until they let go
        if region._ucx is not None and self._ucx is not None:
            self._ucx.unmap(region._ucx)
            region._ucx = None
        region.buffer = None

    def regions(self) -> list[Region]:
        with self._lock:
            return sorted(self._regions.values(), key=lambda r: r.id)

    # --- write grants ---------------------------------------------------------------------------
    def _granted_region(self, region: Region, offset: int, length: int) -> None:
        if self._regions.get(region.id) is not region:
            raise UnknownRegion(f"region {region.id} is not registered with {self.name}")
        if region.remote_writes != "granted":
            raise InvalidOp(f"region {region.id} was registered with remote_writes={region.remote_writes!r}: "
                            "grants apply to regions registered with remote_writes='granted'")
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 < length
                and offset + length <= region.size):
            raise OutOfBounds(f"[{offset}, {offset}+{length}) is not a range of region {region.id} ({region.size} bytes)")

    def grant(self, peer: str, region: Region, offset: int, length: int) -> None:
        """Let the engine whose `peer_id` is `peer` write [offset, offset+length) of `region` (one
        write op must fit inside one grant) until revoked. A peer's grants never overlap (InvalidOp)."""
        self._check_open()
        if not isinstance(peer, str) or not peer:
            raise InvalidOp("a grant names a peer id")
        self._granted_region(region, offset, length)
        if not self._native.grant(peer, region.id, offset, length):
            raise InvalidOp(f"[{offset}, {offset}+{length}) of region {region.id} overlaps a grant {peer} holds")

    def revoke(self, peer: str, region: Region, offset: int, length: int) -> bool:
        """Drop `peer`'s grants that overlap the range. True: no write of that peer lands there any
        more (the range may go to someone else). False: one admitted before is still landing;
        `landing` says when it is over (until then, the range is not anyone else's)."""
        if self._closed:
            return True
        return self._native.revoke(peer, region.id, offset, length)

    def landing(self, peer: str, region: Region, offset: int, length: int) -> bool:
        """Whether a write of `peer` under a grant revoked since is still landing in the range."""
        if self._closed:
            return False
        return self._native.landing(peer, region.id, offset, length)

    def _export_table(self) -> tuple[list[dict[str, Any]], list[int]]:
        """Exported regions and duplicates of their shared-memory fds (the caller closes them)."""
        table, fds = [], []
        with self._lock:
            try:
                for region in sorted(self._regions.values(), key=lambda r: r.id):
                    if not region.remote_access:
                        continue
                    shm = region._shm_fd is not None
                    table.append({"id": region.id, "size": region.size, "kind": region.kind,
                                  "readonly": region.readonly or region.remote_writes == "none",
                                  "writes": region.remote_writes, "shm": shm,
                                  **(region._ucx.advert() if region._ucx is not None else {})})
                    if shm:
                        fds.append(os.dup(region._shm_fd))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        return table, fds

    # --- peers -----------------------------------------------------------------------------
    def export(self) -> EngineDescriptor:
        """The descriptor peers pass to `connect` (JSON via `.to_json()`)."""
        if self._listener is None:
            raise EngineClosed(f"{self.name} does not listen (listen=None)")
        return EngineDescriptor(self.name, self._listener.host, self._listener.port, host_id(), self._unix_name,
                               **(self._ucx.advert() if self._ucx is not None else {}))

    def connect(self, descriptor: EngineDescriptor | dict | str, *, transport: str = "auto",
                streams: int | None = None, timeout: float = 5.0) -> Peer:
        """Authenticate to a peer. transport: "auto" (shm on the same host, else ucx
        over RDMA/shared memory when both ends have it, else tcp), "shm", "tcp", "ucx"."""
        self._check_open()
        peer = Peer(self, EngineDescriptor.parse(descriptor), transport, streams or self.streams, timeout)
        with self._lock:
            self._peers.append(peer)
        return peer

    # --- transfers ---------------------------------------------------------------------------
    def submit(self, ops: Sequence[Op]) -> Batch:
        """Start moving every op; returns at once (tiny local batches finish before it returns)."""
        flat, cuda_reads, ucx, direct = self._prepare(ops)
        return self._batch(self._native.submit(flat), ops, cuda_reads, ucx, direct)

    def transfer(self, ops: Sequence[Op], timeout: float | None = None) -> list[OpResult]:
        """submit + wait: raises the first failed op's typed error."""
        flat, cuda_reads, ucx, direct = self._prepare(ops)
        if cuda_reads or direct:
            return self._batch(self._native.submit(flat), ops, cuda_reads, ucx, direct).wait(timeout)
        # One native call for the whole round (small transfers are dominated by call overheads);
        # the batch object is made only when something failed or timed out.
        timeout = self._timeout if timeout is None else timeout
        failures, native = self._native.run(flat, timeout)
        if not failures:
            return [OpResult(True, op.length) for op in ops]
        batch = self._batch(native, ops, cuda_reads, ucx, direct)
        if failures < 0:
            raise batch.timed_out(timeout)
        return batch.wait(0)

    def _batch(self, native: _native.Batch, ops: Sequence[Op], cuda_reads: list[Read], ucx: bool,
               direct: Sequence[int] = ()) -> Batch:
        return Batch(native, ops, _stage_in(cuda_reads) if cuda_reads else None, default_timeout=self._timeout,
                     on_failure=self._retire_broken_ucx if ucx else None, direct=direct)

    def _prepare(self, ops: Sequence[Op]) -> tuple[array, list[Read], bool, list[int]]:
        """The ops as the native engine takes them, the CUDA reads to stage in afterwards, whether
        any op takes the ucx route, and the indexes of ops done here already: a CUDA region's op
        with host memory of this process on the other side is one device<->host copy into or out
        of that memory (cuda_direct.py); other CUDA sources are staged out here."""
        if self._closed:
            raise EngineClosed(f"engine {self.name} is closed")
        if self._graveyard:
            self._sweep_graveyard()
        flat = array("Q")
        cuda_reads: list[Read] = []
        direct: list[int] = []
        unwatched: set[Peer] = set()
        ucx = False
        try:
            encode = self._encode
            for index, op in enumerate(ops):  # the per-op path of every small transfer: kept to plain lookups
                encoded = encode(op)
                route, local = encoded[1], op.local
                if local._cuda_tensor is not None and route == 0 and \
                        copy_direct(op, local, self._regions.get(encoded[4])):
                    direct.append(index)  # (a mapped peer region's owner cannot go away under a local copy)
                    continue
                flat.extend(encoded)
                if route & UCX_ROUTE:
                    ucx = True
                elif route == 0 and isinstance(op.remote, RemoteRegion):
                    unwatched.add(op.remote.peer)
                if local._cuda_tensor is not None and not (route & UCX_ROUTE and local._ucx.cuda):
                    if isinstance(op, Write):  # (UCX moves mapped device memory itself: no staging)
                        local.sync_from_device(op.local_offset, op.length)
                    else:
                        cuda_reads.append(op)
        except (OverflowError, TypeError) as exc:
            raise InvalidOp(f"offsets and lengths must be non-negative 64-bit integers: {exc}") from exc
        for peer in unwatched:  # copies into a dead peer's memory would "succeed" unseen
            if not peer.alive:
                raise PeerUnreachable(f"{peer.name} is gone")
        return flat, cuda_reads, ucx, direct

    def _retire_broken_ucx(self, batch: _native.Batch) -> None:
        """After a failed batch: peers whose UCX ops failed or stalled stop using UCX (force-closed,
        and the batch's cancelled requests waited out, so no late byte of a failed op lands
        afterwards); their TCP streams carry on."""
        broken = set(self._native.ucx_broken())
        for peer in list(self._peers):
            if peer._ucx_route in broken:
                peer.retire_ucx()
        self._orphans = [b for b in self._orphans if not b.settle(0)]
        if not batch.settle(1.0) and not self._closed:  # keep it (and its regions) until they are over
            log.warning("%s: UCX requests of a failed batch still run after their endpoint closed", self.name)
            self._orphans.append(batch)

    def _encode(self, op: Op) -> tuple[int, ...]:
        if not isinstance(op, (Read, Write)):
            raise InvalidOp(f"not a transfer op: {type(op).__name__}")
        local, remote = op.local, op.remote
        if not isinstance(local, Region) or self._regions.get(local.id) is not local:
            raise UnknownRegion(f"local side of {op!r} is not registered with {self.name}")
        if isinstance(remote, RemoteRegion):
            route, remote_id = remote.peer.route(remote, local, op.opcode == WRITE)
        elif isinstance(remote, Region) and self._regions.get(remote.id) is remote:
            route, remote_id = 0, remote.id
        else:
            raise UnknownRegion(f"remote side of {op!r} is neither a peer's region nor ours")
        return (op.opcode, route, local.id, op.local_offset, remote_id, op.remote_offset, op.length)

    def stats(self) -> dict[str, int]:
        """Bytes moved per transport and ops served/refused, since start."""
        return dict(self._native.stats())

    # --- lifetime ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"engine {self.name} is closed")

    def close(self) -> None:
        """Stop listening, drop peers, fail in-flight ops with EngineClosed, release regions."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        for peer in self._peers:
            peer.close()
        self._native.close()
        if self._ucx is not None:
            self._ucx.close()
        with self._lock:
            regions = list(self._regions.values()) + self._graveyard
            self._graveyard = []
        for region in regions:
            # Unpinned while its memory is still mapped: a CUDA registration that outlives its
            # mapping makes CUDA take whatever is mapped there next for pinned memory and copy
            # through the old pages (seen on an H200: "pageable" copies at the pinned rate, and
            # "resource already mapped" when that range was registered again).
            unpin(region)
            if region._shm_fd is not None:
                os.close(region._shm_fd)
                region._shm_fd = None
        self._regions.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, regions={len(self._regions)}, peers={len(self._peers)})"
