"""What a client read (recency for eviction, NVMe promotion) and found corrupt, reported to each
node in one call per fingerprint every TOUCH_INTERVAL rather than one per get. Best effort: a lost
report only makes eviction a little less informed."""
from __future__ import annotations

import threading
from typing import Callable

TOUCH_INTERVAL = 0.1  # seconds between reports to a node
TOUCH_BACKLOG = 10_000  # hashes kept per node, fingerprint and kind between reports

Send = Callable[[str, str, list[bytes], list[bytes]], None]  # (node, fingerprint, hits, corrupt)


class HitReports:
    """Gathers reports and sends them from a timer thread through `send` (which must not raise)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], dict[str, list[bytes]]] = {}
        self._timer: threading.Timer | None = None
        self._closed = False  # closing: no more timers
        # A flush in flight holds this, so close() returns only once no report is being sent, and
        # `_stopped` (set under it) keeps a timer's flush that was waiting for it from sending: no
        # report thread uses the client's connections after it has closed them.
        self._flush_lock = threading.Lock()
        self._stopped = False

    def add(self, fp: str, hits: dict[str, list[bytes]], corrupt: dict[str, list[bytes]]) -> None:
        """Queue blocks read (`hits`) and found corrupt, by node, for the next flush."""
        with self._lock:
            for kind, found in (("hits", hits), ("corrupt", corrupt)):
                for name, hs in found.items():
                    pending = self._pending.setdefault((name, fp), {"hits": [], "corrupt": []})[kind]
                    pending.extend(hs[: max(0, TOUCH_BACKLOG - len(pending))])  # advisory: drop the excess
            if self._timer is None and self._pending and not self._closed:
                self._timer = threading.Timer(TOUCH_INTERVAL, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Send everything queued: one call per node and fingerprint."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending, self._timer = self._pending, {}, None
            for (name, fp), found in pending.items():
                if self._stopped:
                    return
                self._send(name, fp, found["hits"], found["corrupt"])

    def close(self) -> None:
        """Send what is queued, then nothing more; returns once no report is in flight."""
        with self._lock:
            self._closed = True
            timer = self._timer
        if timer is not None:
            timer.cancel()
        self.flush()  # waits for a timer's flush already running
        with self._flush_lock:
            self._stopped = True
