"""The put pipeline: place -> reserve/lease -> write -> commit -> learn, one result per key.

- **place** (`PutPipeline.run`): pick a node for the keys still short of copies (same host first,
  then by DRAM use: `placement`), in rounds that stay well inside the node's DRAM; a node that fails
  is marked down and the keys it did not take go to the next.
- **small rounds** (`put_inline`): one control call carrying the bytes (same host: the unix socket,
  received straight into the node's arena; other hosts: the same wire over TCP, or TLS).
- **large rounds**: `reserve` slots (or take slots an earlier commit leased), `write` the bytes with
  the engine straight into the node's memory, `commit` them (asking for slots for the next put of
  this shape).
- **learn** (`learn`): check the node's per-key answer and teach this client's mirror what is now
  stored there (read-your-writes, unless the watch's newer news came first).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Collection

from transfer import Region, TransferError, TransferTimeout, Write

from ..errors import (
    InvalidConfig,
    AccessDenied,
    AllocationFailed,
    AuthenticationFailed,
    ConnectionsExhausted,
    KVStoreError,
    NodeRefused,
    NoStoreNodes,
    PutFailed,
    WrongSize,
)
from ..integrity import block_digests
from .links import NodeLinks
from .local_node import LocalNode
from .results import KeyPut, PutResult

log = logging.getLogger(__name__)
LOCAL_INLINE_MAX = 4 << 20  # same host: puts up to this many bytes carry them in the one request
WIRE_INLINE_MAX = 256 << 10  # other hosts: puts up to this many bytes carry them in one call
SYNC_PUBLISH_WAITS = 4  # a sync put answers within this many timeouts (the node waits up to 3 to publish)
# A node's failure that is about the node (down, refused, malformed answer), not the request: the
# node is left alone for a while and its keys go to the next one.
NODE_FAILURES = (TransferError, NoStoreNodes, NodeRefused, OSError, ValueError)


@dataclass
class PutBatch:
    """The blocks of one put, checked: each digest computed once, when a round first needs it,
    each buffer registered with the engine only if a round writes it through the engine."""

    fp: str
    hashes: list[bytes]
    views: list[memoryview]
    digests: list[bytes | None] = field(default_factory=list)
    registered: dict[int, Region] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.digests = [None] * len(self.views)

    def digests_of(self, keys: list[int]) -> list[bytes]:
        todo = [i for i in keys if self.digests[i] is None]
        for i, value in zip(todo, block_digests([self.hashes[i] for i in todo], [self.views[i] for i in todo])):
            self.digests[i] = value
        return [self.digests[i] for i in keys]  # type: ignore[misc]

    def regions_of(self, links: NodeLinks, keys: list[int]) -> list[Region]:
        for i in keys:
            if i not in self.registered:
                self.registered[i] = links.engine.register(self.views[i], remote_access=False)
        return [self.registered[i] for i in keys]

    def release(self, links: NodeLinks) -> None:
        for region in self.registered.values():
            links.engine.unregister(region)
        self.registered.clear()


@dataclass
class Round:
    """What one node answered for one round of keys (positions within the round)."""

    stored: int = 0  # newly stored there
    held: int = 0  # held there already (not written again)
    refused: dict[int, str] = field(default_factory=dict)  # position -> the node's reason


@dataclass
class Slots:
    """Where a large round's blocks go on a node: (position in the round, token, region, offset)
    per block the node does not hold yet, and whether they were leased earlier."""

    slots: list[tuple[int, int, int, int]]
    leased: bool
    held: int  # blocks the node holds already: no slot for them


class PutPipeline:
    """Stores a batch of blocks on `want` distinct nodes each and says, per key, where it landed or why not."""

    def __init__(self, links: NodeLinks, *, publish: str, repair: bool) -> None:
        self.links, self.publish, self.repair = links, publish, repair
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvs-digest")  # a large put's digests

    def close(self) -> None:
        self._hasher.shutdown(wait=True)

    @property
    def _repair_field(self) -> dict:
        return {"repair": True} if self.repair else {}

    # --- place ---------------------------------------------------------------------------------
    def run(self, batch: PutBatch, keys: list[int], want: int, exclude: Collection[str], *,
            strict: bool) -> tuple[list[list[str]], list[list[tuple[str, BaseException]]], PutResult]:
        """Place `keys` of `batch` on `want` nodes each. Returns, per key of the batch, the nodes
        holding it and each node's refusal, and the counts `put_many` returns. `strict` (put_many):
        a node's refusal of some blocks, and a full node (unless repairing), raise at once as
        they always did; otherwise they are the keys' results and the keys go to the next node."""
        links = self.links
        holders: list[list[str]] = [[] for _ in batch.hashes]
        refusals: list[list[tuple[str, BaseException]]] = [[] for _ in batch.hashes]
        stored = held = 0
        tried = set(exclude)
        try:
            while True:
                pending = [i for i in keys if len(holders[i]) < want]
                if not pending:
                    break
                total = sum(batch.views[i].nbytes for i in pending)
                record = links.placement.pick(links.mirror.nodes.values(), tried, total)
                if record is None:
                    break
                name = record.name
                tried.add(name)
                try:
                    for round_keys in rounds(batch, pending, max(record.tiers.get("dram", 0) // 4, 1)):
                        with links.mirror.asking(batch.fp, name, [batch.hashes[i] for i in round_keys]) as since:
                            done = self.put_round(name, batch, round_keys, since)
                        stored += done.stored
                        held += done.held
                        for position, i in enumerate(round_keys):
                            if position in done.refused:
                                refusals[i].append((name, PutFailed(done.refused[position])))
                            else:
                                holders[i].append(name)
                        if strict and done.refused:
                            first = next(iter(done.refused.values()))
                            raise PutFailed(f"{name} refused {len(done.refused)} of {len(round_keys)} blocks: {first}")
                except (AuthenticationFailed, AccessDenied, InvalidConfig, PutFailed):
                    raise  # a configuration error, not a dead node (PutFailed: strict only)
                except AllocationFailed as exc:
                    if strict and not self.repair:
                        raise
                    note(refusals, holders, pending, name, exc)  # full (of last copies): the next node, if any
                except ConnectionsExhausted as exc:  # alive, but no connection for us in time: not marked down
                    note(refusals, holders, pending, name, exc)
                except NODE_FAILURES as exc:
                    if isinstance(exc, WrongSize):
                        raise
                    links.mark_down(name, exc)
                    note(refusals, holders, pending, name, exc)
                finally:
                    links.placement.settle(name, total)
        finally:
            batch.release(links)
        return holders, refusals, PutResult(stored, held)

    def put_round(self, name: str, batch: PutBatch, keys: list[int], since: int) -> Round:
        """One round of blocks onto `name` (`since`: from the mirror's `asking`, taken before the
        round's first request)."""
        local = self.links.local(name)
        size = sum(batch.views[i].nbytes for i in keys)
        sync = self.publish == "sync"
        # A sync put's answer waits for the node's publish, which the node bounds by 3 of its timeouts.
        answer_within = self.links.timeout * (SYNC_PUBLISH_WAITS if sync else 1)
        if local is not None and size <= LOCAL_INLINE_MAX:  # one round trip, bytes with the request
            reply = self.put_inline(name, local, batch, keys, sync, answer_within)
            self.links.stats["local_puts"] += 1
            return self.learn(name, batch.fp, [batch.hashes[i] for i in keys], reply, since)
        wire = self.links.control(name)
        if local is None and size <= WIRE_INLINE_MAX:  # one round trip over the TCP wire
            reply = self.put_inline(name, wire, batch, keys, sync, answer_within)
            self.links.stats["wire_puts"] += 1
            return self.learn(name, batch.fp, [batch.hashes[i] for i in keys], reply, since)
        return self.put_by_engine(name, wire, batch, keys, since, sync, answer_within)

    # --- small rounds: the bytes with the request ---------------------------------------------
    def put_inline(self, name: str, wire: LocalNode, batch: PutBatch, keys: list[int], sync: bool,
                   answer_within: float) -> dict:
        """One control call carrying the blocks. Returns the reply."""
        hashes, views = [batch.hashes[i] for i in keys], [batch.views[i] for i in keys]
        self.links.stats["control_calls"] += 1
        reply, _ = wire.call({"op": "put", "fp": batch.fp, "hashes": [h.hex() for h in hashes],
                              "sizes": [v.nbytes for v in views],
                              "digests": [d.hex() for d in batch.digests_of(keys)], "sync": sync,
                              **self._repair_field}, views, timeout=answer_within)
        return reply

    # --- large rounds: reserve or lease -> write -> commit ------------------------------------
    def put_by_engine(self, name: str, wire: LocalNode, batch: PutBatch, keys: list[int], since: int,
                      sync: bool, answer_within: float) -> Round:
        """Large blocks: write them with the engine (into the node's mapped arena on this host)
        into slots leased by an earlier commit, or else reserved now, then commit them (asking for
        slots for the next put of this shape). Control calls go over `wire`."""
        links = self.links
        node = links.node(name)
        regs = batch.regions_of(links, keys)
        hashes = [batch.hashes[i] for i in keys]
        size = regs[0].size if all(r.size == regs[0].size for r in regs) else 0  # leases are of one size
        # The digests are computed, without the GIL, beside the reserve and the write (the source's
        # bytes: a caller changing them mid-put gets a refused block, never a wrong one). The engine
        # no longer takes them as it copies: BLAKE3 has no native home here, and SHA-256 there (OpenSSL)
        # costs more than BLAKE3 beside the copy (kvstore.integrity).
        hashing = self._hasher.submit(batch.digests_of, keys)
        # Over TCP the node lets our engine (its handshakes carry this id), and no other, write the
        # slots it reserves or leases for this put; on this host we write its mapped arena directly.
        peer = "" if node.peer.transport == "shm" else links.engine.peer_id
        got = self.reserve(name, node, wire, batch.fp, hashes, regs, size, peer)
        if not got.slots:
            return Round(0, got.held)
        tokens = [token for _, token, _, _ in got.slots]
        try:
            self.write(node, regs, got.slots, hashing)
            digests = hashing.result()
            commit = self.commit(name, node, wire, batch.fp, hashes, got, digests, size, len(regs), peer, sync,
                                 answer_within)
            positions = [i for i, _, _, _ in got.slots]
            done = self.learn(name, batch.fp, [hashes[i] for i in positions], commit, since)
            refused = {positions[p]: reason for p, reason in done.refused.items()}
            return Round(done.stored, done.held + got.held, refused)
        except TransferTimeout:
            raise  # the copy may still be landing: no abort, the slots expire at the node after it
        except BaseException:
            links.abort(name, tokens)
            raise

    def reserve(self, name: str, node: Any, wire: LocalNode, fp: str, hashes: list[bytes],
                regs: list[Region], size: int, peer: str) -> Slots:
        """Slots for the blocks the node does not hold: leased by an earlier commit, else reserved now."""
        links = self.links
        leased, aged = links.leases.take(node, name, fp, size, len(regs)) if size else (None, [])
        if aged:  # given back now rather than held at the node until they expire
            links.abort(name, aged)
        if leased is not None:
            return Slots([(i, slot.token, slot.region, slot.offset) for i, slot in enumerate(leased)], True, 0)
        links.stats["control_calls"] += 1
        reply, _ = wire.call({"op": "reserve", "fp": fp, "hashes": [h.hex() for h in hashes],
                              "sizes": [r.size for r in regs], **({"peer": peer} if peer else {}),
                              **self._repair_field})
        slots = [(i, s[0], s[1], s[2]) for i, s in enumerate(reply["slots"]) if s is not None]
        links.placement.seen(name, reply)
        return Slots(slots, False, len(hashes) - len(slots))  # slots come only for blocks the node lacks

    def write(self, node: Any, regs: list[Region], slots: list[tuple[int, int, int, int]], hashing: Any) -> None:
        """The blocks' bytes into their slots through the engine, waited for (after the digests)."""
        writes = [Write(regs[i], 0, node.peer.region(region), offset, regs[i].size) for i, _, region, offset in slots]
        moving = self.links.engine.submit(writes)
        try:
            hashing.result()
        finally:
            moving.wait(self.links.timeout)

    def commit(self, name: str, node: Any, wire: LocalNode, fp: str, hashes: list[bytes], got: Slots,
               digests: list[bytes], size: int, count: int, peer: str, sync: bool, answer_within: float) -> dict:
        """Seal the written slots (naming the blocks of leased ones) and ask for slots for the next
        put of this shape; keeps those granted. Returns the node's answer."""
        links = self.links
        slots = got.slots
        links.stats["control_calls"] += 1
        tokens = [token for _, token, _, _ in slots]
        named = [hashes[i] for i, _, _, _ in slots] if got.leased else None
        # Enough slots for another put like this one, less what is leased already.
        want = links.leases.wanted(node, name, fp, size, count)
        asked = time.monotonic()
        commit, _ = wire.call({"op": "commit", "fp": fp, "tokens": tokens,
                               "digests": [digests[i].hex() for i, _, _, _ in slots],
                               "sync": sync, "lease": {"size": size, "count": want},
                               **({"hashes": [h.hex() for h in named]} if named else {}),
                               **({"peer": peer} if peer else {})},
                              timeout=answer_within)
        granted = [(t, r, o) for t, r, o, n in commit.get("lease") or [] if n == size]
        never_usable = links.leases.keep(node, name, fp, size, granted, asked, commit.get("lease_ttl"))
        if never_usable:  # back at once (and no more are asked for)
            links.abort(name, never_usable)
        return commit

    # --- learn ---------------------------------------------------------------------------------
    def learn(self, name: str, fp: str, hashes: list[bytes], reply: dict, since: int) -> Round:
        """Check a put's answer, teach our own mirror what is now stored there; returns how many
        blocks are new there, how many it held already, and the blocks it refused, with its reasons."""
        self.links.placement.seen(name, reply)
        errors, records = reply["errors"], reply["records"]
        refused = {i: error for i, error in enumerate(errors) if error}
        learned = []
        for h, error, raw in zip(hashes, errors, records):
            if not error and raw:
                try:
                    learned.append((h, bytes.fromhex(raw)))
                except ValueError:
                    continue
        try:  # read-your-writes: no wait for the watch (unless its newer news came first)
            self.links.mirror.remember_many(fp, name, learned, since)
        except KVStoreError:
            pass  # a malformed record is left for the watch to bring (or not)
        stored = reply.get("stored")
        taken = len(errors) - len(refused)
        stored = taken if stored is None else int(stored)
        return Round(stored, max(0, taken - stored), refused)


def rounds(batch: PutBatch, keys: list[int], limit: int) -> list[list[int]]:
    """`keys` in rounds of at most `limit` bytes (one block at least): reservations are not
    evictable, so each round stays well inside the node's DRAM."""
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in keys:
        nbytes = batch.views[i].nbytes
        if current and size + nbytes > limit:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        out.append(current)
    return out


def note(refusals: list[list[tuple[str, BaseException]]], holders: list[list[str]], keys: list[int], name: str,
         exc: BaseException) -> None:
    """`name` failed with `exc` for those of `keys` it neither took nor refused one by one."""
    for i in keys:
        if name not in holders[i] and not (refusals[i] and refusals[i][-1][0] == name):
            refusals[i].append((name, exc))


def key_results(hashes: list[bytes], holders: list[list[str]], refusals: list[list[tuple[str, BaseException]]],
                never_sent: dict[int, BaseException], no_node: str) -> list[KeyPut]:
    """One `KeyPut` per key: where it landed, or why not (`no_node`: why no node was asked)."""
    results = []
    for i, h in enumerate(hashes):
        if i in never_sent:
            results.append(KeyPut(h, (), never_sent[i], str(never_sent[i])))
            continue
        reason = "; ".join(f"{name}: {exc}" for name, exc in refusals[i])
        if holders[i]:
            results.append(KeyPut(h, tuple(holders[i]), None, reason))
            continue
        last = refusals[i][-1][1] if refusals[i] else None
        error = last if isinstance(last, (KVStoreError, TransferError)) else \
            NoStoreNodes(f"no store node took it: {reason or no_node}")
        results.append(KeyPut(h, (), error, reason or no_node))
    return results

