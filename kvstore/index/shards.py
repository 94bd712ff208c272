"""The block index spread over several etcd clusters ("shards") by block hash: opt-in, for
clusters whose index outgrows one etcd (docs/architecture.md, "How far the index scales").

A metadata URL naming several etcd clusters, separated by ';' (`etcd://a:2379;etcd://b:2379`),
shards the index: each block record goes to the shard its block hash picks (`shard_of`), and every
shard also carries each node's record and Transfer Engine descriptor under that node's lease
there. So each shard is a whole index of its part of the hash space, followed by a mirror of its
own (kvstore.index.sharded_mirror), and a node whose lease on one shard ends loses that shard's
records only. Nodes and segments are read from the first shard. One etcd (no ';') is the default
and writes nothing of this.

Every shard records its place in the map (index and count) at `Layout.shard_key`; a process whose
URL gives it another place (a different count, or the same etcds in another order, which would
send each block's record where no reader looks) is refused at connect with both places named.
"""
from __future__ import annotations

import json
from operator import itemgetter
from typing import Sequence

import numpy as np

from ..errors import ShardMapMismatch
from ..keys import HASH_BYTES
from ..metadata import Compare, Metadata, Put, prefix_end
from .records import Layout


def shard_of(block_hash: bytes, shards: int) -> int:
    """The shard that holds `block_hash`'s records. Block hashes are BLAKE3 outputs (kvstore.keys),
    so their first 8 bytes spread blocks evenly; one prompt's blocks land on every shard."""
    return int.from_bytes(bytes(block_hash[:8]), "little") % shards if shards > 1 else 0


def split_by_shard(hashes: Sequence[bytes], shards: int) -> list[tuple[np.ndarray, Sequence[bytes]]]:
    """For each shard: the positions in `hashes` of its blocks, and those hashes, in prompt order
    (shard_of's rule, vectorised: one join, one stable sort, one gather). Writers split their
    batches and readers their prompts with it."""
    if not len(hashes):
        return [(np.empty(0, np.int64), ()) for _ in range(shards)]
    try:
        joined = b"".join(hashes)  # bytes, bytearray and memoryview alike
    except TypeError:
        joined = b""
    if len(joined) != HASH_BYTES * len(hashes):  # not all full-size hashes: each one's first 8 bytes
        heads = np.frombuffer(b"".join(bytes(h[:8]).ljust(8, b"\0") for h in hashes), "<u8")
    else:  # the first 8 bytes of each row (what shard_of reads)
        heads = np.frombuffer(joined, np.uint8).reshape(len(hashes), HASH_BYTES)[:, :8].copy().view("<u8").ravel()
    which = heads % np.uint64(shards)
    order = np.argsort(which, kind="stable")  # by shard, prompt order kept within each
    ends = np.searchsorted(which[order], np.arange(1, shards + 1, dtype=np.uint64)).tolist()
    picked = itemgetter(*order.tolist())(hashes) if len(hashes) > 1 else (hashes[0],)
    out, start = [], 0
    for end in ends:
        out.append((order[start:end], picked[start:end]))
        start = end
    return out


def _place(index: int, count: int) -> bytes:
    return json.dumps({"shard": index, "of": count}, sort_keys=True).encode()


def _describe(raw: bytes) -> str:
    try:
        place = json.loads(raw)
        return f"shard {int(place['shard']) + 1} of {int(place['of'])}"
    except (ValueError, KeyError, TypeError):
        return f"an unreadable place ({raw[:60]!r})"


async def check_place(metadata: Metadata, layout: Layout, index: int, count: int, url: str, *,
                      claim: bool) -> None:
    """Refuse (ShardMapMismatch) when the etcd at `url` records another place than shard `index` of
    `count` for this cluster. With `claim` (a node registering), an etcd that records none is
    given this one; a reader only checks. One etcd of an unsharded cluster (count 1) records none
    and must not be a shard of another map."""
    key = layout.shard_key.encode()
    mine = _place(index, count)
    if claim and count > 1 and await metadata.get(key) is None:
        nodes = (layout.root + "nodes/").encode()
        if (await metadata.range_page(nodes, prefix_end(nodes), limit=1)).keys:
            raise ShardMapMismatch(
                f"etcd {url} holds nodes of cluster {layout.cluster!r} and no shard map: it is that cluster's whole "
                f"(unsharded) index, which this process's metadata URL would make {_describe(mine)}: give every "
                "process the same URL (a sharded cluster starts on etcd clusters of its own)")
        result = await metadata.txn([Compare(key, "version", "==", 0)], [Put(key, mine)])
        if result.succeeded:
            return
    found = await metadata.get(key)
    if found is None or found.value == mine:
        return
    raise ShardMapMismatch(
        f"etcd {url} is {_describe(found.value)} of cluster {layout.cluster!r}'s index, but this process's "
        f"metadata URL makes it {_describe(mine)}: every process of the cluster must list the same etcd "
        "clusters in the same order (separated by ';')")
