"""`memory://NAME`: an in-process metadata store with etcd's semantics (revisions, leases with
expiry, prefix watches with history and compaction). Thread-safe; every store of one NAME in a
process is the same store, so library-mode daemons and clients share it."""
from __future__ import annotations

import asyncio
import bisect
import itertools
import threading
import time
from collections import deque
from typing import AsyncIterator, Sequence

from ..errors import LeaseExpired, MetadataUnavailable, WatchCompacted
from .base import (Compare, Delete, KeyValue, Lease, Metadata, Page, Put, TxnResult, Watch, WatchEvent, as_key,
                   as_value, compare_holds, lease_id)

HISTORY = 200_000  # events kept for watches that start in the past


class _State:
    """One named store: the data behind every MemoryMetadata handle of that name."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.data: dict[bytes, KeyValue] = {}
        self.sorted_keys: list[bytes] = []
        self.revision = 0
        self.compacted = 0
        self.history: deque[WatchEvent] = deque(maxlen=HISTORY)
        # (revision, key, value before it): enough MVCC to read a range as of a recent revision
        self.undo: deque[tuple[int, bytes, KeyValue | None]] = deque(maxlen=HISTORY)
        self.leases: dict[int, tuple[int, float, set[bytes]]] = {}  # id -> (ttl, deadline, keys)
        self.lease_ids = itertools.count(0x1000)
        self.watchers: set["_MemoryWatch"] = set()
        self.reaper = threading.Thread(target=self._reap, daemon=True)
        self.reaper.start()

    def _reap(self) -> None:
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            with self.lock:
                expired = [lid for lid, (_, deadline, _) in self.leases.items() if deadline <= now]
                for lid in expired:
                    self.revoke(lid)

    # All below run with self.lock held.
    def apply(self, ops: Sequence[Put | Delete]) -> int:
        events = []
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self.leases:
                raise LeaseExpired(f"lease {op.lease:x} expired or was revoked")
        if any(isinstance(op, Put) or op.key in self.data for op in ops):
            self.revision += 1
        for op in ops:
            old = self.data.get(op.key)
            if isinstance(op, Put) or old is not None:
                self.undo.append((self.revision, op.key, old))
            if old is not None and old.lease and old.lease in self.leases:
                self.leases[old.lease][2].discard(op.key)
            if isinstance(op, Put):
                self.data[op.key] = KeyValue(op.key, op.value, self.revision, (old.version if old else 0) + 1, op.lease)
                if old is None:
                    bisect.insort(self.sorted_keys, op.key)
                if op.lease:
                    self.leases[op.lease][2].add(op.key)
                events.append(WatchEvent("put", op.key, op.value, self.revision))
            elif old is not None:
                del self.data[op.key]
                del self.sorted_keys[bisect.bisect_left(self.sorted_keys, op.key)]
                events.append(WatchEvent("delete", op.key, b"", self.revision))
        self.history.extend(events)
        for watcher in list(self.watchers):
            watcher.deliver(events)
        return self.revision

    def revoke(self, lid: int) -> None:
        entry = self.leases.pop(lid, None)
        if entry is not None and entry[2]:
            self.apply([Delete(k) for k in sorted(entry[2])])


_STORES: dict[str, _State] = {}
_STORES_LOCK = threading.Lock()


class _MemoryWatch(Watch):
    def __init__(self, state: _State, prefix: bytes, start_revision: int | None) -> None:
        self._state, self._prefix = state, prefix
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        with state.lock:
            if start_revision is not None and start_revision <= state.compacted:
                raise WatchCompacted(state.compacted)
            oldest = state.history[0].revision if state.history else state.revision + 1
            if start_revision is not None and start_revision < oldest and start_revision <= state.revision:
                raise WatchCompacted(oldest - 1)
            if start_revision is not None:
                past = [e for e in state.history if e.revision >= start_revision]
                self.deliver(past)
            state.watchers.add(self)

    def deliver(self, events: list[WatchEvent]) -> None:
        mine = [e for e in events if e.key.startswith(self._prefix)]
        if mine:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, mine)

    async def _batches(self) -> AsyncIterator[list[WatchEvent]]:
        while True:
            batch = await self._queue.get()  # one transaction's events, or a replay of whole ones
            if batch is None:
                return
            yield batch

    async def cancel(self) -> None:
        with self._state.lock:
            self._state.watchers.discard(self)
        self._queue.put_nowait(None)


class MemoryMetadata(Metadata):
    """In-process backend (see module docstring)."""

    def __init__(self, name: str = "default") -> None:
        self.url = f"memory://{name}"
        with _STORES_LOCK:
            self._state = _STORES.setdefault(name, _State())
        self._closed = False

    def _check(self) -> _State:
        if self._closed:
            raise MetadataUnavailable(f"{self.url} handle is closed")
        return self._state

    async def get(self, key: bytes | str) -> KeyValue | None:
        state = self._check()
        with state.lock:
            return state.data.get(as_key(key))

    async def put(self, key: bytes | str, value: bytes | str, lease: Lease | int = 0) -> int:
        state = self._check()
        op = Put(as_key(key), as_value(value), lease_id(lease))
        with state.lock:
            return state.apply([op])

    async def delete(self, key: bytes | str) -> bool:
        state = self._check()
        key = as_key(key)
        with state.lock:
            existed = key in state.data
            state.apply([Delete(key)])
            return existed

    async def range(self, prefix: bytes | str) -> tuple[list[KeyValue], int]:
        state = self._check()
        prefix = as_key(prefix)
        with state.lock:
            start = bisect.bisect_left(state.sorted_keys, prefix)
            out = []
            for key in itertools.islice(state.sorted_keys, start, None):
                if not key.startswith(prefix):
                    break
                out.append(state.data[key])
            return out, state.revision

    async def range_page(self, start: bytes, end: bytes, *, revision: int = 0, limit: int = 0,
                         timeout: float | None = None) -> Page:
        state = self._check()
        start = as_key(start)
        with state.lock:
            at = revision or state.revision
            if at > state.revision:
                raise MetadataUnavailable(f"revision {at} is in the future (now {state.revision})")
            if at < state.revision and at <= state.compacted:
                raise WatchCompacted(state.compacted)
            older = _values_at(state, at, start, end)
            lo = bisect.bisect_left(state.sorted_keys, start)
            hi = len(state.sorted_keys) if end == b"\0" else bisect.bisect_left(state.sorted_keys, end, lo)
            pairs = [(k, state.data[k].value) for k in state.sorted_keys[lo:hi] if k not in older]
            if older:
                pairs += [(k, kv.value) for k, kv in older.items() if kv is not None]
                pairs.sort()
        shown = pairs[:limit] if limit else pairs
        return Page([k for k, _ in shown], [v for _, v in shown], len(shown) < len(pairs), len(pairs), at)

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult:
        state = self._check()
        compare = [Compare(as_key(c.key), c.target, c.op, c.value) for c in compare]
        success, failure = _normalise(success), _normalise(failure)
        with state.lock:
            ok = all(compare_holds(c, state.data.get(c.key)) for c in compare)
            ops = success if ok else failure
            before = state.revision
            revision = state.apply(ops) if ops else state.revision
            return TxnResult(ok, revision, changed=revision != before)

    async def lease_grant(self, ttl: int) -> Lease:
        state = self._check()
        with state.lock:
            lid = next(state.lease_ids)
            state.leases[lid] = (ttl, time.monotonic() + ttl, set())
            return Lease(lid, ttl)

    async def lease_keepalive(self, lease: Lease | int, timeout: float | None = None) -> int:
        state = self._check()
        lid = lease_id(lease)
        with state.lock:
            entry = state.leases.get(lid)
            if entry is None:
                raise LeaseExpired(f"lease {lid:x} expired or was revoked")
            state.leases[lid] = (entry[0], time.monotonic() + entry[0], entry[2])
            return entry[0]

    async def lease_revoke(self, lease: Lease | int) -> None:
        state = self._check()
        with state.lock:
            state.revoke(lease_id(lease))

    async def watch(self, prefix: bytes | str, start_revision: int | None = None) -> Watch:
        return _MemoryWatch(self._check(), as_key(prefix), start_revision)

    async def compact(self, revision: int) -> None:
        state = self._check()
        with state.lock:
            state.compacted = max(state.compacted, min(revision, state.revision))
            while state.history and state.history[0].revision <= state.compacted:
                state.history.popleft()

    async def close(self) -> None:
        self._closed = True


def _values_at(state: _State, revision: int, start: bytes, end: bytes) -> dict[bytes, KeyValue | None]:
    """Keys in [start, end) changed after `revision`, with their value then (None: absent)."""
    older: dict[bytes, KeyValue | None] = {}
    for changed, key, before in reversed(state.undo):  # newest first: the last write wins is the oldest
        if changed <= revision:
            return older
        if start <= key and (end == b"\0" or key < end):
            older[key] = before
    if len(state.undo) == state.undo.maxlen:  # entries after `revision` may have been dropped
        raise WatchCompacted(revision)
    return older


def _normalise(ops: Sequence[Put | Delete]) -> list[Put | Delete]:
    return [Put(as_key(op.key), as_value(op.value), op.lease) if isinstance(op, Put) else Delete(as_key(op.key))
            for op in ops]


def reset_memory_stores() -> None:
    """Forget every named in-process store (tests)."""
    with _STORES_LOCK:
        _STORES.clear()
