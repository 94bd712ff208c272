"""Index updates go to the metadata service in the background, in pipelined batches.

A put returns once its block is written on the node; the record reaches etcd with the next batch
after the node verified it (usually a few milliseconds later). Updates are coalesced per block —
the last word on a block wins — and one batch is in flight at a time while the next one gathers. One exception: a deletion
that follows a put not yet sent is held for the batch after that put's, because deleting a key
etcd never had is no event at all, and the putting client, whose mirror learned the block from the
put's reply, would keep listing it. A batch that fails (etcd down, lease lost) goes back under
whatever arrived since (newer words still win) and is retried with a backoff.

What this keeps true: the index never lists a block the node does not hold sealed under that
record for longer than one batch, and a get checks every block's digest, so a record that is
late or briefly stale yields a miss, never wrong bytes. A daemon that dies before publishing
leaves nothing behind: its unpublished blocks are simply never visible, and its lease takes the
published ones away.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Awaitable, Callable

from ..errors import MetadataUnavailable
from .oplog import Throttle
from .store import Update

log = logging.getLogger(__name__)


STEP = 0.002  # seconds of gap after a batch per update it carried, up to the window
LOG_EVERY_S = 30.0  # while publishing fails, a reminder this often (the first failure and the recovery at once)


class Publisher:
    """See module docstring. `apply` publishes one batch (a coroutine on `loop`). The next batch
    starts at least STEP seconds per update of the last one later, and at most `window`: a lone
    update after a quiet spell goes at once, sparse puts each go alone, and a stream gathers into
    transactions up to `window` apart (less work per update for etcd, every watcher and us)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, apply: Callable[[list[Update]], Awaitable[int]],
                 timeout: float, counters: dict[str, float] | None = None,
                 on_published: Callable[[float], None] | None = None, window: float = 0.0) -> None:
        self._loop, self._apply, self._timeout = loop, apply, timeout
        self.counters = counters if counters is not None else {}
        self._on_published = on_published  # called with the oldest update's wait (seconds) per batch
        self._pending: dict[tuple[str, bytes], object] = {}
        # Deletions held for the batch after their put's: key -> (ticket, when it arrived).
        self._after: dict[tuple[str, bytes], tuple[int, float]] = {}
        self._since: float | None = None  # when the oldest pending update arrived
        self._lock = threading.Condition()
        self._enqueued = 0  # tickets handed out
        self._done = 0  # every ticket <= this is published
        # The etcd revision of the last batch that changed the index: a waiter's changes are in
        # etcd at or before it, and a watcher of the cluster sees an event carrying it.
        self._revision = 0
        self._stopped = False
        self._scheduled = False  # a wake-up of the loop is on its way
        self._wake = asyncio.Event()
        self.window = window
        self._last_batch = float("-inf")
        self._gap = 0.0  # how long after _last_batch the next batch may start
        # Failures are logged when they start, every LOG_EVERY_S while they last, and when they end.
        self._failing_since: float | None = None
        self._failed_batches = 0
        self._said = Throttle(LOG_EVERY_S)
        self._task = asyncio.run_coroutine_threadsafe(self._run(), loop)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._after)

    def enqueue(self, updates: list[Update]) -> int:
        """Queue updates; returns a ticket for `wait`."""
        with self._lock:
            self._enqueued += 1
            ticket = self._enqueued
            for fingerprint, block_hash, record in updates:
                key = (fingerprint, bytes(block_hash))
                if record is None and self._pending.get(key) is not None:
                    self._hold_deletion(key, ticket, time.monotonic())
                else:
                    self._pending[key] = record
                    self._after.pop(key, None)
            if self._since is None and self._pending:
                self._since = time.monotonic()
            wake, self._scheduled = not self._scheduled, True
        if wake:  # once per batch: waking the loop thread costs the caller a GIL hand-off
            self._loop.call_soon_threadsafe(self._wake.set)
        return ticket

    def _hold_deletion(self, key: tuple[str, bytes], ticket: int, since: float) -> None:
        """Delete `key` in the batch after the one carrying its pending put (see module docstring)."""
        self._after.setdefault(key, (ticket, since))  # a deletion held already is the older

    def wait(self, ticket: int, timeout: float) -> int:
        """Block until everything queued up to `ticket` is published (MetadataUnavailable after
        timeout); returns a revision at or after those changes that a watcher of the cluster will
        see (0: none published yet)."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._done >= ticket or self._stopped, timeout):
                raise MetadataUnavailable("publishing to the metadata service timed out")
            return self._revision

    def publish(self, updates: list[Update], wait: bool, timeout: float) -> int:
        """Queue updates; with `wait`, return once published, with `wait`'s revision (else 0)."""
        ticket = self.enqueue(updates)
        return self.wait(ticket, timeout) if wait else 0

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            gap = self._last_batch + self._gap - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)
            self._last_batch = time.monotonic()
            with self._lock:
                if self._stopped:
                    return
                after, self._after = self._after, {}
                batch, self._pending = self._pending, dict.fromkeys(after)
                # A ticket whose deletion was held is done only once the next batch lands.
                upto = min((ticket for ticket, _ in after.values()), default=self._enqueued + 1) - 1
                held = bool(after)
                self._scheduled = held  # the held deletions wake the next round themselves
                since, self._since = self._since, min((t for _, t in after.values()), default=None)
            self._gap = min(self.window, STEP * len(batch))
            if batch:
                try:
                    revision = await asyncio.wait_for(self._apply([(fp, h, r) for (fp, h), r in batch.items()]),
                                                      self._timeout)
                except Exception as exc:  # noqa: BLE001 - etcd down, lease lost, timeout: retry the batch
                    with self._lock:
                        for key, record in batch.items():
                            newer = self._pending.setdefault(key, record)  # what arrived since is newer
                            if newer is None and record is not None:  # a deletion behind a put that failed
                                self._pending[key] = record
                                self._hold_deletion(key, self._done + 1, time.monotonic() if since is None else since)
                        if self._since is None or (since is not None and since < self._since):
                            self._since = since
                    self.counters["publish_failures"] = self.counters.get("publish_failures", 0) + 1
                    self._failed(len(batch), exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    self._wake.set()
                    continue
                backoff = 0.05
                if self._failing_since is not None:
                    log.warning("index publishing recovered after %.1f s and %d failed batches",
                                time.monotonic() - self._failing_since, self._failed_batches)
                    self._failing_since, self._failed_batches = None, 0
                self.counters["publish_batches"] = self.counters.get("publish_batches", 0) + 1
                self.counters["published_updates"] = self.counters.get("published_updates", 0) + len(batch)
                if self._on_published is not None and since is not None:
                    self._on_published(time.monotonic() - since)
                with self._lock:
                    self._revision = max(self._revision, revision or 0)
            with self._lock:
                self._done = max(self._done, upto)
                self._lock.notify_all()
            if held:
                self._wake.set()

    def _failed(self, updates: int, exc: BaseException) -> None:
        self._failed_batches += 1
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            self._said = Throttle(LOG_EVERY_S)
            self._said()
            log.warning("publishing %d index updates failed, retrying (clients do not see new blocks until "
                        "it works): %s", updates, why)
        elif self._said():
            log.warning("index publishing still failing after %.0f s (%d batches failed, %d updates waiting): %s",
                        time.monotonic() - self._failing_since, self._failed_batches, self.pending, why)

    def flush(self, timeout: float) -> None:
        """Wait until everything queued so far is published."""
        with self._lock:
            ticket = self._enqueued
        self.wait(ticket, timeout)

    def stop(self) -> None:
        """Stop publishing (what is still queued is dropped: the lease takes care of the rest)."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        self._loop.call_soon_threadsafe(self._wake.set)
        try:
            self._task.result(self._timeout)
        except Exception:  # noqa: BLE001 - stopping
            pass
