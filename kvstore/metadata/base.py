"""The metadata interface: a small subset of etcd's API that both backends implement identically.

Keys and values are bytes (str is UTF-8 encoded). Every write bumps the store's revision once (a
transaction counts as one write). Keys bound to a lease vanish when the lease expires or is revoked,
and watchers see those deletions like any other.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Sequence

from ..errors import InvalidKey, InvalidValue, ValueTooLarge

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 1 << 20  # below etcd's 1.5 MiB request limit
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: bytes
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl: int


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes


@dataclass(frozen=True, slots=True)
class Compare:
    """`target` of `key` compared with `value`; a missing key has version 0 and value b""."""

    key: bytes
    target: Literal["version", "value", "mod_revision"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes


@dataclass(frozen=True, slots=True)
class Page:
    """One bounded range read at one revision: keys and values in key order."""

    keys: list[bytes]
    values: list[bytes]
    more: bool  # keys past the last one remain in the range
    count: int  # keys in the whole range at `revision`, this page included
    revision: int


@dataclass
class TxnResult:
    succeeded: bool
    revision: int
    responses: list = field(default_factory=list)
    # Whether the transaction wrote anything: one that deleted only absent keys bumps no revision,
    # and its `revision` is the store's current one, which may carry no event under our prefix.
    changed: bool = True


def as_key(key: bytes | str) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise InvalidKey(f"keys are str or bytes, not {type(key).__name__}")
    if not key or len(key) > MAX_KEY_BYTES:
        raise InvalidKey(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


def as_value(value: bytes | str) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidValue(f"values are str or bytes, not {type(value).__name__}")
    value = bytes(value)
    if len(value) > MAX_VALUE_BYTES:
        raise ValueTooLarge(f"value of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
    return value


def compare_holds(cmp: Compare, current: KeyValue | None) -> bool:
    actual: int | bytes
    if cmp.target == "version":
        actual = current.version if current else 0
    elif cmp.target == "mod_revision":
        actual = current.mod_revision if current else 0
    else:
        actual = current.value if current else b""
    return {"==": actual == cmp.value, "!=": actual != cmp.value,
            "<": actual < cmp.value, ">": actual > cmp.value}[cmp.op]  # type: ignore[operator]


class Watch(abc.ABC):
    """An async iterator of WatchEvents; raises MetadataUnavailable or WatchCompacted when it ends
    for a reason other than cancel(). `batches()` gives the same events in lists that each hold
    every event of the revisions they cover: a transaction's changes share one revision, and a
    follower that says "revision R is in" after R's first event lets a reader see half of it."""

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self._events()

    def batches(self) -> AsyncIterator[list[WatchEvent]]:
        return self._batches()

    async def _events(self) -> AsyncIterator[WatchEvent]:
        async for batch in self._batches():
            for event in batch:
                yield event

    @abc.abstractmethod
    def _batches(self) -> AsyncIterator[list[WatchEvent]]:
        """Non-empty lists of whole revisions, in revision order."""

    @abc.abstractmethod
    async def cancel(self) -> None: ...


class Metadata(abc.ABC):
    """Backend-blind metadata store (see module docstring)."""

    url: str

    @abc.abstractmethod
    async def get(self, key: bytes | str) -> KeyValue | None: ...

    @abc.abstractmethod
    async def put(self, key: bytes | str, value: bytes | str, lease: Lease | int = 0) -> int:
        """Returns the new revision."""

    @abc.abstractmethod
    async def delete(self, key: bytes | str) -> bool: ...

    @abc.abstractmethod
    async def range(self, prefix: bytes | str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the revision of that snapshot."""

    @abc.abstractmethod
    async def range_page(self, start: bytes, end: bytes, *, revision: int = 0, limit: int = 0,
                         timeout: float | None = None) -> Page:
        """Keys in [start, end) as of `revision` (0: now), at most `limit` (0: all). Raises WatchCompacted
        when that revision is no longer readable."""

    @abc.abstractmethod
    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult: ...

    @abc.abstractmethod
    async def lease_grant(self, ttl: int) -> Lease: ...

    @abc.abstractmethod
    async def lease_keepalive(self, lease: Lease | int, timeout: float | None = None) -> int:
        """Refresh; returns the remaining TTL or raises LeaseExpired. `timeout` bounds each attempt
        (the handle's own timeout if None): a keep-alive must give up on a hung member well inside
        the lease's TTL to have time for another."""

    @abc.abstractmethod
    async def lease_revoke(self, lease: Lease | int) -> None: ...

    @abc.abstractmethod
    async def watch(self, prefix: bytes | str, start_revision: int | None = None) -> Watch: ...

    @abc.abstractmethod
    async def compact(self, revision: int) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def put_many(self, items: Sequence[Put], chunk: int = MAX_TXN_OPS) -> int:
        """Write many keys in as few transactions as etcd allows (`chunk` ops each, fewer where
        the server refuses that many: an etcd run with a lower --max-txn-ops or request size)."""
        return await self._in_transactions(list(items), chunk)

    async def delete_many(self, keys: Sequence[bytes | str], chunk: int = MAX_TXN_OPS) -> int:
        return await self._in_transactions([Delete(as_key(k)) for k in keys], chunk)

    _txn_ops_taken: int | None = None  # the most ops the server refused no transaction of (learned)

    async def _in_transactions(self, ops: list[Put | Delete], chunk: int) -> int:
        """The revision of the last transaction that changed a key (0: none did, as when every
        key to delete was gone already)."""
        revision, start = 0, 0
        chunk = min(chunk, self._txn_ops_taken or chunk)
        while start < len(ops):
            try:
                result = await self.txn([], ops[start : start + chunk])
                if result.changed:
                    revision = result.revision
            except ValueTooLarge:
                if chunk == 1:
                    raise  # one op alone is too large: not something smaller transactions fix
                chunk = self._txn_ops_taken = max(1, chunk // 2)  # every later batch starts here
                continue
            start += chunk
        return revision


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\0"


def lease_id(lease: Lease | int) -> int:
    return lease.id if isinstance(lease, Lease) else int(lease)
