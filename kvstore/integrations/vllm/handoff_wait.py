"""P/D hand-off loads that wait for a prefill's blocks still being written, off the load pool.

A decode may wait up to `remote_wait_s` for the blocks a prefill promised. Waiting on a load
thread would hold that thread: N hand-offs waiting would delay every other load by up to the
whole budget. Here one thread waits for all of them on the index mirror's watch and hands each
to the load pool once its blocks are all published, or once its budget is spent (the load then
reads what is there; vLLM recomputes the rest).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .plan import GroupBlock


@dataclass
class PendingHandoff:
    req_id: str
    blocks: list[GroupBlock]
    deadline: float  # time.monotonic() after which the load starts with what is published
    tokens: int | None = None  # prompt tokens the load provides (the connector's accounting)
    started: float = 0.0  # time.monotonic() when it began waiting


class HandoffWaiter:
    """One thread, woken by the mirror's watch, releasing hand-off loads as their blocks land."""

    def __init__(self, mirror: Any, fingerprints: Sequence[Any], release: Callable[[PendingHandoff], None]) -> None:
        self._mirror = mirror
        self._fingerprints = list(fingerprints)
        self._release = release
        self._pending: dict[str, PendingHandoff] = {}
        self._lock = threading.Lock()
        self._edits = 0  # counts add/cancel/close: a change the waiting thread must look at
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, req_id: str, blocks: list[GroupBlock], wait_s: float, tokens: int | None = None) -> None:
        with self._lock:
            now = time.monotonic()
            self._pending[req_id] = PendingHandoff(req_id, blocks, now + wait_s, tokens, now)
            self._edits += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-handoff-wait", daemon=True)
                self._thread.start()
        self._mirror.wake()

    def cancel(self, req_id: str) -> bool:
        """Drop a waiting hand-off (its request ended); False when it is not waiting (any more)."""
        with self._lock:
            self._edits += 1
            return self._pending.pop(req_id, None) is not None

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Stop waiting: every hand-off still waiting is released (it loads what is published)."""
        with self._lock:
            self._closed = True
            self._edits += 1
            thread = self._thread
        self._mirror.wake()
        if thread is not None:
            thread.join(5.0)

    def _published(self, pending: PendingHandoff) -> bool:
        return all(self._mirror.contains(self._fingerprints[g], h) for g, _, h in pending.blocks)

    def _take_due(self) -> tuple[list[PendingHandoff], float | None, int, bool]:
        """Pop the hand-offs to release now (blocks published, budget spent, or closing); also the
        seconds until the next budget runs out (None: nothing waits), the edit count seen, and
        whether the waiter is closed."""
        with self._lock:
            pending, edits, closed = list(self._pending.values()), self._edits, self._closed
        now = time.monotonic()
        ready = [p.req_id for p in pending if closed or p.deadline <= now or self._published(p)]
        with self._lock:
            due = [self._pending.pop(r) for r in ready if r in self._pending]
            left = [p.deadline for p in self._pending.values()]
        return due, (max(0.0, min(left) - time.monotonic()) if left else None), edits, closed

    def _run(self) -> None:
        while True:
            revision = self._mirror.revision
            due, wait, edits, closed = self._take_due()
            for pending in due:
                self._release(pending)
            if closed:
                return
            if due:
                continue
            # Woken by a change of the index, an add/cancel/close, at the latest when a budget runs out.
            self._mirror.wait_until(lambda m: m.revision != revision or self._edits != edits,
                                    60.0 if wait is None else wait)
