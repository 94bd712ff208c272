"""What a daemon tells its operator in its log besides errors, summed rather than one line per event:
evictions per period (a busy node evicts thousands of blocks a second), nodes joining and leaving
the cluster. The daemon calls `tick()` on both from its periodic timer."""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)


class Throttle:
    """True at most once per `every` seconds (the first time at once)."""

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self._clock, self._last = every, clock, float("-inf")

    def __call__(self) -> bool:
        now = self._clock()
        if now - self._last < self.every:
            return False
        self._last = now
        return True


class EvictionLog:
    """One line per `every` seconds with evictions in it: how many blocks left each tier, how many
    of DRAM's went down to NVMe instead of away."""

    def __init__(self, counters: dict[str, float], tiers: Callable[[], Iterable[str]], every: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._counters, self._tiers, self.every, self._clock = counters, tiers, every, clock
        self._since = clock()
        self._last = self._read()

    def _read(self) -> dict[str, float]:
        seen = {f"evictions_{t}": self._counters.get(f"evictions_{t}", 0) for t in self._tiers()}
        seen["demotions"] = self._counters.get("demotions", 0)
        return seen

    def tick(self) -> str | None:
        """Log (and return) the line for the period just ended, if it is over and had evictions."""
        now = self._clock()
        if now - self._since < self.every:
            return None
        current = self._read()
        delta = {k: int(v - self._last.get(k, 0)) for k, v in current.items()}
        period, self._since, self._last = now - self._since, now, current
        evicted = {k.removeprefix("evictions_"): v for k, v in delta.items() if k.startswith("evictions_") and v > 0}
        if not evicted:
            return None
        parts = []
        for tier, count in evicted.items():
            if tier == "dram" and delta["demotions"]:
                moved = min(delta["demotions"], count)
                parts.append(f"{count} from dram ({moved} moved to nvme, {count - moved} dropped)")
            else:
                parts.append(f"{count} from {tier}")
        line = f"evicted {sum(evicted.values())} blocks in the last {period:.0f} s: {', '.join(parts)}"
        log.info(line)
        return line


class NeighbourWatch:
    """Logs the cluster's other nodes as they join and leave (a node that leaves without being
    drained was stopped, or died and its lease ran out: its blocks left the index with it)."""

    def __init__(self, node: str, list_nodes: Callable[[], Iterable[str]]) -> None:
        self.node, self._list = node, list_nodes
        self._known: set[str] | None = None

    def tick(self) -> list[str]:
        """Look once; log and return the lines for what changed since the last look."""
        names = set(self._list()) - {self.node}
        lines: list[str] = []
        if self._known is not None:
            for name in sorted(self._known - names):
                lines.append(f"node {name} left the cluster (stopped, or dead and its lease expired); "
                             "its blocks are no longer listed")
                log.warning(lines[-1])
            for name in sorted(names - self._known):
                lines.append(f"node {name} joined the cluster")
                log.info(lines[-1])
        elif names:
            lines.append(f"other nodes in the cluster: {', '.join(sorted(names))}")
            log.info(lines[-1])
        self._known = names
        return lines
