"""The store operations a daemon serves, each defined once: the checks on its arguments, what it
does to the store and the index, and its result per key.

Their one protocol, the framed wire (local.py: JSON frames, bytes in hex, block bytes as
attachments; its unix socket, its TCP or TLS socket, and library mode's in-process calls), only
translates. A failure is an `OpFailed` with one of CODES, which the wire sends as its error code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from transfer.auth import PEER_ID, scoped_peer

from ..access import denied
from ..errors import AllocationFailed, InvalidRequest, KVStoreError, MetadataError
from ..index.signatures import RecordSigner
from ..integrity import DIGEST_BYTES, DIGEST_NAME
from ..keys import HASH_BYTES
from .slot import Slot
from .store import MAX_BLOCK_BYTES, BlockStore, Update

# invalid: the request itself is wrong; exhausted: no room; refused: the node will not (draining,
# no tier, a store error); unavailable: the metadata service failed it; denied: a tenant named a
# fingerprint not its own.
CODES = ("invalid", "exhausted", "refused", "unavailable", "denied")
DIGESTS_WANTED = (f"digests: {DIGEST_BYTES} bytes each ({DIGEST_NAME}; a client that sends checksums is older "
                  "than this node)")


class OpFailed(Exception):
    """An operation refused or failed, as `code` (one of CODES) and a one-line message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Reserved:
    """(token, slot) per hash; slot None where the node holds the block already."""

    slots: list[tuple[int, Slot | None]]
    used: int
    capacity: int


@dataclass(frozen=True)
class Removed:
    """How many of the blocks a remove named were held, and an etcd revision at or after their
    records' deletion (0: none was published): a client whose mirror has applied it lists none of
    them, and no older event about them is still on its way."""

    count: int
    revision: int


@dataclass(frozen=True)
class Sealed:
    """What a commit or a put sealed: an error ('' where none) and the sealed record (encoded, b""
    where none) per block, how many were new, and for a commit the slots leased for the next put."""

    errors: list[str]
    records: list[bytes]
    stored: int
    used: int
    capacity: int
    lease: list[tuple[int, Slot]]
    lease_ttl: float


# --- the checks, one place for both transports ------------------------------------------------------
def check_hashes(hashes: Sequence[Any]) -> list[bytes]:
    if not all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes):
        raise OpFailed("invalid", f"hashes: every hash is {HASH_BYTES} bytes")
    return list(hashes)


def check_digests(digests: Sequence[Any], n: int) -> list[bytes]:
    if len(digests) != n:
        raise OpFailed("invalid", f"{DIGESTS_WANTED}: one per block")
    if not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in digests):
        raise OpFailed("invalid", DIGESTS_WANTED)
    return list(digests)


def check_ints(values: Any, what: str, n: int | None = None, limit: int = 2**64 - 1) -> list[int]:
    """`values` as `n` integers in 0..limit (any number of them where n is None)."""
    if not isinstance(values, (list, tuple)) or (n is not None and len(values) != n) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= limit for v in values):
        raise OpFailed("invalid", f"{what}: {'' if n is None else f'{n} '}integers in 0..{limit}")
    return list(values)


def check_fingerprint(fingerprint: Any, tenant: str) -> str:
    """A fingerprint the caller may name: a tenant only its own (`tenant:...`)."""
    if not isinstance(fingerprint, str):
        raise OpFailed("invalid", "fp: a string")
    refused = denied(tenant, fingerprint)
    if refused is not None:
        raise OpFailed("denied", refused)
    return fingerprint


def check_peer(peer: Any, tenant: str) -> str:
    """The client engine's identity a reserve or commit names: its peer id, scoped by the caller's
    tenant ("" when none)."""
    if peer is None or peer == "":
        return ""
    if not isinstance(peer, str) or not PEER_ID.fullmatch(peer):
        raise OpFailed("invalid", "peer: the client engine's peer_id, 32 hex digits")
    return scoped_peer(tenant, peer)


