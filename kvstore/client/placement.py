"""Where a client's next put goes: same host first, then the node with the least DRAM used,
counting this client's puts still in flight there and the use the node reported in its last reply
(fresher than its published record, which is refreshed every 2 s, and it counts other clients'
reservations). That is what spreads a burst of puts over nodes by free space.

Bounded share: among nodes equally near, one may take at most SHARE_BOUND times its fair share
(its DRAM capacity over theirs) of the bytes this client placed lately (decayed with a half-life of
SHARE_HALF_LIFE_S); a node past it is picked only when every other is past it too. Without it, a
node that just (re)started empty is the least used by far and takes every put of a burst until it
is as full as the rest: its one link and one DRAM pool then carry the whole cluster's write load and
puts time out. With it, an empty node fills over a few bursts, at most 1.5x as fast as a fair share
(three nodes: at most half of the puts, not all of them)."""
from __future__ import annotations

import threading
import time
from typing import Collection, Iterable

from ..index.records import NodeRecord

USAGE_FRESH_S = 2.5  # a node's use from its last reply beats its published record this long
DOWN_S = 2.0  # a node that failed a call is not tried again for this long
SHARE_BOUND = 1.5  # a node's most of this client's recent put bytes, in fair shares (see module docstring)
SHARE_HALF_LIFE_S = 2.0  # how fast past puts stop counting toward the share


class PutPlacement:
    """Picks put targets for one client; `here` is this client's host id."""

    def __init__(self, here: str) -> None:
        self.here = here
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {}  # node -> bytes of this client's puts under way there
        self._usage: dict[str, tuple[int, int, float]] = {}  # node -> (used, capacity, when) from its replies
        self._down: dict[str, float] = {}  # node -> until when it is not tried
        self._recent: dict[str, tuple[float, float]] = {}  # node -> (put bytes placed there, decayed; as of when)

    def _placed(self, name: str, now: float) -> float:
        """Bytes of this client's puts placed at `name` lately (decayed; lock held)."""
        placed, when = self._recent.get(name, (0.0, now))
        return placed * 0.5 ** ((now - when) / SHARE_HALF_LIFE_S)

    def pick(self, nodes: Iterable[NodeRecord], exclude: Collection[str], nbytes: int) -> NodeRecord | None:
        """The next target among `nodes`, or None; counts `nbytes` in flight there until `settle`."""
        now = time.monotonic()
        with self._lock:
            eligible = []
            for n in nodes:
                if n.draining or n.name in exclude or not self.usable(n.name):
                    continue
                used, capacity = n.used.get("dram", 0), n.tiers.get("dram", 0)
                seen = self._usage.get(n.name)
                if seen is not None and now - seen[2] < USAGE_FRESH_S:
                    used, capacity = seen[0], seen[1]
                eligible.append((n, used, max(capacity, 1), self._placed(n.name, now)))
            if not eligible:
                return None
            near = [e for e in eligible if e[0].host == self.here] or eligible  # the share among equals
            total_capacity = sum(e[2] for e in near)
            total_placed = sum(e[3] for e in near) + nbytes
            best = None
            for n, used, capacity, placed in eligible:
                over = len(near) > 1 and placed + nbytes > SHARE_BOUND * total_placed * capacity / total_capacity
                key = (n.host != self.here, over, (used + self._inflight.get(n.name, 0)) / capacity, n.name)
                if best is None or key < best[0]:
                    best = (key, n, placed)
            _, chosen, placed = best
            self._inflight[chosen.name] = self._inflight.get(chosen.name, 0) + nbytes
            self._recent[chosen.name] = (placed + nbytes, now)
            return chosen

    def settle(self, name: str, nbytes: int) -> None:
        """A put of `nbytes` to `name` is over: no longer in flight."""
        with self._lock:
            left = self._inflight.get(name, 0) - nbytes
            if left > 0:
                self._inflight[name] = left
            else:
                self._inflight.pop(name, None)

    def seen(self, name: str, reply: dict) -> None:
        """Note the DRAM use a node's reply reported, if it did."""
        used, capacity = reply.get("used"), reply.get("capacity")
        if isinstance(used, int) and isinstance(capacity, int) and capacity > 0:
            with self._lock:
                self._usage[name] = (used, capacity, time.monotonic())

    def mark_down(self, name: str) -> None:
        """`name` failed a call: leave it alone for a while."""
        self._down[name] = time.monotonic() + DOWN_S

    def usable(self, name: str) -> bool:
        return self._down.get(name, 0) < time.monotonic()
