"""`kvstore.Client`: put and get KV blocks by (fingerprint, block hash) across the cluster.

Put: pick target nodes (same host first, then by DRAM use counting this client's puts in flight and
the use each node reported in its last reply) -> store the blocks there in one control round trip
(same host: an authenticated unix socket, the bytes received straight into the node's DRAM arena;
other hosts: a gRPC Put carrying small blocks) or, for large batches, Reserve -> write with the
Transfer Engine straight into the node's memory -> Commit. The node verifies the digest, seals
and queues the index update; the putting client's own mirror learns the block at once
(read-your-writes, unless a watch event about the block came first: see the README), other
clients when the node's next publish batch reaches etcd.
Get: index-mirror lookup -> read with the engine (or, for a same-host node's NVMe tier, with
O_DIRECT from the tier file's read-only fd) straight into the caller's buffer -> verify the
digest (BLAKE3, kvstore.integrity) -> on a dead node or corrupt copy try the next replica, else
report a miss. Every remote step has a timeout.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

import grpc

from transfer import Engine, Peer, Read, Region, TransferError, TransferTimeout, Write
from transfer.descriptor import host_id

from ..access import ControlAuth, client_secret
from ..errors import (
    AccessDenied,
    AllocationFailed,
    AuthenticationFailed,
    ConnectionReplaced,
    ConnectionsExhausted,
    FingerprintMismatch,
    InvalidConfig,
    KVStoreError,
    NodeRefused,
    NoStoreNodes,
    PutFailed,
    StoreClosed,
    WrongSize,
)
from ..index import IndexMirror
from ..codec import CodecError, check_codec, decode
from ..index.records import MAX_BLOCK_BYTES, BlockRecord, NodeRecord
from ..index.signatures import RecordVerifier
from ..integrity import block_digests
from ..keys import HASH_BYTES, ModelFingerprint, fingerprint_tenant
from ..store.v1 import store_pb2, store_pb2_grpc
from ..wire import TCP_SCHEME, tcp_endpoint
from .channel_guard import ChannelGuard
from .leases import SlotLeases
from .local_node import LocalNode, TierFile, fill_segments
from .placement import PutPlacement
from .reads import TierReads, VerifiedSlots, landed_digests, read_in_stages, read_in_waves
from .reports import HitReports

log = logging.getLogger(__name__)
STRIPE_BYTES = 512 << 10  # a 1 MiB block goes out as two 512 KiB pieces in parallel
LOCAL_INLINE_MAX = 4 << 20  # same host: puts up to this many bytes carry them in the one request
GRPC_INLINE_MAX = 256 << 10  # other hosts: puts up to this many bytes carry them in one call
WIRE_CONNECT_S = 2.0  # the first connection to a node's TCP wire; unreachable, gRPC is used instead
WIRE_RETRY_S = 30.0  # ... for this long
# A node that refused this client a control-wire connection (its tenant's share, or all of them, taken)
# is called over gRPC for this long before the wire is tried again.
WIRE_BUSY_S = 10.0
WIRE_READ_BYTES = 2 << 20  # raw bytes one wire-codec `read` asks for (the node takes up to 64 MiB)
WIRE_READ_DEPTH = 4  # wire-codec `read`s of one get under way at once
SYNC_PUBLISH_WAITS = 4  # a sync put answers within this many timeouts (the node waits up to 3 to publish)


class PutResult(int):
    """What a put returns: the number of blocks newly stored (an int, as before), and
    `already_held`: how many of its blocks a node it went to held already (from an earlier put of
    the same key, this client's or another's), summed over nodes. Such a block is not written
    again: the node's copy stands, whoever wrote it."""

    already_held: int

    def __new__(cls, stored: int = 0, already_held: int = 0) -> PutResult:
        result = super().__new__(cls, stored)
        result.already_held = already_held
        return result

    def __repr__(self) -> str:
        return f"PutResult({int(self)}, already_held={self.already_held})"


@dataclass
class _Node:
    name: str
    peer: Peer
    guard: ChannelGuard  # retire() it, never close the channel: calls may still be on it
    stub: store_pb2_grpc.StoreControlStub


