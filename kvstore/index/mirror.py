"""The block index mirror: a watch-fed, in-memory copy of a cluster's nodes, segments and block
records, answering "how many leading blocks of this prompt are cached, and where" without touching
the network.

It loads a snapshot at one revision (nodes and segments first, then the block records in many
small ranges read in parallel, see index_load), then follows a watch from the next revision. The
first load is served while it fills: answers say `loading=True` and `stale=True` and only ever
hold blocks that were in the index at the snapshot's revision. After any disconnect or compaction
it resumes its watch from the revision after the last one it applied (every change since arrives
as events), and only where etcd has compacted that history away (or before the first snapshot was
complete) loads a fresh snapshot beside the old one and swaps it in whole, so it never holds a
half-old view. While it cannot reach the metadata service for longer than `stale_after` seconds, every
answer says `stale=True`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..aio import bounded, quiet, shared_loop
from ..errors import (InvalidRecord, KVStoreError, MetadataError, MetadataUnavailable, NotMirrored, ShardMapMismatch,
                      WatchCompacted)
from ..keys import ModelFingerprint
from ..metadata import Metadata, Page, WatchEvent, check_metadata_url, open_metadata, prefix_end, shard_urls
from ..outage_log import OutageLog
from .mirror_tables import MirrorTables, Placement, Snapshot, node_prefix_lengths
from .records import BlockRecord, Layout, NodeRecord
from .shards import check_place
from .signatures import RecordVerifier
from .snapshot import load_prefix
from .table import NO_IDS, Presence

log = logging.getLogger(__name__)
REFUSED_LOG_S = 30.0  # records failing their seal: a line at the first, then at most this often


class Match:
    """Leading blocks of a prompt found in the index; `placements` is built on first use."""

    __slots__ = ("length", "stale", "loading", "_ids", "_all", "_placements")

    def __init__(self, ids: np.ndarray, placements: list[Placement], stale: bool, loading: bool = False) -> None:
        self.length, self.stale, self.loading = len(ids), stale, loading
        self._ids, self._all = ids, placements
        self._placements: list[Placement] | None = None

    @property
    def placements(self) -> list[Placement]:
        if self._placements is None:
            every = self._all
            self._placements = [every[i] for i in self._ids.tolist()]
        return self._placements

    @property
    def locations(self) -> list[tuple[tuple[str, str], ...]]:
        return [p.locations for p in self.placements]

    def __repr__(self) -> str:
        return f"Match(length={self.length}, stale={self.stale}, loading={self.loading})"


def fingerprint_id(fingerprint: ModelFingerprint | str) -> str:
    """The index's name of a fingerprint (its digest)."""
    return fingerprint.digest if isinstance(fingerprint, ModelFingerprint) else fingerprint


def in_scope(scope: frozenset[str] | None, fingerprint: ModelFingerprint | str) -> str:
    """The fingerprint's index id; NotMirrored when it is outside a mirror's `scope` (None: all)."""
    fp = fingerprint_id(fingerprint)
    if scope is not None and fp not in scope:
        raise NotMirrored(f"this index mirror holds {len(scope)} fingerprint(s) only (fingerprints=...), "
                          f"not {fp[:80]!r}: mirror it too, or use a mirror of the whole cluster")
    return fp


async def _reap(tasks: set[asyncio.Task], rounds: int = 3) -> None:
    """Cancel tasks and let them finish (bounded: one that swallowed its cancel is cancelled again),
    then collect their outcomes, so asyncio does not log a failure not raised as "never retrieved"
    (the watch and the health check both fail when the service goes away)."""
    for _ in range(rounds):
        pending = {t for t in tasks if not t.done()}
        if not pending:
            break
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.5)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()


