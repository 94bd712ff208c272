"""Saves off the forward pass: a bounded queue of staged blocks and one thread putting them.

The forward pass only copies each layer's blocks into host staging; the put (and the publish)
happens here. When the queue is full, offload saves are dropped (a later miss costs a recompute,
a stall would cost every running request); saves a decode instance waits for (P/D) wait for room
instead, for at most `handoff_wait_s`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class SaveBatch:
    blocks: list[tuple[bytes, np.ndarray]]
    handoff: bool  # a decode instance waits for these blocks
    group: int = 0  # the KV cache group (its fingerprint) the blocks belong to
    ready: Callable[[], None] | None = None  # waits until the blocks' bytes are in their buffers (a device copy)
    release: Callable[[], None] | None = None  # the buffers may be reused: called once, stored, failed or dropped

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for _, buf in self.blocks)


PutBatch = Callable[[SaveBatch], object]  # stores one batch (its blocks under its group's fingerprint)


class SaveWriter:
    """One background thread storing staged blocks, at most `max_bytes` queued."""

    def __init__(self, put_many: PutBatch, max_bytes: int,
                 on_done: Callable[[SaveBatch, float, Exception | None], None],
                 handoff_wait_s: float = 5.0) -> None:
        self._put_many = put_many
        self._max_bytes = max_bytes
        self._on_done = on_done
        self._handoff_wait_s = handoff_wait_s
        self._queue: deque[SaveBatch] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self.dropped_blocks = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-save", daemon=True)
        self._thread.start()

    def submit(self, batch: SaveBatch) -> bool:
        """Queue a batch; False when it was dropped for lack of room."""
        size = batch.nbytes
        with self._cond:
            if self._closed:
                _release(batch)
                return False
            deadline = time.monotonic() + (self._handoff_wait_s if batch.handoff else 0.0)
            while self._queued_bytes and self._queued_bytes + size > self._max_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.dropped_blocks += len(batch.blocks)
                    _release(batch)
                    return False
                self._cond.wait(left)
            self._queue.append(batch)
            self._queued_bytes += size
            self._cond.notify_all()
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far is stored (or failed)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    @property
    def pending(self) -> bool:
        with self._cond:
            return bool(self._queue) or self._busy

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch = self._queue.popleft()
                self._busy = True
            started, error = time.perf_counter(), None
            try:
                if batch.ready is not None:
                    batch.ready()
                self._put_many(batch)
            except Exception as exc:  # noqa: BLE001 - a failed save is a later miss, never a crash
                error = exc
                log.warning("kvstore save of %d blocks failed: %s", len(batch.blocks), exc)
            try:
                self._on_done(batch, time.perf_counter() - started, error)
            finally:
                _release(batch)
                with self._cond:
                    self._queued_bytes -= batch.nbytes
                    self._busy = False
                    self._cond.notify_all()


def _release(batch: SaveBatch) -> None:
    release, batch.release = batch.release, None
    if release is not None:
        release()
