"""The mirror of a sharded index (kvstore.index.shards): one IndexMirror per shard behind
IndexMirror's face, each question sent to the shard its block hashes pick.

A prompt's blocks are spread over every shard, so a prefix question asks each shard about its
blocks (in prompt order) and the prefix ends at the first block any shard lacks. Nodes and their
descriptors are read from the first shard (every node registers on every shard). A shard that
cannot be reached answers as its mirror does (stale, from what it last had; nothing it never
loaded): the other shards' blocks are unaffected. `revision` is a change counter (the sum of the
shards' revisions): revisions of different etcd clusters do not compare.

`open_mirror(url, ...)` builds the mirror a metadata URL calls for: this one for several shards,
an IndexMirror for one etcd or memory://.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import InvalidRecord, MetadataUnavailable
from ..keys import ModelFingerprint
from ..metadata import shard_urls
from .mirror import IndexMirror, Match, in_scope
from .mirror_tables import Placement
from .records import BlockRecord, NodeRecord
from .shards import shard_of, split_by_shard
from .signatures import RecordVerifier
from .table import Presence

Fingerprint = ModelFingerprint | str
log = logging.getLogger(__name__)


def open_mirror(metadata_url: str, cluster: str = "default", **options) -> "IndexMirror | ShardedMirror":
    """A mirror (not started) of the index `metadata_url` names: sharded when it lists several
    etcd clusters separated by ';'. `options` as IndexMirror's."""
    if len(shard_urls(metadata_url)) > 1:
        return ShardedMirror(metadata_url, cluster, **options)
    return IndexMirror(metadata_url, cluster, **options)


def _since(since: dict | int | None, mirror: IndexMirror) -> int | None:
    """A `since` for one shard's mirror: from this mirror's `asking` (by shard), or one given for
    all (a host index's, whose view this mirror took over)."""
    return since.get(id(mirror)) if isinstance(since, dict) else since


class ShardedMatch(Match):
    """A Match found over several shards; `placements` gathered from each shard's on first use."""

    __slots__ = ("_parts",)

    def __init__(self, length: int, parts: list[tuple[np.ndarray, Match]], stale: bool, loading: bool) -> None:
        self.length, self.stale, self.loading = length, stale, loading
        self._parts = parts  # (positions in the prompt, that shard's Match), shard by shard
        self._placements: list[Placement] | None = None

    @property
    def placements(self) -> list[Placement]:
        if self._placements is None:
            out: list = [None] * self.length
            for positions, match in self._parts:
                for position, placement in zip(positions.tolist(), match.placements):
                    if position < self.length:
                        out[position] = placement
            self._placements = out
        return self._placements


