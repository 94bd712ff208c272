"""`etcd://host:port[,host:port...]`: the metadata interface over a real etcd (v3 API over gRPC, with
aetcd's protobufs), failing over between the members of an etcd cluster.

Every call carries a timeout; gRPC and etcd errors come back as kvstore.errors types. Ranges are
read in pages pinned to one revision, so a snapshot of a million keys stays consistent and under
gRPC's message limit.

Failover. aetcd's client dials one host:port, so the connection handling is ours. A handle talks to
one endpoint at a time (a gRPC channel of its own). Every request carries etcd's `hasleader`
metadata, so a member cut off from its cluster's leader refuses at once ("etcdserver: no leader")
instead of hanging, and ends our watch streams after a few election timeouts. A call that fails in
a way another member may not (UNAVAILABLE: refused, reset, no leader, leader changed, etcd's own
request timeout; DEADLINE_EXCEEDED; our own attempt timeout) moves the handle to the next endpoint
and, with several endpoints, is tried again there (a transaction with comparisons is not: it may
have applied) until the call's budget (twice `timeout`) is spent; each attempt is bounded by
`timeout`, and after a full round of failures the next round waits a little (0.1 s doubling to 1 s),
so an election is waited out instead of spun through. One endpoint: one attempt, as before, on a
fresh channel after a failure (a new channel does not inherit gRPC's reconnect backoff).

- Leases are the cluster's, not a member's: a keep-alive sent to the next member keeps the lease.
- Watches resume where they stopped: a watch remembers the revision after the last event it handed
  on and, when its stream breaks, goes silent (no answer to a progress request within `timeout`) or
  its handle moves to another endpoint, re-creates itself there from that revision, within the same
  budget. Only a compacted revision (WatchCompacted) or a budget spent ends it with an error.
- New handles start at the endpoint the process last found working (for the same endpoint list).
- A channel left behind is closed once calls on it have run out their deadlines.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import aetcd.exceptions as aetcd_errors
import grpc
from aetcd import rpc
from aetcd.utils import prefix_range_end

from ..aio import bounded, quiet
from ..errors import (InvalidKey, LeaseExpired, MetadataError, MetadataTimeout, MetadataUnavailable, ValueTooLarge,
                      WatchCompacted)
from .base import (Compare, Delete, KeyValue, Lease, Metadata, Page, Put, TxnResult, Watch, WatchEvent, as_key,
                   as_value, lease_id)

log = logging.getLogger(__name__)
T = TypeVar("T")

PAGE = 10_000
_TARGETS = {"version": rpc.Compare.VERSION, "value": rpc.Compare.VALUE, "mod_revision": rpc.Compare.MOD}
_OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS, ">": rpc.Compare.GREATER}
HAS_LEADER = ("hasleader", "true")  # etcd: refuse (Unavailable, "no leader") when this member has no leader
_MOVE_ON = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
ROUND_PAUSE = (0.1, 1.0)  # after every endpoint failed once: first pause, longest pause

# (scheme, endpoints) -> the index of the endpoint last found working, process-wide: a handle opened
# after a failover (a mirror's resync, a daemon's next client) starts where the others are.
_preferred: dict[tuple, int] = {}
_preferred_lock = threading.Lock()


def _status(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    return None, str(exc) or type(exc).__name__


def _moves_on(exc: BaseException) -> bool:
    """Whether another member (or a fresh channel) may succeed where this attempt failed."""
    if isinstance(exc, (asyncio.TimeoutError, MetadataTimeout, _Silent)):
        return True
    if isinstance(exc, (aetcd_errors.ConnectionFailedError, aetcd_errors.ConnectionTimeoutError)):
        return True
    code, text = _status(exc)
    if code in _MOVE_ON:
        return True
    # a member's auth token is its own (simple tokens are not replicated) and expires: log in again
    return code == grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" in text


def _translate(exc: BaseException, where: str = "") -> MetadataError:
    """An aetcd/gRPC failure as a typed kvstore error."""
    if isinstance(exc, MetadataError):
        return exc
    code, text = _status(exc)
    at = f" ({where})" if where else ""
    if isinstance(exc, aetcd_errors.RevisionCompactedError):
        return WatchCompacted(exc.compacted_revision)
    if "required revision has been compacted" in text:  # a range at a pinned revision
        return WatchCompacted(0)
    if isinstance(exc, (aetcd_errors.ConnectionTimeoutError, asyncio.TimeoutError, _Silent)) \
            or code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return MetadataTimeout(f"etcd did not answer in time{at}: {text}")
    if "lease not found" in text:
        return LeaseExpired(text)
    if "too large" in text or "too many operations" in text:
        return ValueTooLarge(text)
    if "key is not provided" in text:
        return InvalidKey(text)
    if isinstance(exc, aetcd_errors.ConnectionFailedError) or code == grpc.StatusCode.UNAVAILABLE:
        return MetadataUnavailable(f"etcd unreachable{at}: {text}")
    return MetadataUnavailable(f"etcd error{at}: {text}")


class _Silent(Exception):
    """A watch stream that answered nothing, not even a progress request, within the timeout."""


def _kv(raw) -> KeyValue:
    return KeyValue(raw.key, raw.value, raw.mod_revision, raw.version, raw.lease)


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


class _Connection:
    """One gRPC channel to one endpoint, logged in (etcd auth) before its first call."""

    def __init__(self, host: str, port: int, credentials: grpc.ChannelCredentials | None,
                 username: str | None, password: str | None) -> None:
        self.host, self.port = host, port
        self.where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        target = self.where
        # Own subchannels: gRPC shares them per process by default, so a new channel inherited
        # another's reconnect backoff after an etcd restart and failed at once.
        options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.use_local_subchannel_pool", 1)]
        self.channel = (grpc.aio.secure_channel(target, credentials, options=options) if credentials is not None
                        else grpc.aio.insecure_channel(target, options=options))
        self._username, self._password = username, password
        self.metadata: tuple = (HAS_LEADER,)
        self._ready: asyncio.Future | None = None
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)
        self.closed = False

    async def connect(self, timeout: float = 5.0) -> None:
        """Log in once (no-op without a user); concurrent callers share the one attempt."""
        if self._username is None:
            return
        if self._ready is None or (self._ready.done() and self._ready.exception() is not None):
            self._ready = asyncio.ensure_future(self._login(timeout))
        await asyncio.wait_for(asyncio.shield(self._ready), timeout + 0.5)

    async def _login(self, timeout: float) -> None:
        reply = await rpc.AuthStub(self.channel).Authenticate(
            rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=timeout)
        self.metadata = (("token", reply.token), HAS_LEADER)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        try:
            await self.channel.close()
        except Exception:  # noqa: BLE001 - closing: nothing left to save
            pass


class EtcdMetadata(Metadata):
    """etcd backend (see module docstring). `endpoints`: [(host, port), ...], the members of one
    etcd cluster (or `EtcdMetadata(host, port)` for one)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]] | str, port: int | None = None, timeout: float = 5.0, *,
                 tls: EtcdTls | None = None, username: str | None = None, password: str | None = None) -> None:
        if isinstance(endpoints, str):
            endpoints = [(endpoints, int(port))]  # type: ignore[arg-type]
        self.endpoints = [(str(h), int(p)) for h, p in endpoints]
        if not self.endpoints:
            raise ValueError("etcd needs at least one endpoint")
        scheme = "etcd+tls" if tls else "etcd"
        shown = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        self.url = f"{scheme}://{shown}"
        self.timeout = timeout
        self._credentials = tls.credentials() if tls else None
        self._username, self._password = username, password
        self._key = (scheme, tuple(self.endpoints))
        with _preferred_lock:
            self._index = _preferred.get(self._key, 0) % len(self.endpoints)
        self._conn: _Connection | None = None
        self._retired: set[_Connection] = set()
        self._watches: weakref.WeakSet[_EtcdWatch] = weakref.WeakSet()
        self._closed = False
        self.failovers = 0  # times this handle moved to another endpoint (or a fresh channel)

    # --- endpoints and failover ------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """host:port of the endpoint in use."""
        host, port = self.endpoints[self._index]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _current(self) -> _Connection:
        if self._closed:
            raise MetadataUnavailable(f"{self.url} handle is closed")
        if self._conn is None:
            host, port = self.endpoints[self._index]
            self._conn = _Connection(host, port, self._credentials, self._username, self._password)
        return self._conn

    @property
    def _client(self) -> _Connection:
        """The connection in use (its `channel`, `connect()`): tests that speak etcd's API directly."""
        return self._current()

    def _fail_over(self, conn: _Connection, why: MetadataError) -> None:
        """`conn` failed: use the next endpoint (a fresh channel), unless the handle has already moved."""
        if conn is not self._conn or self._closed:
            return
        before = conn.where
        self._index = (self._index + 1) % len(self.endpoints)
        self._conn = None
        self.failovers += 1
        self._retire(conn)
        if len(self.endpoints) > 1:
            log.warning("etcd %s failed (%s); moving to %s", before, why, self.endpoint)
        for watch in list(self._watches):
            watch._moved(conn)

    def _retire(self, conn: _Connection) -> None:
        """Close `conn` once every call on it has run out its deadline (closing at once would cancel them
        under their callers' feet)."""
        self._retired.add(conn)
        loop = asyncio.get_running_loop()

        def close() -> None:
            if conn in self._retired:
                self._retired.discard(conn)
                loop.create_task(conn.close())

        loop.call_later(2 * self.timeout + 1, close)

    def _worked(self, conn: _Connection) -> None:
        if conn is self._conn:
            with _preferred_lock:
                _preferred[self._key] = self._index

    async def _run(self, op: Callable[[_Connection, float], Awaitable[T]], *, retry: bool = True,
                   timeout: float | None = None) -> T:
        """`op(connection, attempt_timeout)` on the endpoint in use, moving to the next endpoint when it
        fails there in a way another member may not; tried again (with `retry` and several endpoints)
        until 2 x `timeout` is spent."""
        loop = asyncio.get_running_loop()
        timeout = self.timeout if timeout is None else timeout
        deadline = loop.time() + 2 * timeout
        failures, last = 0, None
        while True:
            left = deadline - loop.time()
            if left <= 0.01:
                raise last or MetadataTimeout(f"etcd did not answer within {2 * timeout:.1f}s ({self.url})")
            conn = self._current()
            attempt = min(timeout, left)
            try:
                await conn.connect(attempt)
                result = await bounded(op(conn, attempt), attempt + 0.5)
            except (MetadataError, grpc.aio.AioRpcError, aetcd_errors.ClientError, asyncio.TimeoutError) as exc:
                error = _translate(exc, conn.where)
                if not _moves_on(exc):
                    raise error from exc
                self._fail_over(conn, error)
                failures += 1
                last = error
                if not retry or len(self.endpoints) == 1:
                    raise error from exc
                if failures % len(self.endpoints) == 0:  # every endpoint failed once: an election, or all down
                    pause = min(ROUND_PAUSE[0] * 2 ** (failures // len(self.endpoints) - 1), ROUND_PAUSE[1])
                    await asyncio.sleep(min(pause, max(0.0, deadline - loop.time() - 0.05)))
                continue
            self._worked(conn)
            return result

    # --- the interface ---------------------------------------------------------------------------
    async def get(self, key: bytes | str) -> KeyValue | None:
        request = rpc.RangeRequest(key=as_key(key))
        response = await self._run(lambda c, t: c.kv.Range(request, timeout=t, metadata=c.metadata))
        return _kv(response.kvs[0]) if response.kvs else None

    async def put(self, key: bytes | str, value: bytes | str, lease: Lease | int = 0) -> int:
        request = rpc.PutRequest(key=as_key(key), value=as_value(value), lease=lease_id(lease))
        response = await self._run(lambda c, t: c.kv.Put(request, timeout=t, metadata=c.metadata))
        return response.header.revision

    async def delete(self, key: bytes | str) -> bool:
        request = rpc.DeleteRangeRequest(key=as_key(key))
        response = await self._run(lambda c, t: c.kv.DeleteRange(request, timeout=t, metadata=c.metadata))
        return response.deleted > 0

    async def range(self, prefix: bytes | str) -> tuple[list[KeyValue], int]:
        prefix = as_key(prefix)
        end = prefix_range_end(prefix)
        out: list[KeyValue] = []
        start, revision = prefix, 0
        while True:
            page = await self._range(rpc.RangeRequest(key=start, range_end=end, limit=PAGE, revision=revision),
                                     self.timeout)
            revision = revision or page.header.revision
            out.extend(_kv(raw) for raw in page.kvs)
            if not page.more or not page.kvs:
                return out, revision
            start = page.kvs[-1].key + b"\0"

    async def _range(self, request: "rpc.RangeRequest", timeout: float):
        async def attempt(c: _Connection, t: float):
            try:
                return await c.kv.Range(request, timeout=t, metadata=c.metadata)
            except grpc.aio.AioRpcError as exc:
                if request.serializable and "future revision" in (exc.details() or ""):
                    # a member behind the one that gave us the revision: read through consensus instead
                    linear = rpc.RangeRequest()
                    linear.CopyFrom(request)
                    linear.serializable = False
                    return await c.kv.Range(linear, timeout=t, metadata=c.metadata)
                raise

        return await self._run(attempt, timeout=timeout)

    async def range_page(self, start: bytes, end: bytes, *, revision: int = 0, limit: int = 0,
                         timeout: float | None = None) -> Page:
        timeout = self.timeout if timeout is None else timeout
        # At a pinned revision any member that has applied it can answer: no consensus round trip.
        request = rpc.RangeRequest(key=as_key(start), range_end=end, limit=limit, revision=revision,
                                   serializable=revision > 0)
        response = await self._range(request, timeout)
        kvs = response.kvs
        # Two flat lists: about half the cost of one KeyValue object per key at a million keys.
        return Page([kv.key for kv in kvs], [kv.value for kv in kvs], response.more, response.count,
                    revision or response.header.revision)

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult:
        request = rpc.TxnRequest(compare=[self._compare(c) for c in compare],
                                 success=[self._op(o) for o in success], failure=[self._op(o) for o in failure])
        # Plain puts and deletes are the same when applied twice; a comparison may not hold the second time.
        response = await self._run(lambda c, t: c.kv.Txn(request, timeout=t, metadata=c.metadata),
                                   retry=not compare)
        responses = list(response.responses)
        changed = any(r.WhichOneof("response") == "response_put" or
                      (r.WhichOneof("response") == "response_delete_range" and r.response_delete_range.deleted)
                      for r in responses)
        return TxnResult(response.succeeded, response.header.revision, responses, changed)

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
        # Granted twice (the first answer lost): the spare lease holds nothing and expires by itself.
        request = rpc.LeaseGrantRequest(TTL=int(ttl))
        response = await self._run(lambda c, t: c.lease.LeaseGrant(request, timeout=t, metadata=c.metadata))
        if response.error:
            raise MetadataUnavailable(f"etcd refused a lease: {response.error}")
        return Lease(response.ID, response.TTL)

    async def lease_keepalive(self, lease: Lease | int, timeout: float | None = None) -> int:
        lid = lease_id(lease)

        async def refresh(c: _Connection, t: float):
            call = c.lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lid)]), timeout=t, metadata=c.metadata)
            async for reply in call:
                call.cancel()
                return reply
            return None

        reply = await self._run(refresh, timeout=self.timeout if timeout is None else min(timeout, self.timeout))
        if reply is None or reply.TTL <= 0:
            raise LeaseExpired(f"lease {lid:x} expired or was revoked")
        return reply.TTL

    async def lease_revoke(self, lease: Lease | int) -> None:
        request = rpc.LeaseRevokeRequest(ID=lease_id(lease))
        try:
            await self._run(lambda c, t: c.lease.LeaseRevoke(request, timeout=t, metadata=c.metadata))
        except LeaseExpired:
            pass  # already gone: the goal is reached

    async def watch(self, prefix: bytes | str, start_revision: int | None = None) -> Watch:
        watch = _EtcdWatch(self, as_key(prefix), start_revision or 0)
        await watch.start()
        self._watches.add(watch)
        return watch

    async def compact(self, revision: int) -> None:
        request = rpc.CompactionRequest(revision=revision, physical=True)
        await self._run(lambda c, t: c.kv.Compact(request, timeout=t, metadata=c.metadata))

    async def close(self) -> None:
        self._closed = True
        for watch in list(self._watches):
            await watch.cancel()
        conns = [c for c in (self._conn, *self._retired) if c is not None]
        self._conn = None
        self._retired.clear()
        for conn in conns:
            await conn.close()


