"""The StoreControl gRPC service: thin handlers over BlockStore, errors as proper status codes.

Who may call (the cluster secret's holder, or a tenant on its own fingerprints only) is checked
before a handler runs (kvstore.access.AccessRules); a tenant's engine is granted writes under its
tenant-scoped identity (transfer.auth.scoped_peer), which no other tenant's engine can claim."""
from __future__ import annotations

import time
from typing import Callable

import grpc

from transfer.auth import PEER_ID, scoped_peer

from ..access import current_tenant
from ..errors import AllocationFailed, InvalidRequest, KVStoreError, MetadataError
from ..index.signatures import RecordSigner
from ..integrity import DIGEST_BYTES, DIGEST_NAME
from ..store.v1 import store_pb2, store_pb2_grpc
from .metrics import DaemonMetrics
from .store import BlockStore, Update


# A client older than the BLAKE3 digests sends `checksums` (a field now reserved): no digests arrive.
_DIGESTS_WANTED = (f"digests: {DIGEST_BYTES} bytes each ({DIGEST_NAME}; a client that sends checksums is older "
                   "than this node):")
MAX_INLINE_BYTES = 64 << 20  # bytes of blocks one Put may carry (the gRPC message limit is set above it)


class StoreControlService(store_pb2_grpc.StoreControlServicer):
    """`publish(updates, wait)` queues index updates; with wait it returns once they are published.
    Puts and commits wait only when the client asked (sync); evictions and promotions never do.
    Records in replies go sealed by `signer`, byte for byte as the node publishes them (a client
    echoes them into its mirror)."""

    def __init__(self, node: str, store: BlockStore, publish: Callable[[list[Update], bool], None],
                 metrics: DaemonMetrics, accepting: Callable[[], bool], signer: RecordSigner | None = None) -> None:
        self.node, self.store, self.publish, self.metrics = node, store, publish, metrics
        self.accepting = accepting
        self.signer = signer or RecordSigner(b"", "default", node)

    def _encoded(self, fingerprint: str, hashes, records) -> list[bytes]:
        """Each record sealed and encoded (b"" where there is none)."""
        encode = self.signer.encode
        return [b"" if r is None else encode(fingerprint, h, r) for h, r in zip(hashes, records)]

    def _usage(self) -> dict[str, int]:
        return {"used": self.store.dram.used, "capacity": self.store.dram.capacity}

    def _run(self, op: str, context, fn):
        started = time.perf_counter()
        try:
            return fn()
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except AllocationFailed as exc:
            if exc.updates:
                self.publish(exc.updates, False)  # evictions made on the way are real: keep the index true
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except MetadataError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"metadata service: {exc}")
        except KVStoreError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            self.metrics.latency.labels(op).observe(time.perf_counter() - started)

    @staticmethod
    def _check_hashes(hashes, context) -> None:
        for h in hashes:
            if len(h) != 16:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hashes: every hash is 16 bytes, got {len(h)}")

    @staticmethod
    def _check_digests(digests, context) -> None:
        for d in digests:
            if len(d) != DIGEST_BYTES:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{_DIGESTS_WANTED} got one of {len(d)} bytes")

    def Reserve(self, request, context):
        self._check_hashes(request.hashes, context)
        if not self.accepting():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.node} is draining: it takes no new blocks")

        def run():
            slots, updates = self.store.reserve(request.fingerprint, list(request.hashes), list(request.sizes),
                                                self._peer(request, context), repair=request.repair)
            if updates:
                self.publish(updates, False)
            return store_pb2.ReserveResponse(slots=[
                store_pb2.Slot(hash=h, exists=True) if slot is None else
                store_pb2.Slot(hash=h, region=slot.tier.region.id, offset=slot.offset, size=slot.size, token=token)
                for h, (token, slot) in zip(request.hashes, slots)], **self._usage())

        return self._run("reserve", context, run)

    @staticmethod
    def _peer(request, context) -> str:
        """The client engine's identity the request names (granted writes into its slots: its peer id,
        scoped by the caller's tenant), or ""."""
        if request.peer and not PEER_ID.fullmatch(request.peer):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peer: the client engine's peer_id, 32 hex digits")
        return scoped_peer(current_tenant(), request.peer)

    def Commit(self, request, context):
        if len(request.tokens) != len(request.digests):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _DIGESTS_WANTED + " one per token")
        self._check_digests(request.digests, context)
        self._check_hashes(request.hashes, context)
        peer = self._peer(request, context)  # before anything is taken

        def run():
            records: list = []
            fresh: list = []
            named: list = []
            errors, updates, leased = self.store.commit_and_lease(
                request.fingerprint, list(request.tokens), list(request.digests), lease_size=request.lease_size,
                lease_count=request.lease_count if self.accepting() else 0, records=records, fresh=fresh,
                verify=request.sync, hashes=list(request.hashes) or None, peer=peer,  # else verified after answering
                named=named)
            if updates:
                self.publish(updates, request.sync)  # queued; published before we answer only when asked
            return store_pb2.CommitResponse(sealed=[not e for e in errors], errors=errors, stored=sum(fresh),
                                            records=self._encoded(request.fingerprint, named, records),
                                            lease=[store_pb2.Slot(region=slot.tier.region.id, offset=slot.offset,
                                                                  size=slot.size, token=token) for token, slot in leased],
                                            lease_ttl=self.store.reservation_timeout, **self._usage())

        return self._run("commit", context, run)

    def Put(self, request, context):
        self._check_hashes(request.hashes, context)
        if not (len(request.hashes) == len(request.payloads) == len(request.digests)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _DIGESTS_WANTED + " payloads and digests, one per hash")
        self._check_digests(request.digests, context)
        if not self.accepting():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.node} is draining: it takes no new blocks")

        def run():
            errors, records, updates, stored = self.store.put_inline(request.fingerprint, list(request.hashes),
                                                             list(request.payloads), list(request.digests),
                                                             verify=request.sync,  # else verified after answering
                                                             repair=request.repair)
            if updates:
                self.publish(updates, request.sync)
            return store_pb2.PutResponse(sealed=[not e for e in errors], errors=errors, stored=stored,
                                         records=self._encoded(request.fingerprint, request.hashes, records),
                                         **self._usage())

        return self._run("put", context, run)

    def Abort(self, request, context):
        return self._run("abort", context, lambda: (self.store.abort(request.tokens), store_pb2.Empty())[1])

    def Touch(self, request, context):
        self._check_hashes(request.hashes, context)

        def run():
            updates = self.store.touch(request.fingerprint, list(request.hashes), list(request.corrupt))
            if updates:
                self.publish(updates, False)
            return store_pb2.Empty()

        return self._run("touch", context, run)

    def Remove(self, request, context):
        self._check_hashes(request.hashes, context)

        def run():
            removed, updates = self.store.remove(request.fingerprint, list(request.hashes))
            if updates:
                self.publish(updates, True)  # a removal is visible everywhere when it returns
            return store_pb2.RemoveResponse(removed=removed)

        return self._run("remove", context, run)

    def Lookup(self, request, context):
        self._check_hashes(request.hashes, context)

        def run():
            records = self.store.records(request.fingerprint, list(request.hashes))
            return store_pb2.LookupResponse(records=self._encoded(request.fingerprint, request.hashes, records))

        return self._run("lookup", context, run)

    def Stats(self, request, context):
        def run():
            with self.store.lock:
                tiers = [store_pb2.TierStats(name=t.name, capacity=t.capacity, used=t.used, blocks=len(t.sealed),
                                             high_watermark=t.high, low_watermark=t.low) for t in self.store.tiers]
                counters = dict(self.store.counters)
            return store_pb2.StatsResponse(node=self.node, tiers=tiers, counters=counters,
                                           eviction_policy=self.store.dram.policy.name)

        return self._run("stats", context, run)

