"""Replica repair: keeps every block this node holds at the cluster's replica count.

When holders die (their lease expires and their records leave the index), the surviving holder
with the smallest name copies each under-replicated block to nodes that lack it; the others only
wait, so a block is never repaired twice. Scans run when the set of nodes changed (a node restarted
under its name counts: its address changed), while work is left, and every `full_scan_s` as a
safety net. A replica that leaves the index while its node stays (evicted by a full node, removed,
or the records of a node's previous run expiring after it came back) is looked at at once: the
watch wakes the repairer, which checks those blocks alone (until the copy lands, that block has one
replica fewer: the smaller that window, the fewer blocks a second failure can take). A block sealed
here a moment ago may look short only because its other holders' records are still on their way
(each node publishes its own, in batches): the repairer asks those nodes before copying it, so a put
does not end up with a third replica on a node its writer left out, and a truly short block is still
copied at once.
`under_replicated` counts the blocks this node is responsible for that still lack replicas (summed
over nodes by `kvstore admin status`).

**Under memory pressure.** A full node evicts the blocks other nodes also hold first, so a full
cluster with replicas keeps one copy of more blocks rather than refusing puts. A repair copy only
goes to a node with free room (its published usage below ROOM_FRACTION of its capacity), where it
takes free space and never evicts anything (the store refuses a repair copy it cannot fit without
dropping a block): a copy into a full node evicted another replicated block, whose repair evicted
the next, without end. Blocks left short for want of room are counted and said once (with why they
are short: a node that left, or copies evicted), and copied when room appears.

A node that stops gracefully hands off first (`hand_off`): it copies every block it holds that would
be left with fewer live replicas than the cluster's count without it, before its lease (and with it
its replicas) goes. Survivors would repair those too, but only once they notice it left; a crash of
the other holder in that window lost blocks acknowledged on every replica. A batch that fails (its
targets busy past their timeouts, or down) is tried again until the hand-off's time is up: giving
up on the first failure left the whole group to the survivors, the same window.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..errors import AccessDenied, AuthenticationFailed
from .oplog import Throttle

log = logging.getLogger(__name__)
REPAIR_BATCH = 32
REMOVED_MAX = 1 << 16  # removed replicas noted between two rounds; past it, the next round scans everything
HAND_OFF_S = 30.0  # a graceful stop copies blocks for at most this long, then leaves anyway
HAND_OFF_RETRY_S = 0.5  # a hand-off batch that failed (every target busy or down) is tried again after this
WAKE_BATCH_S = 0.05  # a replica removal wakes the repairer this long later: a burst of removals is one round
ROOM_FRACTION = 0.9  # a repair copy goes only to a node using less than this share of its capacity
PUBLISH_GRACE_S = 5.0  # a block sealed here less than this long ago may have holders not listed yet


def has_room(record) -> bool:
    """Whether a node's published usage leaves room for repair copies (see ROOM_FRACTION)."""
    capacity = sum(record.tiers.values())
    return capacity > 0 and sum(record.used.values()) < ROOM_FRACTION * capacity


