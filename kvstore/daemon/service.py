"""The StoreControl gRPC service: protobuf in and out over the store operations
(kvstore.daemon.operations), their failures as status codes.

Who may call (the cluster secret's holder, or a tenant on its own fingerprints only) is checked
before a handler runs (kvstore.access.AccessRules); a tenant's engine is granted writes under its
tenant-scoped identity (transfer.auth.scoped_peer), which no other tenant's engine can claim."""
from __future__ import annotations

import time

import grpc

from ..access import current_tenant
from ..errors import KVStoreError
from ..store.v1 import store_pb2, store_pb2_grpc
from .metrics import DaemonMetrics
from .operations import OpFailed, Sealed, StoreOperations

MAX_INLINE_BYTES = 64 << 20  # bytes of blocks one Put may carry (the gRPC message limit is set above it)
STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "refused": grpc.StatusCode.FAILED_PRECONDITION, "unavailable": grpc.StatusCode.UNAVAILABLE,
          "denied": grpc.StatusCode.PERMISSION_DENIED}


def _lease(sealed: Sealed) -> list:
    return [store_pb2.Slot(region=slot.tier.region.id, offset=slot.offset, size=slot.size, token=token)
            for token, slot in sealed.lease]


class StoreControlService(store_pb2_grpc.StoreControlServicer):
    def __init__(self, ops: StoreOperations, metrics: DaemonMetrics) -> None:
        self.ops, self.store, self.metrics = ops, ops.store, metrics

    def _run(self, op: str, context, fn):
        started = time.perf_counter()
        try:
            return fn()
        except OpFailed as exc:
            context.abort(STATUS[exc.code], str(exc))
        except KVStoreError as exc:
            failed = self.ops.failure(exc)
            context.abort(STATUS[failed.code], str(failed))
        finally:
            self.metrics.latency.labels(op).observe(time.perf_counter() - started)

    def Reserve(self, request, context):
        def run():
            reserved = self.ops.reserve(request.fingerprint, request.hashes, list(request.sizes),
                                        tenant=current_tenant(), peer=request.peer, repair=request.repair)
            return store_pb2.ReserveResponse(slots=[
                store_pb2.Slot(hash=h, exists=True) if slot is None else
                store_pb2.Slot(hash=h, region=slot.tier.region.id, offset=slot.offset, size=slot.size, token=token)
                for h, (token, slot) in zip(request.hashes, reserved.slots)],
                used=reserved.used, capacity=reserved.capacity)

        return self._run("reserve", context, run)

    def Commit(self, request, context):
        def run():
            sealed = self.ops.commit(request.fingerprint, list(request.tokens), request.digests,
                                     tenant=current_tenant(), sync=request.sync, hashes=list(request.hashes) or None,
                                     lease_size=request.lease_size, lease_count=request.lease_count,
                                     peer=request.peer)
            return store_pb2.CommitResponse(sealed=[not e for e in sealed.errors], errors=sealed.errors,
                                            stored=sealed.stored, records=sealed.records, lease=_lease(sealed),
                                            lease_ttl=sealed.lease_ttl, used=sealed.used, capacity=sealed.capacity)

        return self._run("commit", context, run)

    def Put(self, request, context):
        def run():
            sealed = self.ops.put_inline(request.fingerprint, request.hashes, request.payloads, request.digests,
                                         tenant=current_tenant(), sync=request.sync, repair=request.repair)
            return store_pb2.PutResponse(sealed=[not e for e in sealed.errors], errors=sealed.errors,
                                         stored=sealed.stored, records=sealed.records, used=sealed.used,
                                         capacity=sealed.capacity)

        return self._run("put", context, run)

    def Abort(self, request, context):
        return self._run("abort", context, lambda: (self.ops.abort(list(request.tokens)), store_pb2.Empty())[1])

    def Touch(self, request, context):
        return self._run("touch", context, lambda: (self.ops.touch(request.fingerprint, request.hashes,
                                                                   request.corrupt, tenant=current_tenant()),
                                                    store_pb2.Empty())[1])

    def Remove(self, request, context):
        return self._run("remove", context, lambda: store_pb2.RemoveResponse(
            removed=self.ops.remove(request.fingerprint, request.hashes, tenant=current_tenant())))

    def Lookup(self, request, context):
        return self._run("lookup", context, lambda: store_pb2.LookupResponse(
            records=self.ops.lookup(request.fingerprint, request.hashes, tenant=current_tenant())))

    def Stats(self, request, context):
        def run():
            with self.store.lock:
                tiers = [store_pb2.TierStats(name=t.name, capacity=t.capacity, used=t.used, blocks=len(t.sealed),
                                             high_watermark=t.high, low_watermark=t.low) for t in self.store.tiers]
                counters = dict(self.store.counters)
            return store_pb2.StatsResponse(node=self.ops.node, tiers=tiers, counters=counters,
                                           eviction_policy=self.store.dram.policy.name)

        return self._run("stats", context, run)
