"""The host index: one mirror of the cluster's block index per host, held by the host's daemon and
asked by every client on the host (`Client(index="host")`, kvstore.index.host_mirror) over the
same-host control wire, instead of one mirror and one etcd watch in every process (a TP=8 engine
is nine of them).

The mirror starts at the first question (a daemon nobody asks keeps none) and follows the whole
cluster; until its first snapshot is in, answers say `loading` and `stale`. Answers carry `stale`
as the mirror has it, so a client never takes a stale host view for a current one. Records go out
as their nodes sealed them: each client checks the seals with its own secret (a tenant's client,
only its tenant's), as it does with its own mirror. A record a client teaches the index (`learn`,
a put's answer) is taken only for a registered node and with that node's seal under the cluster
secret (a tenant's records carry it too), so no process, a tenant's least of all, can plant
records the others would be sent to.

Questions (the `index` op, `q` names one; the block hashes follow the frame raw, `count` of them, at
most MAX_HASHES):
  match    {fp, hashes}            -> {length, stale, loading}: the leading blocks held anywhere
  prefix   {fp, hashes}            -> {lengths: {node: n}, stale}: per node, the leading blocks it holds
  lookup   {fp, hashes}            -> {records: [{node: sealed record (hex)}]}: every replica of each
  learn    {fp, node, hashes, records} -> {learned}: a put's answer (the sealed records), learned at
           once, as a client's own mirror does
  wait     {revision, timeout}      -> {reached}: whether the mirror applied that revision in time
  status   {}                      -> {revision, stale, loading, blocks (not for a tenant)}
  table    {}                      -> {salt_key} and, over SCM_RIGHTS, a read-only fd of the shared table
           (kvstore.index.shared_table) a worker probes for `match` itself; not for a tenant (it
           holds every tenant's blocks), not where the host cannot share one
"""
from __future__ import annotations

import functools
import struct
import threading
import time
from collections import OrderedDict
from typing import Callable

from ..errors import InvalidRecord, NotMirrored
from ..index import shared_table
from ..index.mirror import IndexMirror, in_scope
from ..index.shared_table import SharedTable
from ..index.signatures import RecordVerifier
from ..keys import HASH_BYTES
from .operations import OpFailed, check_fingerprint

MAX_HASHES = 1 << 16  # one question about at most this many blocks (a 1M-token prompt in 16-token blocks)
CHUNK = 4096  # hashes split per struct call (a layout per size up to this, cached)
MAX_WAIT_S = 10.0
START_WAIT_S = 0.5  # the first question waits this long for the mirror's first records, no more
NODES_WAIT_S = 2.0  # a question waits at most this long for the mirror's node records (a fresh mirror)
# A learned record of a replica whose deletion the watch applied this recently is not taken: the
# put's answer may have been overtaken by the block's removal, and nothing would unlist it again
# (a genuine put after that deletion is listed by its own event, milliseconds later).
RECENT_DELETE_S = 60.0
RECENT_DELETES = 200_000  # replicas remembered as recently deleted, at most (the oldest go first)


@functools.lru_cache(maxsize=64)
def _layout(count: int) -> struct.Struct:
    return struct.Struct(f"{HASH_BYTES}s" * count)


def split_hashes(raw: bytes) -> list[bytes]:
    """`raw` (whole hashes, back to back) as one bytes object per hash, in a few C calls."""
    count, out = len(raw) // HASH_BYTES, []
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        out += _layout(n).unpack_from(raw, start * HASH_BYTES)
    return out


