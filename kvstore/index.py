"""The block index mirror: a watch-fed, in-memory copy of a cluster's nodes, segments and block
records, answering "how many leading blocks of this prompt are cached, and where" without touching
the network.

It loads a snapshot (a range at one revision), then follows a watch from the next revision. After
any disconnect or compaction it loads a fresh snapshot and swaps it in whole, so it never holds a
half-old view. While it cannot reach the metadata service for longer than `stale_after` seconds,
every answer says `stale=True`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from .aio import shared_loop
from .errors import InvalidRecord, KVStoreError, MetadataError, MetadataUnavailable
from .keys import ModelFingerprint
from .layout import TIERS, BlockRecord, Layout, NodeRecord
from .metadata import KeyValue, Metadata, WatchEvent, open_metadata

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one block is held: (node, tier) per replica. Shared by every block placed alike."""

    locations: tuple[tuple[str, str], ...]
    nodes: frozenset[str]


@dataclass(frozen=True, slots=True)
class Match:
    """Leading blocks of a prompt found in the index."""

    length: int
    placements: list[Placement]
    stale: bool

    @property
    def locations(self) -> list[tuple[tuple[str, str], ...]]:
        return [p.locations for p in self.placements]


class _Snapshot:
    """Everything the mirror knows; replaced whole on resync."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.segments: dict[str, str] = {}
        # fingerprint -> block hash -> (placement, record or tuple of records). A record is the
        # 26-byte BlockRecord prefixed with the owner's node number (u16): ~210 bytes per block.
        self.blocks: dict[str, dict[bytes, tuple[Placement, bytes | tuple[bytes, ...]]]] = {}
        self.block_count = 0


def _fingerprint_id(fingerprint: ModelFingerprint | str) -> str:
    return fingerprint.digest if isinstance(fingerprint, ModelFingerprint) else fingerprint


class IndexMirror:
    """Mirror of one cluster's index, kept current by a task on the shared background loop."""

    def __init__(self, metadata_url: str, cluster: str = "default", *, stale_after: float = 3.0,
                 timeout: float = 5.0) -> None:
        self.url, self.layout = metadata_url, Layout(cluster)
        self.stale_after, self.timeout = stale_after, timeout
        self._root = self.layout.root.encode()
        self._blocks_prefix = self.layout.blocks_prefix().encode()
        self._snapshot = _Snapshot()
        self._node_names: list[str] = []
        self._node_numbers: dict[str, int] = {}
        self._placements: dict[frozenset, Placement] = {}
        self._revision = 0
        self._last_ok = float("-inf")
        self._connected = False
        self._changed = threading.Condition()
        self._apply_lock = threading.Lock()  # watch events and remember() edit the same tables
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._future = None
        self._stopping: asyncio.Event | None = None
        self.resyncs = 0

    # --- lifetime -----------------------------------------------------------------------------
    def start(self, wait: float | None = None) -> "IndexMirror":
        """Start following; wait (default `timeout`) for the first snapshot, else MetadataUnavailable."""
        self._future = asyncio.run_coroutine_threadsafe(self._follow(), shared_loop())
        if not self._synced.wait(self.timeout if wait is None else wait):
            self.stop()
            raise MetadataUnavailable(f"index mirror could not load a snapshot from {self.url}")
        return self

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
        """True while the mirror cannot confirm it is current (not connected, or silent too long)."""
        return not self._connected or time.monotonic() - self._last_ok > self.stale_after

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

    def match(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]) -> Match:
        """How many leading `hashes` are cached anywhere, and where each of them is."""
        table = self._snapshot.blocks.get(_fingerprint_id(fingerprint))
        placements: list[Placement] = []
        if table:
            get = table.get
            for h in hashes:
                entry = get(h)
                if entry is None:
                    break
                placements.append(entry[0])
        return Match(len(placements), placements, self.stale)

    def node_prefix_lengths(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each node, how many leading blocks it holds itself (the conductor's input)."""
        table = self._snapshot.blocks.get(_fingerprint_id(fingerprint)) or {}
        lengths: dict[str, int] = {}
        alive: set[str] = set()
        previous: Placement | None = None
        count = 0
        for count, h in enumerate(hashes):
            entry = table.get(h)
            if entry is None:
                break
            placement = entry[0]
            if previous is None:
                alive = set(placement.nodes)
            elif placement is not previous:
                for node in alive - placement.nodes:
                    lengths[node] = count
                alive &= placement.nodes
            if not alive:
                break
            previous = placement
        else:
            count = len(hashes)
        for node in alive:
            lengths[node] = count
        return lengths

    def contains(self, fingerprint: ModelFingerprint | str, block_hash: bytes) -> bool:
        """Whether any node holds the block (no record decoding)."""
        table = self._snapshot.blocks.get(_fingerprint_id(fingerprint))
        return bool(table) and block_hash in table

    def lookup(self, fingerprint: ModelFingerprint | str, block_hash: bytes) -> dict[str, BlockRecord]:
        """Every replica of one block: node -> record."""
        table = self._snapshot.blocks.get(_fingerprint_id(fingerprint)) or {}
        entry = table.get(block_hash)
        if entry is None:
            return {}
        raws = entry[1] if isinstance(entry[1], tuple) else (entry[1],)
        return {self._node_names[int.from_bytes(r[:2], "little")]: BlockRecord.decode(r[2:]) for r in raws}

    def remember(self, fingerprint: ModelFingerprint | str, block_hash: bytes, node: str,
                 record: BlockRecord | bytes) -> None:
        """Learn one replica now, as its watch 'put' event would (a putting client's own mirror)."""
        value = record.encode() if isinstance(record, BlockRecord) else bytes(record)
        with self._apply_lock:
            self._apply_block(self._snapshot, "put", _fingerprint_id(fingerprint), bytes(block_hash), node, value)
        with self._changed:
            self._changed.notify_all()

    def wait_for_revision(self, revision: int, timeout: float = 5.0) -> bool:
        """Block until the mirror has applied `revision` (tests, benchmarks)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._revision >= revision, timeout)

    def wait_until(self, predicate, timeout: float = 5.0) -> bool:
        """Block until `predicate(self)` holds after some update, or the timeout passes."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    # --- applying changes (mirror thread) -------------------------------------------------------
    def _node_number(self, node: str) -> int:
        number = self._node_numbers.get(node)
        if number is None:
            number = self._node_numbers[node] = len(self._node_names)
            self._node_names.append(node)
        return number

    def _placement(self, raws: tuple[bytes, ...]) -> Placement:
        spots = frozenset((int.from_bytes(r[:2], "little"), r[3]) for r in raws)
        placement = self._placements.get(spots)
        if placement is None:
            locations = tuple(sorted((self._node_names[n], TIERS[t]) for n, t in spots))
            placement = self._placements[spots] = Placement(locations, frozenset(n for n, _ in locations))
        return placement

    def _apply(self, snap: _Snapshot, kind: str, key: bytes, value: bytes) -> None:
        rest = key[len(self._root):].decode()
        section, _, name = rest.partition("/")
        if section == "blocks":
            fingerprint, hash_hex, node = name.split("/", 2)
            self._apply_block(snap, kind, fingerprint, bytes.fromhex(hash_hex), node, value)
        elif section == "nodes":
            if kind == "put":
                snap.nodes[name] = NodeRecord.decode(value)
            else:
                snap.nodes.pop(name, None)
        elif section == "segments":
            if kind == "put":
                snap.segments[name] = value.decode()
            else:
                snap.segments.pop(name, None)

    def _apply_block(self, snap: _Snapshot, kind: str, fingerprint: str, block_hash: bytes, node: str,
                     value: bytes) -> None:
        table = snap.blocks.setdefault(fingerprint, {})
        number = self._node_number(node).to_bytes(2, "little")
        entry = table.get(block_hash)
        raws = () if entry is None else (entry[1] if isinstance(entry[1], tuple) else (entry[1],))
        kept = tuple(r for r in raws if r[:2] != number)
        if kind == "put":
            BlockRecord.decode(value)  # refuse what we could not serve later
            kept = tuple(sorted(kept + (number + value,)))
        if kept:
            table[block_hash] = (self._placement(kept), kept[0] if len(kept) == 1 else kept)
        elif entry is not None:
            del table[block_hash]
        snap.block_count += (1 if kept else 0) - (1 if entry is not None else 0)

    def _load(self, items: list[KeyValue]) -> _Snapshot:
        snap = _Snapshot()
        for item in items:
            try:
                self._apply(snap, "put", item.key, item.value)
            except (InvalidRecord, ValueError, UnicodeDecodeError) as exc:
                log.warning("ignoring malformed index entry %r: %s", item.key[:200], exc)
        return snap

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
                log.info("index mirror lost %s: %s", self.url, exc)
            finally:
                self._connected = False
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

    async def _sync_and_watch(self, metadata: Metadata) -> None:
        items, revision = await metadata.range(self._root)
        snapshot = self._load(items)
        del items  # this frame lives as long as the watch: do not pin the raw snapshot
        watch = await metadata.watch(self._root, start_revision=revision + 1)
        with self._changed:
            self._snapshot, self._revision = snapshot, revision
            self._connected, self._last_ok = True, time.monotonic()
            self.resyncs += 1
            self._changed.notify_all()
        self._synced.set()
        events = asyncio.create_task(self._consume(watch))
        health = asyncio.create_task(self._ping(metadata))
        stopper = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait({events, health, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in (events, health, stopper):
                task.cancel()
            await watch.cancel()

    async def _consume(self, watch) -> None:
        async for event in watch:
            self._on_event(event)
        raise MetadataUnavailable("watch ended")

    def _on_event(self, event: WatchEvent) -> None:
        try:
            with self._apply_lock:
                self._apply(self._snapshot, event.kind, event.key, event.value)
        except (InvalidRecord, ValueError, UnicodeDecodeError) as exc:
            log.warning("ignoring malformed index event %r: %s", event.key[:200], exc)
        with self._changed:
            self._revision = event.revision
            self._last_ok = time.monotonic()
            self._changed.notify_all()

    async def _ping(self, metadata: Metadata) -> None:
        """Prove the service is still there while the watch is quiet."""
        probe = self._root + b"health"
        while True:
            await asyncio.sleep(self.stale_after / 3)
            try:
                await asyncio.wait_for(metadata.get(probe), self.stale_after)
            except (MetadataError, asyncio.TimeoutError) as exc:
                raise MetadataUnavailable(f"health check failed: {exc}") from exc
            self._last_ok = time.monotonic()
