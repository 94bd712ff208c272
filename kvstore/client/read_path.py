"""The read pipeline: locate -> land -> read -> recheck -> report, one bool per key.

- **locate**: each block's replicas from the index mirror (records whose seal is not their node's
  are dropped), DRAM and this host first, nodes marked down last.
- **land**: every destination becomes segments (region, offset, length) of registered memory.
- **read**: replica by replica, each node's share through `NodeReader` (which checks digests);
  a block that fails on one replica is tried on the next.
- **recheck**: blocks whose bytes failed their digest may have moved on their node (demoted,
  promoted): the node is asked where they are now and the moved ones are read once more.
- **report**: hits and corrupt copies go to their nodes in batched hit reports (LRU, re-checks).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from transfer import Region, TransferError

from ..errors import AuthenticationFailed, KVStoreError, WrongSize
from ..index.records import BlockRecord
from ..index.signatures import RecordVerifier
from .links import NodeLinks
from .node_reads import NodeReader, Targets
from .reads import VerifiedSlots
from .reports import HitReports

log = logging.getLogger(__name__)
Candidates = list[list[tuple[str, BlockRecord]]]


def host_bytes(data: Any) -> memoryview:
    """A flat byte view of a buffer, numpy array or CPU torch tensor (no copy)."""
    if type(data).__module__.startswith("torch"):
        import torch

        if data.device.type != "cpu" or not data.is_contiguous():
            raise WrongSize("torch tensors must be contiguous CPU tensors here")
        return memoryview(data.view(-1).view(torch.uint8).numpy())
    view = memoryview(data)
    if not view.c_contiguous:
        raise WrongSize("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class ReadPipeline:
    """Reads blocks into caller buffers from their replicas and reports what it found."""

    def __init__(self, links: NodeLinks, records: RecordVerifier, verified: VerifiedSlots, *,
                 wire_codec: str | None) -> None:
        self.links, self.records = links, records
        self.nodes = NodeReader(links, verified, wire_codec=wire_codec)
        self.reports = HitReports(self.touch)

    def close_reports(self) -> None:
        self.reports.close()  # before the connections its reports go over

    def close(self) -> None:
        self.nodes.close()

    def run(self, fp: str, hashes: list[bytes], outs: list[Any], expected: int | None,
            stages: Sequence[int] | None, on_stage: Callable[[int], None] | None,
            filled: list[int] | None = None) -> list[bool]:
        """`filled`, when given, gets the bytes each block filled of its buffer (0: a miss)."""
        candidates = self.locate(fp, hashes)
        temporary: list[Region] = []
        try:
            targets = self.land(outs, temporary)
            for i, (segments, options) in enumerate(zip(targets, candidates)):
                room = sum(length for _, _, length in segments)
                if expected is not None and room != expected:
                    raise WrongSize(f"a buffer of {room} bytes for a block of {expected} (the fingerprint's geometry)")
                if options and options[0][1].size > room:
                    raise WrongSize(f"buffer of {room} bytes for a block of {options[0][1].size}")
                if filled is not None and options and options[0][1].size < room and expected is None \
                        and len(segments) == 1:
                    # Asked how much was filled (Client.get_into, as Mooncake's get_into): a plain
                    # buffer larger than a block of any size takes it at its start.
                    region, offset, _ = segments[0]
                    room = options[0][1].size
                    targets[i] = [(region, offset, room)]
                # A stored block smaller than a destination in parts would fill it only partly: not a hit.
                candidates[i] = [c for c in options if c[1].size == room]
            found, hits, mismatched = self.read(fp, hashes, candidates, targets, stages, on_stage)
            corrupt = self.recheck(fp, hashes, targets, found, hits, mismatched, staged=on_stage is not None)
        finally:
            for region in temporary:
                self.links.engine.unregister(region)
        self.reports.add(fp, hits, corrupt)
        if filled is not None:
            filled[:] = [sum(length for _, _, length in segments) if hit else 0 for segments, hit in zip(targets, found)]
        return found

    # --- locate ----------------------------------------------------------------------------------
    def locate(self, fp: str, hashes: list[bytes]) -> Candidates:
        """Each block's replicas, best first (DRAM, this host), those on nodes marked down last."""
        links = self.links
        here, nodes = links.here, links.mirror.nodes  # a copy: take it once per call
        candidates: Candidates = []
        refused = self.records.refused
        for replicas in links.mirror.lookup_many(fp, hashes, self.records):
            ranked = sorted(replicas.items(), key=lambda kv: (kv[1].tier != "dram",
                                                              getattr(nodes.get(kv[0]), "host", "") != here, kv[0]))
            candidates.append([c for c in ranked if links.placement.usable(c[0])] or ranked)
        if self.records.refused != refused:
            self.check_refused(fp, hashes, candidates)
        links.stats["refused_records"] = self.records.refused
        return candidates

    def check_refused(self, fp: str, hashes: Sequence[bytes], kept: Candidates) -> None:
        """Records of these blocks failed their seal: forged in the index, or this client's secret is
        not the cluster's (or its tenant's). Authenticating to their nodes tells which: a wrong
        secret raises AuthenticationFailed in one line, as a put does, instead of every get missing."""
        links = self.links
        suspects: set[str] = set()
        for h, found in zip(hashes, kept):
            suspects |= set(links.mirror.lookup(fp, bytes(h))) - {name for name, _ in found}
        for name in sorted(suspects):
            if name in links.nodes or not links.placement.usable(name):
                continue  # authenticated already (the records were forged), or known to be down
            try:
                links.node(name)
            except AuthenticationFailed:
                raise
            except (KVStoreError, TransferError, OSError, ValueError) as exc:
                log.debug("could not reach %s to check this client's secret: %s", name, exc)

    # --- land ------------------------------------------------------------------------------------
    def land(self, outs: list[Any], temporary: list[Region]) -> Targets:
        """Every destination as segments (region, offset, length): a plain buffer is one segment of
        a region registered for this call (added to `temporary`); a list of segments (e.g. one
        block's layers in registered KV-cache tensors) is read into place with one op per segment."""
        targets: Targets = []
        for out in outs:
            if isinstance(out, list):
                targets.append(out)
                continue
            view = out.host_view() if isinstance(out, Region) else host_bytes(out)
            if view.readonly:
                raise WrongSize("output buffers must be writable")
            region = out if isinstance(out, Region) else self.links.engine.register(view, remote_access=False)
            if region is not out:
                temporary.append(region)
            targets.append([(region, 0, view.nbytes)])
        return targets

    # --- read ------------------------------------------------------------------------------------
    def read(self, fp: str, hashes: list[bytes], candidates: Candidates, targets: Targets,
             stages: Sequence[int] | None, on_stage: Callable[[int], None] | None
             ) -> tuple[list[bool], dict[str, list[bytes]], dict[str, list[tuple[int, BlockRecord]]]]:
        """Replica by replica: (found, hits per node, blocks that failed per node)."""
        found = [False] * len(hashes)
        hits: dict[str, list[bytes]] = {}
        mismatched: dict[str, list[tuple[int, BlockRecord]]] = {}  # node -> blocks that failed there
        # A staged reader may already use early stages: bytes from a second replica would come too late.
        attempts = max((len(c) for c in candidates), default=0)
        if on_stage is not None:
            attempts = min(attempts, 1)
        for attempt in range(attempts):
            by_node: dict[str, list[tuple[int, BlockRecord]]] = {}
            for i, options in enumerate(candidates):
                if not found[i] and attempt < len(options):
                    name, record = options[attempt]
                    by_node.setdefault(name, []).append((i, record))
            staged = (stages, on_stage) if on_stage is not None and len(by_node) == 1 else None
            for name, wanted in by_node.items():
                for i in self.nodes.read_from(name, hashes, wanted, targets, staged, fp=fp):
                    found[i] = True
                    hits.setdefault(name, []).append(bytes(hashes[i]))
                for i, record in wanted:
                    if not found[i] and self.links.placement.usable(name):
                        mismatched.setdefault(name, []).append((i, record))
        return found, hits, mismatched

    # --- recheck ---------------------------------------------------------------------------------
    def recheck(self, fp: str, hashes: list[bytes], targets: Targets, found: list[bool],
                hits: dict[str, list[bytes]], mismatched: dict[str, list[tuple[int, BlockRecord]]],
                staged: bool) -> dict[str, list[bytes]]:
        """Blocks that failed on a node, read again where they moved; returns those still corrupt there."""
        corrupt: dict[str, list[bytes]] = {}
        for name, failed in mismatched.items():
            # Staged: a consumer may already use stages of the first read.
            moved, gone = self.reread_moved(name, fp, hashes, failed, targets, found) if not staged else ([], set())
            for i in moved:
                hits.setdefault(name, []).append(bytes(hashes[i]))
            # Still corrupt there even when another replica served the block: the node re-checks it.
            bad = [bytes(hashes[i]) for i, _ in failed if i not in moved and i not in gone]
            if bad:
                corrupt[name] = bad
        return corrupt

    def reread_moved(self, name: str, fp: str, hashes: Sequence[bytes], failed: list[tuple[int, BlockRecord]],
                     targets: Targets, found: list[bool]) -> tuple[list[int], set[int]]:
        """Blocks whose bytes at `name` failed their digest may have moved there (demoted, promoted)
        since our mirror heard: ask the node where they are now and read the moved ones once more.
        Returns (blocks found that way, blocks the node no longer holds)."""
        wanted = [(i, record) for i, record in failed if not found[i]]
        if not wanted:
            return [], set()
        asked = [bytes(hashes[i]) for i, _ in wanted]
        mirror = self.links.mirror
        with mirror.asking(fp, name, asked) as since:
            try:
                fresh = self.lookup(name, fp, asked)
            except AuthenticationFailed:
                raise
            except (KVStoreError, TransferError, OSError, ValueError) as exc:
                log.debug("lookup at %s failed: %s", name, exc)
                return [], set()
            gone = {i for (i, _), now in zip(wanted, fresh) if now is None}
            again = [(i, now) for (i, was), now in zip(wanted, fresh)
                     if now is not None and now != was and now.size == sum(length for _, _, length in targets[i])]
            read = self.nodes.read_from(name, hashes, again, targets, fp=fp) if again else []
            for i in read:
                found[i] = True
            # The next get goes straight to the right place without waiting for the watch (whose
            # news, if it arrived while we asked, wins: hence still inside the question).
            landed = set(read)
            try:
                mirror.remember_many(fp, name, [(bytes(hashes[i]), now) for i, now in again if i in landed], since)
                mirror.forget_many(fp, name, [bytes(hashes[i]) for i in gone], since)
            except KVStoreError:
                pass
        return read, gone

    def lookup(self, name: str, fp: str, hashes: list[bytes]) -> list[BlockRecord | None]:
        """The node's current record of each block (None where it does not hold it)."""
        reply, _ = self.links.control(name).call({"op": "lookup", "fp": fp, "hashes": [h.hex() for h in hashes]})
        records = reply.get("records")
        if not isinstance(records, list) or not all(r is None or isinstance(r, str) for r in records):
            raise ValueError(f"{name} answered a malformed lookup")
        raws = [None if r is None else bytes.fromhex(r) for r in records]
        if len(raws) != len(hashes):
            raise ValueError(f"{name} answered {len(raws)} records for {len(hashes)} blocks")
        # A reply altered on the way (a relay without the session key) names no other bytes either.
        check = self.records.check
        return [None if raw is None or not check(fp, h, name, raw) else BlockRecord.decode(raw)
                for h, raw in zip(hashes, raws)]

    # --- report ----------------------------------------------------------------------------------
    def touch(self, name: str, fp: str, hits: list[bytes], corrupt: list[bytes]) -> None:
        """Send one hit report to `name` (HitReports' sender); best effort."""
        try:
            self.links.control(name).call({"op": "touch", "fp": fp, "hashes": [h.hex() for h in hits],
                                           "corrupt": [h.hex() for h in corrupt]}, wait=False)
        except (KVStoreError, TransferError, OSError, ValueError) as exc:
            log.debug("touch to %s failed: %s", name, exc)