class IndexMirror:
    """Mirror of one cluster's index, kept current by a task on the shared background loop."""

    def __init__(self, metadata_url: str, cluster: str = "default", *, stale_after: float = 3.0,
                 timeout: float = 5.0, verifier: RecordVerifier | None = None,
                 fingerprints: Iterable[ModelFingerprint | str] | None = None, place: tuple[int, int] = (0, 1)) -> None:
        check_metadata_url(metadata_url)  # a typo fails here, at once, not after the first load's timeout
        if len(shard_urls(metadata_url)) > 1:
            raise ValueError(f"{metadata_url!r} names several index shards: kvstore.index.open_mirror mirrors them")
        self.url, self.layout = metadata_url, Layout(cluster)
        # (index, count) in a sharded index's map, checked at every connect (kvstore.index.shards)
        self.place, self.refused = place, None
        # A scoped mirror (a host whose engines serve a few models) loads and keeps the blocks of
        # these fingerprints only: its memory and its load time follow them, not the cluster. A
        # question about any other fingerprint raises NotMirrored instead of answering "none".
        self.scope: frozenset[str] | None = None if fingerprints is None else \
            frozenset(fingerprint_id(f) for f in fingerprints)
        self.stale_after, self.timeout = stale_after, timeout
        self.tables = MirrorTables(self.layout)  # node numbers, placements, applying changes
        self._root, self._blocks_prefix = self.tables.root, self.tables.blocks_prefix
        self._snapshot = Snapshot()
        self._fresh: Snapshot | None = None  # the snapshot being loaded
        self._revision = 0
        # Who asked a node about blocks (`asking`) learns from its answer only what no watch event
        # that arrived meanwhile has settled: the open questions (fingerprint, node, hashes), the
        # revision of the last event on each replica they ask about, and where the current and the
        # loading snapshot began. All under _apply_lock.
        self._questions: list[tuple[str, str, frozenset[bytes]]] = []
        self._event_revisions: dict[tuple[str, bytes, str], int] = {}
        self._applied = 0  # the last revision applied
        self.event_revision = 0  # the revision of the last watch event applied (0: none yet)
        self._keep_trying = False  # started with keep_trying: failures before the first load are said too
        self._base = 0  # the revision the current snapshot was loaded at
        self._fresh_base = 0  # the revision the snapshot being loaded is read at
        self._last_ok = float("-inf")
        self._connected = False
        self._loading = False
        self._changed = threading.Condition()
        # While etcd is down the follower retries every second: one line, then one every 30 s.
        self._outage = OutageLog(log, f"index mirror lost {metadata_url} (answers are stale until it reloads)")
        self._apply_lock = threading.Lock()  # watch events, pages and remember() edit the same tables
        self._begun = threading.Event()
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._future = None
        self._stopping: asyncio.Event | None = None
        self.resyncs = 0  # complete snapshots loaded (the first included)
        self.resumes = 0  # watches resumed from the last applied revision after a disconnect
        self._reload = False  # a watch said its history was compacted: the next connection loads a snapshot
        # Records `lookup` dropped because their seal was not their node's (kvstore.index.signatures);
        # `verifier` checks every lookup that brings none of its own.
        self.verifier = verifier
        self.refused_records = 0
        self._refused_said = float("-inf")
        self._removal_listeners: list[Callable[[str, bytes, str], None]] = []
        self._presence: Presence | None = None

    # --- lifetime -----------------------------------------------------------------------------
    def start(self, wait: float | None = None, *, keep_trying: bool = False) -> "IndexMirror":
        """Start following; wait (default `timeout`) for the first snapshot. A snapshot still
        loading by then is served as it fills (`loading`); no connection: MetadataUnavailable,
        unless `keep_trying` (then it answers stale, and empty, until it connects). An etcd that
        records another place in a shard map than this mirror's: ShardMapMismatch, either way."""
        self._keep_trying = keep_trying
        self._future = asyncio.run_coroutine_threadsafe(self._follow(), shared_loop())
        deadline = time.monotonic() + (self.timeout if wait is None else wait)
        begun = self._begun.wait(max(0.0, deadline - time.monotonic()))  # (set on a refusal too)
        if self.refused is not None:
            self.stop()
            raise self.refused
        if not begun and not keep_trying:
            self.stop()
            raise MetadataUnavailable(f"index mirror could not load a snapshot from {self.url}")
        self._synced.wait(max(0.0, deadline - time.monotonic()))
        return self

    def on_replica_removed(self, listener: Callable[[str, bytes, str], None]) -> None:
        """Call `listener(fingerprint, block_hash, node)` for every replica record a watch event
        removes (an eviction, a removal, the end of a node's lease). It runs on the watch's thread
        with the mirror's tables locked: it may only take note. A snapshot reload calls nothing
        (`resyncs` counts those)."""
        self._removal_listeners.append(listener)

    def share_presence(self, presence_of: Callable[[int], Presence]) -> None:
        """Tell `presence_of(this shard's number)` the current snapshot's blocks, then each that
        appears or goes, and each snapshot swapped in (kvstore.index.shared_table)."""
        with self._apply_lock:  # (before start: its snapshots keep no match() index from then on)
            self._presence, self._snapshot = presence_of(self.place[0]), Snapshot(indexed=False)
            self._snapshot.share(self._presence)

    def _make_current(self, snap: Snapshot) -> None:  # (the caller holds _apply_lock)
        if snap is not self._snapshot:
            self._snapshot.share(None)
            self._snapshot = snap
            snap.share(self._presence)

    def wait_begun(self, timeout: float) -> bool:
        """Block until the first snapshot has begun loading (the nodes and segments are in)."""
        return self._begun.wait(timeout)

    def wait_loaded(self, timeout: float) -> bool:
        """Block until a complete snapshot is in place (tests, benchmarks, callers that must not guess)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._synced.is_set() and not self._loading, timeout)

    def stop(self) -> None:
        self._stop.set()
        shared_loop().call_soon_threadsafe(self._wake)
        if self._future is not None:
            try:
                self._future.result(self.timeout + 2)
            except Exception as exc:  # noqa: BLE001 - stopping: report, do not raise
                log.debug("index mirror ended with %r", exc)

    def _wake(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    def __enter__(self) -> "IndexMirror":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- queries (any thread, no I/O) ------------------------------------------------------------
    @property
    def stale(self) -> bool:
        """True while the mirror cannot confirm it is current (loading, not connected, or silent too long)."""
        return self._loading or not self._connected or time.monotonic() - self._last_ok > self.stale_after

    @property
    def loading(self) -> bool:
        """True while a snapshot is being read (answers may miss blocks that are in the index)."""
        return self._loading

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return dict(self._snapshot.nodes)

    @property
    def segments(self) -> dict[str, str]:
        return dict(self._snapshot.segments)

    @property
    def block_count(self) -> int:
        return self._snapshot.block_count

    @property
    def malformed(self) -> int:
        """Index entries ignored as malformed."""
        return self.tables.malformed

    def _mirrored(self, fingerprint: ModelFingerprint | str) -> str:
        return in_scope(self.scope, fingerprint)

    def match(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]) -> Match:
        """How many leading `hashes` are cached anywhere, and where each of them is."""
        loading = self._loading
        return Match(self._prefix_ids(fingerprint, hashes), self.tables.placements, self.stale, loading)

    def _prefix_ids(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]) -> np.ndarray:
        table = self._snapshot.blocks.get(self._mirrored(fingerprint))
        if table is None or not hashes:
            return NO_IDS
        return table.prefix(hashes, self.tables.placement_id)  # native, also for a few blocks

    def node_prefix_lengths(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each node, how many leading blocks it holds itself (the conductor's input)."""
        return node_prefix_lengths(self._prefix_ids(fingerprint, hashes), self.tables.placements)

    def contains(self, fingerprint: ModelFingerprint | str, block_hash: bytes) -> bool:
        """Whether any node holds the block (no record decoding)."""
        table = self._snapshot.blocks.get(self._mirrored(fingerprint))
        return table is not None and block_hash in table.records

    def sealed(self, fingerprint: ModelFingerprint | str, block_hash: bytes) -> dict[str, bytes]:
        """Every replica of one block as its node sealed it: node -> encoded record, unchecked (what
        a host index hands its clients, who check the seals themselves)."""
        table = self._snapshot.blocks.get(self._mirrored(fingerprint))
        entry = None if table is None else table.records.get(block_hash)
        if entry is None:
            return {}
        node_of = self.tables.node_of
        return {node_of(r): bytes(r[2:]) for r in (entry if isinstance(entry, tuple) else (entry,))}

    def lookup_many(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes],
                    verifier: RecordVerifier | None = None) -> list[dict[str, BlockRecord]]:
        """`lookup` of each block (one question to a host index; here, a loop)."""
        return [self.lookup(fingerprint, bytes(h), verifier) for h in hashes]

    def lookup(self, fingerprint: ModelFingerprint | str, block_hash: bytes,
               verifier: RecordVerifier | None = None) -> dict[str, BlockRecord]:
        """Every replica of one block: node -> record. With a `verifier` (or the mirror's own), only
        the records whose seal is their node's: the others are dropped and counted
        (`refused_records`). Whoever reads bytes by a record passes one; who only counts or
        routes need not (a forged record costs them a miss at most)."""
        fp = self._mirrored(fingerprint)
        replicas, verifier = self.sealed(fp, block_hash), verifier or self.verifier
        found = {}
        for node, raw in replicas.items():
            if verifier is None or verifier.check(fp, bytes(block_hash), node, raw):
                found[node] = BlockRecord.decode(raw)
            else:
                self._refused(fp, block_hash, node)
        return found

    def _refused(self, fingerprint: str, block_hash: bytes, node: str) -> None:
        self.refused_records += 1
        now = time.monotonic()
        if now - self._refused_said >= REFUSED_LOG_S:
            self._refused_said = now
            log.warning("dropped %d block record(s) whose seal is not their node's (the latest: block %s of %s on "
                        "%s): written into the index by someone without the secret, or by a node of another cluster "
                        "secret or tenants file; reads of those blocks miss", self.refused_records,
                        bytes(block_hash).hex()[:16], fingerprint[:80], node)

    @contextlib.contextmanager
    def asking(self, fingerprint: ModelFingerprint | str, node: str, hashes: Sequence[bytes]) -> Iterator[int]:
        """Around a question to `node` about these blocks whose answer the caller passes to
        `remember_many` or `forget_many`: yields the `since` for them, so that a watch event about one
        of these replicas that arrives while the question is out wins over the answer."""
        question = (fingerprint_id(fingerprint), node, frozenset(map(bytes, hashes)))
        with self._apply_lock:
            # Every event up to the loading snapshot's revision was in etcd before this question.
            since = max(self._applied, self._fresh_base if self._fresh is not None else 0)
            self._questions.append(question)
        try:
            yield since
        finally:
            with self._apply_lock:
                self._questions.remove(question)
                for replica in [r for r in self._event_revisions if not self._asked(r)]:
                    del self._event_revisions[replica]

    def _asked(self, replica: tuple[str, bytes, str]) -> bool:
        fingerprint, block_hash, node = replica
        return any(fp == fingerprint and n == node and block_hash in hashes for fp, n, hashes in self._questions)

    def remember(self, fingerprint: ModelFingerprint | str, block_hash: bytes, node: str,
                 record: BlockRecord | bytes) -> None:
        """Learn one replica now, as its watch 'put' event would (no `since`: tests and tools). The
        record goes in as its node sealed it (a reply's, byte for byte what the watch will echo); one
        without a seal is listed but fails every `lookup` that checks seals."""
        self.remember_many(fingerprint, node, [(block_hash, record)])

    def remember_many(self, fingerprint: ModelFingerprint | str, node: str,
                      blocks: Sequence[tuple[bytes, BlockRecord | bytes]], since: int | None = None) -> None:
        """`remember` for many blocks of one node under one lock; InvalidRecord (after learning the
        valid ones) if any record is malformed. `since` (from `asking`): skip blocks that a watch event
        arriving while the question was out has settled."""
        self._learn(fingerprint, node, "put", [(h, r.encode() if isinstance(r, BlockRecord) else bytes(r))
                                               for h, r in blocks], since)

    def forget_many(self, fingerprint: ModelFingerprint | str, node: str, hashes: Sequence[bytes],
                    since: int | None = None) -> None:
        """Drop `node`'s replica of each block now, as its watch 'delete' event would (a reader that
        found the node no longer holds them); `since` as for `remember_many`."""
        self._learn(fingerprint, node, "delete", [(h, b"") for h in hashes], since)

    def _learn(self, fingerprint: ModelFingerprint | str, node: str, kind: str,
               blocks: list[tuple[bytes, bytes]], since: int | None = None) -> None:
        fp, bad = fingerprint_id(fingerprint), None
        if self.scope is not None and fp not in self.scope:
            return  # not kept here (a put's answer about another model)
        with self._apply_lock:
            snaps = list({id(s): s for s in (self._snapshot, self._fresh) if s is not None}.values())
            if since is not None:  # a snapshot read at a revision after `since` folded in news unseen
                snaps = [s for s in snaps if not (s is self._fresh and since < self._fresh_base)
                         and not (s is self._snapshot and since < self._base)]
            for block_hash, value in blocks:
                block_hash = bytes(block_hash)
                # An event about this replica arrived while the question was out: it wins.
                news = since is not None and self._event_revisions.get((fp, block_hash, node), 0) > since
                try:
                    for snap in snaps:
                        if not (news and snap is self._snapshot):
                            self.tables.apply_block(snap, kind, fp, block_hash, node, value)
                except (InvalidRecord, ValueError) as exc:
                    bad = exc if isinstance(exc, InvalidRecord) else InvalidRecord(str(exc))
        with self._changed:
            self._changed.notify_all()
        if bad is not None:
            raise bad

    def wait_for_revision(self, revision: int, timeout: float = 5.0) -> bool:
        """Block until the mirror has applied every change up to `revision` (tests, benchmarks).
        Only changes under this cluster's root reach the mirror, while etcd counts revisions
        across the whole store: wait for a revision one of them carries (what a publish returns),
        not that of a later read, which another cluster's writes may have moved past every
        revision this mirror will see (until its next change or resync)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._revision >= revision, timeout)

    def wake(self) -> None:
        """Wake every wait_until, whose predicate may hold for a reason outside the index."""
        with self._changed:
            self._changed.notify_all()

    def wait_until(self, predicate: Callable[["IndexMirror"], bool], timeout: float = 5.0) -> bool:
        """Block until `predicate(self)` holds after some update, or the timeout passes. The
        predicate sees whole watch batches (it runs under the apply lock: it must not call what
        takes that lock, such as asking or remember)."""
        def holds() -> bool:
            with self._apply_lock:
                return predicate(self)

        with self._changed:
            return self._changed.wait_for(holds, timeout)

    # --- the follower loop ----------------------------------------------------------------------
    async def _follow(self) -> None:
        self._stopping = asyncio.Event()
        if self._stop.is_set():
            return
        backoff = 0.1
        while not self._stop.is_set():
            metadata = open_metadata(self.url, timeout=self.timeout)
            try:
                await self._sync_and_watch(metadata)
                backoff = 0.1
            except (KVStoreError, OSError) as exc:
                if isinstance(exc, ShardMapMismatch):  # start() raises it; a running mirror answers stale
                    self.refused = exc
                    self._begun.set()
                if isinstance(exc, WatchCompacted):
                    self._reload = True  # the history after our revision is gone: only a snapshot will do
                if self._begun.is_set() or self._keep_trying:  # else start() says it (or its caller)
                    self._outage.failed(exc)
            finally:
                with self._changed:  # a waiter on `stale` wakes now, not at its timeout
                    self._connected = False
                    self._changed.notify_all()
                with self._apply_lock:
                    self._fresh = None
                try:
                    await asyncio.wait_for(metadata.close(), self.timeout)
                except (asyncio.TimeoutError, KVStoreError):
                    pass
            if not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._stopping.wait(), backoff)
                except asyncio.TimeoutError:
                    pass
                backoff = min(backoff * 2, 1.0)

    async def _load_snapshot(self, metadata: Metadata) -> tuple[Snapshot, int]:
        """Nodes and segments, then every block record, all at the revision of the first read."""
        nodes_prefix, segments_prefix = self._root + b"nodes/", self._root + b"segments/"
        nodes = await metadata.range_page(nodes_prefix, prefix_end(nodes_prefix), timeout=self.timeout)
        revision = nodes.revision
        segments = await metadata.range_page(segments_prefix, prefix_end(segments_prefix), revision=revision,
                                             timeout=self.timeout)
        snap = Snapshot(self._presence is None)
        with self._apply_lock:
            for page in (nodes, segments):
                self.tables.apply_slowly(snap, page.keys, page.values)
            self._fresh, self._fresh_base = snap, revision
            if not self._synced.is_set():  # nothing better to answer from: serve it as it fills
                self._make_current(snap)
            self._loading = True
        self._begun.set()

        def take(page: Page) -> None:
            with self._apply_lock:
                self.tables.load_page(snap, page)

        if self.scope is None:
            await load_prefix(metadata, self._blocks_prefix, revision, take, timeout=self.timeout)
        else:  # one range per fingerprint, all at the same revision
            for fp in sorted(self.scope):
                await load_prefix(metadata, self._blocks_prefix + fp.encode() + b"/", revision, take,
                                  timeout=self.timeout)
        return snap, revision

    async def _sync_and_watch(self, metadata: Metadata) -> None:
        await check_place(metadata, self.layout, *self.place, self.url, claim=False)
        watch = await self._resume(metadata)
        if watch is None:
            watch = await self._sync(metadata)
            if watch is None:
                return  # stopped while loading
        else:
            with self._changed:
                self._connected, self._last_ok = True, time.monotonic()
                self.resumes += 1
                self._changed.notify_all()
            self._outage.recovered()
        events = quiet(asyncio.create_task(self._consume(watch)))
        health = quiet(asyncio.create_task(self._ping(metadata)))
        stopper = quiet(asyncio.create_task(self._stopping.wait()))
        try:
            done, _ = await asyncio.wait({events, health, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            await _reap({events, health, stopper})
            await watch.cancel()

    async def _resume(self, metadata: Metadata):
        """After a disconnect, the watch again from the revision after the last one applied: every
        change since comes as events, the view stays whole and current, and nothing is read again.
        None (load a snapshot instead) before the first complete snapshot, or when etcd has
        compacted that history away."""
        with self._apply_lock:
            if self._reload or not self._synced.is_set() or self._loading or self._fresh is not None \
                    or not self._applied:
                return None
            since = self._applied
        try:
            watch = await metadata.watch(self._root, start_revision=since + 1)
        except WatchCompacted as exc:
            log.info("index mirror cannot resume from revision %d (%s): reloading a snapshot", since + 1, exc)
            return None
        log.info("index mirror resumed its watch from revision %d", since + 1)
        return watch

    async def _sync(self, metadata: Metadata):
        """A whole snapshot loaded beside the current view and swapped in, and the watch from the
        revision after it (None: stopped meanwhile)."""
        loading = quiet(asyncio.ensure_future(self._load_snapshot(metadata)))
        stopper = quiet(asyncio.ensure_future(self._stopping.wait()))
        try:
            await asyncio.wait({loading, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not loading.done():
                loading.cancel()
        if not loading.done() or loading.cancelled():
            return None
        snapshot, revision = loading.result()
        watch = await metadata.watch(self._root, start_revision=revision + 1)
        with self._changed:
            with self._apply_lock:
                self._make_current(snapshot)
                self._fresh = None
                self._applied = self._base = revision
            self._revision, self._loading = revision, False
            self._connected, self._last_ok = True, time.monotonic()
            self.resyncs += 1
            self._reload = False
            self._changed.notify_all()
        self._synced.set()
        self._outage.recovered()
        return watch

    async def _consume(self, watch) -> None:
        async for events in watch.batches():
            self._on_events(events)
        raise MetadataUnavailable("watch ended")

    def _on_events(self, events: list[WatchEvent]) -> None:
        """Apply whole revisions, then announce the last: a transaction publishes many blocks as
        one revision, and a waiter woken at its first event read the rest as missing."""
        with self._apply_lock:
            for event in events:
                self._on_event(event)
        with self._changed:
            self._revision = max(self._revision, events[-1].revision)
            self.event_revision = max(self.event_revision, events[-1].revision)
            self._last_ok = time.monotonic()
            self._changed.notify_all()

    def _on_event(self, event: WatchEvent) -> None:
        """One event into the current snapshot (the caller holds _apply_lock)."""
        if self.scope is not None and event.key.startswith(self._blocks_prefix) and \
                event.key[len(self._blocks_prefix):].split(b"/", 1)[0].decode(errors="replace") not in self.scope:
            self._applied = max(self._applied, event.revision)  # another model's block: not kept here
            return
        try:
            replica = self.tables.apply(self._snapshot, event.kind, event.key, event.value)
        except (InvalidRecord, ValueError, UnicodeDecodeError) as exc:
            log.warning("ignoring malformed index event %r: %s", event.key[:200], exc)
            replica = None
        self._applied = max(self._applied, event.revision)
        if replica is not None and self._questions and self._asked(replica):
            self._event_revisions[replica] = event.revision
        if replica is not None and event.kind == "delete":
            for listener in self._removal_listeners:
                try:
                    listener(*replica)
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the watch
                    log.exception("a replica-removal listener failed")

    async def _ping(self, metadata: Metadata) -> None:
        """Prove the service is still there while the watch is quiet."""
        probe = self._root + b"health"
        while True:
            await asyncio.sleep(self.stale_after / 3)
            try:
                # Bounded by the handle (2 x timeout, moving between etcd endpoints); answers turn
                # stale after `stale_after` without an answer meanwhile, as `stale` says.
                await bounded(metadata.get(probe), 2 * self.timeout + 1)
            except (MetadataError, asyncio.TimeoutError) as exc:
                raise MetadataUnavailable(f"health check failed: {exc}") from exc
            self._last_ok = time.monotonic()
