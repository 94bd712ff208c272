"""Typed errors of the KV store. Transfer Engine errors live in `transfer.errors` and are
re-exported here so callers need one import."""
from __future__ import annotations

from transfer.errors import (AuthenticationFailed, OutOfBounds, PeerUnreachable, TransferError,  # noqa: F401
                             TransferTimeout, UnknownRegion)

__all__ = ["AuthenticationFailed", "OutOfBounds", "PeerUnreachable", "TransferError", "TransferTimeout",
           "UnknownRegion"]  # extended below by the kvstore errors


class KVStoreError(Exception):
    """Base class of every kvstore error."""


# --- keys -------------------------------------------------------------------------------------
class InvalidFingerprint(KVStoreError, ValueError):
    """A model fingerprint field is missing, of the wrong type or out of range."""


class FingerprintMismatch(KVStoreError):
    """Two parties disagree on the model fingerprint: their KV blocks are not interchangeable."""

    def __init__(self, message: str, differences: dict[str, tuple[object, object]] | None = None) -> None:
        super().__init__(message)
        self.differences = differences or {}


class InvalidTokens(KVStoreError, ValueError):
    """Token ids that are not non-negative 32-bit integers, or a bad block size."""


# --- metadata ---------------------------------------------------------------------------------
class MetadataError(KVStoreError):
    """Base class of metadata-service errors."""


class MetadataUnavailable(MetadataError, ConnectionError):
    """The metadata service (etcd) cannot be reached or answered with an error."""


class MetadataTimeout(MetadataUnavailable, TimeoutError):
    """A metadata call did not finish within its timeout."""


class InvalidKey(MetadataError, ValueError):
    """A metadata key is empty, too long or not str/bytes."""


class InvalidValue(MetadataError, TypeError):
    """A metadata value is not bytes/str."""


class ValueTooLarge(MetadataError, ValueError):
    """A metadata value (or a batch) exceeds the service's size limit."""


class LeaseExpired(MetadataError):
    """The lease no longer exists (expired or revoked): keys bound to it are gone."""


class WatchCompacted(MetadataError):
    """A watch asked for history that was compacted away; resynchronise from a snapshot."""

    def __init__(self, compacted_revision: int) -> None:
        super().__init__(f"revision compacted up to {compacted_revision}")
        self.compacted_revision = compacted_revision


class InvalidRecord(MetadataError, ValueError):
    """A stored record cannot be decoded (wrong version, truncated, corrupt)."""


class NotMirrored(KVStoreError, LookupError):
    """A question about a fingerprint outside an index mirror's scope (`IndexMirror(fingerprints=...)`):
    it holds no blocks of it, so it cannot say whether any node does."""

__all__ += [
    "KVStoreError", "InvalidFingerprint", "FingerprintMismatch", "InvalidTokens", "MetadataError",
    "MetadataUnavailable", "MetadataTimeout", "InvalidKey", "InvalidValue", "ValueTooLarge", "LeaseExpired",
    "WatchCompacted", "InvalidRecord", "NotMirrored"
]


# --- integrations -----------------------------------------------------------------------------
class UnsupportedDeployment(KVStoreError):
    """A serving setup the store cannot serve correctly (refused at start-up, never silently wrong)."""


class UnsupportedKVLayout(UnsupportedDeployment):
    """KV cache tensors whose shape or layout the connector cannot copy blocks of."""


__all__ += ["UnsupportedDeployment", "UnsupportedKVLayout"]


# --- store and client --------------------------------------------------------------------------
class AllocationFailed(KVStoreError):
    """No room for the block even after evicting everything evictable. `updates` lists the
    evictions done on the way, which still have to be published."""

    def __init__(self, message: str, updates: list | None = None) -> None:
        super().__init__(message)
        self.updates = updates or []


class InvalidRequest(KVStoreError, ValueError):
    """A request a node refuses as malformed (a fingerprint that cannot name an index key, ...)."""


class WrongSize(InvalidRequest):
    """A block size is zero, too large, or does not match the buffer it goes to."""


class BlockTooLarge(WrongSize):
    """A block larger than every live node's DRAM tier: no node has room for it, however empty."""


class NoStoreNodes(KVStoreError):
    """No live store node can take the request."""


class PutFailed(KVStoreError):
    """A block could not be stored on enough nodes."""


class RemoveIncomplete(KVStoreError):
    """A remove reached some nodes holding the blocks and not others: `removed` copies went,
    `failed` maps each node that could not be reached or refused to why (the copies it holds stay
    until it is asked again or their lease ends)."""

    def __init__(self, removed: int, failed: dict[str, str]) -> None:
        self.removed, self.failed = removed, dict(failed)
        why = "; ".join(f"{node}: {reason}" for node, reason in sorted(failed.items()))
        super().__init__(f"{removed} copies removed; not removed on {len(failed)} node(s): {why}")

    def __reduce__(self):  # pickled across processes (multiprocessing, Ray) with its fields
        return RemoveIncomplete, (self.removed, self.failed)


class NodeRefused(KVStoreError):
    """A node refused a request (draining, metadata service unavailable); others may take it."""


class ConnectionsExhausted(NodeRefused):
    """A node's control wire refused a new connection: its connections, or the caller's tenant's
    share of them, are all open (a client's control call waits for one within its timeout, then
    raises this; its wire reads go through the Transfer Engine meanwhile)."""


class StoreClosed(KVStoreError):
    """The client (or embedded store) was closed: it answers nothing, not even from its mirror."""


class InvalidConfig(KVStoreError, ValueError):
    """A setting that cannot work (a tier path that is not a directory, a size the disk cannot hold)."""


class InsecureFile(InvalidConfig):
    """A secret file (cluster secret, admin token, tenants) others may read, or too short to be a secret."""


class ShardMapMismatch(InvalidConfig):
    """A sharded index's etcd records another place in the shard map (another count of shards, or
    another order) than this process's metadata URL gives it."""


class AccessDenied(KVStoreError, PermissionError):
    """A tenant asked for a fingerprint that is not its own (wire code 'denied')."""


__all__ += ["AllocationFailed", "InvalidRequest", "WrongSize", "NoStoreNodes", "PutFailed", "NodeRefused",
            "ConnectionsExhausted", "StoreClosed", "InvalidConfig", "InsecureFile", "ShardMapMismatch", "AccessDenied"]
