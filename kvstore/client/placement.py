"""Where a client's next put goes: same host first, then the node with the least DRAM used,
counting this client's puts still in flight there and the use the node reported in its last reply
(fresher than its published record, which is refreshed every 2 s, and it counts other clients'
reservations). That is what spreads a burst of puts over nodes by free space."""
from __future__ import annotations

import threading
import time
from typing import Any, Collection, Iterable

from ..index.records import NodeRecord

USAGE_FRESH_S = 2.5  # a node's use from its last reply beats its published record this long
DOWN_S = 2.0  # a node that failed a call is not tried again for this long


class PutPlacement:
    """Picks put targets for one client; `here` is this client's host id."""

    def __init__(self, here: str) -> None:
        self.here = here
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {}  # node -> bytes of this client's puts under way there
        self._usage: dict[str, tuple[int, int, float]] = {}  # node -> (used, capacity, when) from its replies
        self._down: dict[str, float] = {}  # node -> until when it is not tried

    def pick(self, nodes: Iterable[NodeRecord], exclude: Collection[str], nbytes: int) -> NodeRecord | None:
        """The next target among `nodes`, or None; counts `nbytes` in flight there until `settle`."""
        now = time.monotonic()
        with self._lock:
            best = None
            for n in nodes:
                if n.draining or n.name in exclude or not self.usable(n.name):
                    continue
                used, capacity = n.used.get("dram", 0), n.tiers.get("dram", 0)
                seen = self._usage.get(n.name)
                if seen is not None and now - seen[2] < USAGE_FRESH_S:
                    used, capacity = seen[0], seen[1]
                key = (n.host != self.here, (used + self._inflight.get(n.name, 0)) / max(capacity, 1), n.name)
                if best is None or key < best[0]:
                    best = (key, n)
            if best is None:
                return None
            self._inflight[best[1].name] = self._inflight.get(best[1].name, 0) + nbytes
            return best[1]

    def settle(self, name: str, nbytes: int) -> None:
        """A put of `nbytes` to `name` is over: no longer in flight."""
        with self._lock:
            left = self._inflight.get(name, 0) - nbytes
            if left > 0:
                self._inflight[name] = left
            else:
                self._inflight.pop(name, None)

    def seen(self, name: str, reply: Any) -> None:
        """Note the DRAM use a node's reply (a wire dict or a gRPC message) reported, if it did."""
        used = reply.get("used") if isinstance(reply, dict) else getattr(reply, "used", None)
        capacity = reply.get("capacity") if isinstance(reply, dict) else getattr(reply, "capacity", None)
        if isinstance(used, int) and isinstance(capacity, int) and capacity > 0:
            with self._lock:
                self._usage[name] = (used, capacity, time.monotonic())

    def mark_down(self, name: str) -> None:
        """`name` failed a call: leave it alone for a while."""
        self._down[name] = time.monotonic() + DOWN_S

    def usable(self, name: str) -> bool:
        return self._down.get(name, 0) < time.monotonic()