def host_bytes(data: Any) -> memoryview:
    """A flat byte view of a buffer, numpy array or CPU torch tensor (no copy)."""
    if type(data).__module__.startswith("torch"):
        import torch

        if data.device.type != "cpu" or not data.is_contiguous():
            raise WrongSize("torch tensors must be contiguous CPU tensors here")
        return memoryview(data.view(-1).view(torch.uint8).numpy())
    view = memoryview(data)
    if not view.c_contiguous:
        raise WrongSize("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Client:
    """Synchronous client; `AsyncClient` wraps it for asyncio callers."""

    def __init__(self, metadata: str = "memory://default", *, cluster: str = "default",
                 fingerprint: ModelFingerprint | None = None, secret: str | None = None, timeout: float = 5.0,
                 replicas: int | None = None, mirror: IndexMirror | None = None, transport: str = "auto",
                 tls_ca: str | None = None, publish: str = "async", tenant: str | None = None,
                 repair: bool = False, wire_codec: str | None = None) -> None:
        self.fingerprint, self.timeout = fingerprint, timeout
        # Same-host DRAM slots this client verified (KVSTORE_VERIFY=once: re-reads skip the hash);
        # first, so that a bad setting fails before anything is started.
        self._verified = VerifiedSlots()
        # "lz4": gets from nodes on other hosts (or over forced TCP) go over the framed wire with the
        # blocks coded by the node where that gains (kvstore.codec), decoded and checked here. For
        # slow links; on a fast one the node's coding costs more than the bytes it saves.
        self.wire_codec = check_codec(wire_codec)
        # Puts are repair copies (a daemon's repairer): a node takes them only into room it can make
        # without evicting a block no other live node holds; one that cannot is skipped for the next.
        self.repair = repair
        # A tenant client (`tenant=` with that tenant's own `secret=`) may use only its fingerprints.
        self.tenant = tenant or ""
        if self.tenant:
            from transfer.auth import TENANT_NAME, TENANT_RULE

            if not TENANT_NAME.fullmatch(self.tenant):
                raise InvalidConfig(f"tenant must be {TENANT_RULE}, not {self.tenant[:80]!r}")
            if not secret:
                raise InvalidConfig(f"tenant {self.tenant!r} needs its own secret: pass secret= (the tenant's, "
                                    "from the daemons' --tenants file)")
            if fingerprint is not None and fingerprint.tenant != self.tenant:
                raise InvalidConfig(f"this client is tenant {self.tenant!r} but its fingerprint's tenant is "
                                    f"{fingerprint.tenant!r}: a tenant stores only fingerprints with tenant="
                                    f"{self.tenant!r}")
        # None: the cluster's count, as its daemons were started with (`kvstore serve --replicas`).
        self.replicas = None if replicas is None else max(1, replicas)
        self._warned_replicas = False
        self.transport = transport  # "auto" (shared memory on the same host, else TCP) or "tcp"
        if publish not in ("async", "sync"):
            raise ValueError(f"publish must be 'async' or 'sync', not {publish!r}")
        # "async": a put returns once sealed (this client's mirror knows it at once, others after the
        # node's next publish batch); "sync": once the node has published it to the metadata service.
        self.publish = publish
        self._own_mirror = mirror is None
        self.mirror = mirror or IndexMirror(metadata, cluster, timeout=timeout).start()
        # Given, else KVSTORE_SECRET, else what `kvstore serve` generated for this cluster (same user).
        secret, self.secret_source = client_secret(cluster, secret)
        self.engine = Engine(f"client-{os.getpid()}-{uuid.uuid4().hex[:6]}", listen=None, secret=secret,
                             stall_timeout=timeout, stripe_bytes=STRIPE_BYTES, tenant=self.tenant)
        self._secret = secret.encode() if secret else b""
        # Records are used to read bytes only once their seal is their node's (the cluster secret's
        # MAC, or this tenant's): a record written into the index by anyone else is a miss.
        self._records = RecordVerifier(self._secret, cluster, self.tenant)
        self._tls_roots = open(tls_ca, "rb").read() if tls_ca else None  # control calls over TLS
        self._metadata: list[tuple[str, str]] = []  # per-call tokens come from ControlAuth
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()
        self._reports = HitReports(self._touch)
        self._locals: dict[str, LocalNode] = {}
        self._wires: dict[str, LocalNode] = {}  # the same wire over TCP, to nodes on other hosts
        self._wire_down: dict[str, float] = {}  # node -> until when its wire is left alone (unreachable)
        self._wire_busy: dict[str, float] = {}  # node -> until when both its wires are left alone (refused us)
        self._local_addresses: dict[tuple[str, str], tuple[str, Any]] = {}  # (node, field) -> (segment seen, address)
        self._here = host_id()  # this host's name and boot, read once
        self._placement = PutPlacement(self._here)
        self._leases = SlotLeases(timeout)
        self._tier_reads = TierReads()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvs-digest")  # a large put's digests
        self.stats: dict[str, int] = {"control_calls": 0, "local_puts": 0, "wire_puts": 0, "nvme_fd_reads": 0,
                                      "nvme_fd_bytes": 0, "already_held": 0, "wire_reads": 0,
                                      "wire_read_bytes": 0, "wire_read_raw_bytes": 0, "coded_reads": 0,
                                      "reads_unhashed": 0, "refused_records": 0, "control_fallbacks": 0}
        self.closed = False
        try:
            self.check_secrets()  # a node expecting another kind of secret fails here, in one line
        except BaseException:
            self.close()
            raise

    @property
    def _repair_field(self) -> dict:
        return {"repair": True} if self.repair else {}

    # --- fingerprints and nodes ------------------------------------------------------------------
    def _fp(self, fingerprint: ModelFingerprint | str | None) -> str:
        if self.closed:
            raise StoreClosed("this client is closed")
        if fingerprint is None:
            if self.fingerprint is None:
                raise FingerprintMismatch("no fingerprint given and the client has none")
            return self.fingerprint.digest
        if self.fingerprint is not None:
            if isinstance(fingerprint, ModelFingerprint):
                self.fingerprint.check_compatible(fingerprint)
            elif fingerprint != self.fingerprint.digest:
                raise FingerprintMismatch(f"fingerprint {fingerprint} is not this client's {self.fingerprint.digest}")
        name = fingerprint.digest if isinstance(fingerprint, ModelFingerprint) else fingerprint
        if self.tenant and isinstance(name, str) and fingerprint_tenant(name) != self.tenant:
            raise AccessDenied(f"this client is tenant {self.tenant!r}: it may only use fingerprints of its own "
                               f"(tenant={self.tenant!r}, digests '{self.tenant}:...'), not {name[:80]!r}")
        return name

    def _geometry(self, fingerprint: ModelFingerprint | str | None) -> ModelFingerprint | None:
        """The fingerprint whose fields give a block's size, when one is known (after `_fp`)."""
        return fingerprint if isinstance(fingerprint, ModelFingerprint) else self.fingerprint

    def _check_block_sizes(self, fingerprint: ModelFingerprint | None, sizes: Iterable[int]) -> None:
        """Refuse blocks no node can hold, or of another size than the fingerprint's geometry:
        stored, they would be matched as cached and then fail every read."""
        expected = fingerprint.block_bytes if fingerprint is not None else None
        largest = max((n.tiers.get("dram", 0) for n in self.mirror.nodes.values()), default=0)
        for size in sizes:
            if size == 0:
                raise WrongSize("cannot store an empty block")
            if expected is not None and size != expected:
                f = fingerprint
                raise WrongSize(f"a block of {f.model_id} is {expected} bytes (key and value x {f.num_layers} layers "
                                f"x {f.block_size} tokens x {f.num_kv_heads} heads x {f.head_size} x {f.dtype}), "
                                f"got {size}: check the fingerprint, or use kv_layout='bytes' for free-form blocks")
            if size > MAX_BLOCK_BYTES:
                raise WrongSize(f"a block of {size} bytes is over the {MAX_BLOCK_BYTES >> 20} MiB a node takes")
            if largest and size > largest:
                raise WrongSize(f"a block of {size} bytes is larger than every store node's DRAM tier "
                                f"(the largest holds {largest})")

    def cluster_replicas(self) -> int:
        """The cluster's replica count: the largest `--replicas` a live node was started with."""
        return max((n.replicas for n in self.mirror.nodes.values()), default=1)

    def _replicas_wanted(self) -> int:
        cluster = self.cluster_replicas()
        if self.replicas is None:
            return cluster
        if self.replicas > cluster and not self._warned_replicas:
            self._warned_replicas = True  # nodes repair up to the cluster's count only: say so once
            log.warning("this client writes %d copies of each block, but the cluster's nodes keep %d after a node "
                        "dies: start them with `kvstore serve --replicas %d`", self.replicas, cluster, self.replicas)
        return self.replicas

    def check_secrets(self) -> None:
        """Raise AuthenticationFailed, in one line that says where this client's secret came from,
        if a registered node expects another kind of secret (none, or one) than this client has."""
        for record in list(self.mirror.nodes.values()):
            self._check_secret(record)

    def _check_secret(self, record: NodeRecord) -> None:
        if record.secured and not self._secret:
            raise AuthenticationFailed(f"node {record.name} requires the cluster secret and this client has none "
                                       f"({self.secret_source}): pass secret=, or set KVSTORE_SECRET to the "
                                       "contents of the daemon's --secret-file")
        if not record.secured and self._secret:
            raise AuthenticationFailed(f"node {record.name} runs without a secret (--insecure) but this client has "
                                       f"one (from {self.secret_source}): pass secret=\"\" for none, or start the "
                                       "daemon with that secret")

    def _refused(self, name: str, exc: AuthenticationFailed) -> AuthenticationFailed:
        """A node's refusal of this client's secret, saying where the secret came from."""
        return AuthenticationFailed(f"node {name} refused this client's cluster secret (from {self.secret_source}): "
                                    f"{exc}")

    def _node(self, name: str) -> _Node:
        with self._lock:
            node = self._nodes.get(name)
            if node is not None and node.peer.alive:
                return node
            record, segment = self.mirror.nodes.get(name), self.mirror.segments.get(name)
            if record is None or not segment:
                raise NoStoreNodes(f"node {name} is not registered")
            self._check_secret(record)
            if node is not None:
                node.peer.close()
                node.guard.retire()
            try:
                peer = self.engine.connect(segment, transport=self.transport, timeout=self.timeout)
            except AuthenticationFailed as exc:
                raise self._refused(name, exc) from None
            if self._tls_roots is not None:
                raw = grpc.secure_channel(record.endpoint, grpc.ssl_channel_credentials(self._tls_roots))
            else:
                raw = grpc.insecure_channel(record.endpoint)
            guard = ChannelGuard(raw, name)
            channel = guard.channel
            if self._secret:
                channel = grpc.intercept_channel(channel, ControlAuth(self._secret, name, self.engine.name,
                                                                      self.tenant))
            node = self._nodes[name] = _Node(name, peer, guard, store_pb2_grpc.StoreControlStub(channel))
            return node

    def _local(self, name: str) -> LocalNode | None:
        """The same-host fast path to `name`, or None (another host, forced TCP, an older daemon)."""
        if self.transport not in ("auto", "shm") or self._wire_busy.get(name, 0) > time.monotonic():
            return None
        record = self.mirror.nodes.get(name)
        if record is None or record.host != self._here:
            return None
        return self._control_wire(name, "kvstore_local", "", self._locals)

    def _wire(self, name: str) -> LocalNode | None:
        """The same framed wire to `name` over TCP (another host, or forced TCP): one round trip per
        control call instead of a gRPC call's thread hops. None where gRPC runs over TLS (the wire
        does not encrypt) or the node has none."""
        now = time.monotonic()
        if self._tls_roots is not None or self.transport not in ("auto", "tcp") or \
                self._wire_down.get(name, 0) > now or self._wire_busy.get(name, 0) > now:
            return None
        wire = self._control_wire(name, "kvstore_wire", TCP_SCHEME, self._wires)
        if wire is None or wire.reached:
            return wire
        try:  # first use: a wire this client cannot reach (a firewall, say) leaves gRPC to do its work
            wire.warm(min(self.timeout, WIRE_CONNECT_S))
        except AuthenticationFailed:
            raise  # a configuration error, which gRPC would meet as well
        except ConnectionsExhausted as exc:
            self._busy(name, exc)
            return None
        except (OSError, ValueError, TransferError) as exc:
            log.info("control wire to %s unreachable, using gRPC for %.0f s: %s", name, WIRE_RETRY_S, exc)
            self._wire_down[name] = time.monotonic() + WIRE_RETRY_S
            return None
        return wire

    def _busy(self, name: str, why: ConnectionsExhausted) -> None:
        """`name` refused this client a control-wire connection: gRPC carries its control calls for
        WIRE_BUSY_S (the connections this client has pooled there are left alone meanwhile)."""
        if self._wire_busy.get(name, 0) <= time.monotonic():
            log.info("control wire of %s refused a connection, using gRPC for %.0f s: %s", name, WIRE_BUSY_S, why)
            self.stats["control_fallbacks"] += 1
        self._wire_busy[name] = time.monotonic() + WIRE_BUSY_S

    def _control(self, name: str) -> LocalNode | None:
        """The framed wire for control calls to `name` (same host, else TCP), or None (gRPC)."""
        return self._local(name) or self._wire(name)

    def _control_wire(self, name: str, field: str, scheme: str, pool: dict[str, LocalNode]) -> LocalNode | None:
        """The pooled connections to the wire `name`'s segment names under `field`, or None."""
        segment = self.mirror.segments.get(name)
        if not segment:
            return None
        known = self._local_addresses.get((name, field))
        if known is not None and known[0] is segment:
            address = known[1]
        else:
            try:
                value = json.loads(segment).get(field)
                address = scheme + value if isinstance(value, str) and value else None
                if address and scheme:
                    tcp_endpoint(address)  # checked once per segment, not per call
            except (ValueError, AttributeError):
                address = None
            self._local_addresses[(name, field)] = (segment, address)
        if address is None:
            return None
        with self._lock:
            node = pool.get(name)
            if node is not None and node.address == address and not node.closed:
                return node
            if node is not None:
                node.close()
            record = self.mirror.nodes.get(name)
            if record is not None:
                self._check_secret(record)
            node = pool[name] = LocalNode(name, address, self._secret, self.engine.name, self.timeout,
                                          self.secret_source, tenant=self.tenant)
            return node

    def _mark_down(self, name: str, why: Exception) -> None:
        """Leave `name` alone for a while and drop this client's connections to it."""
        if isinstance(why, ConnectionReplaced):  # another thread marked it down already: the connection
            return  # there now is a new one, not the one that failed
        log.info("store node %s failed: %s", name, why)
        self._placement.mark_down(name)
        with self._lock:
            node = self._nodes.pop(name, None)
            local = self._locals.pop(name, None)
            wire = self._wires.pop(name, None)
            self._leases.forget(name)  # its slots are of no use now
        if node is not None:
            node.peer.close()
            node.guard.retire()
        for control in (local, wire):
            if control is not None:
                control.close()

    def _rpc(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise WrongSize(exc.details()) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise AllocationFailed(exc.details()) from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise AuthenticationFailed(exc.details()) from None
            if code == grpc.StatusCode.PERMISSION_DENIED:
                raise AccessDenied(exc.details()) from None
            raise

    # --- put ---------------------------------------------------------------------------------
    def put(self, block_hash: bytes, data: Any, fingerprint: ModelFingerprint | str | None = None) -> PutResult:
        """Store one block; returns how many nodes newly stored it (a PutResult: `.already_held`
        says on how many it was held already)."""
        return self.put_many([(block_hash, data)], fingerprint)

    def put_many(self, items: Iterable[tuple[bytes, Any]], fingerprint: ModelFingerprint | str | None = None,
                 replicas: int | None = None, exclude: Collection[str] = ()) -> PutResult:
        """Store blocks on `replicas` distinct nodes each (none of them in `exclude`); returns blocks
        newly stored (all nodes), as a PutResult: an int whose `already_held` counts the blocks a
        node held already (stored earlier by this client or another: their bytes stand, these are
        not written). `items` is any iterable of (hash, block), a `zip` included. When it
        returns, every block's bytes are on each node counted (the node verifies them before it
        publishes them; sync: before it answers), and this client's mirror lists it there; see the
        docs for what others see."""
        fp = self._fp(fingerprint)
        items = list(items)  # walked more than once below: a zip or a generator would be empty the second time
        if not items:
            return PutResult(0)
        hashes = [bytes(h) for h, _ in items]
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise WrongSize(f"block hashes are {HASH_BYTES} bytes, got {len(h)}")
        views = [host_bytes(d) for _, d in items]
        self._check_block_sizes(self._geometry(fingerprint), (v.nbytes for v in views))
        sums: list[bytes | None] = [None] * len(views)  # each computed once, when a round first needs it

        def digests(start: int, end: int) -> list[bytes]:
            todo = [i for i in range(start, end) if sums[i] is None]
            for i, value in zip(todo, block_digests([hashes[i] for i in todo], [views[i] for i in todo])):
                sums[i] = value
            return sums[start:end]  # type: ignore[return-value]

        total = sum(v.nbytes for v in views)
        want = replicas or self._replicas_wanted()
        stored, held, placed, errors, tried = 0, 0, 0, [], set(exclude)
        registered: list[Region] = []

        def regions() -> list[Region]:  # only the two-step path writes through the engine
            if not registered:
                registered.extend(self.engine.register(v, remote_access=False) for v in views)
            return registered

        try:
            while placed < want:
                record = self._placement.pick(self.mirror.nodes.values(), tried, total)
                if record is None:
                    break
                tried.add(record.name)
                try:
                    # Reservations are not evictable: keep each round well inside the node's DRAM.
                    limit, start = max(record.tiers.get("dram", 0) // 4, 1), 0
                    while start < len(views):
                        end, size = start, 0
                        while end < len(views) and (end == start or size + views[end].nbytes <= limit):
                            size += views[end].nbytes
                            end += 1
                        with self.mirror.asking(fp, record.name, hashes[start:end]) as since:
                            done = self._put_on(record.name, fp, hashes[start:end], views[start:end],
                                                functools.partial(digests, start, end), regions, start, since)
                        stored += done
                        held += getattr(done, "already_held", 0)
                        start = end
                    placed += 1
                except (AuthenticationFailed, AccessDenied):
                    raise  # a configuration error, not a dead node
                except AllocationFailed as exc:
                    if not self.repair:
                        raise
                    errors.append(f"{record.name}: {exc}")  # full of last copies: the next node, if any
                except (TransferError, grpc.RpcError, NoStoreNodes, NodeRefused, OSError, ValueError) as exc:
                    if isinstance(exc, WrongSize):
                        raise
                    self._mark_down(record.name, exc)
                    errors.append(f"{record.name}: {exc}")
                finally:
                    self._placement.settle(record.name, total)
        finally:
            for region in registered:
                self.engine.unregister(region)
        if not errors:  # every node that could be asked took them: say why there were not more
            live = len(self.mirror.nodes)
            errors.append(f"no other node could take them (the cluster has {live} live node{'s' if live != 1 else ''}"
                          + (f", {len(exclude)} excluded)" if exclude else ")"))
        if placed == 0:
            raise NoStoreNodes(f"no store node took the blocks: {'; '.join(errors)}")
        if placed < want:
            log.warning("stored %d of %d replicas: %s", placed, want, "; ".join(errors))
        self.stats["already_held"] += held
        return PutResult(stored, held)

    def _put_on(self, name: str, fp: str, hashes: list[bytes], views: list[memoryview],
                digests_of: Callable[[], list[bytes]], regions, first: int, since: int) -> int:
        """One round of blocks onto `name`; returns how many it newly stored (`since`: from the
        mirror's `asking`, taken before the round's first request; `digests_of`: the round's
        digests, computed by its first call). A node that refuses this client a control-wire
        connection (nothing was asked on it) gets the round again over gRPC."""
        try:
            return self._put_once(name, fp, hashes, views, digests_of, regions, first, since)
        except ConnectionsExhausted as exc:
            self._busy(name, exc)
            return self._put_once(name, fp, hashes, views, digests_of, regions, first, since)

    def _put_once(self, name: str, fp: str, hashes: list[bytes], views: list[memoryview],
                  digests_of: Callable[[], list[bytes]], regions, first: int, since: int) -> int:
        local = self._local(name)
        size = sum(v.nbytes for v in views)
        sync = self.publish == "sync"
        # A sync put's answer waits for the node's publish, which the node bounds by 3 of its timeouts.
        answer_within = self.timeout * (SYNC_PUBLISH_WAITS if sync else 1)
        if local is not None and size <= LOCAL_INLINE_MAX:  # one round trip, bytes with the request
            self.stats["control_calls"] += 1
            reply, _ = local.call({"op": "put", "fp": fp, "hashes": [h.hex() for h in hashes],
                                   "sizes": [v.nbytes for v in views], "digests": [d.hex() for d in digests_of()],
                                   "sync": sync, **self._repair_field}, views, timeout=answer_within)
            self.stats["local_puts"] += 1
            return self._sealed(name, fp, hashes, reply, since)
        wire = self._control(name)
        if local is None and size <= GRPC_INLINE_MAX:  # one round trip over the TCP wire (or gRPC)
            self.stats["control_calls"] += 1
            if wire is not None:
                reply, _ = wire.call({"op": "put", "fp": fp, "hashes": [h.hex() for h in hashes],
                                      "sizes": [v.nbytes for v in views],
                                      "digests": [d.hex() for d in digests_of()], "sync": sync,
                                      **self._repair_field}, views, timeout=answer_within)
                self.stats["wire_puts"] += 1
            else:
                reply = self._rpc(self._node(name).stub.Put, store_pb2.PutRequest(
                    fingerprint=fp, hashes=hashes, payloads=[bytes(v) for v in views], digests=digests_of(),
                    client=self.engine.name, sync=sync, repair=self.repair), answer_within)
            return self._sealed(name, fp, hashes, reply, since)
        return self._put_by_engine(name, wire, fp, hashes, regions()[first : first + len(views)],
                                   digests_of, since, sync, answer_within)

    def _put_by_engine(self, name: str, wire: LocalNode | None, fp: str, hashes: list[bytes], regs: list[Region],
                       digests_of: Callable[[], list[bytes]], since: int, sync: bool, answer_within: float) -> int:
        """Large blocks: write them with the engine (into the node's mapped arena on this host)
        into slots leased by an earlier commit, or else reserved now, then commit them (asking for
        slots for the next put of this shape). Control calls go over `wire` where there is one,
        else gRPC."""
        node = self._node(name)
        size = regs[0].size if all(r.size == regs[0].size for r in regs) else 0  # leases are of one size
        # The digests are computed, without the GIL, beside the reserve and the write (the source's
        # bytes: a caller changing them mid-put gets a refused block, never a wrong one). The engine
        # no longer takes them as it copies: BLAKE3 has no native home here, and SHA-256 there (OpenSSL)
        # costs more than BLAKE3 beside the copy (kvstore.integrity).
        hashing = self._hasher.submit(digests_of)
        # Over TCP the node lets our engine (its handshakes carry this id), and no other, write the
        # slots it reserves or leases for this put; on this host we write its mapped arena directly.
        peer = "" if node.peer.transport == "shm" else self.engine.peer_id
        leased, aged = self._leases.take(node, name, fp, size, len(regs)) if size else (None, [])
        if aged:  # given back now rather than held at the node until they expire
            self._abort(name, aged)
        if leased is not None:
            slots = [(i, slot.token, slot.region, slot.offset) for i, slot in enumerate(leased)]
        elif wire is not None:
            self.stats["control_calls"] += 1
            reply, _ = wire.call({"op": "reserve", "fp": fp, "hashes": [h.hex() for h in hashes],
                                   "sizes": [r.size for r in regs], **({"peer": peer} if peer else {}),
                                   **self._repair_field})
            slots = [(i, s[0], s[1], s[2]) for i, s in enumerate(reply["slots"]) if s is not None]
        else:
            self.stats["control_calls"] += 1
            reply = self._rpc(node.stub.Reserve, store_pb2.ReserveRequest(
                fingerprint=fp, hashes=hashes, sizes=[r.size for r in regs], client=self.engine.name, peer=peer,
                repair=self.repair))
            slots = [(i, s.token, s.region, s.offset) for i, s in enumerate(reply.slots) if not s.exists]
        if leased is None:
            self._placement.seen(name, reply)
        held = len(hashes) - len(slots)  # reserved slots come only for blocks the node does not hold
        if not slots:
            return PutResult(0, held)
        tokens = [token for _, token, _, _ in slots]
        try:
            writes = [Write(regs[i], 0, node.peer.region(region), offset, regs[i].size) for i, _, region, offset in slots]
            moving = self.engine.submit(writes)
            try:
                digests = hashing.result()
            finally:
                moving.wait(self.timeout)
            self.stats["control_calls"] += 1
            todo = [hashes[i] for i, _, _, _ in slots]
            named = todo if leased is not None else None
            # Enough slots for another put like this one, less what is leased already.
            want = self._leases.wanted(node, name, fp, size, len(regs))
            asked = time.monotonic()
            if wire is not None:
                commit, _ = wire.call({"op": "commit", "fp": fp, "tokens": tokens,
                                        "digests": [digests[i].hex() for i, _, _, _ in slots],
                                        "sync": sync, "lease": {"size": size, "count": want},
                                        **({"hashes": [h.hex() for h in named]} if named else {}),
                                        **({"peer": peer} if peer else {})},
                                       timeout=answer_within)
                granted = [(t, r, o) for t, r, o, n in commit.get("lease") or [] if n == size]
                ttl = commit.get("lease_ttl")
            else:
                commit = self._rpc(node.stub.Commit, store_pb2.CommitRequest(
                    fingerprint=fp, tokens=tokens, digests=[digests[i] for i, _, _, _ in slots],
                    sync=sync, hashes=named or [], lease_size=size, lease_count=want, peer=peer),
                    answer_within)
                granted = [(s.token, s.region, s.offset) for s in commit.lease if s.size == size]
                ttl = commit.lease_ttl
            never_usable = self._leases.keep(node, name, fp, size, granted, asked, ttl)
            if never_usable:  # back at once (and no more are asked for)
                self._abort(name, never_usable)
            done = self._sealed(name, fp, todo, commit, since)
            return PutResult(done, done.already_held + held)
        except TransferTimeout:
            raise  # the copy may still be landing: no abort, the slots expire at the node after it
        except BaseException:
            self._abort(name, tokens)
            raise

    def _abort(self, name: str, tokens: list[int]) -> None:
        """Give reserved or leased slots back to `name`; best effort (the node reclaims them at expiry)."""
        try:
            wire = self._control(name)
            if wire is not None:
                try:
                    wire.call({"op": "abort", "tokens": tokens})
                    return
                except ConnectionsExhausted as exc:
                    self._busy(name, exc)
            if (node := self._nodes.get(name)) is not None:
                self._rpc(node.stub.Abort, store_pb2.AbortRequest(tokens=tokens))
        except (grpc.RpcError, KVStoreError, OSError, ValueError) as exc:
            log.debug("giving slots back to %s failed: %s", name, exc)

    def _sealed(self, name: str, fp: str, hashes: list[bytes], reply: Any, since: int) -> PutResult:
        """Check a put's answer (a same-host dict with hex records, or a gRPC reply), teach our own
        mirror what is now stored there; returns how many blocks are new there, and how many it held
        already."""
        self._placement.seen(name, reply)
        hex_records = isinstance(reply, dict)
        errors, records = (reply["errors"], reply["records"]) if hex_records else (reply.errors, reply.records)
        failed = [e for e in errors if e]
        learned = []
        for h, error, raw in zip(hashes, errors, records):
            if not error and raw:
                try:
                    learned.append((h, bytes.fromhex(raw) if hex_records else bytes(raw)))
                except ValueError:
                    continue
        try:  # read-your-writes: no wait for the watch (unless its newer news came first)
            self.mirror.remember_many(fp, name, learned, since)
        except KVStoreError:
            pass  # a malformed record is left for the watch to bring (or not)
        if failed:
            raise PutFailed(f"{name} refused {len(failed)} of {len(errors)} blocks: {failed[0]}")
        stored = reply.get("stored") if isinstance(reply, dict) else getattr(reply, "stored", None)
        stored = len(errors) if stored is None else int(stored)
        return PutResult(stored, max(0, len(errors) - stored))

    # --- get ---------------------------------------------------------------------------------
    def get(self, block_hash: bytes, out: Any, fingerprint: ModelFingerprint | str | None = None) -> bool:
        """Read one block into `out`; False on a miss."""
        return self.get_many([block_hash], [out], fingerprint)[0]

    def get_many(self, hashes: Iterable[bytes], outs: Iterable[Any],
                 fingerprint: ModelFingerprint | str | None = None, *, stages: Sequence[int] | None = None,
                 on_stage: Callable[[int], None] | None = None) -> list[bool]:
        """Read blocks into caller buffers (zero extra copies on the shared-memory path).

        With `stages` (the stage of each segment of a block's segment list, e.g. its layer) and
        `on_stage`, segments are read stage by stage and `on_stage(s)` says when every block's stage-s
        bytes have landed, so a consumer can start on them (and change them: each block's digest is taken
        as its stages land; a block that fails is a miss). Each block is read from its first replica only.

        Buffers pair with hashes in order; extra buffers are left alone (`get_many(hashes[:n], outs)`
        after `match_prefix` reads the n cached blocks into the first n buffers)."""
        fp = self._fp(fingerprint)
        hashes, outs = list(hashes), list(outs)
        if len(outs) < len(hashes):
            raise WrongSize(f"{len(hashes)} hashes but only {len(outs)} buffers")
        outs = outs[: len(hashes)]
        here = self._here
        nodes = self.mirror.nodes  # a copy: take it once per call
        candidates: list[list[tuple[str, BlockRecord]]] = []
        refused = self._records.refused
        for h in hashes:
            replicas = self.mirror.lookup(fp, bytes(h), self._records)
            ranked = sorted(replicas.items(), key=lambda kv: (kv[1].tier != "dram",
                                                              getattr(nodes.get(kv[0]), "host", "") != here, kv[0]))
            candidates.append([c for c in ranked if self._placement.usable(c[0])] or ranked)
        if self._records.refused != refused:
            self._check_refused(fp, hashes, candidates)
        self.stats["refused_records"] = self._records.refused
        # Every destination becomes segments (region, offset, length): a plain buffer is one
        # segment of a region registered for this call; a list of segments (e.g. one block's layers
        # in registered KV-cache tensors) is read into place with one op per segment.
        temporary: list[Region] = []
        targets: list[list[tuple[Region, int, int]]] = []
        try:
            for out in outs:
                if isinstance(out, list):
                    targets.append(out)
                    continue
                view = out.host_view() if isinstance(out, Region) else host_bytes(out)
                if view.readonly:
                    raise WrongSize("output buffers must be writable")
                region = out if isinstance(out, Region) else self.engine.register(view, remote_access=False)
                if region is not out:
                    temporary.append(region)
                targets.append([(region, 0, view.nbytes)])
            expected = getattr(self._geometry(fingerprint), "block_bytes", None)
            for i, (segments, options) in enumerate(zip(targets, candidates)):
                room = sum(length for _, _, length in segments)
                if expected is not None and room != expected:
                    raise WrongSize(f"a buffer of {room} bytes for a block of {expected} (the fingerprint's geometry)")
                if options and options[0][1].size > room:
                    raise WrongSize(f"buffer of {room} bytes for a block of {options[0][1].size}")
                # A stored block smaller than its destination would fill it only partly: not a hit.
                candidates[i] = [c for c in options if c[1].size == room]
            found = [False] * len(hashes)
            hits: dict[str, list[bytes]] = {}
            mismatched: dict[str, list[tuple[int, BlockRecord]]] = {}  # node -> blocks that failed there
            # A staged reader may already use early stages: bytes from a second replica would come too late.
            attempts = max((len(c) for c in candidates), default=0)
            if on_stage is not None:
                attempts = min(attempts, 1)
            for attempt in range(attempts):
                by_node: dict[str, list[tuple[int, BlockRecord]]] = {}
                for i, options in enumerate(candidates):
                    if not found[i] and attempt < len(options):
                        name, record = options[attempt]
                        by_node.setdefault(name, []).append((i, record))
                staged = (stages, on_stage) if on_stage is not None and len(by_node) == 1 else None
                for name, wanted in by_node.items():
                    for i in self._read_from(name, hashes, wanted, targets, staged, fp=fp):
                        found[i] = True
                        hits.setdefault(name, []).append(bytes(hashes[i]))
                    for i, record in wanted:
                        if not found[i] and self._placement.usable(name):
                            mismatched.setdefault(name, []).append((i, record))
            corrupt: dict[str, list[bytes]] = {}
            for name, failed in mismatched.items():
                # Staged: a consumer may already use stages of the first read.
                moved, gone = self._reread_moved(name, fp, hashes, failed, targets, found) \
                    if on_stage is None else ([], set())
                for i in moved:
                    hits.setdefault(name, []).append(bytes(hashes[i]))
                # Still corrupt there even when another replica served the block: the node re-checks it.
                bad = [bytes(hashes[i]) for i, _ in failed if i not in moved and i not in gone]
                if bad:
                    corrupt[name] = bad
        finally:
            for region in temporary:
                self.engine.unregister(region)
        self._reports.add(fp, hits, corrupt)
        return found

    def _check_refused(self, fp: str, hashes: Sequence[bytes], kept: list[list[tuple[str, BlockRecord]]]) -> None:
        """Records of these blocks failed their seal: forged in the index, or this client's secret is
        not the cluster's (or its tenant's). Authenticating to their nodes tells which: a wrong
        secret raises AuthenticationFailed in one line, as a put does, instead of every get missing."""
        suspects: set[str] = set()
        for h, found in zip(hashes, kept):
            suspects |= set(self.mirror.lookup(fp, bytes(h))) - {name for name, _ in found}
        for name in sorted(suspects):
            if name in self._nodes or not self._placement.usable(name):
                continue  # authenticated already (the records were forged), or known to be down
            try:
                self._node(name)
            except AuthenticationFailed:
                raise
            except (KVStoreError, TransferError, OSError, ValueError) as exc:
                log.debug("could not reach %s to check this client's secret: %s", name, exc)

    def _reread_moved(self, name: str, fp: str, hashes: Sequence[bytes], failed: list[tuple[int, BlockRecord]],
                      targets: list[list[tuple[Region, int, int]]], found: list[bool]) -> tuple[list[int], set[int]]:
        """Blocks whose bytes at `name` failed their digest may have moved there (demoted, promoted)
        since our mirror heard: ask the node where they are now and read the moved ones once more.
        Returns (blocks found that way, blocks the node no longer holds)."""
        wanted = [(i, record) for i, record in failed if not found[i]]
        if not wanted:
            return [], set()
        asked = [bytes(hashes[i]) for i, _ in wanted]
        with self.mirror.asking(fp, name, asked) as since:
            try:
                fresh = self._lookup(name, fp, asked)
            except AuthenticationFailed:
                raise
            except (grpc.RpcError, KVStoreError, TransferError, OSError, ValueError) as exc:
                log.debug("lookup at %s failed: %s", name, exc)
                return [], set()
            gone = {i for (i, _), now in zip(wanted, fresh) if now is None}
            again = [(i, now) for (i, was), now in zip(wanted, fresh)
                     if now is not None and now != was and now.size == sum(length for _, _, length in targets[i])]
            read = self._read_from(name, hashes, again, targets, fp=fp) if again else []
            for i in read:
                found[i] = True
            # The next get goes straight to the right place without waiting for the watch (whose
            # news, if it arrived while we asked, wins: hence still inside the question).
            landed = set(read)
            try:
                self.mirror.remember_many(fp, name, [(bytes(hashes[i]), now) for i, now in again if i in landed],
                                          since)
                self.mirror.forget_many(fp, name, [bytes(hashes[i]) for i in gone], since)
            except KVStoreError:
                pass
        return read, gone

    def _lookup(self, name: str, fp: str, hashes: list[bytes]) -> list[BlockRecord | None]:
        """The node's current record of each block (None where it does not hold it)."""
        wire = self._control(name)
        if wire is not None:
            try:
                reply, _ = wire.call({"op": "lookup", "fp": fp, "hashes": [h.hex() for h in hashes]})
            except ConnectionsExhausted as exc:
                self._busy(name, exc)
                return self._lookup(name, fp, hashes)
            records = reply.get("records")
            if not isinstance(records, list) or not all(r is None or isinstance(r, str) for r in records):
                raise ValueError(f"{name} answered a malformed lookup")
            raws = [None if r is None else bytes.fromhex(r) for r in records]
        else:
            reply = self._rpc(self._node(name).stub.Lookup, store_pb2.LookupRequest(fingerprint=fp, hashes=hashes))
            raws = [bytes(r) or None for r in reply.records]
        if len(raws) != len(hashes):
            raise ValueError(f"{name} answered {len(raws)} records for {len(hashes)} blocks")
        # A reply altered on the way (gRPC without TLS) names no other bytes either: as not held.
        check = self._records.check
        return [None if raw is None or not check(fp, h, name, raw) else BlockRecord.decode(raw)
                for h, raw in zip(hashes, raws)]

    def _read_from(self, name: str, hashes: Sequence[bytes], wanted: list[tuple[int, BlockRecord]],
                   targets: list[list[tuple[Region, int, int]]],
                   staged: tuple[Sequence[int] | None, Callable[[int], None]] | None = None, fp: str = ""
                   ) -> list[int]:
        """Indexes of `wanted` read from `name` whose bytes match their digest."""
        if self.wire_codec and staged is None and fp and self._local(name) is None:
            wire = self._wire(name)
            if wire is not None:
                return self._read_wire(name, wire, fp, hashes, wanted, targets)
        ops, owners, op_stages = [], [], []
        stage_list = list(staged[0] or ()) if staged is not None else []
        if any(b < a for a, b in zip(stage_list, stage_list[1:])):
            raise ValueError("stages must not decrease along a block's segments")
        last_stage = stage_list[-1] if stage_list else 0  # segments past the list belong to the last stage
        # Digests taken as bytes land: staged reads' before the consumer may change them, tier reads'
        # in the worker that read them.
        checked: dict[int, bytes] = {}
        records = dict(wanted)
        via_fd: list[tuple[int, BlockRecord]] = []
        failed: set[int] = set()
        try:
            tier = None
            if any(record.tier == "nvme" for _, record in wanted):
                local = self._local(name)
                try:
                    tier = local.tier() if local is not None else None
                except AuthenticationFailed:
                    raise
                except (OSError, ValueError, KVStoreError) as exc:  # the engine route still works
                    log.debug("no tier fd from %s: %s", name, exc)
            rest, coded = [], []
            for i, record in wanted:
                if tier is not None and record.tier == "nvme" and record.region == tier.region:
                    via_fd.append((i, record))
                elif record.codec:  # its frame, decoded here: read whole before any stage is told
                    coded.append((i, record))
                else:
                    rest.append((i, record))
            if rest or coded:
                node = self._node(name)
            if coded:
                failed.update(self._read_coded(node, coded, targets))
            for i, record in rest:
                remote, done = node.peer.region(record.region), 0
                for j, (region, offset, length) in enumerate(targets[i]):
                    take = min(length, record.size - done)
                    if take <= 0:
                        break
                    ops.append(Read(region, offset, remote, record.offset + done, take))
                    owners.append(i)
                    if staged is not None:
                        op_stages.append(stage_list[j] if j < len(stage_list) else last_stage)
                    done += take
            # Same-host DRAM slots read from the mapped arena: their seal numbers before the copy; a
            # slot this client verified under the same number is not hashed again if the number still
            # holds after the copy (reads.VerifiedSlots says why that is safe).
            view, before = (self._seal_view(name, rest) if rest and node.peer.transport == "shm" else None), {}
            if view is not None:
                before = {i: view.number(record.offset) for i, record in rest
                          if record.tier == "dram" and record.region == view.region}
            trusted = {i for i, number in before.items() if self._verified.trusted(view, records[i], number)}

            def tier_reads() -> None:  # same-host NVMe: straight from the tier file, no daemon, no network
                read = self._read_tier(tier, via_fd, targets, hashes)
                failed.update(i for i, _ in via_fd if i not in read)
                checked.update(read)

            if staged is not None:
                if via_fd:
                    tier_reads()
                results, owners = read_in_stages(self.engine, self.timeout, ops, owners, op_stages, staged[1],
                                                 hashes, checked, trusted)
            elif ops:
                results, owners, sums = read_in_waves(self.engine, time.monotonic() + self.timeout, ops, owners,
                                                      records, hashes, targets, trusted,
                                                      tier_reads if via_fd else None)
                checked.update(sums)
            else:
                results = []
                if via_fd:
                    tier_reads()
        except AuthenticationFailed:
            raise
        except (TransferError, NoStoreNodes, NodeRefused, OSError, ValueError) as exc:
            self._mark_down(name, exc)
            return []
        failed.update(owner for owner, result in zip(owners, results) if not result.ok)
        after = {i: view.number(records[i].offset) for i in before} if view is not None else {}
        for i in trusted:
            if i not in failed and after[i] == before[i]:
                checked[i] = records[i].digest
                self.stats["reads_unhashed"] += 1
        # Everything not checked yet (a trusted slot whose number moved during the copy included).
        checked.update(landed_digests(
            hashes, [(i, record) for i, record in wanted if i not in failed and i not in checked], targets))
        good = [i for i, record in wanted if i not in failed and checked[i] == record.digest]
        for i in good:
            if i in before and i not in trusted and before[i] == after[i]:
                self._verified.remember(view, records[i], before[i])
        return good

    def _seal_view(self, name: str, items: list[tuple[int, BlockRecord]]):
        """The seal table of `name` when it is on this host and `items` has DRAM blocks, else None."""
        if not any(record.tier == "dram" for _, record in items):
            return None
        local = self._local(name)
        if local is None:
            return None
        try:
            return local.seals()
        except AuthenticationFailed:
            raise
        except (OSError, ValueError, KVStoreError) as exc:  # hashed as ever
            log.debug("no seal table from %s: %s", name, exc)
            return None

    def _read_coded(self, node: "_Node", items: list[tuple[int, BlockRecord]],
                    targets: list[list[tuple[Region, int, int]]]) -> set[int]:
        """Coded blocks (an NVMe tier with --disk-codec) through the engine: each frame into a
        scratch region, decoded here into its destination. Returns the indexes that failed."""
        scratches = [self.engine.register(bytearray(record.stored), remote_access=False) for _, record in items]
        failed: set[int] = set()
        try:
            ops = [Read(scratch, 0, node.peer.region(record.region), record.offset, record.stored)
                   for scratch, (_, record) in zip(scratches, items)]
            results = self.engine.submit(ops).wait(self.timeout, raise_on_error=False)
            for scratch, (i, record), result in zip(scratches, items, results):
                try:
                    if not result.ok:
                        raise CodecError("read failed")
                    fill_segments(decode(scratch.buffer, record.codec, record.size), targets[i])
                except CodecError:
                    failed.add(i)
        finally:
            for scratch in scratches:
                self.engine.unregister(scratch)
        self.stats["coded_reads"] += len(items) - len(failed)
        return failed

    def _read_wire(self, name: str, wire: LocalNode, fp: str, hashes: Sequence[bytes],
                   wanted: list[tuple[int, BlockRecord]], targets: list[list[tuple[Region, int, int]]]) -> list[int]:
        """Blocks through the node's framed wire with the wire codec (see `wire_codec`): each decoded
        here and kept only when its digest over the raw bytes is the record's. Small requests, up to
        WIRE_READ_DEPTH at once on pooled connections, so that the node codes one while another is
        on the link and this client decodes a third (one large request would do each in turn)."""
        chunks, chunk, total = [], [], 0
        for i, record in wanted:
            if chunk and total + record.size > WIRE_READ_BYTES:
                chunks.append(chunk)
                chunk, total = [], 0
            chunk.append((i, record))
            total += record.size
        if chunk:
            chunks.append(chunk)

        def one(chunk: list[tuple[int, BlockRecord]]) -> tuple[list[int], int, int]:
            """(indexes landed whole and right, bytes sent, raw bytes) of one request."""
            reply, parts = wire.read({"op": "read", "fp": fp, "hashes": [bytes(hashes[i]).hex() for i, _ in chunk],
                                      "codec": self.wire_codec}, timeout=self.timeout)
            records = reply["records"]
            if len(records) != len(chunk):
                raise ValueError(f"{name} answered {len(records)} records for {len(chunk)}")
            parts_left, landed, sent_bytes, raw_bytes = iter(parts), [], 0, 0
            for (i, wanted_record), raw in zip(chunk, records):
                if raw is None:
                    continue
                data = next(parts_left)
                try:
                    sent = BlockRecord.decode(bytes.fromhex(raw))
                    if sent.size != wanted_record.size:
                        continue
                    fill_segments(decode(data, sent.codec, sent.size) if sent.codec else data, targets[i])
                except (CodecError, ValueError):
                    continue
                sent_bytes += len(data)
                raw_bytes += sent.size
                landed.append((i, wanted_record))
            sums = dict(landed_digests(hashes, landed, targets))
            return [i for i, record in landed if sums[i] == record.digest], sent_bytes, raw_bytes

        good: list[int] = []
        busy = False
        pool = ThreadPoolExecutor(min(WIRE_READ_DEPTH, len(chunks)), thread_name_prefix="kvs-wire-read") \
            if len(chunks) > 1 else None
        try:
            results = pool.map(one, chunks) if pool is not None else map(one, chunks)
            for read, sent_bytes, raw_bytes in results:
                good += read
                self.stats["wire_reads"] += 1  # counted here, not by the workers: += is not atomic
                self.stats["wire_read_bytes"] += sent_bytes
                self.stats["wire_read_raw_bytes"] += raw_bytes
        except (AuthenticationFailed, AccessDenied):
            raise
        except ConnectionsExhausted as exc:  # no connection for another request: the rest through the engine
            self._busy(name, exc)
            busy = True
        except (OSError, ValueError, KVStoreError, TimeoutError) as exc:
            self._mark_down(name, exc)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        if busy:
            done = set(good)
            good += self._read_from(name, hashes, [(i, r) for i, r in wanted if i not in done], targets, fp=fp)
        return good

    def _read_tier(self, tier: TierFile, items: list[tuple[int, BlockRecord]],
                   targets: list[list[tuple[Region, int, int]]], hashes: Sequence[bytes]) -> dict[int, bytes]:
        """Same-host NVMe blocks straight from the node's tier file: {index: digest of what landed}."""
        read = self._tier_reads.read(tier, items, targets, hashes)
        self.stats["nvme_fd_reads"] += len(read)  # counted here, not by the workers: += is not atomic
        self.stats["nvme_fd_bytes"] += sum(record.size for i, record in items if i in read)
        return read

    def _touch(self, name: str, fp: str, hits: list[bytes], corrupt: list[bytes]) -> None:
        """Send one hit report to `name` (HitReports' sender); best effort."""
        try:
            node = self._nodes.get(name) or self._node(name)  # tier-fd readers may not have it yet
        except (KVStoreError, TransferError, OSError) as exc:
            log.debug("touch to %s skipped: %s", name, exc)
            return
        try:
            node.stub.Touch(store_pb2.TouchRequest(fingerprint=fp, hashes=hits, corrupt=corrupt),
                            timeout=self.timeout, metadata=self._metadata)
        except (grpc.RpcError, ConnectionReplaced) as exc:
            log.debug("touch to %s failed: %s", name, exc)

    # --- queries -------------------------------------------------------------------------------
    def contains(self, block_hash: bytes, fingerprint: ModelFingerprint | str | None = None) -> bool:
        return self.mirror.contains(self._fp(fingerprint), bytes(block_hash))

    def match_prefix(self, hashes: Sequence[bytes], fingerprint: ModelFingerprint | str | None = None) -> int:
        """How many leading blocks of a prompt the cluster holds."""
        return self.mirror.match(self._fp(fingerprint), hashes).length

    def remove(self, hashes: Sequence[bytes], fingerprint: ModelFingerprint | str | None = None) -> int:
        """Remove blocks from every node holding them; returns copies removed."""
        fp = self._fp(fingerprint)
        by_node: dict[str, list[bytes]] = {}
        for h in hashes:
            for name in self.mirror.lookup(fp, bytes(h)):
                by_node.setdefault(name, []).append(bytes(h))
        removed = 0
        for name, hs in by_node.items():
            request = store_pb2.RemoveRequest(fingerprint=fp, hashes=hs)
            try:
                reply = self._rpc(self._node(name).stub.Remove, request)
            except ConnectionReplaced:  # another thread replaced the connection just now: once more on the new one
                reply = self._rpc(self._node(name).stub.Remove, request)
            removed += reply.removed
        return removed

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._reports.close()  # before the connections its reports go over
        for name, tokens in self._leases.drain(dict(self._nodes)).items():  # not left to expire
            self._abort(name, tokens)
        for node in self._nodes.values():
            node.guard.retire()  # closed once a call another thread has on it ends
        for wire in list(self._locals.values()) + list(self._wires.values()):
            wire.close()
        self._hasher.shutdown(wait=True)
        self._tier_reads.close()
        self.engine.close()
        if self._own_mirror:
            self.mirror.stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio form of Client: the same methods, awaitable (the work runs off the event loop)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sync = Client(*args, **kwargs)

    def __getattr__(self, name: str):
        method = getattr(self.sync, name)

        async def call(*args: Any, **kwargs: Any):
            return await asyncio.to_thread(method, *args, **kwargs)

        return call
