"""Reading blocks from one node into caller buffers, and checking that they are the right bytes.

Routes, per block: a same-host NVMe block straight from the node's tier file (no daemon, no
network); a coded block (`--disk-codec`) into a scratch region and decoded here; the rest through the
engine (the mapped arena on this host, TCP elsewhere), wave by wave or stage by stage; with the wire
codec, through the node's framed wire. Every block's digest is checked against its record (a
same-host DRAM slot this client verified under the same seal number may skip it: `reads.VerifiedSlots`).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from transfer import Read, Region, TransferError

from ..codec import CodecError, decode
from ..errors import AccessDenied, AuthenticationFailed, ConnectionsExhausted, KVStoreError, NodeRefused, NoStoreNodes
from ..index.records import BlockRecord
from .links import NodeLink, NodeLinks
from .local_node import LocalNode, TierFile, fill_segments
from .reads import TierReads, VerifiedSlots, landed_digests, read_in_stages, read_in_waves

log = logging.getLogger(__name__)
WIRE_READ_BYTES = 2 << 20  # raw bytes one wire-codec `read` asks for (the node takes up to 64 MiB)
WIRE_READ_DEPTH = 4  # wire-codec `read`s of one get under way at once
Targets = list[list[tuple[Region, int, int]]]


class NodeReader:
    """Reads and verifies blocks from one node at a time (`read_from`)."""

    def __init__(self, links: NodeLinks, verified: VerifiedSlots, *, wire_codec: str | None) -> None:
        self.links, self.wire_codec = links, wire_codec
        self.verified = verified  # same-host DRAM slots this client verified (KVSTORE_VERIFY=once)
        self.tier_reads = TierReads()

    def close(self) -> None:
        self.tier_reads.close()

    def read_from(self, name: str, hashes: Sequence[bytes], wanted: list[tuple[int, BlockRecord]], targets: Targets,
                  staged: tuple[Sequence[int] | None, Callable[[int], None]] | None = None, fp: str = ""
                  ) -> list[int]:
        """Indexes of `wanted` read from `name` whose bytes match their digest."""
        links = self.links
        if self.wire_codec and staged is None and fp and links.local(name) is None and not links.is_busy(name):
            wire = links.wire(name)
            if wire is not None:
                return self.read_wire(name, wire, fp, hashes, wanted, targets)
        ops, owners, op_stages = [], [], []
        stage_list = list(staged[0] or ()) if staged is not None else []
        if any(b < a for a, b in zip(stage_list, stage_list[1:])):
            raise ValueError("stages must not decrease along a block's segments")
        last_stage = stage_list[-1] if stage_list else 0  # segments past the list belong to the last stage
        # Digests taken as bytes land: staged reads' before the consumer may change them, tier reads'
        # in the worker that read them.
        checked: dict[int, bytes] = {}
        records = dict(wanted)
        via_fd: list[tuple[int, BlockRecord]] = []
        failed: set[int] = set()
        try:
            tier = None
            if any(record.tier == "nvme" for _, record in wanted):
                local = links.local(name)
                try:
                    tier = local.tier() if local is not None else None
                except AuthenticationFailed:
                    raise
                except (OSError, ValueError, KVStoreError) as exc:  # the engine route still works
                    log.debug("no tier fd from %s: %s", name, exc)
            rest, coded = [], []
            for i, record in wanted:
                if tier is not None and record.tier == "nvme" and record.region == tier.region:
                    via_fd.append((i, record))
                elif record.codec:  # its frame, decoded here: read whole before any stage is told
                    coded.append((i, record))
                else:
                    rest.append((i, record))
            if rest or coded:
                node = links.node(name)
            if coded:
                failed.update(self.read_coded(node, coded, targets))
            for i, record in rest:
                remote, done = node.peer.region(record.region), 0
                for j, (region, offset, length) in enumerate(targets[i]):
                    take = min(length, record.size - done)
                    if take <= 0:
                        break
                    ops.append(Read(region, offset, remote, record.offset + done, take))
                    owners.append(i)
                    if staged is not None:
                        op_stages.append(stage_list[j] if j < len(stage_list) else last_stage)
                    done += take
            # Same-host DRAM slots read from the mapped arena: their seal numbers before the copy; a
            # slot this client verified under the same number is not hashed again if the number still
            # holds after the copy (reads.VerifiedSlots says why that is safe).
            view, before = (self.seal_view(name, rest) if rest and node.peer.transport == "shm" else None), {}
            if view is not None:
                before = {i: view.number(record.offset) for i, record in rest
                          if record.tier == "dram" and record.region == view.region}
            trusted = {i for i, number in before.items() if self.verified.trusted(view, records[i], number)}

            def tier_reads() -> None:  # same-host NVMe: straight from the tier file, no daemon, no network
                read = self.read_tier(tier, via_fd, targets, hashes)
                failed.update(i for i, _ in via_fd if i not in read)
                checked.update(read)

            if staged is not None:
                if via_fd:
                    tier_reads()
                results, owners = read_in_stages(links.engine, links.timeout, ops, owners, op_stages, staged[1],
                                                 hashes, checked, trusted)
            elif ops:
                results, owners, sums = read_in_waves(links.engine, time.monotonic() + links.timeout, ops, owners,
                                                      records, hashes, targets, trusted,
                                                      tier_reads if via_fd else None)
                checked.update(sums)
            else:
                results = []
                if via_fd:
                    tier_reads()
        except AuthenticationFailed:
            raise
        except (TransferError, NoStoreNodes, NodeRefused, OSError, ValueError) as exc:
            links.mark_down(name, exc)
            return []
        failed.update(owner for owner, result in zip(owners, results) if not result.ok)
        after = {i: view.number(records[i].offset) for i in before} if view is not None else {}
        for i in trusted:
            if i not in failed and after[i] == before[i]:
                checked[i] = records[i].digest
                links.stats["reads_unhashed"] += 1
        # Everything not checked yet (a trusted slot whose number moved during the copy included).
        checked.update(landed_digests(
            hashes, [(i, record) for i, record in wanted if i not in failed and i not in checked], targets))
        good = [i for i, record in wanted if i not in failed and checked[i] == record.digest]
        for i in good:
            if i in before and i not in trusted and before[i] == after[i]:
                self.verified.remember(view, records[i], before[i])
        return good

    def seal_view(self, name: str, items: list[tuple[int, BlockRecord]]):
        """The seal table of `name` when it is on this host and `items` has DRAM blocks, else None."""
        if not any(record.tier == "dram" for _, record in items):
            return None
        local = self.links.local(name)
        if local is None:
            return None
        try:
            return local.seals()
        except AuthenticationFailed:
            raise
        except (OSError, ValueError, KVStoreError) as exc:  # hashed as ever
            log.debug("no seal table from %s: %s", name, exc)
            return None

    def read_coded(self, node: NodeLink, items: list[tuple[int, BlockRecord]], targets: Targets) -> set[int]:
        """Coded blocks (an NVMe tier with --disk-codec) through the engine: each frame into a
        scratch region, decoded here into its destination. Returns the indexes that failed."""
        engine = self.links.engine
        scratches = [engine.register(bytearray(record.stored), remote_access=False) for _, record in items]
        failed: set[int] = set()
        try:
            ops = [Read(scratch, 0, node.peer.region(record.region), record.offset, record.stored)
                   for scratch, (_, record) in zip(scratches, items)]
            results = engine.submit(ops).wait(self.links.timeout, raise_on_error=False)
            for scratch, (i, record), result in zip(scratches, items, results):
                try:
                    if not result.ok:
                        raise CodecError("read failed")
                    fill_segments(decode(scratch.buffer, record.codec, record.size), targets[i])
                except CodecError:
                    failed.add(i)
        finally:
            for scratch in scratches:
                engine.unregister(scratch)
        self.links.stats["coded_reads"] += len(items) - len(failed)
        return failed

    def read_wire(self, name: str, wire: LocalNode, fp: str, hashes: Sequence[bytes],
                  wanted: list[tuple[int, BlockRecord]], targets: Targets) -> list[int]:
        """Blocks through the node's framed wire with the wire codec (see `wire_codec`): each decoded
        here and kept only when its digest over the raw bytes is the record's. Small requests, up to
        WIRE_READ_DEPTH at once on pooled connections, so that the node codes one while another is
        on the link and this client decodes a third (one large request would do each in turn)."""
        links = self.links
        chunks, chunk, total = [], [], 0
        for i, record in wanted:
            if chunk and total + record.size > WIRE_READ_BYTES:
                chunks.append(chunk)
                chunk, total = [], 0
            chunk.append((i, record))
            total += record.size
        if chunk:
            chunks.append(chunk)

        def one(chunk: list[tuple[int, BlockRecord]]) -> tuple[list[int], int, int]:
            """(indexes landed whole and right, bytes sent, raw bytes) of one request."""
            reply, parts = wire.read({"op": "read", "fp": fp, "hashes": [bytes(hashes[i]).hex() for i, _ in chunk],
                                      "codec": self.wire_codec}, timeout=links.timeout)
            records = reply["records"]
            if len(records) != len(chunk):
                raise ValueError(f"{name} answered {len(records)} records for {len(chunk)}")
            parts_left, landed, sent_bytes, raw_bytes = iter(parts), [], 0, 0
            for (i, wanted_record), raw in zip(chunk, records):
                if raw is None:
                    continue
                data = next(parts_left)
                try:
                    sent = BlockRecord.decode(bytes.fromhex(raw))
                    if sent.size != wanted_record.size:
                        continue
                    fill_segments(decode(data, sent.codec, sent.size) if sent.codec else data, targets[i])
                except (CodecError, ValueError):
                    continue
                sent_bytes += len(data)
                raw_bytes += sent.size
                landed.append((i, wanted_record))
            sums = dict(landed_digests(hashes, landed, targets))
            return [i for i, record in landed if sums[i] == record.digest], sent_bytes, raw_bytes

        good: list[int] = []
        busy = False
        pool = ThreadPoolExecutor(min(WIRE_READ_DEPTH, len(chunks)), thread_name_prefix="kvs-wire-read") \
            if len(chunks) > 1 else None
        try:
            results = pool.map(one, chunks) if pool is not None else map(one, chunks)
            for read, sent_bytes, raw_bytes in results:
                good += read
                links.stats["wire_reads"] += 1  # counted here, not by the workers: += is not atomic
                links.stats["wire_read_bytes"] += sent_bytes
                links.stats["wire_read_raw_bytes"] += raw_bytes
        except (AuthenticationFailed, AccessDenied):
            raise
        except ConnectionsExhausted as exc:  # no connection for another request: the rest through the engine
            links.busy(name, exc)
            busy = True
        except (OSError, ValueError, KVStoreError, TimeoutError) as exc:
            links.mark_down(name, exc)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        if busy:
            done = set(good)
            good += self.read_from(name, hashes, [(i, r) for i, r in wanted if i not in done], targets, fp=fp)
        return good

    def read_tier(self, tier: TierFile, items: list[tuple[int, BlockRecord]], targets: Targets,
                  hashes: Sequence[bytes]) -> dict[int, bytes]:
        """Same-host NVMe blocks straight from the node's tier file: {index: digest of what landed}."""
        read = self.tier_reads.read(tier, items, targets, hashes)
        self.links.stats["nvme_fd_reads"] += len(read)  # counted here, not by the workers: += is not atomic
        self.links.stats["nvme_fd_bytes"] += sum(record.size for i, record in items if i in read)
        return read
