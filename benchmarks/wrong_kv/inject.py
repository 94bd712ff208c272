"""Faults injected into stored blocks: their bytes (a daemon's DRAM arena or NVMe tier file) or
their records in etcd. Each injection checks first that it changes a block a reader would accept
(the bytes at the record's place match its digest) and after that the block no longer verifies,
and can be undone."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .cluster import Cluster, Held

SECTOR = 4096  # a torn write stops at a sector boundary


@dataclass
class Injection:
    kind: str
    fingerprint: str
    block_hash: bytes
    held: Held  # the block's record as it was
    original: bytes = b""  # the slot's bytes before (byte faults)
    fake: Held | None = None  # the record written instead (wrong_holder)
    detail: str = ""


def _flip(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    out = bytearray(data)
    pos, bit = rng.randrange(len(out)), rng.randrange(8)
    out[pos] ^= 1 << bit
    return bytes(out), f"bit {bit} of byte {pos}"


def _other_bytes(cluster: Cluster, rng: random.Random, held: Held, others: list[Held]) -> tuple[bytes, str]:
    """What a slot holds when this block's write never reached it: zeros (never written), or
    another block's bytes (the slot's previous occupant)."""
    size = held.record.size
    same = [o for o in others if o.record.size == size and not o.record.codec and
            (o.node, o.record.tier, o.record.offset) != (held.node, held.record.tier, held.record.offset)]
    if same and rng.random() < 0.5:
        other = rng.choice(same)
        return cluster.read_slot(other.node, other.record), f"another block's bytes ({other.node} {other.record.tier})"
    return bytes(size), "zeros"


def corrupt_bytes(cluster: Cluster, rng: random.Random, kind: str, fp: str, block_hash: bytes, held: Held,
                  others: list[Held]) -> Injection | None:
    """A byte fault in a stored block; None when its slot no longer holds it (moved meanwhile)."""
    record = held.record
    original = cluster.read_slot(held.node, record)
    if not cluster.intact(block_hash, record, original):
        return None
    if kind in ("dram_bitflip", "nvme_bitflip"):
        data, detail = _flip(rng, original)
    elif kind == "torn_nvme_write":
        cut = rng.randrange(1, record.size // SECTOR) * SECTOR  # the sectors written before the tear
        filler, what = _other_bytes(cluster, rng, held, others)
        data = original[:cut] + filler[cut:]
        detail = f"torn after {cut} of {record.size} bytes, the rest {what}"
    elif kind == "store_failed_record_visible":
        data, what = _other_bytes(cluster, rng, held, others)
        detail = f"record visible, the slot holds {what}"
    else:
        raise ValueError(kind)
    if data == original:  # another block's bytes equal to this one's: no fault at all
        return None
    cluster.write_slot(held.node, record, data)
    if cluster.intact(block_hash, record, cluster.read_slot(held.node, record)):
        raise RuntimeError(f"{kind}: the corrupted block at {held.node} still verifies")
    return Injection(kind, fp, block_hash, held, original=original, detail=f"{held.node} {record.tier}: {detail}")


def undo_bytes(cluster: Cluster, injection: Injection) -> None:
    """Put the block's bytes back (its node may have dropped it already: then its slot is free)."""
    if injection.held.node in cluster.daemons:
        cluster.write_slot(injection.held.node, injection.held.record, injection.original)


def rewrite_holder(cluster: Cluster, rng: random.Random, fp: str, block_hash: bytes, held: Held,
                   others: list[Held]) -> tuple[Injection, int] | None:
    """The block's etcd record rewritten to point at the wrong holder: (a) moved to another node,
    which never stored it; (b) on its node, at another block's slot; (c) another block's whole
    record under this block's key. Returns the injection and the etcd revision of the write."""
    nodes = sorted(n for n in cluster.daemons if n != held.node and not cluster.daemons[n].remote)
    choices = ["moved"] if nodes else []
    same_node = [o for o in others if o.node == held.node and o.record.offset != held.record.offset]
    if same_node:
        choices.append("other slot")
    if others:
        choices.append("other record")
    if not choices:
        return None
    variant = rng.choice(choices)
    if variant == "moved":
        node = rng.choice(nodes)
        record = held.record
        if cluster.daemons[node].disk_dir is None and record.tier == "nvme":
            return None
        there = cluster.read_slot(node, record)
        if cluster.intact(block_hash, record, there):
            return None  # that node's bytes there are this block's: no fault
        detail = f"record moved from {held.node} to {node}"
    elif variant == "other slot":
        other = rng.choice(same_node)
        node, record = held.node, replace(other.record, digest=held.record.digest)
        detail = f"record on {node} points at another block's {other.record.tier} slot"
    else:
        other = rng.choice(others)
        node, record = other.node, other.record
        detail = f"another block's record ({other.node} {other.record.tier}) under this key"
    lease = _node_lease(cluster, node, others, held)
    key = cluster.layout.block_key(fp, block_hash, node).encode()
    fake = Held(node, record, lease, key, record.encode())
    if node != held.node:
        cluster.etcd.delete(held.key)
    revision = cluster.etcd.put(key, fake.value, lease)
    return Injection("wrong_holder", fp, block_hash, held, fake=fake, detail=detail), revision


def _node_lease(cluster: Cluster, node: str, others: list[Held], held: Held) -> int:
    """The lease `node`'s records live on (a record written for it goes when the node goes)."""
    for h in [held, *others]:
        if h.node == node:
            return h.lease
    kv = cluster.etcd.get(cluster.layout.node_key(node))
    return kv.lease if kv is not None else 0


def undo_holder(cluster: Cluster, injection: Injection) -> None:
    """The block's own record back, and the rewritten one gone, unless someone (a node storing
    the block anew) wrote either key since."""
    fake, held = injection.fake, injection.held
    assert fake is not None
    if fake.key == held.key:
        from kvstore.metadata.base import Compare, Put

        cluster.etcd.call(cluster.etcd.meta.txn([Compare(held.key, "value", "==", fake.value)],
                                                [Put(held.key, held.value, held.lease)]))
        return
    cluster.etcd.delete_if(fake.key, fake.value)
    if held.node in cluster.daemons:
        cluster.etcd.put_if_absent(held.key, held.value, held.lease)
