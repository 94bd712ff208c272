"""Slots a store node leased to a client with a commit, for its next put of the same shape: that
put writes straight into them and commits, with no reserve round trip. A slot is written into only
while a write started now ends well inside the node's hold on it, and only over the connection it
was leased through: a reconnect may reach another incarnation of the node, whose regions reuse the
ids (they count from 1) but not the slots."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

LEASE_MAX_BYTES = 64 << 20  # slots kept per node, fingerprint and block size (one put's worth, up to this)


@dataclass
class LeasedSlot:
    token: int
    region: int
    offset: int
    usable_until: float  # monotonic: written into only before this


@dataclass
class _Pool:
    connection: object  # the connection the slots were leased through
    slots: list[LeasedSlot]


class SlotLeases:
    """A client's leased slots, by (node, fingerprint, block size). `timeout`: the client's, which
    bounds how long a write into a slot may take."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._ttl: dict[str, float] = {}  # node -> how long it holds a leased slot (from its last grant)

    def take(self, connection: object, name: str, fp: str, size: int,
             count: int) -> tuple[list[LeasedSlot] | None, list[int]]:
        """(`count` slots of `size` bytes on `name`, or None when there are not enough; tokens of
        slots grown too old to use, to give back). Slots leased over another connection are forgotten."""
        with self._lock:
            pool = self._pools.get((name, fp, size))
            if pool is None:
                return None, []
            if pool.connection is not connection:
                del self._pools[(name, fp, size)]
                return None, []
            fresh = time.monotonic() + self.timeout
            aged = [slot.token for slot in pool.slots if slot.usable_until <= fresh]
            pool.slots[:] = [slot for slot in pool.slots if slot.usable_until > fresh]
            if len(pool.slots) < count:
                return None, aged
            taken, pool.slots[:] = pool.slots[:count], pool.slots[count:]
            return taken, aged

    def wanted(self, connection: object, name: str, fp: str, size: int, count: int) -> int:
        """How many slots to ask for with a commit: another put of `count` blocks, less those held;
        none where the node's hold on a slot is too short for this client to use it."""
        ttl = self._ttl.get(name)
        if not size or (ttl is not None and not self.usable(ttl)):
            return 0
        with self._lock:
            pool = self._pools.get((name, fp, size))
            held = len(pool.slots) if pool is not None and pool.connection is connection else 0
        return max(0, min(count, LEASE_MAX_BYTES // size) - held)

    def usable(self, ttl: float) -> bool:
        """Whether a slot held `ttl` seconds can be written into at all: only while half its hold is
        left less a timeout, and a write takes up to a timeout."""
        return ttl / 2 - 2 * self.timeout > 0

    def keep(self, connection: object, name: str, fp: str, size: int, granted: list[tuple[int, int, int]],
             asked: float, ttl: Any) -> list[int]:
        """Keep slots (token, region, offset) a commit asked at `asked` leased: the node holds them
        for `ttl` seconds from some moment after. Returns tokens never usable, to give back now."""
        if not granted:
            return []
        self._ttl[name] = ttl = float(ttl) if isinstance(ttl, (int, float)) else 0.0
        if not self.usable(ttl):
            return [token for token, _, _ in granted]
        until = asked + ttl / 2 - self.timeout
        with self._lock:
            pool = self._pools.get((name, fp, size))
            if pool is None or pool.connection is not connection:
                pool = self._pools[(name, fp, size)] = _Pool(connection, [])
            pool.slots.extend(LeasedSlot(token, region, offset, until) for token, region, offset in granted)
        return []

    def forget(self, name: str) -> None:
        """Drop every slot on `name` (its connection failed)."""
        with self._lock:
            for key in [key for key in self._pools if key[0] == name]:
                del self._pools[key]

    def slots(self) -> list[LeasedSlot]:
        """Every slot held now."""
        with self._lock:
            return [slot for pool in self._pools.values() for slot in pool.slots]

    def drain(self, connections: dict[str, object]) -> dict[str, list[int]]:
        """Forget every slot; returns, by node, the tokens leased over the connection still open
        to it (`connections`): the others' node may be gone."""
        with self._lock:
            pools, self._pools = self._pools, {}
        by_node: dict[str, list[int]] = {}
        for (name, _, _), pool in pools.items():
            if connections.get(name) is pool.connection:
                by_node.setdefault(name, []).extend(slot.token for slot in pool.slots)
        return by_node