class StoreOperations:
    """The daemon's store operations over `store`; `publish(updates, wait)` queues index updates
    (with wait it returns once they are published, with the etcd revision that says so);
    `accepting()` is False while the node drains.
    Records in results go sealed by `signer`, byte for byte as the node publishes them."""

    def __init__(self, node: str, store: BlockStore, publish: Callable[[list[Update], bool], int],
                 accepting: Callable[[], bool], signer: RecordSigner) -> None:
        self.node, self.store, self.publish, self.accepting, self.signer = node, store, publish, accepting, signer

    # --- failures ---------------------------------------------------------------------------------
    def failure(self, exc: KVStoreError) -> OpFailed:
        """The OpFailed a store error means (an allocation's evictions made on the way are real:
        they are published first, to keep the index true)."""
        if isinstance(exc, AllocationFailed):
            if exc.updates:
                self.publish(exc.updates, False)
            return OpFailed("exhausted", str(exc))
        if isinstance(exc, InvalidRequest):
            return OpFailed("invalid", str(exc))
        if isinstance(exc, MetadataError):
            return OpFailed("unavailable", f"metadata service: {exc}")
        return OpFailed("refused", str(exc))

    def _published(self, updates: list[Update], wait: bool) -> int:
        if not updates:
            return 0
        try:
            return self.publish(updates, wait)
        except KVStoreError as exc:
            raise self.failure(exc) from None

    def _check_accepting(self) -> None:
        if not self.accepting():
            raise OpFailed("refused", f"{self.node} is draining: it takes no new blocks")

    def _encoded(self, fingerprint: str, hashes: Sequence[bytes], records: Sequence) -> list[bytes]:
        encode = self.signer.encode
        return [b"" if r is None else encode(fingerprint, h, r) for h, r in zip(hashes, records)]

    def _usage(self) -> dict[str, int]:
        return {"used": self.store.dram.used, "capacity": self.store.dram.capacity}

    # --- the operations ---------------------------------------------------------------------------
    def reserve(self, fingerprint: Any, hashes: Sequence[Any], sizes: Any, *, tenant: str, peer: Any = "",
                repair: bool = False, writer: Any = None) -> Reserved:
        """Slots for blocks the caller then writes itself (granted to its engine `peer`)."""
        fingerprint, hashes = check_fingerprint(fingerprint, tenant), check_hashes(hashes)
        sizes = check_ints(sizes, "sizes", len(hashes), MAX_BLOCK_BYTES)
        peer = check_peer(peer, tenant)
        self._check_accepting()
        try:
            slots, updates = self.store.reserve(fingerprint, hashes, sizes, peer, repair=repair, writer=writer)
        except KVStoreError as exc:
            raise self.failure(exc) from None
        self._published(updates, False)
        return Reserved(slots, **self._usage())

    def commit(self, fingerprint: Any, tokens: Any, digests: Sequence[Any], *, tenant: str, sync: bool,
               hashes: Sequence[Any] | None = None, lease_size: int = 1, lease_count: int = 0, peer: Any = "",
               writer: Any = None) -> Sealed:
        """Seal what the caller wrote into its reserved (or leased: `hashes` name those blocks)
        slots; verified now when `sync`, else by the verifier after the answer. Leases slots for the
        caller's next put from free space (maybe fewer than asked, none while draining)."""
        fingerprint = check_fingerprint(fingerprint, tenant)
        tokens = check_ints(tokens, "tokens")
        digests = check_digests(digests, len(tokens))
        hashes = check_hashes(hashes) if hashes is not None else None
        lease_size, lease_count = check_ints([lease_size, lease_count], "lease size and count", 2, MAX_BLOCK_BYTES)
        peer = check_peer(peer, tenant)
        records: list = []
        fresh: list = []
        named: list = []
        try:
            errors, updates, leased = self.store.commit_and_lease(
                fingerprint, tokens, digests, lease_size=lease_size,
                lease_count=lease_count if self.accepting() else 0, records=records, fresh=fresh, verify=sync,
                hashes=hashes, peer=peer, writer=writer, named=named)
        except KVStoreError as exc:
            raise self.failure(exc) from None
        self._published(updates, sync)  # queued; published before the answer only when asked
        return Sealed(errors, self._encoded(fingerprint, named, records), sum(fresh), lease=leased,
                      lease_ttl=self.store.reservation_timeout, **self._usage())

    def begin_put(self, fingerprint: Any, hashes: Sequence[Any], sizes: Any, digests: Sequence[Any], *,
                  tenant: str, repair: bool = False) -> tuple[str, list[bytes], list[int], list[bytes], Reserved]:
        """The first half of a put whose bytes follow the request (the framed wire receives them
        straight into the slots): checks and slots. Then `finish_put`, or `abort` of its tokens."""
        fingerprint, hashes = check_fingerprint(fingerprint, tenant), check_hashes(hashes)
        sizes = check_ints(sizes, "sizes", len(hashes), MAX_BLOCK_BYTES)
        digests = check_digests(digests, len(hashes))
        self._check_accepting()
        try:
            slots, updates = self.store.reserve(fingerprint, hashes, sizes, repair=repair)
        except KVStoreError as exc:
            raise self.failure(exc) from None
        self._published(updates, False)
        return fingerprint, hashes, sizes, digests, Reserved(slots, **self._usage())

    def finish_put(self, fingerprint: str, hashes: list[bytes], slots: list[tuple[int, Slot | None]],
                   digests: list[bytes], *, sync: bool) -> Sealed:
        """Verify (now when `sync`) and seal what landed in `begin_put`'s slots."""
        errors, records, updates, stored = self.store.commit_reserved(fingerprint, hashes, slots, digests, sync)
        self._published(updates, sync)
        return Sealed(errors, self._encoded(fingerprint, hashes, records), stored, lease=[], lease_ttl=0.0,
                      **self._usage())

    def abort(self, tokens: Any) -> None:
        self.store.abort(check_ints(tokens, "tokens"))

    def lookup(self, fingerprint: Any, hashes: Sequence[Any], *, tenant: str) -> list[bytes]:
        """Where this node holds the blocks now: each one's sealed record, b"" where it holds none."""
        fingerprint, hashes = check_fingerprint(fingerprint, tenant), check_hashes(hashes)
        return self._encoded(fingerprint, hashes, self.store.records(fingerprint, hashes))

    def touch(self, fingerprint: Any, hashes: Sequence[Any], corrupt: Sequence[Any], *, tenant: str) -> None:
        """Blocks read (kept warm), and those a reader found corrupt (dropped)."""
        fingerprint = check_fingerprint(fingerprint, tenant)
        updates = self.store.touch(fingerprint, check_hashes(hashes), check_hashes(corrupt))
        self._published(updates, False)

    def remove(self, fingerprint: Any, hashes: Sequence[Any], *, tenant: str) -> Removed:
        """Drop the blocks; gone from etcd when it returns."""
        fingerprint = check_fingerprint(fingerprint, tenant)
        removed, updates = self.store.remove(fingerprint, check_hashes(hashes))
        return Removed(removed, self._published(updates, True))
