"""What a put returns: a count for `put_many`'s callers, one record per key for `put_batch`'s.

`put_batch` answers as Mooncake's BatchPut does (one result per key, not one error for the round),
so a caller retries exactly the keys that failed, knowing why each did.
"""
from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class KeyPut:
    """One key's outcome of `Client.put_batch`.

    `nodes`: the nodes that hold the block once the put returned (newly written or held there
    already). A key is stored (`ok`) when at least one node holds it, as `put_many` counts a put;
    `len(nodes)` below the replicas asked for says it is short of copies (`reason` says why).
    `error`: why it is on no node, typed (`kvstore.errors`: `WrongSize` never sent, `AllocationFailed`
    a node without room, `PutFailed` a node refused its bytes, `NoStoreNodes` no node could take it,
    a `TransferError` a node failed mid-write); `reason`: every node's refusal, in the order asked."""

    key: bytes
    nodes: tuple[str, ...] = ()
    error: Exception | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None