class ShardedMirror:
    """See module docstring. Options as IndexMirror's; each shard's mirror gets them all."""

    def __init__(self, metadata_url: str, cluster: str = "default", *, stale_after: float = 3.0,
                 timeout: float = 5.0, verifier: RecordVerifier | None = None,
                 fingerprints: Iterable[Fingerprint] | None = None) -> None:
        self.url, self.timeout, self.verifier = metadata_url, timeout, verifier
        self.urls = shard_urls(metadata_url)
        fingerprints = None if fingerprints is None else list(fingerprints)
        count = len(self.urls)
        self.shards = [IndexMirror(url, cluster, stale_after=stale_after, timeout=timeout, verifier=verifier,
                                   fingerprints=fingerprints, place=(i, count)) for i, url in enumerate(self.urls)]
        self.layout, self.scope = self.shards[0].layout, self.shards[0].scope
        self.stale_cuts = 0  # prefixes that ended at a block of a shard whose mirror was stale (down, loading)

    # --- lifetime -----------------------------------------------------------------------------
    def start(self, wait: float | None = None, *, keep_trying: bool = False) -> "ShardedMirror":
        """Start every shard's mirror side by side, each waiting up to `wait` (default `timeout`)
        for its snapshot and checking its place in the map (ShardMapMismatch, at once). A shard
        that does not answer keeps trying: its blocks are misses until it does (`stale_cuts` counts
        the prefixes it cut short). MetadataUnavailable only when no shard answers, unless
        `keep_trying`."""
        failures: list[BaseException] = []

        def start(mirror: IndexMirror) -> None:
            try:
                mirror.start(wait, keep_trying=True)
            except BaseException as exc:  # noqa: BLE001 - raised below, once every shard has tried
                failures.append(exc)

        threads = [threading.Thread(target=start, args=(m,), daemon=True) for m in self.shards]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        begun = [m.wait_begun(0) for m in self.shards]
        if failures or (not any(begun) and not keep_trying):
            self.stop()
            if failures:
                raise failures[0]
            raise MetadataUnavailable(f"index mirror could not load a snapshot from any shard of {self.url}")
        for index, (url, ok) in enumerate(zip(self.urls, begun)):
            if not ok:
                log.warning("index shard %d (%s) did not answer: its blocks are misses until it does", index + 1, url)
        return self

    def stop(self) -> None:
        for mirror in self.shards:
            mirror.stop()

    def __enter__(self) -> "ShardedMirror":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def on_replica_removed(self, listener: Callable[[str, bytes, str], None]) -> None:
        for mirror in self.shards:
            mirror.on_replica_removed(listener)

    def share_presence(self, presence_of: Callable[[int], Presence]) -> None:
        for mirror in self.shards:
            mirror.share_presence(presence_of)

    def wait_begun(self, timeout: float) -> bool:
        """Until some shard has begun loading (its nodes are in): a shard that is down must not
        hold up every question for the others."""
        deadline = time.monotonic() + timeout
        while not any(m.wait_begun(0) for m in self.shards):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.shards[0].wait_begun(min(left, 0.005))
        return True

    def wait_loaded(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(m.wait_loaded(max(0.0, deadline - time.monotonic())) for m in self.shards)

    # --- state ----------------------------------------------------------------------------------
    @property
    def stale(self) -> bool:
        return any(m.stale for m in self.shards)

    @property
    def loading(self) -> bool:
        return any(m.loading for m in self.shards)

    @property
    def revision(self) -> int:
        return sum(m.revision for m in self.shards)

    def _home(self) -> IndexMirror:
        """The shard whose node records are read: every node registers on every shard, so the
        first current one (else the first that loaded, else the first) lists them all."""
        for mirror in self.shards:
            if not mirror.stale:
                return mirror
        return next((m for m in self.shards if m.wait_begun(0)), self.shards[0])

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self._home().nodes

    @property
    def segments(self) -> dict[str, str]:
        return self._home().segments

    @property
    def block_count(self) -> int:
        return sum(m.block_count for m in self.shards)

    @property
    def malformed(self) -> int:
        return sum(m.malformed for m in self.shards)

    @property
    def refused_records(self) -> int:
        return sum(m.refused_records for m in self.shards)

    @property
    def resyncs(self) -> int:
        return sum(m.resyncs for m in self.shards)

    # --- questions ------------------------------------------------------------------------------
    def _shard(self, block_hash: bytes) -> IndexMirror:
        return self.shards[shard_of(block_hash, len(self.shards))]

    def _parts(self, hashes: Sequence[bytes]) -> list[tuple[IndexMirror, np.ndarray, list[bytes]]]:
        return [(mirror, positions, own)
                for mirror, (positions, own) in zip(self.shards, split_by_shard(hashes, len(self.shards))) if len(positions)]

    def match(self, fingerprint: Fingerprint, hashes: Sequence[bytes]) -> ShardedMatch:
        """How many leading `hashes` are cached anywhere: each shard matches its own blocks in
        prompt order; the prefix ends at the first block a shard lacks."""
        in_scope(self.scope, fingerprint)
        length, parts, cut_by = len(hashes), [], None
        asked = self._parts(hashes)
        for mirror, positions, own in asked:
            found = mirror.match(fingerprint, own)
            parts.append((positions, found))
            if found.length < len(own) and int(positions[found.length]) < length:
                length, cut_by = int(positions[found.length]), mirror
        # Stale or loading only as far as the shards this answer rests on: those holding a block
        # of the prefix, and the one that ended it (a shard that is down does not taint the rest).
        used = [m for m, positions, _ in asked if int(positions[0]) < length or m is cut_by]
        stale = any(m.stale for m in used)
        if cut_by is not None and cut_by.stale:
            self.stale_cuts += 1
        return ShardedMatch(length, parts, stale, any(m.loading for m in used))

    def node_prefix_lengths(self, fingerprint: Fingerprint, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each node, how many leading blocks it holds itself: on each shard, how many of that
        shard's blocks it holds in a row (none where the shard does not list it), and the prefix
        ends at the first block of any shard it lacks."""
        in_scope(self.scope, fingerprint)
        parts = [(positions, own, mirror.node_prefix_lengths(fingerprint, own))
                 for mirror, positions, own in self._parts(hashes)]
        lengths: dict[str, int] = {}
        for node in {node for _, _, held in parts for node in held}:
            end = len(hashes)
            for positions, own, held in parts:
                count = held.get(node, 0)
                if count < len(own):
                    end = min(end, int(positions[count]))
            if end:
                lengths[node] = end
        return lengths

    def contains(self, fingerprint: Fingerprint, block_hash: bytes) -> bool:
        return self._shard(block_hash).contains(fingerprint, block_hash)

    def sealed(self, fingerprint: Fingerprint, block_hash: bytes) -> dict[str, bytes]:
        return self._shard(block_hash).sealed(fingerprint, block_hash)

    def lookup(self, fingerprint: Fingerprint, block_hash: bytes,
               verifier: RecordVerifier | None = None) -> dict[str, BlockRecord]:
        return self._shard(block_hash).lookup(fingerprint, block_hash, verifier)

    def lookup_many(self, fingerprint: Fingerprint, hashes: Sequence[bytes],
                    verifier: RecordVerifier | None = None) -> list[dict[str, BlockRecord]]:
        return [self.lookup(fingerprint, bytes(h), verifier) for h in hashes]

    @contextlib.contextmanager
    def asking(self, fingerprint: Fingerprint, node: str, hashes: Sequence[bytes]) -> Iterator[dict]:
        """IndexMirror.asking on each shard the blocks live on; yields the `since` of each (a dict
        by shard) for remember_many and forget_many."""
        with contextlib.ExitStack() as stack:
            since = {}
            for mirror, _, own in self._parts(hashes):
                since[id(mirror)] = stack.enter_context(mirror.asking(fingerprint, node, own))
            yield since

    def remember(self, fingerprint: Fingerprint, block_hash: bytes, node: str, record: BlockRecord | bytes) -> None:
        self._shard(block_hash).remember(fingerprint, block_hash, node, record)

    def remember_many(self, fingerprint: Fingerprint, node: str, blocks: Sequence[tuple[bytes, BlockRecord | bytes]],
                      since: dict | int | None = None) -> None:
        """As IndexMirror's, shard by shard; InvalidRecord once every shard has learned its valid ones."""
        records = {bytes(h): r for h, r in blocks}
        bad = None
        for mirror, _, own in self._parts([h for h, _ in blocks]):
            try:
                mirror.remember_many(fingerprint, node, [(h, records[bytes(h)]) for h in own], _since(since, mirror))
            except InvalidRecord as exc:
                bad = exc
        if bad is not None:
            raise bad

    def forget_many(self, fingerprint: Fingerprint, node: str, hashes: Sequence[bytes],
                    since: dict | int | None = None) -> None:
        for mirror, _, own in self._parts(hashes):
            mirror.forget_many(fingerprint, node, own, _since(since, mirror))

    # --- waiting --------------------------------------------------------------------------------
    def wait_for_revision(self, revision: int, timeout: float = 5.0) -> bool:
        """Until the change counter reaches `revision` (a sharded publish returns 0: at once)."""
        return self.wait_until(lambda m: m.revision >= revision, timeout)

    def wake(self) -> None:
        for mirror in self.shards:
            mirror.wake()

    def wait_until(self, predicate: Callable[["ShardedMirror"], bool], timeout: float = 5.0) -> bool:
        """Until `predicate(self)` holds, checked after each change of any shard (at most every
        5 ms apart), or the timeout passes."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.shards[0].wait_until(lambda _: False, min(left, 0.005))
