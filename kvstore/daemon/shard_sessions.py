"""A node's presence in a sharded index (kvstore.index.shards): one NodeSession per shard, each
with its own lease carrying the node's record, its descriptor and the block records of that
shard's part of the hash space. Same face as NodeSession, so the daemon does not care which.

A publish returns revision 0: revisions of different etcd clusters do not compare, so a caller
waiting for "its" revision in a mirror (a remove) has nothing to wait for, and a mirror may list a
removed block for one watch delay longer (a read then misses; it never gets other bytes).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Iterable, Sequence

from ..index.records import BlockRecord, Layout, NodeRecord
from ..index.shards import split_by_shard
from ..index.signatures import RecordSigner
from ..metadata import Metadata
from .session import NodeSession


async def _all(calls: list) -> None:
    """Run the shards' calls side by side and wait for every one of them (a failure does not leave
    the others running unawaited, to land after the caller retried); then raise the first failure."""
    for result in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(result, BaseException):
            raise result


class ShardedSession:
    """See module docstring. `metadatas`: one handle per shard, in the map's order."""

    def __init__(self, metadatas: Sequence[Metadata], layout: Layout, node: NodeRecord, segment: str = "",
                 ttl: int = 10, on_lease_lost: Callable[[], None] | None = None,
                 signer: RecordSigner | None = None) -> None:
        count = len(metadatas)
        self.shards = [NodeSession(m, layout, node, segment, ttl, on_lease_lost, signer, place=(i, count))
                       for i, m in enumerate(metadatas)]
        self.layout, self.node = layout, node

    @property
    def lease(self):
        return self.shards[0].lease

    async def start(self) -> None:
        """Register on every shard whose session is not alive (all, the first time; after a lost
        lease, the shards that lost theirs: the others keep their lease and records)."""
        await _all([s.start() for s in self.shards if not s.alive])

    async def publish(self, fingerprint: str, blocks: Sequence[tuple[bytes, BlockRecord]]) -> int:
        parts = split_by_shard([h for h, _ in blocks], len(self.shards))
        await _all([s.publish(fingerprint, [blocks[i] for i in positions.tolist()])
                    for s, (positions, _) in zip(self.shards, parts) if len(positions)])
        return 0

    async def unpublish(self, fingerprint: str, hashes: Iterable[bytes]) -> int:
        parts = split_by_shard(list(hashes), len(self.shards))
        await _all([s.unpublish(fingerprint, own) for s, (_, own) in zip(self.shards, parts) if len(own)])
        return 0

    async def put_node(self, record: NodeRecord) -> None:
        await _all([s.put_node(record) for s in self.shards])

    async def node_names(self) -> list[str]:
        return await self.shards[0].node_names()

    async def close(self, revoke: bool = True, attempts: int = 2) -> None:
        await _all([s.close(revoke, attempts) for s in self.shards])

    async def release(self) -> None:
        await asyncio.gather(*[s.release() for s in self.shards], return_exceptions=True)
