"""`kvstore.Client`: put and get KV blocks by (fingerprint, block hash) across the cluster.

Put: pick target nodes (same host first, then least used; replicas on distinct nodes) -> Reserve
slots -> write the bytes with the Transfer Engine straight into the node's memory -> Commit (the
node verifies the checksum, seals, publishes). Get: index-mirror lookup -> read with the engine
straight into the caller's buffer -> verify the checksum -> on a dead node or corrupt copy try the
next replica, else report a miss. Every remote step has a timeout.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import grpc

from transfer import Engine, Peer, Read, Region, TransferError, Write
from transfer.descriptor import host_id

from .access import ControlAuth, cluster_secret
from .daemon.store import AllocationFailed, WrongSize
from .errors import AuthenticationFailed, FingerprintMismatch, KVStoreError
from .index import IndexMirror
from .integrity import block_checksum
from .keys import HASH_BYTES, ModelFingerprint
from .layout import BlockRecord, NodeRecord
from .store.v1 import store_pb2, store_pb2_grpc

log = logging.getLogger(__name__)
TOUCH_INTERVAL = 0.1  # seconds between hit reports to a node
TOUCH_BACKLOG = 10_000  # hashes kept per node between reports
STRIPE_BYTES = 512 << 10  # a 1 MiB block goes out as two 512 KiB pieces in parallel


class NoStoreNodes(KVStoreError):
    """No live store node can take the request."""


class PutFailed(KVStoreError):
    """A block could not be stored on enough nodes."""


@dataclass
class _Node:
    name: str
    peer: Peer
    channel: grpc.Channel
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
                 replicas: int = 1, mirror: IndexMirror | None = None, transport: str = "auto",
                 tls_ca: str | None = None) -> None:
        self.fingerprint, self.timeout, self.replicas = fingerprint, timeout, max(1, replicas)
        self.transport = transport  # "auto" (shared memory on the same host, else TCP) or "tcp"
        self._own_mirror = mirror is None
        self.mirror = mirror or IndexMirror(metadata, cluster, timeout=timeout).start()
        # Batches of blocks already spread over the streams; striping a block further only turns
        # one large (O_DIRECT) read on the node into several small ones.
        if secret is None:  # what `kvstore serve` generated for this cluster, if it did (same user)
            secret = cluster_secret(cluster)
        self.engine = Engine(f"client-{os.getpid()}-{uuid.uuid4().hex[:6]}", listen=None, secret=secret,
                             stall_timeout=timeout, stripe_bytes=STRIPE_BYTES)
        self._secret = secret.encode() if secret else b""
        self._tls_roots = open(tls_ca, "rb").read() if tls_ca else None  # control calls over TLS
        self._metadata: list[tuple[str, str]] = []  # per-call tokens come from ControlAuth
        self._nodes: dict[str, _Node] = {}
        self._down: dict[str, float] = {}  # node -> time until which we do not try it
        self._lock = threading.Lock()
        self._pending_touch: dict[tuple[str, str], dict[str, list[bytes]]] = {}
        self._touch_timer: threading.Timer | None = None
        # A flush in flight holds this: close() must not close a channel under a running call
        # (grpc segfaults on a call racing its channel's close).
        self._flush_lock = threading.Lock()
        self._closed = self._channels_closed = False

    # --- fingerprints and nodes ------------------------------------------------------------------
    def _fp(self, fingerprint: ModelFingerprint | str | None) -> str:
        if fingerprint is None:
            if self.fingerprint is None:
                raise FingerprintMismatch("no fingerprint given and the client has none")
            return self.fingerprint.digest
        if self.fingerprint is not None:
            if isinstance(fingerprint, ModelFingerprint):
                self.fingerprint.check_compatible(fingerprint)
            elif fingerprint != self.fingerprint.digest:
                raise FingerprintMismatch(f"fingerprint {fingerprint} is not this client's {self.fingerprint.digest}")
        return fingerprint.digest if isinstance(fingerprint, ModelFingerprint) else fingerprint

    def _node(self, name: str) -> _Node:
        with self._lock:
            node = self._nodes.get(name)
            if node is not None and node.peer.alive:
                return node
            record, segment = self.mirror.nodes.get(name), self.mirror.segments.get(name)
            if record is None or not segment:
                raise NoStoreNodes(f"node {name} is not registered")
            if node is not None:
                node.peer.close()
                node.channel.close()
            peer = self.engine.connect(segment, transport=self.transport, timeout=self.timeout)
            if self._tls_roots is not None:
                channel = grpc.secure_channel(record.endpoint, grpc.ssl_channel_credentials(self._tls_roots))
            else:
                channel = grpc.insecure_channel(record.endpoint)
            if self._secret:
                channel = grpc.intercept_channel(channel, ControlAuth(self._secret, name, self.engine.name))
            node = self._nodes[name] = _Node(name, peer, channel, store_pb2_grpc.StoreControlStub(channel))
            return node

    def _mark_down(self, name: str, why: Exception) -> None:
        log.info("store node %s failed: %s", name, why)
        self._down[name] = time.monotonic() + 2.0
        with self._lock:
            node = self._nodes.pop(name, None)
        if node is not None:
            node.peer.close()
            node.channel.close()

    def _usable(self, name: str) -> bool:
        return self._down.get(name, 0) < time.monotonic()

    def _targets(self) -> list[NodeRecord]:
        """Put candidates: same host first, then by DRAM use."""
        here = host_id()
        nodes = [n for n in self.mirror.nodes.values() if not n.draining and self._usable(n.name)]
        def load(n: NodeRecord) -> float:
            return n.used.get("dram", 0) / max(n.tiers.get("dram", 1), 1)
        return sorted(nodes, key=lambda n: (n.host != here, load(n), n.name))

    def _rpc(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise WrongSize(exc.details()) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise AllocationFailed(exc.details()) from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise AuthenticationFailed(exc.details()) from None
            raise

    # --- put ---------------------------------------------------------------------------------
    def put(self, block_hash: bytes, data: Any, fingerprint: ModelFingerprint | str | None = None) -> int:
        """Store one block; returns how many nodes newly stored it."""
        return self.put_many([(block_hash, data)], fingerprint)

    def put_many(self, items: Sequence[tuple[bytes, Any]], fingerprint: ModelFingerprint | str | None = None,
                 replicas: int | None = None, exclude: Collection[str] = ()) -> int:
        """Store blocks on `replicas` distinct nodes each (none of them in `exclude`); returns blocks
        newly stored (all nodes)."""
        fp = self._fp(fingerprint)
        if not items:
            return 0
        hashes = [bytes(h) for h, _ in items]
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise WrongSize(f"block hashes are {HASH_BYTES} bytes, got {len(h)}")
        views = [host_bytes(d) for _, d in items]
        if any(v.nbytes == 0 for v in views):
            raise WrongSize("cannot store an empty block")
        checksums = [block_checksum(h, v) for h, v in zip(hashes, views)]
        want = replicas or self.replicas
        stored, placed, errors = 0, 0, []
        regions = [self.engine.register(v, remote_access=False) for v in views]
        try:
            for record in self._targets():
                if placed == want:
                    break
                if record.name in exclude:
                    continue
                try:
                    # Reservations are not evictable: keep each round well inside the node's DRAM.
                    limit, start = max(record.tiers.get("dram", 0) // 4, 1), 0
                    while start < len(regions):
                        end, size = start, 0
                        while end < len(regions) and (end == start or size + regions[end].size <= limit):
                            size += regions[end].size
                            end += 1
                        stored += self._put_on(record.name, fp, hashes[start:end], regions[start:end],
                                               checksums[start:end])
                        start = end
                    placed += 1
                except AuthenticationFailed:
                    raise  # a configuration error, not a dead node
                except (TransferError, grpc.RpcError, NoStoreNodes) as exc:
                    self._mark_down(record.name, exc)
                    errors.append(f"{record.name}: {exc}")
        finally:
            for region in regions:
                self.engine.unregister(region)
        if placed == 0:
            raise NoStoreNodes("no store node took the blocks" + (f": {'; '.join(errors)}" if errors else ""))
        if placed < want:
            log.warning("stored %d of %d replicas: %s", placed, want, "; ".join(errors))
        return stored

    def _put_on(self, name: str, fp: str, hashes: list[bytes], regions: list[Region], checksums: list[int]) -> int:
        node = self._node(name)
        reply = self._rpc(node.stub.Reserve, store_pb2.ReserveRequest(
            fingerprint=fp, hashes=hashes, sizes=[r.size for r in regions], client=self.engine.name))
        todo = [(i, slot) for i, slot in enumerate(reply.slots) if not slot.exists]
        if not todo:
            return 0
        tokens = [slot.token for _, slot in todo]
        try:
            self.engine.transfer([Write(regions[i], 0, node.peer.region(slot.region), slot.offset, regions[i].size)
                                  for i, slot in todo], timeout=self.timeout)
            commit = self._rpc(node.stub.Commit, store_pb2.CommitRequest(
                fingerprint=fp, tokens=tokens, checksums=[checksums[i] for i, _ in todo]))
        except BaseException:
            try:
                self._rpc(node.stub.Abort, store_pb2.AbortRequest(tokens=tokens))
            except (grpc.RpcError, KVStoreError):
                pass  # the node reclaims expired reservations by itself
            raise
        failed = [e for e in commit.errors if e]
        if failed:
            raise PutFailed(f"{name} refused {len(failed)} of {len(tokens)} blocks: {failed[0]}")
        return len(tokens)

    # --- get ---------------------------------------------------------------------------------
    def get(self, block_hash: bytes, out: Any, fingerprint: ModelFingerprint | str | None = None) -> bool:
        """Read one block into `out`; False on a miss."""
        return self.get_many([block_hash], [out], fingerprint)[0]

    def get_many(self, hashes: Sequence[bytes], outs: Sequence[Any],
                 fingerprint: ModelFingerprint | str | None = None) -> list[bool]:
        """Read blocks into caller buffers (zero extra copies on the shared-memory path)."""
        fp = self._fp(fingerprint)
        if len(hashes) != len(outs):
            raise WrongSize(f"{len(hashes)} hashes but {len(outs)} buffers")
        here = host_id()
        nodes = self.mirror.nodes  # a copy: take it once per call
        candidates: list[list[tuple[str, BlockRecord]]] = []
        for h in hashes:
            replicas = self.mirror.lookup(fp, bytes(h))
            ranked = sorted(replicas.items(), key=lambda kv: (kv[1].tier != "dram",
                                                              getattr(nodes.get(kv[0]), "host", "") != here, kv[0]))
            candidates.append([c for c in ranked if self._usable(c[0])] or ranked)
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
            for i, (segments, options) in enumerate(zip(targets, candidates)):
                room = sum(length for _, _, length in segments)
                if options and options[0][1].size > room:
                    raise WrongSize(f"buffer of {room} bytes for a block of {options[0][1].size}")
                # A stored block smaller than its destination would fill it only partly: not a hit.
                candidates[i] = [c for c in options if c[1].size == room]
            found = [False] * len(hashes)
            hits: dict[str, list[bytes]] = {}
            corrupt: dict[str, list[bytes]] = {}
            for attempt in range(max((len(c) for c in candidates), default=0)):
                by_node: dict[str, list[tuple[int, BlockRecord]]] = {}
                for i, options in enumerate(candidates):
                    if not found[i] and attempt < len(options):
                        name, record = options[attempt]
                        by_node.setdefault(name, []).append((i, record))
                for name, wanted in by_node.items():
                    for i in self._read_from(name, hashes, wanted, targets):
                        found[i] = True
                        hits.setdefault(name, []).append(bytes(hashes[i]))
                    for i, record in wanted:
                        if not found[i] and self._usable(name):
                            corrupt.setdefault(name, []).append(bytes(hashes[i]))
        finally:
            for region in temporary:
                self.engine.unregister(region)
        self._report(fp, hits, corrupt)
        return found

    def _read_from(self, name: str, hashes: Sequence[bytes], wanted: list[tuple[int, BlockRecord]],
                   targets: list[list[tuple[Region, int, int]]]) -> list[int]:
        """Indexes of `wanted` read from `name` whose bytes match their checksum."""
        ops, owners = [], []
        try:
            node = self._node(name)
            for i, record in wanted:
                remote, done = node.peer.region(record.region), 0
                for region, offset, length in targets[i]:
                    take = min(length, record.size - done)
                    if take <= 0:
                        break
                    ops.append(Read(region, offset, remote, record.offset + done, take))
                    owners.append(i)
                    done += take
            results = self.engine.submit(ops).wait(self.timeout, raise_on_error=False)
        except AuthenticationFailed:
            raise
        except (TransferError, NoStoreNodes) as exc:
            self._mark_down(name, exc)
            return []
        failed = {owner for owner, result in zip(owners, results) if not result.ok}
        good = []
        for i, record in wanted:
            if i in failed:
                continue
            parts, done = [], 0
            for region, offset, length in targets[i]:
                take = min(length, record.size - done)
                if take <= 0:
                    break
                parts.append(region.host_view()[offset : offset + take])
                done += take
            if block_checksum(bytes(hashes[i]), parts) == record.checksum:
                good.append(i)
        return good

    def _report(self, fp: str, hits: dict[str, list[bytes]], corrupt: dict[str, list[bytes]]) -> None:
        """Queue what was read (recency, NVMe promotion) and what was corrupt, for the next flush."""
        with self._lock:
            for kind, found in (("hits", hits), ("corrupt", corrupt)):
                for name, hs in found.items():
                    pending = self._pending_touch.setdefault((name, fp), {"hits": [], "corrupt": []})[kind]
                    pending.extend(hs[: max(0, TOUCH_BACKLOG - len(pending))])  # advisory: drop the excess
            if self._touch_timer is None and self._pending_touch and not self._closed:
                self._touch_timer = threading.Timer(TOUCH_INTERVAL, self._flush_touches)
                self._touch_timer.daemon = True
                self._touch_timer.start()

    def _flush_touches(self) -> None:
        """One Touch per node and fingerprint for everything read since the last flush; best effort."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending_touch, self._touch_timer = self._pending_touch, {}, None
            for (name, fp), found in pending.items():
                node = self._nodes.get(name)
                if node is None or self._channels_closed:
                    continue
                try:
                    node.stub.Touch(store_pb2.TouchRequest(fingerprint=fp, hashes=found["hits"],
                                                           corrupt=found["corrupt"]),
                                    timeout=self.timeout, metadata=self._metadata)
                except grpc.RpcError as exc:
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
            reply = self._rpc(self._node(name).stub.Remove, store_pb2.RemoveRequest(fingerprint=fp, hashes=hs))
            removed += reply.removed
        return removed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            timer = self._touch_timer
        if timer is not None:
            timer.cancel()
        self._flush_touches()  # waits for a timer's flush already running
        with self._flush_lock:
            self._channels_closed = True
            for node in self._nodes.values():
                node.channel.close()
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
