"""A node's presence in the metadata service: one lease, kept alive in the background, carrying the
node record, its Transfer Engine descriptor and every block record it publishes, each sealed by the
node (kvstore.index.signatures). When the node dies, the lease expires and all of it disappears
from every index mirror by itself."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Sequence

from ..errors import LeaseExpired, MetadataError, MetadataUnavailable
from ..index.records import BlockRecord, Layout, NodeRecord
from ..index.shards import check_place
from ..index.signatures import RecordSigner
from ..metadata import Lease, Metadata, Put
from ..outage_log import OutageLog

log = logging.getLogger(__name__)


class NodeSession:
    """Register a node under a lease; publish and unpublish its blocks in batched transactions.
    `signer` seals every record published (default: the key of an --insecure cluster, which anyone
    can derive)."""

    def __init__(self, metadata: Metadata, layout: Layout, node: NodeRecord, segment: str = "",
                 ttl: int = 10, on_lease_lost: Callable[[], None] | None = None,
                 signer: RecordSigner | None = None, place: tuple[int, int] = (0, 1)) -> None:
        self.metadata, self.layout, self.node = metadata, layout, node
        self.place = place  # (index, count) in a sharded index's map (kvstore.index.shards); (0, 1): unsharded
        self.signer = signer or RecordSigner(b"", layout.cluster, node.name)
        self.segment, self.ttl = segment, ttl
        self.on_lease_lost = on_lease_lost
        self.lease: Lease | None = None
        self._keepalive: asyncio.Task | None = None
        self._starting = asyncio.Lock()
        # Retried four times a second while etcd is down: one line, then one every 30 s.
        self._outage = OutageLog(log, f"lease keep-alive for {node.name} failed")

    async def start(self) -> None:
        """Check (and, in a sharded index, claim) this etcd's place in the shard map, grant the
        lease, write node and segment records, start the keep-alive. One start at a time, and none
        while the session is alive: a second lease would outlive close() with its keep-alive."""
        async with self._starting:
            if self.alive:
                return
            await check_place(self.metadata, self.layout, *self.place, self.metadata.url, claim=True)
            self.lease = await self.metadata.lease_grant(self.ttl)
            await self.metadata.put_many([
                Put(self.layout.node_key(self.node.name).encode(), self.node.encode(), self.lease.id),
                Put(self.layout.segment_key(self.node.name).encode(), self.segment.encode(), self.lease.id),
            ])
            self._keepalive = asyncio.create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        """Refresh the lease every ttl/3. A refresh that fails (etcd down, its member gone: the handle
        has already tried the others) is tried again after a short pause, not a whole interval: the
        TTL runs meanwhile, and a lease kept alive across a failover is one not lost. Each attempt is
        bounded by ttl/3 as well: a member cut off from its leader holds a refresh until the attempt
        times out, and one held for the handle's whole timeout (often longer than the TTL) lets the
        lease expire before the next member is tried."""
        interval = max(self.ttl / 3, 0.2)
        delay = interval
        while True:
            await asyncio.sleep(delay)
            try:
                await self.metadata.lease_keepalive(self.lease, timeout=interval)
                delay = interval
                self._outage.recovered()
            except LeaseExpired:
                log.warning("node %s lost its lease: its records are gone", self.node.name)
                if self.on_lease_lost is not None:
                    self.on_lease_lost()
                return
            except MetadataError as exc:  # etcd down or slow: keep trying until the TTL runs out
                self._outage.failed(exc)
                delay = min(interval, 0.25)
            except Exception:  # noqa: BLE001 - the keep-alive must outlive any surprise, or the lease goes
                log.exception("lease keep-alive for %s failed unexpectedly", self.node.name)
                delay = min(interval, 0.25)

    def _lease_id(self) -> int:
        if self.lease is None:
            raise LeaseExpired("session not started")
        return self.lease.id

    async def publish(self, fingerprint: str, blocks: Sequence[tuple[bytes, BlockRecord]]) -> int:
        """Make sealed blocks visible: one transaction per 128 records, never one per block. Each
        record goes signed by this node, whatever seal it came with."""
        lease = self._lease_id()
        encode = self.signer.encode
        puts = [Put(self.layout.block_key(fingerprint, h, self.node.name).encode(), encode(fingerprint, h, record),
                    lease) for h, record in blocks]
        return await self.metadata.put_many(puts)

    async def unpublish(self, fingerprint: str, hashes: Iterable[bytes]) -> int:
        keys = [self.layout.block_key(fingerprint, h, self.node.name) for h in hashes]
        return await self.metadata.delete_many(keys)

    @property
    def alive(self) -> bool:
        """Started, and its lease not lost since."""
        return self._keepalive is not None and not self._keepalive.done()

    async def put_node(self, record: NodeRecord) -> None:
        """Write the node's record again (usage, draining) under its lease."""
        await self.metadata.put(self.layout.node_key(record.name), record.encode(), lease=self._lease_id())

    async def node_names(self) -> list[str]:
        """Every node this cluster's metadata lists."""
        items, _ = await self.metadata.range(self.layout.root + "nodes/")
        return sorted(kv.key.decode().rsplit("/", 1)[-1] for kv in items)

    async def release(self) -> None:
        """Close the metadata handle (after close())."""
        await self.metadata.close()

    async def close(self, revoke: bool = True, attempts: int = 2) -> None:
        """Stop the keep-alive; revoke the lease (drop every record) unless told not to. A revoke that
        times out or finds etcd unavailable is tried again (`attempts` in all): one missed leaves the
        node's records in every mirror until the lease runs out (up to its TTL), and an etcd busy
        with other writers can hold a single attempt past its timeout."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            try:
                await self._keepalive
            except asyncio.CancelledError:
                pass
            self._keepalive = None
        if revoke and self.lease is not None:
            for attempt in range(1, attempts + 1):
                try:
                    await self.metadata.lease_revoke(self.lease)
                    break
                except MetadataUnavailable as exc:
                    if attempt == attempts:
                        raise
                    log.info("revoking the lease of %s failed (%s): trying again", self.node.name, exc)
                    await asyncio.sleep(0.2)
            self.lease = None
