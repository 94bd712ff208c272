"""Log lines for a failure that repeats while a dependency is down (etcd, a peer): the first one
in full, then one summary every `every` seconds for as long as it lasts, and one line when it
ends. A loop that retries four times a second must not write four lines a second into a daemon's
log, or into the stderr of the application a library client lives in."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable


class OutageLog:
    """Rate-limited lines about one kind of failure (see the module docstring). Thread-safe."""

    def __init__(self, logger: logging.Logger, what: str, every: float = 30.0, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.what, self.every, self.level, self._clock = logger, what, every, level, clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when this outage began (None: no outage)
        self._last_line = 0.0
        self._unsaid = 0  # failures since the last line

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def failed(self, detail: object) -> None:
        """One more failure: said in full if it is the first, summed up every `every` seconds."""
        now = self._clock()
        with self._lock:
            if self._since is None:
                self._since, self._last_line, self._unsaid = now, now, 0
                line = f"{self.what}: {detail}"
            elif now - self._last_line >= self.every:
                line = (f"{self.what}: still failing after {now - self._since:.0f} s ({self._unsaid + 1} more "
                        f"failures since the last line; the last: {detail})")
                self._last_line, self._unsaid = now, 0
            else:
                self._unsaid += 1
                return
        self._log.log(self.level, "%s", line)

    def recovered(self) -> None:
        """The failure is over: one line, if there was an outage."""
        with self._lock:
            if self._since is None:
                return
            lasted, self._since = self._clock() - self._since, None
        self._log.log(self.level, "%s: recovered after %.1f s", self.what, lasted)