_END = object()  # the reader's last word: the stream ended (or was cancelled)


class _EtcdWatch(Watch):
    """One prefix watch on a gRPC stream of its own, a batch per response. etcd sends every event
    of a revision in one WatchResponse (no fragments are asked for). A reader task reads the stream
    into a queue (cancelling a gRPC read cancels its call, so reads are never timed out themselves);
    the consumer waits on the queue with a deadline, asks for a progress notice when the stream has
    been quiet for `timeout`, and resumes the watch from the revision after its last event on the
    handle's current endpoint when the stream breaks, stays silent or the handle moves."""

    def __init__(self, owner: EtcdMetadata, prefix: bytes, start_revision: int) -> None:
        self._owner, self._prefix = owner, prefix
        self._next = start_revision  # the first revision not handed on yet (0: from now)
        self._conn: _Connection | None = None
        self._stream = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._cancelled = False
        self.resumes = 0  # times the watch was re-created (another endpoint, a fresh stream)

    async def start(self) -> None:
        await self._owner._run(self._open)

    async def _open(self, conn: _Connection, timeout: float) -> None:
        stream = conn.watch.Watch(metadata=conn.metadata)
        create = rpc.WatchCreateRequest(key=self._prefix, range_end=prefix_range_end(self._prefix),
                                        start_revision=self._next)
        queue: asyncio.Queue = asyncio.Queue()
        reader = quiet(asyncio.ensure_future(self._read(stream, queue)))
        try:
            await asyncio.wait_for(stream.write(rpc.WatchRequest(create_request=create)), timeout)
            created = await asyncio.wait_for(queue.get(), timeout)
            if isinstance(created, BaseException):
                raise created
            if created is _END or not created.created:
                raise MetadataUnavailable("etcd did not confirm the watch")
            self._check(created)
        except BaseException:
            stream.cancel()  # a half-made watch (timed out, refused) must not linger on the channel
            reader.cancel()
            raise
        if not self._next:
            self._next = created.header.revision + 1  # "from now" is pinned: a resume starts there
        self._drop_stream()
        self._conn, self._stream, self._queue, self._reader = conn, stream, queue, reader

    @staticmethod
    async def _read(stream, queue: asyncio.Queue) -> None:
        try:
            while True:
                response = await stream.read()
                if response is grpc.aio.EOF:
                    queue.put_nowait(_END)
                    return
                queue.put_nowait(response)
        except asyncio.CancelledError:
            queue.put_nowait(_END)
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which resumes or raises
            queue.put_nowait(exc)

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self._reader is not None:
            self._reader.cancel()
        self._stream = self._reader = None

    def _moved(self, conn: _Connection) -> None:
        """The handle left `conn`: a watch on it resumes on the new endpoint."""
        if conn is self._conn and not self._cancelled:
            self._queue.put_nowait(_Moved())

    async def _next_response(self):
        """The stream's next response; _Silent when it answers nothing, even a progress request."""
        timeout = self._owner.timeout
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            pass
        try:  # quiet: is anyone there?
            await asyncio.wait_for(self._stream.write(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest())),
                                   timeout)
            return await asyncio.wait_for(self._queue.get(), timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            return _Silent(f"watch on {self._conn.where if self._conn else '?'} silent for {2 * timeout:.1f}s: {exc!r}")

    async def _batches(self) -> AsyncIterator[list[WatchEvent]]:
        while not self._cancelled:
            response = await self._next_response()
            if self._cancelled:
                return
            problem: BaseException | None = None
            if response is _END:
                problem = MetadataUnavailable("etcd ended the watch stream")
            elif isinstance(response, BaseException):
                problem = response
            elif response.compact_revision:
                raise WatchCompacted(response.compact_revision)
            elif response.canceled:
                problem = MetadataUnavailable(f"etcd cancelled the watch: {response.cancel_reason or 'no reason'}")
            if problem is not None:
                await self._resume(problem)
                continue
            if response.events:  # empty: a progress notice
                batch = [WatchEvent("put" if e.type == rpc.Event.PUT else "delete", e.kv.key, e.kv.value,
                                    e.kv.mod_revision) for e in response.events]
                self._next = batch[-1].revision + 1
                yield batch

    async def _resume(self, problem: BaseException) -> None:
        """Re-create the watch from the first revision not handed on, on the handle's endpoint (the
        next one when this stream's endpoint is still the handle's and it failed there)."""
        conn = self._conn
        error = _translate(problem, conn.where if conn else "")
        if isinstance(error, WatchCompacted):
            raise error
        if conn is not None and not isinstance(problem, _Moved) and _moves_on_watch(problem):
            self._owner._fail_over(conn, error)
        self._drop_stream()
        self._conn = None
        try:
            await self._owner._run(self._open)
        except WatchCompacted:
            raise
        except MetadataError as exc:
            raise MetadataUnavailable(f"watch could not resume from revision {self._next}: {exc}") from exc
        self.resumes += 1
        log.info("etcd watch on %r resumed from revision %d on %s", self._prefix, self._next, self._conn.where)

    @staticmethod
    def _check(response) -> None:
        if response.compact_revision:
            raise WatchCompacted(response.compact_revision)
        if response.canceled:
            raise MetadataUnavailable(f"etcd cancelled the watch: {response.cancel_reason or 'no reason given'}")

    async def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self._drop_stream()
        self._queue.put_nowait(_END)
        self._owner._watches.discard(self)


class _Moved(Exception):
    """The handle moved to another endpoint while this watch was on the old one."""


def _moves_on_watch(problem: BaseException) -> bool:
    """A broken stream (ended, cancelled by etcd, reset, silent) is a reason to try another member."""
    return isinstance(problem, (MetadataUnavailable, _Silent)) or _moves_on(problem)
