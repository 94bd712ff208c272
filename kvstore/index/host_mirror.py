"""The block index as the host's daemon holds it (`Client(index="host")`): this process keeps only
the cluster's nodes and segments (an IndexMirror of no fingerprint: a few records) and asks the
host's one mirror (kvstore.daemon.host_index) about blocks over the same-host control wire, so
the host holds one copy of the index however many processes read it.

Answers carry the host mirror's `stale`, never hidden. Records come back as their nodes sealed
them and are checked here, with this client's secret, as its own mirror's would be. A put's
answer is told to the host index at once (every process on the host then sees the blocks, not only
this one); removals reach it by their etcd events. `match`, the question a scheduler asks per
request, is answered from the host's shared table (kvstore.index.shared_table) where the daemon
hands one out: a probe of shared memory, no round trip; a table that is retired, changing under
every try or no longer stamped by its daemon is not used, and the daemon is asked instead. When the host's daemon cannot be reached, this
client says so in one line and keeps a mirror of its own from then on: slower to start, never a
silent stale view.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from transfer.descriptor import host_id

from ..errors import (AccessDenied, AuthenticationFailed, ConnectionsExhausted, InvalidConfig, InvalidRequest,
                      KVStoreError, NodeRefused, NoStoreNodes)
from ..keys import HASH_BYTES, ModelFingerprint
from .mirror import IndexMirror, fingerprint_id, in_scope
from .sharded_mirror import open_mirror
from .records import BlockRecord, NodeRecord
from .shared_table import SharedTableView
from .signatures import RecordVerifier

log = logging.getLogger(__name__)
STATUS_EVERY_S = 0.5  # how long the host's `stale` is taken as known
CHUNK = 4096  # blocks per question (a longer prompt asks in several)
LOOKUP_CHUNK = 1024  # blocks per lookup: its records (~150 B per replica) stay far under a frame's limit
MAX_HOST_WAIT_S = 10.0  # the most a host waits for a revision on one question (its own bound)
CATCH_UP_S = 1.0  # how long a woken waiter lets the host catch up with what this process saw
TABLE_RETRY_S = 1.0  # after the host's table could not be had, how long its questions go over the socket


@dataclass(frozen=True)
class HostMatch:
    """Leading blocks of a prompt found by the host index (IndexMirror.Match's length and flags)."""

    length: int
    stale: bool
    loading: bool = False


def _joined_prefix(hashes: Sequence[bytes]) -> bytes:
    """The hashes up to the first that is not a block hash (never present: a prefix stops there),
    back to back, as a question sends them. The common case, all of them, is the one join the
    question needs anyway: lengths that only sum right (a 15- and a 17-byte "hash") are read as
    other hashes, which no block has."""
    raw = b"".join(hashes)
    if len(raw) == HASH_BYTES * len(hashes):
        return raw
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            return b"".join(hashes[:i])
    return raw


def host_daemon(nodes: dict[str, NodeRecord], here: str | None = None) -> str | None:
    """The daemon of this host whose index every client here asks: the first by name, not draining."""
    here = here or host_id()
    names = sorted(n for n, r in nodes.items() if r.host == here and not r.draining)
    return names[0] if names else None


class HostIndexMirror:
    """IndexMirror's questions answered by the host's daemon (see module docstring). `attach(ask)`
    before the first block question: `ask(node, message, attachments, timeout)` sends one control
    message (and the bytes that follow it) to a node of this host and returns its reply within
    `timeout` (None: the client's), raising what the wire raises."""

    def __init__(self, metadata_url: str, cluster: str = "default", *, timeout: float = 5.0,
                 verifier: RecordVerifier | None = None,
                 fingerprints: Iterable[ModelFingerprint | str] | None = None) -> None:
        # Nodes and segments only (over every shard of a sharded index: its revision moves with
        # every shard's changes, and a shard that is down does not take the nodes away).
        self.members = open_mirror(metadata_url, cluster, timeout=timeout, fingerprints=())
        self.url, self.layout, self.timeout = metadata_url, self.members.layout, timeout
        self.scope: frozenset[str] | None = None if fingerprints is None else \
            frozenset(fingerprint_id(f) for f in fingerprints)
        self.verifier = verifier
        self.refused_records = 0
        self.host: str | None = None  # the daemon asked
        self._ask: Callable[[str, dict, Sequence[bytes], float | None], dict] | None = None
        self._own: IndexMirror | None = None  # after the host failed: a mirror of this process's own
        self._lock = threading.Lock()
        self._table_lock = threading.Lock()  # (apart: a round trip for the table holds no fallback up)
        self._host_stale, self._status_at = False, float("-inf")
        self._caught_up = 0  # the last of this process's event revisions the host was seen to have applied
        self._open_table: Callable[[str], tuple[dict, int]] | None = None
        self._view: SharedTableView | None = None  # the host's shared table, mapped
        self._view_asked = float("-inf")
        self._no_table = False  # the host said it shares none with this client (a tenant's, or no x86-64)
        self.table_misses = 0  # matches the shared table could not answer (asked over the socket)
        self.use_table = True  # False: every match over the socket (a benchmark's comparison)

    # --- lifetime -------------------------------------------------------------------------------
    def start(self, wait: float | None = None) -> "HostIndexMirror":
        self.members.start(wait)
        self.host = host_daemon(self.members.nodes)
        if self.host is None:
            self.members.stop()
            raise InvalidConfig(f"index='host': no kvstore serve daemon of cluster {self.layout.cluster!r} runs on "
                                "this host (start one, or use index='own')")
        return self

    def attach(self, ask: Callable[[str, dict, Sequence[bytes], float | None], dict],
               open_table: Callable[[str], tuple[dict, int]] | None = None) -> None:
        """`open_table(node)`: that node's reply to a `table` question and the read-only descriptor
        of its shared table that came with it (the caller's to close), raising what the wire
        raises; None: every question goes over the socket."""
        self._ask, self._open_table = ask, open_table

    def stop(self) -> None:
        self._view = None  # (unmapped once no probe holds it)
        self.members.stop()
        if self._own is not None:
            self._own.stop()

    @property
    def own(self) -> IndexMirror | None:
        """The mirror this process fell back to (None while the host index answers)."""
        return self._own

    def _question(self, message: dict, raw: bytes | memoryview = b"", timeout: float | None = None) -> dict | None:
        """The host index's reply, or None once this client keeps its own mirror. The block hashes
        go `raw` (back to back) after the frame (hex in JSON cost milliseconds for a long prompt). A host that cannot
        be reached or says it cannot answer is left for good; a refusal of the question itself
        (a fingerprint not the caller's, a bad request) raises, as it would of any store call."""
        if self._own is not None:
            return None
        if self._ask is None or self.host is None:
            raise InvalidConfig("a host index mirror was asked before attach()")
        try:
            reply = self._ask(self.host, {"op": "index", **message, "count": len(raw) // HASH_BYTES},
                              [raw] if len(raw) else [], timeout)
        except (AccessDenied, AuthenticationFailed, ConnectionsExhausted):
            raise  # the caller's (a fingerprint or secret not its own), or a busy moment: not a dead host
        except (OSError, NoStoreNodes, NodeRefused) as exc:
            self._fall_back(exc)
            return None
        except InvalidRequest as exc:
            if "unknown op" not in str(exc):
                raise
            self._fall_back(exc)  # a daemon older than host indexes (a rolling upgrade)
            return None
        if "stale" in reply:  # the host's word on its view, as fresh as this answer
            self._host_stale, self._status_at = bool(reply["stale"]), time.monotonic()
        return reply

    def _table(self) -> SharedTableView | None:
        """The host's shared table while it is current, asked for again once it is retired."""
        view = self._view
        if not self.use_table:
            return None
        if view is not None and not view.retired:
            return view
        if self._open_table is None or self._no_table or self._own is not None or self.host is None or \
                time.monotonic() - self._view_asked < TABLE_RETRY_S:
            return None
        with self._table_lock:
            if self._view is not view:  # another thread got the new one meanwhile
                return self._view
            self._view, self._view_asked = None, time.monotonic()
            try:
                reply, fd = self._open_table(self.host)
            except InvalidRequest as exc:  # refused for good: a tenant's client, or no table on this host
                log.debug("the host index of %s shares no table with this client: %s", self.host, exc)
                self._no_table = True
                return None
            except (KVStoreError, OSError) as exc:  # asked again in a while; the socket answers meanwhile
                log.debug("the host index of %s did not hand its table over: %s", self.host, exc)
                return None
            try:
                self._view = SharedTableView(fd, bytes.fromhex(reply["salt_key"]))
            except OSError as exc:  # (out of descriptors or memory: asked again in a while)
                log.debug("the host index of %s: its table could not be mapped: %s", self.host, exc)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("the host index of %s handed over no usable table (%s): asking over its socket", self.host,
                            exc)
                self._no_table = True
            finally:
                os.close(fd)
            return self._view

    def _fall_back(self, why: Exception) -> None:
        with self._lock:
            if self._own is not None:
                return
            self._view = None
            log.warning("the host index of %s did not answer (%s: %s): this process keeps a mirror of its own from now "
                        "on (answers say stale until it has loaded)", self.host, type(why).__name__, why)
            self._own = open_mirror(self.url, self.layout.cluster, timeout=self.timeout, verifier=self.verifier,
                                    fingerprints=self.scope)
            # Served as soon as it began loading, and while etcd is away too: answers say loading
            # and stale until its snapshot is in.
            self._own.start(self.timeout, keep_trying=True)

    def _mirrored(self, fingerprint: ModelFingerprint | str) -> str:
        return in_scope(self.scope, fingerprint)

    # --- what this process keeps itself ---------------------------------------------------------
    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.members.nodes

    @property
    def segments(self) -> dict[str, str]:
        return self.members.segments

    @property
    def revision(self) -> int:
        return self.members.revision

    @property
    def resyncs(self) -> int:
        return self.members.resyncs

    @property
    def malformed(self) -> int:
        return self.members.malformed

    @property
    def loading(self) -> bool:
        return self.members.loading or (self._own is not None and self._own.loading)

    @property
    def stale(self) -> bool:
        """True while this process's or the host's view cannot be confirmed current."""
        if self.members.stale:
            return True
        if self._own is not None:
            return self._own.stale
        if time.monotonic() - self._status_at > STATUS_EVERY_S:
            self.status()  # (may leave the host: then the own mirror says)
        return self._own.stale if self._own is not None else self._host_stale

    def status(self) -> dict:
        reply = self._question({"q": "status"})
        if reply is None:
            return {"revision": self._own.revision, "stale": self._own.stale, "loading": self._own.loading,
                    "blocks": self._own.block_count}
        return reply

    @property
    def block_count(self) -> int:
        return int(self.status().get("blocks", 0))

    # --- block questions ------------------------------------------------------------------------
    # A question names at most CHUNK blocks (longer prompts go in several, in order): the reply of
    # a lookup stays far under a frame's limit, and the host splits them in one call each.
    def match(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]):
        fp = self._mirrored(fingerprint)
        view = self._table()
        if view is not None:
            probed = view.prefix(fp, hashes)
            if probed is not None:
                length, stale, loading = probed
                self._host_stale, self._status_at = stale, time.monotonic()  # the host's word, as fresh
                return HostMatch(length, stale or self.members.stale, loading)
            self.table_misses += 1
        raw = memoryview(_joined_prefix(hashes))
        length, stale, loading = 0, self.members.stale, False
        for start in range(0, len(raw) // HASH_BYTES, CHUNK):
            part = raw[start * HASH_BYTES : (start + CHUNK) * HASH_BYTES]
            reply = self._question({"q": "match", "fp": fp}, part)
            if reply is None:
                return self._own.match(fp, hashes)
            length += int(reply["length"])
            stale, loading = stale or bool(reply.get("stale")), loading or bool(reply.get("loading"))
            if int(reply["length"]) < len(part) // HASH_BYTES:
                break
        return HostMatch(length, stale, loading)

    def node_prefix_lengths(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per node, the leading blocks it holds itself."""
        fp, raw = self._mirrored(fingerprint), memoryview(_joined_prefix(hashes))
        lengths: dict[str, int] = {}
        alive: set[str] | None = None  # nodes that held every block so far
        for start in range(0, len(raw) // HASH_BYTES, CHUNK):
            part = raw[start * HASH_BYTES : (start + CHUNK) * HASH_BYTES]
            reply = self._question({"q": "prefix", "fp": fp}, part)
            if reply is None:
                return self._own.node_prefix_lengths(fp, hashes)
            got = {str(n): int(k) for n, k in reply["lengths"].items()}
            for node, k in got.items():
                if alive is None or node in alive:
                    lengths[node] = start + k
            alive = {n for n, k in got.items() if k == len(part) // HASH_BYTES and (alive is None or n in alive)}
            if not alive:
                break
        return lengths

    def contains(self, fingerprint: ModelFingerprint | str, block_hash: bytes) -> bool:
        return self.match(fingerprint, [block_hash]).length == 1

    def lookup(self, fingerprint: ModelFingerprint | str, block_hash: bytes,
               verifier: RecordVerifier | None = None) -> dict[str, BlockRecord]:
        return self.lookup_many(fingerprint, [block_hash], verifier)[0]

    def lookup_many(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes],
                    verifier: RecordVerifier | None = None) -> list[dict[str, BlockRecord]]:
        """Every replica of each block (a hash that is not a block hash: none); with a verifier
        (or this mirror's), those whose seal is not their node's dropped and counted."""
        fp = self._mirrored(fingerprint)
        found: list[dict[str, BlockRecord]] = [{} for _ in hashes]
        asked = [i for i, h in enumerate(hashes) if len(h) == HASH_BYTES]
        verifier = verifier or self.verifier
        for start in range(0, len(asked), LOOKUP_CHUNK):
            part = asked[start : start + LOOKUP_CHUNK]
            reply = self._question({"q": "lookup", "fp": fp}, b"".join(hashes[i] for i in part))
            if reply is None:
                return self._own.lookup_many(fp, hashes, verifier)
            for i, replicas in zip(part, reply["records"]):
                for node, hexed in replicas.items():
                    raw = bytes.fromhex(hexed)
                    if verifier is None or verifier.check(fp, bytes(hashes[i]), node, raw):
                        found[i][node] = BlockRecord.decode(raw)
                    else:
                        self.refused_records += 1
        return found

    # --- what a put or a remove learned ---------------------------------------------------------
    @contextlib.contextmanager
    def asking(self, fingerprint: ModelFingerprint | str, node: str, hashes: Sequence[bytes]) -> Iterator[int]:
        """IndexMirror.asking's face (the host index keeps no guard for questions out here: a
        record a put teaches it is one its node sealed and holds)."""
        if self._own is not None:
            with self._own.asking(fingerprint, node, hashes) as since:
                yield since
        else:
            yield 0

    def remember_many(self, fingerprint: ModelFingerprint | str, node: str,
                      blocks: Sequence[tuple[bytes, BlockRecord | bytes]], since: int | None = None) -> None:
        """A put's answer, told to the host index: every process on the host knows the blocks at
        once (it takes each only with its node's seal)."""
        fp = fingerprint_id(fingerprint)
        if (self.scope is not None and fp not in self.scope) or not blocks:
            return
        records = [(r.encode() if isinstance(r, BlockRecord) else bytes(r)).hex() for _, r in blocks]
        reply = self._question({"q": "learn", "fp": fp, "node": node, "records": records},
                               b"".join(h for h, _ in blocks))
        if reply is None:
            self._own.remember_many(fp, node, blocks, since)

    def remember(self, fingerprint: ModelFingerprint | str, block_hash: bytes, node: str,
                 record: BlockRecord | bytes) -> None:
        self.remember_many(fingerprint, node, [(block_hash, record)])

    def forget_many(self, fingerprint: ModelFingerprint | str, node: str, hashes: Sequence[bytes],
                    since: int | None = None) -> None:
        """Only this process's own mirror (after the host failed) forgets at once. The host index
        unlists a replica by its etcd delete event, never on one client's word: a forget arriving
        after a newer put of the same block would unlist it for every process on the host, and
        no later event would list it again (a remove waits for its deletion's revision instead)."""
        if self._own is not None:
            self._own.forget_many(fingerprint, node, hashes, since)

    # --- waiting --------------------------------------------------------------------------------
    def wait_for_revision(self, revision: int, timeout: float = 5.0) -> bool:
        """Whether the host's mirror (and this process's view of the nodes) applied `revision` in
        time. The host waits a little less than this call may take, so its "not yet" comes back
        as an answer, not as a lost connection."""
        deadline = time.monotonic() + timeout
        waited = max(0.0, min(timeout, MAX_HOST_WAIT_S))
        reply = self._question({"q": "wait", "revision": int(revision), "timeout": waited},
                               timeout=waited + self.timeout)
        reached = self._own.wait_for_revision(revision, timeout) if reply is None else bool(reply.get("reached"))
        return reached and self.members.wait_for_revision(revision, max(0.0, deadline - time.monotonic()))

    def wait_until(self, predicate: Callable[["HostIndexMirror"], bool], timeout: float = 5.0) -> bool:
        """Poll `predicate(self)` until it holds or the timeout passes (its questions go to the
        host). When it holds, the host has applied every change this process has seen first: a
        waiter woken by a new revision here then finds that change in the host's answers."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self):
                self._catch_up(min(CATCH_UP_S, max(0.0, deadline - time.monotonic())))
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _catch_up(self, timeout: float) -> None:
        """Let the host apply the last event this process applied (only an event's revision: a
        snapshot's may be another cluster's, which the host would never reach); best effort."""
        revision = self.members.event_revision
        if self._own is not None or revision <= self._caught_up:
            return
        try:
            reply = self._question({"q": "wait", "revision": revision, "timeout": timeout}, timeout=timeout + self.timeout)
        except (KVStoreError, OSError) as exc:
            log.debug("the host index did not catch up with revision %d: %s", revision, exc)
            return
        if reply is not None and reply.get("reached"):
            self._caught_up = revision

    def wait_loaded(self, timeout: float) -> bool:
        return self.members.wait_loaded(timeout)

    def wake(self) -> None:
        self.members.wake()

    def on_replica_removed(self, listener: Callable[[str, bytes, str], None]) -> None:
        raise InvalidConfig("a host index reports no removals to a client: a daemon's repairer keeps its own mirror")