class HostIndex:
    """See module docstring. `make_mirror` builds the (not yet started) mirror on first use;
    `verifier` (the cluster secret's) checks the node seal of every record a client teaches it."""

    def __init__(self, make_mirror: Callable[[], IndexMirror], timeout: float, verifier: RecordVerifier) -> None:
        self._make_mirror, self._timeout, self._verifier = make_mirror, timeout, verifier
        self._deleted: OrderedDict[tuple[str, bytes, str], float] = OrderedDict()  # replica -> when
        self._mirror: IndexMirror | None = None
        self._table: SharedTable | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._stopped = threading.Event()

    def mirror(self) -> IndexMirror:
        with self._lock:
            if self._closed:
                raise OpFailed("unavailable", "this node is stopping: its host index is closed")
            if self._mirror is None:  # served while it loads (and while etcd is away: stale)
                mirror = self._make_mirror()
                mirror.on_replica_removed(self._removed)
                table = SharedTable() if shared_table.supported() else None
                if table is not None:
                    mirror.share_presence(table.of_shard)
                try:
                    self._mirror = mirror.start(START_WAIT_S, keep_trying=True)
                except BaseException:
                    if table is not None:
                        table.close()
                    raise
                if table is not None:
                    self._table = table
                    threading.Thread(target=self._beat, args=(mirror, table), name="host-index-beat",
                                     daemon=True).start()
            mirror = self._mirror
        mirror.wait_begun(min(NODES_WAIT_S, self._timeout / 2))  # (at once, but for the first questions)
        return mirror

    def _beat(self, mirror: IndexMirror, table: SharedTable) -> None:
        """Stamp the shared table with the mirror's flags until the index closes: a worker trusts
        it only while the stamp is fresh."""
        while not self._stopped.wait(shared_table.BEAT_S) and not table.closed:
            table.beat(mirror.stale, mirror.loading)

    def table(self, tenant: str) -> tuple[dict, int]:
        """The reply to a `table` question and the descriptor that follows it."""
        if tenant:
            raise OpFailed("invalid", "index: the shared table holds every tenant's blocks: a tenant's client asks "
                                      "the daemon")
        mirror, table = self.mirror(), self._table
        if table is None:
            raise OpFailed("invalid", "index: this host shares no table (it needs Linux on x86-64)")
        if table.closed:
            raise OpFailed("unavailable", "index: the shared table was given up (see this node's log)")
        table.beat(mirror.stale, mirror.loading)
        try:
            fd = table.reader_fd()
        except OSError as exc:
            raise OpFailed("unavailable", f"index: the shared table could not be handed over: {exc}") from None
        return {"ok": True, "salt_key": table.salt_key.hex()}, fd

    def _removed(self, fingerprint: str, block_hash: bytes, node: str) -> None:
        """A watch event removed a replica (called under the mirror's lock: only take note)."""
        deleted, now = self._deleted, time.monotonic()
        deleted[(fingerprint, block_hash, node)] = now
        deleted.move_to_end((fingerprint, block_hash, node))
        while deleted and (len(deleted) > RECENT_DELETES or next(iter(deleted.values())) < now - RECENT_DELETE_S):
            deleted.popitem(last=False)

    def answer(self, request: dict, tenant: str, hashes: list[bytes]) -> dict:
        """The reply to one `index` question (OpFailed for a bad one)."""
        q = request.get("q")
        mirror = self.mirror()
        if q == "status":  # the cluster's block count is not a tenant's to know
            return {"ok": True, "revision": mirror.revision, "stale": mirror.stale, "loading": mirror.loading,
                    **({} if tenant else {"blocks": mirror.block_count})}
        if q == "wait":
            revision, timeout = request.get("revision"), request.get("timeout", self._timeout)
            if not isinstance(revision, int) or not isinstance(timeout, (int, float)) or revision < 0:
                raise OpFailed("invalid", "wait: {revision: int >= 0, timeout: seconds}")
            return {"ok": True, "reached": mirror.wait_for_revision(revision, min(max(0.0, timeout), MAX_WAIT_S))}
        fingerprint = check_fingerprint(request.get("fp"), tenant)
        try:
            if q == "match":
                length = None if self._table is None else self._table.prefix(in_scope(mirror.scope, fingerprint), hashes)
                if length is None or length < 0:  # (its mirror keeps no index of its own while the table lasts)
                    match = mirror.match(fingerprint, hashes)
                    return {"ok": True, "length": match.length, "stale": match.stale, "loading": match.loading}
                return {"ok": True, "length": length, "stale": mirror.stale, "loading": mirror.loading}
            if q == "prefix":
                stale = mirror.stale
                return {"ok": True, "lengths": {} if stale else mirror.node_prefix_lengths(fingerprint, hashes),
                        "stale": stale}
            if q == "lookup":
                return {"ok": True, "records": [{node: raw.hex() for node, raw in mirror.sealed(fingerprint, h).items()}
                                                for h in hashes]}
            if q == "learn":
                return {"ok": True, "learned": self._learn(mirror, fingerprint, hashes, request)}
        except NotMirrored as exc:
            raise OpFailed("invalid", str(exc)) from None
        raise OpFailed("invalid", f"index: unknown question {str(q)[:40]!r} (match, prefix, lookup, learn, wait, "
                                  "status)")

    def _learn(self, mirror: IndexMirror, fingerprint: str, hashes: list[bytes], request: dict) -> int:
        """A put's records, each taken only with its node's seal; how many were."""
        node, records = request.get("node"), request.get("records")
        if not isinstance(node, str) or not isinstance(records, list) or len(records) != len(hashes) or \
                not all(isinstance(r, str) for r in records):
            raise OpFailed("invalid", "learn: {node, records: one sealed record (hex) per hash}")
        if node not in mirror.nodes:
            return 0  # not a registered node (its records reach the index, if ever, through etcd)
        verifier = self._verifier
        try:
            sealed = [(h, bytes.fromhex(r)) for h, r in zip(hashes, records)]
        except ValueError:
            raise OpFailed("invalid", "learn: records in hex") from None
        taken = [(h, raw) for h, raw in sealed if verifier.check(fingerprint, h, node, raw)]
        # Under the mirror's question guard: a watch event about one of these replicas that comes
        # while we decide wins; the recent deletions cover those that came before.
        with mirror.asking(fingerprint, node, [h for h, _ in taken]) as since:
            cutoff = time.monotonic() - RECENT_DELETE_S
            taken = [(h, raw) for h, raw in taken if self._deleted.get((fingerprint, h, node), cutoff) <= cutoff]
            try:
                mirror.remember_many(fingerprint, node, taken, since)
            except (InvalidRecord, ValueError) as exc:
                raise OpFailed("invalid", f"learn: {exc}") from None
        return len(taken)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            mirror, self._mirror = self._mirror, None
        self._stopped.set()
        if self._table is not None:
            self._table.close()  # retired: its readers ask the daemon, which says it is stopping
        if mirror is not None:
            mirror.stop()
