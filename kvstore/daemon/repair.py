"""Replica repair: keeps every block this node holds at the cluster's replica count.

When holders die (their lease expires and their records leave the index), the surviving holder
with the smallest name copies each under-replicated block to nodes that lack it; the others only
wait, so a block is never repaired twice. Scans run when the set of nodes changed, while work is
left, and every `full_scan_s` as a safety net. `under_replicated` counts the blocks this node is
responsible for that still lack replicas (summed over nodes by `kvstore admin status`).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from .oplog import Throttle

log = logging.getLogger(__name__)
REPAIR_BATCH = 32


class Repairer:
    """Background repair for one daemon (see module docstring)."""

    def __init__(self, node: str, store, counters: dict[str, float], make_client: Callable[[], object],
                 replicas: int, interval: float = 1.0, full_scan_s: float = 30.0) -> None:
        self.node, self.store, self.counters, self.replicas = node, store, counters, replicas
        self._make_client, self._client = make_client, None
        self.interval, self.full_scan_s = interval, full_scan_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_nodes: frozenset[str] = frozenset()
        self._pending = True
        self._said_short = 0  # the last scan's shortfall: a line when it grows or ends, not every scan
        self._said_stuck = 0  # blocks last said to have nowhere to go
        self._failure_said = Throttle(30.0)
        counters.setdefault("under_replicated_blocks", 0)
        counters.setdefault("replicas_repaired", 0)

    def start(self) -> "Repairer":
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-repair-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._client is not None:
            self._client.close()

    def _loop(self) -> None:
        since_full = 0.0
        while not self._stop.wait(self.interval):
            since_full += self.interval
            try:
                if self._client is None:
                    self._client = self._make_client()
                nodes = frozenset(self._client.mirror.nodes)
                if self._pending or nodes != self._seen_nodes or since_full >= self.full_scan_s:
                    self._seen_nodes, since_full = nodes, 0.0
                    self._pending = self.scan() > 0
            except Exception as exc:  # noqa: BLE001 - a failed round is retried next interval
                if self._failure_said():  # retried every interval: said at most every 30 s
                    log.warning("replica repair on %s failed (retrying): %s", self.node, exc)
                self._pending = True

    def _live(self) -> dict[str, object]:
        return {name: rec for name, rec in self._client.mirror.nodes.items() if not rec.draining}

    def scan(self) -> int:
        """One pass: count and repair what this node is responsible for; returns blocks still short."""
        mirror, live = self._client.mirror, self._live()
        groups: dict[tuple[str, tuple[str, ...]], list[bytes]] = {}
        for (fingerprint, block_hash), _slot in self.store.keys():
            holders = {n for n in mirror.lookup(fingerprint, block_hash) if n in live} | {self.node}
            if len(holders) >= self.replicas or min(holders) != self.node:
                continue
            groups.setdefault((fingerprint, tuple(sorted(holders))), []).append(block_hash)
        short = sum(len(hashes) for hashes in groups.values())
        self.counters["under_replicated_blocks"] = short
        if short > self._said_short:  # more than last time: a holder left (a shrinking count is the repair's)
            log.warning("%d blocks held here have fewer than %d live replicas (a holder left): repairing",
                        short, self.replicas)
        elif not short and self._said_short:
            log.info("every block held here has its %d replicas again", self.replicas)
        self._said_short = short
        if not short:
            return 0
        before, attempted, copies, stuck = short, False, 0, 0
        spare = [n for n in live if n != self.node]
        for (fingerprint, holders), hashes in groups.items():
            missing = self.replicas - len(holders)
            if not [n for n in spare if n not in holders]:
                stuck += len(hashes)
                continue  # nowhere to copy to until another node joins
            for start in range(0, len(hashes), REPAIR_BATCH):
                if self._stop.is_set():
                    return short
                items = [(h, data) for h in hashes[start : start + REPAIR_BATCH]
                         if (data := self.store.read_block((fingerprint, h))) is not None]
                if not items:
                    continue
                attempted = True
                self._client.put_many(items, fingerprint=fingerprint, replicas=missing, exclude=set(holders))
                self.counters["replicas_repaired"] += len(items)
                copies += len(items)
                short -= len(items)
        self.counters["under_replicated_blocks"] = max(short, 0)
        if copies:
            log.info("replica repair copied %d blocks to other nodes", copies)
        if stuck and stuck != self._said_stuck:
            log.warning("%d under-replicated blocks have no node left to copy to (waiting for one to join)", stuck)
        self._said_stuck = stuck
        return before if attempted else short  # after copying, check again once the index shows them
