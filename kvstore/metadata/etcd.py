"""`etcd://host:port`: the metadata interface over a real etcd (v3 API, through aetcd).

Every call carries a timeout; gRPC and etcd errors come back as kvstore.errors types. Ranges are
read in pages pinned to one revision, so a snapshot of a million keys stays consistent and under
gRPC's message limit.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import aetcd
import aetcd.exceptions as aetcd_errors
import aetcd.watcher as aetcd_watcher
import grpc
from aetcd import rpc
from aetcd.utils import prefix_range_end

from ..errors import (InvalidKey, LeaseExpired, MetadataError, MetadataTimeout, MetadataUnavailable, ValueTooLarge,
                      WatchCompacted)
from .base import (Compare, Delete, KeyValue, Lease, Metadata, Page, Put, TxnResult, Watch, WatchEvent, as_key,
                   as_value, lease_id)

PAGE = 10_000
_TARGETS = {"version": rpc.Compare.VERSION, "value": rpc.Compare.VALUE, "mod_revision": rpc.Compare.MOD}
_OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS, ">": rpc.Compare.GREATER}


def _translate(exc: BaseException) -> MetadataError:
    """An aetcd/gRPC failure as a typed kvstore error."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aetcd_errors.RevisionCompactedError):
        return WatchCompacted(exc.compacted_revision)
    if "required revision has been compacted" in text:  # a range at a pinned revision
        return WatchCompacted(0)
    if isinstance(exc, (aetcd_errors.ConnectionTimeoutError, asyncio.TimeoutError)):
        return MetadataTimeout(f"etcd did not answer in time: {text}")
    if isinstance(exc, aetcd_errors.ConnectionFailedError):
        return MetadataUnavailable(f"etcd unreachable: {text}")
    if "lease not found" in text:
        return LeaseExpired(text)
    if "too large" in text or "too many operations" in text:
        return ValueTooLarge(text)
    if "key is not provided" in text:
        return InvalidKey(text)
    if isinstance(exc, rpc.AioRpcError):
        return _translate(_from_rpc(exc))
    return MetadataUnavailable(f"etcd error: {text}")


def _from_rpc(exc: "rpc.AioRpcError") -> Exception:
    try:
        aetcd_errors._handle_exception(exc)
    except Exception as translated:  # noqa: BLE001 - aetcd raises the mapped type
        return translated
    return exc


def _kv(raw) -> KeyValue:
    return KeyValue(raw.key, raw.value, raw.mod_revision, raw.version, raw.lease)