class Repairer:
    """Background repair for one daemon (see module docstring)."""

    def __init__(self, node: str, store, counters: dict[str, float], make_client: Callable[[], object],
                 replicas: int, interval: float = 1.0, full_scan_s: float = 30.0) -> None:
        self.node, self.store, self.counters, self.replicas = node, store, counters, replicas
        self._make_client, self._client = make_client, None
        self.interval, self.full_scan_s = interval, full_scan_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # a replica left the index: look now, not at the next interval
        self._thread: threading.Thread | None = None
        self._seen_nodes: frozenset[tuple[str, str]] = frozenset()  # (name, address): a restart changes it
        self._seen_resyncs = 0
        self._pending = True
        self._removed: set[tuple[str, bytes, str]] = set()  # (fingerprint, hash, holder) replicas that left
        self._removed_overflow = False
        self._removed_lock = threading.Lock()
        self._said_short = 0  # the last scan's shortfall: a line when it grows or ends, not every scan
        self._said_stuck = 0  # blocks last said to have nowhere to go
        self._said_full = 0  # blocks last said to have no node with room
        self._departed: set[str] = set()  # nodes gone since the last full scan (the shortfall's reason)
        self._failure_said = Throttle(30.0)
        counters.setdefault("under_replicated_blocks", 0)
        counters.setdefault("replicas_repaired", 0)

    def start(self) -> "Repairer":
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-repair-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self, hand_off: float = 0.0) -> None:
        """Stop repairing; with `hand_off` (seconds, a graceful stop once the node takes no more
        puts), first copy what would be left short without this node (`hand_off`)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            if hand_off > 0:
                self.hand_off(hand_off)
        finally:
            if self._client is not None:
                self._client.close()

    def hand_off(self, budget: float) -> int:
        """Copy every block held here that has fewer than `replicas` live replicas elsewhere to
        nodes that lack it, within `budget` seconds (each call within the client's timeouts);
        returns blocks left short. Best effort: what fails is said, in one line, and the survivors'
        repair takes it from there."""
        deadline = time.monotonic() + budget
        try:
            if self._client is None:
                self._client = self._make_client()
            live = [n for n in self._live() if n != self.node]
            mirror = self._client.mirror
            groups: dict[tuple[str, tuple[str, ...]], list[bytes]] = {}
            for (fingerprint, block_hash), _slot in self.store.keys():
                others = tuple(sorted(n for n in mirror.lookup(fingerprint, block_hash) if n in live))
                if len(others) < self.replicas:
                    groups.setdefault((fingerprint, others), []).append(block_hash)
        except Exception as exc:  # noqa: BLE001 - stopping: say it, leave the rest to the survivors
            log.warning("%s could not hand off its blocks before leaving: %s", self.node, exc)
            return 0
        short = sum(len(hashes) for hashes in groups.values())
        if not short:
            return 0
        copied, failed, nowhere, full, said_retry = 0, "", 0, 0, False
        records = self._live()
        for (fingerprint, others), hashes in groups.items():
            exclude = {*others, self.node}
            if not [n for n in live if n not in exclude]:
                nowhere += len(hashes)
                continue
            if not [n for n in live if n not in exclude and has_room(records[n])]:
                full += len(hashes)  # a copy would have to evict a block there: no retry makes room
                continue
            start = 0
            while start < len(hashes) and time.monotonic() <= deadline:
                items = [(h, data) for h in hashes[start : start + REPAIR_BATCH]
                         if (data := self.store.read_block((fingerprint, h))) is not None]
                if items:
                    try:
                        self._client.put_many(items, fingerprint=fingerprint, replicas=self.replicas - len(others),
                                              exclude=exclude)
                    except (AuthenticationFailed, AccessDenied) as exc:  # configuration: no retry helps
                        failed = f"{type(exc).__name__}: {exc}"
                        break
                    except Exception as exc:  # noqa: BLE001 - typed store errors, busy or dead nodes: again
                        failed = f"{type(exc).__name__}: {exc}"
                        if not said_retry:
                            log.warning("%s: handing off %d blocks failed (%s); trying again for up to %.0f s",
                                        self.node, len(items), failed, max(deadline - time.monotonic(), 0))
                            said_retry = True
                        time.sleep(HAND_OFF_RETRY_S)
                        continue
                    copied += len(items)
                    self.counters["replicas_repaired"] += len(items)
                start += REPAIR_BATCH
            if time.monotonic() > deadline:
                failed = f"out of time ({budget:.0f} s)" + (f"; last failure {failed}" if failed else "")
                break
        if full:
            failed = f"{full} with no node that has room for them" + (f"; {failed}" if failed else "")
        if nowhere:
            failed = f"{nowhere} with no other node to copy to" + (f"; {failed}" if failed else "")
        left = short - copied
        if left:
            log.warning("%s handed off %d blocks before leaving; %d it held are left with fewer than %d replicas "
                        "(%s)", self.node, copied, left, self.replicas, failed)
        else:
            log.info("%s handed off %d blocks before leaving (they had fewer than %d replicas elsewhere)",
                     self.node, copied, self.replicas)
        return left

    def held_elsewhere(self, fingerprint: str, block_hash: bytes) -> bool:
        """Whether a live node other than this one (not draining) lists the block: the store's
        eviction drops such blocks first and spares the others (BlockStore.replicated). False while
        the repairer's mirror is not up yet."""
        client = self._client
        if client is None:
            return False
        mirror = client.mirror
        nodes = mirror.nodes
        return any(name != self.node and (rec := nodes.get(name)) is not None and not rec.draining
                   for name in mirror.lookup(fingerprint, block_hash))

    def _replica_removed(self, fingerprint: str, block_hash: bytes, node: str) -> None:
        """The watch removed `node`'s replica of a block (on the watch's thread: only noted)."""
        if node == self.node:
            return
        with self._removed_lock:
            if len(self._removed) < REMOVED_MAX:
                self._removed.add((fingerprint, block_hash, node))
            else:
                self._removed_overflow = True
        self._wake.set()

    def _take_removed(self) -> tuple[set[tuple[str, bytes]], bool]:
        with self._removed_lock:
            removed, overflow = self._removed, self._removed_overflow
            self._removed, self._removed_overflow = set(), False
        return {(fp, h) for fp, h, _node in removed}, overflow

    def _loop(self) -> None:
        last_full = time.monotonic()
        last_round = last_full - self.interval  # the first round at once
        while not self._stop.is_set():
            if self._wake.wait(max(self.interval - (time.monotonic() - last_round), 0.0)):
                self._stop.wait(WAKE_BATCH_S)
            self._wake.clear()
            if self._stop.is_set():
                break
            now = time.monotonic()
            due = now - last_round >= self.interval  # the interval's round; a wake-up between them looks
            if due:  # only at the blocks the watch named
                last_round = now
            try:
                if self._client is None:
                    self._client = self._make_client()
                    self._client.mirror.on_replica_removed(self._replica_removed)
                mirror = self._client.mirror
                nodes = frozenset((name, rec.endpoint) for name, rec in mirror.nodes.items())
                self._departed |= {name for name, _ in self._seen_nodes} - {name for name, _ in nodes}
                removed, overflow = self._take_removed()
                if due and (self._pending or overflow or nodes != self._seen_nodes or now - last_full >= self.full_scan_s
                            or mirror.resyncs != self._seen_resyncs):
                    self._seen_nodes, self._seen_resyncs, last_full = nodes, mirror.resyncs, now
                    self._pending = self.scan() > 0
                elif removed or overflow:  # between rounds: the blocks the watch named; too many to
                    short = self.scan(removed) if removed else 0  # name (overflow): the next round scans all
                    self._pending = self._pending or overflow or short > 0
            except Exception as exc:  # noqa: BLE001 - a failed round is retried next interval
                if self._failure_said():  # retried every interval: said at most every 30 s
                    log.warning("replica repair on %s failed (retrying): %s", self.node, exc)
                self._pending = True

    def _live(self) -> dict[str, object]:
        return {name: rec for name, rec in self._client.mirror.nodes.items() if not rec.draining}

    def _unlisted_holders(self, fingerprint: str, hashes: list[bytes], listed: tuple[str, ...],
                          live: dict[str, object]) -> dict[bytes, set[str]]:
        """The live nodes not in `listed` that hold each of `hashes` (sealed here a moment ago)
        though the index does not list them yet, as the nodes themselves answer. A node that does not
        answer holds nothing here: a needless copy costs room, a missed one a block."""
        held: dict[bytes, set[str]] = {}
        for name in live:
            if name == self.node or name in listed:
                continue
            try:
                records = self._client.reads.lookup(name, fingerprint, hashes)
            except Exception:  # noqa: BLE001 - busy or gone: copy as if it held nothing
                continue
            for h, record in zip(hashes, records):
                if record is not None:
                    held.setdefault(h, set()).add(name)
        return held

    def _regroup_unlisted(self, groups: dict[tuple[str, tuple[str, ...]], list[bytes]],
                          young: dict[tuple[str, tuple[str, ...]], list[bytes]], live: dict[str, object]) -> None:
        """Move each `young` block of `groups` (short blocks by fingerprint and listed holders) that
        other nodes hold unlisted to its true group, or out where that makes it whole or another
        node's to repair."""
        for group, hashes in young.items():
            fingerprint, listed = group
            unlisted = self._unlisted_holders(fingerprint, hashes, listed, live)
            if not unlisted:
                continue
            groups[group] = [h for h in groups[group] if h not in unlisted]
            if not groups[group]:
                del groups[group]
            for h, more in unlisted.items():
                holders = {*listed, *more}
                if len(holders) < self.replicas and min(holders) == self.node:
                    groups.setdefault((fingerprint, tuple(sorted(holders))), []).append(h)

    def scan(self, only: set[tuple[str, bytes]] | None = None) -> int:
        """One pass: count and repair what this node is responsible for (of `only`, the blocks one
        of whose replicas left the index, when given); returns blocks still short."""
        mirror, live = self._client.mirror, self._live()
        held = self.store.keys() if only is None else self.store.sealed(sorted(only))
        young_after = time.monotonic() - PUBLISH_GRACE_S
        groups: dict[tuple[str, tuple[str, ...]], list[bytes]] = {}
        young: dict[tuple[str, tuple[str, ...]], list[bytes]] = {}
        for (fingerprint, block_hash), slot in held:
            holders = {n for n in mirror.lookup(fingerprint, block_hash) if n in live} | {self.node}
            if len(holders) >= self.replicas or min(holders) != self.node:
                continue
            group = (fingerprint, tuple(sorted(holders)))
            groups.setdefault(group, []).append(block_hash)
            if slot.held_since > young_after:
                young.setdefault(group, []).append(block_hash)
        self._regroup_unlisted(groups, young, live)
        short = sum(len(hashes) for hashes in groups.values())
        if only is not None and not short:
            return 0  # a look at a few blocks: the count stays the last full scan's
        self.counters["under_replicated_blocks"] = short
        if short > self._said_short:  # more than last time (a shrinking count is the repair's)
            why = (f"{', '.join(sorted(self._departed))} left" if self._departed else
                   "their other copies were evicted under memory pressure or removed")
            log.warning("%d blocks held here have fewer than %d live replicas (%s): repairing where there is room",
                        short, self.replicas, why)
        elif not short and self._said_short:
            log.info("every block held here has its %d replicas again", self.replicas)
        self._said_short = short
        if only is None:
            self._departed = set()
        if not short:
            return 0
        before, attempted, copies, stuck, full = short, False, 0, 0, 0
        spare = [n for n in live if n != self.node]
        roomy = {n for n in spare if has_room(live[n])}
        for (fingerprint, holders), hashes in groups.items():
            missing = self.replicas - len(holders)
            if not [n for n in spare if n not in holders]:
                stuck += len(hashes)
                continue  # nowhere to copy to until another node joins
            if not [n for n in roomy if n not in holders]:
                full += len(hashes)
                continue  # a copy would only be evicted again (or evict another's): until room appears
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
        if full and full > self._said_full:
            log.info("%d under-replicated blocks wait for room: every node that could take a copy is full (a copy "
                     "would evict another block)", full)
        self._said_full = full
        # Blocks waiting for a node or for room are looked at again at the next full scan, not every round.
        progress = short - stuck - full
        return before - stuck - full if attempted else progress  # after copying, check again once listed