class _EtcdWatch(Watch):
    """One prefix watch on a gRPC stream of its own, a batch per response. etcd sends every event
    of a revision in one WatchResponse (no fragments are asked for); aetcd's watcher hands them on
    one at a time and loses where a revision ends, which a follower needs to say when it is in."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._cancelled = False

    @classmethod
    async def open(cls, client: aetcd.Client, prefix: bytes, start_revision: int | None) -> "_EtcdWatch":
        stream = rpc.WatchStub(client.channel).Watch(metadata=client.metadata)
        create = rpc.WatchCreateRequest(key=prefix, range_end=prefix_range_end(prefix),
                                        start_revision=start_revision or 0)
        watch = cls(stream)
        try:
            await stream.write(rpc.WatchRequest(create_request=create))
            created = await watch._next()
            if created is None or not created.created:
                raise MetadataUnavailable("etcd did not confirm the watch")
            watch._check(created)
        except BaseException:
            stream.cancel()  # a half-made watch (timed out, refused) must not linger on the channel
            raise
        return watch

    async def _batches(self) -> AsyncIterator[list[WatchEvent]]:
        while (response := await self._next()) is not None:
            self._check(response)
            if response.events:  # empty: a progress notice
                yield [WatchEvent("put" if e.type == rpc.Event.PUT else "delete", e.kv.key, e.kv.value,
                                  e.kv.mod_revision) for e in response.events]

    async def _next(self):
        """The next response; None once cancel() ended the stream."""
        try:
            response = await self._stream.read()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._cancelled and not (current is not None and current.cancelling()):
                return None  # grpc reports our own cancel() to the reader as a cancellation
            raise
        except (aetcd_errors.ClientError, rpc.AioRpcError) as exc:
            if self._cancelled:
                return None
            raise _translate(exc) from exc
        if response is grpc.aio.EOF:
            if self._cancelled:
                return None
            raise MetadataUnavailable("etcd ended the watch stream")
        return response

    @staticmethod
    def _check(response) -> None:
        if response.compact_revision:
            raise WatchCompacted(response.compact_revision)
        if response.canceled:
            raise MetadataUnavailable(f"etcd cancelled the watch: {response.cancel_reason or 'no reason given'}")

    async def cancel(self) -> None:
        self._cancelled = True
        self._stream.cancel()


@dataclass(frozen=True)
class EtcdTls:
    """PEM files for `etcd+tls://`: the CA that signed etcd's certificate, and optionally our client
    certificate and key (etcd's --client-cert-auth)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd client TLS needs both cert and key")
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


class _Client(aetcd.Client):
    """aetcd's client, over TLS when given credentials (aetcd itself only dials plaintext)."""

    def __init__(self, *args, credentials: grpc.ChannelCredentials | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._credentials is None:
            return await super().connect()
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                                   options=list(self._options.items()))
            if self._username is not None:
                reply = await rpc.AuthStub(self.channel).Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd_watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                                  metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdMetadata(Metadata):
    """etcd backend (see module docstring)."""

    def __init__(self, host: str, port: int, timeout: float = 5.0, *, tls: EtcdTls | None = None,
                 username: str | None = None, password: str | None = None) -> None:
        self.url = f"{'etcd+tls' if tls else 'etcd'}://{host}:{port}"
        self.timeout = timeout
        self._client = _Client(host, port, username=username, password=password, timeout=timeout,
                               # Own subchannels: gRPC shares them per process by default, so a new
                               # client inherited another's reconnect backoff after an etcd restart
                               # and failed at once ("connection refused" with etcd already healthy).
                               options={"grpc.max_receive_message_length": 256 << 20,
                                        "grpc.use_local_subchannel_pool": 1},
                               credentials=tls.credentials() if tls else None)

    async def _call(self, coro):
        try:
            return await asyncio.wait_for(coro, self.timeout * 2)
        except MetadataError:
            raise
        except (aetcd_errors.ClientError, rpc.AioRpcError, asyncio.TimeoutError) as exc:
            raise _translate(exc) from exc

    async def get(self, key: bytes | str) -> KeyValue | None:
        result = await self._call(self._client.get(as_key(key)))
        return None if result is None else KeyValue(result.key, result.value, result.mod_revision, result.version,
                                                    result.lease)

    async def put(self, key: bytes | str, value: bytes | str, lease: Lease | int = 0) -> int:
        result = await self._call(self._client.put(as_key(key), as_value(value), lease=lease_id(lease) or None))
        return result.header.revision

    async def delete(self, key: bytes | str) -> bool:
        result = await self._call(self._client.delete(as_key(key)))
        return result is not None and result.deleted > 0

    async def range(self, prefix: bytes | str) -> tuple[list[KeyValue], int]:
        prefix = as_key(prefix)
        end = prefix_range_end(prefix)
        await self._call(self._client.connect())
        out: list[KeyValue] = []
        start, revision = prefix, 0
        while True:
            request = rpc.RangeRequest(key=start, range_end=end, limit=PAGE, revision=revision)
            response = await self._call(self._client.kvstub.Range(request, timeout=self.timeout,
                                                                            metadata=self._client.metadata))
            revision = revision or response.header.revision
            out.extend(_kv(raw) for raw in response.kvs)
            if not response.more or not response.kvs:
                return out, revision
            start = response.kvs[-1].key + b"\0"

    async def range_page(self, start: bytes, end: bytes, *, revision: int = 0, limit: int = 0,
                         timeout: float | None = None) -> Page:
        timeout = self.timeout if timeout is None else timeout
        await self._call(self._client.connect())
        # At a pinned revision any member that has applied it can answer: no consensus round trip.
        request = rpc.RangeRequest(key=as_key(start), range_end=end, limit=limit, revision=revision,
                                   serializable=revision > 0)
        try:
            response = await asyncio.wait_for(
                self._client.kvstub.Range(request, timeout=timeout, metadata=self._client.metadata), timeout + 1)
        except (aetcd_errors.ClientError, rpc.AioRpcError, asyncio.TimeoutError) as exc:
            raise _translate(exc) from exc
        kvs = response.kvs
        # Two flat lists: about half the cost of one KeyValue object per key at a million keys.
        return Page([kv.key for kv in kvs], [kv.value for kv in kvs], response.more, response.count,
                    revision or response.header.revision)

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult:
        await self._call(self._client.connect())
        request = rpc.TxnRequest(compare=[self._compare(c) for c in compare],
                                 success=[self._op(o) for o in success], failure=[self._op(o) for o in failure])
        response = await self._call(self._client.kvstub.Txn(request, timeout=self.timeout, metadata=self._client.metadata))
        return TxnResult(response.succeeded, response.header.revision, list(response.responses))

    @staticmethod
    def _compare(c: Compare) -> "rpc.Compare":
        msg = rpc.Compare(key=as_key(c.key), target=_TARGETS[c.target], result=_OPS[c.op])
        if c.target == "value":
            msg.value = as_value(c.value)  # type: ignore[arg-type]
        elif c.target == "version":
            msg.version = int(c.value)
        else:
            msg.mod_revision = int(c.value)
        return msg

    @staticmethod
    def _op(op: Put | Delete) -> "rpc.RequestOp":
        if isinstance(op, Put):
            return rpc.RequestOp(request_put=rpc.PutRequest(key=as_key(op.key), value=as_value(op.value), lease=op.lease))
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=as_key(op.key)))

    async def lease_grant(self, ttl: int) -> Lease:
        lease = await self._call(self._client.lease(int(ttl)))
        return Lease(lease.id, lease.ttl)

    async def lease_keepalive(self, lease: Lease | int) -> int:
        reply = await self._call(self._client.refresh_lease(lease_id(lease)))
        if reply is None or reply.TTL <= 0:
            raise LeaseExpired(f"lease {lease_id(lease):x} expired or was revoked")
        return reply.TTL

    async def lease_revoke(self, lease: Lease | int) -> None:
        try:
            await self._call(self._client.revoke_lease(lease_id(lease)))
        except LeaseExpired:
            pass  # already gone: the goal is reached

    async def watch(self, prefix: bytes | str, start_revision: int | None = None) -> Watch:
        await self._call(self._client.connect())
        return await self._call(_EtcdWatch.open(self._client, as_key(prefix), start_revision))

    async def compact(self, revision: int) -> None:
        await self._call(self._client.compact(revision, physical=True))

    async def close(self) -> None:
        try:
            await self._client.close()
        except (aetcd_errors.ClientError, rpc.AioRpcError):
            pass
