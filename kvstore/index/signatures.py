"""Block records signed by the node that publishes them, checked by the readers that use them.

Why: a reader trusts a record to say where a block's bytes are and which digest they hash to. The
digest is keyed by the block's hash alone (kvstore.integrity), a public function, so whoever could
write a record (anyone with write access to etcd, no kvstore secret needed) could point a block at
other bytes with a digest computed to match them, and a reader would accept those bytes.

So every record carries a seal made by its node: a 16-byte MAC (keyed BLAKE3, a PRF) under a key
derived from the cluster secret, the cluster and the node, over the fingerprint, the block hash,
the node and every field of the record. For a tenant's fingerprint (`tenant:...`) the seal holds a
second MAC, under a key derived from that tenant's secret (the node has it from its tenants file),
since a client authenticated as a tenant lacks the cluster secret: it checks that one. A reader
checks the MAC before it reads bytes by a record: a record that fails is dropped and counted, so
a writer to etcd without a secret can cause misses, never make a reader accept other bytes. The
MACs are deterministic: the record a node returns in a reply and the one it publishes are the
same bytes, so a client that learned a block from its put's reply recognises the watch's echo.

What a seal does not stop: a record of the same block that the node signed earlier (another place,
since freed) replayed into etcd; its digest is still the block's own, so the bytes found there fail
it (a miss). On an --insecure cluster (no secret) the key derives from the empty secret: anyone can
sign records there. MAC_BYTES: 128 bits; a forger has no key to test guesses against offline, and
each guess costs a write to etcd and a reader's miss.
"""
from __future__ import annotations

import hmac
import threading
from typing import Mapping

import blake3

from ..keys import fingerprint_tenant
from .records import MAC_BYTES, BlockRecord

_NODE_CONTEXT = b"kvstore block record v4\0"
_TENANT_CONTEXT = b"kvstore tenant block record v4\0"


def _key(secret: bytes, context: bytes) -> bytes:
    return blake3.blake3(context, key=blake3.blake3(secret).digest()).digest()


def node_record_key(secret: bytes, cluster: str, node: str) -> bytes:
    """The key of `node`'s MACs, from the cluster secret (empty on an --insecure cluster)."""
    return _key(secret, _NODE_CONTEXT + cluster.encode() + b"\0" + node.encode())


def tenant_record_key(tenant_secret: bytes, cluster: str, tenant: str, node: str) -> bytes:
    """The key of `node`'s MACs on tenant `tenant`'s records, from that tenant's own secret."""
    return _key(tenant_secret, _TENANT_CONTEXT + cluster.encode() + b"\0" + tenant.encode() + b"\0" + node.encode())


def _message(fingerprint: str, block_hash: bytes, node: bytes, fields: bytes) -> bytes:
    # Unambiguous: names never hold a NUL (records.NAME), the hash is 16 bytes, the fields' length
    # follows from their version byte.
    return fingerprint.encode() + b"\0" + bytes(block_hash) + node + b"\0" + fields


def _mac(key: bytes, message: bytes) -> bytes:
    return blake3.blake3(message, key=key).digest(MAC_BYTES)


class RecordSigner:
    """A node's side: seals the records it publishes and hands out (`tenants`: name -> secret of
    the tenants whose records also get a tenant MAC)."""

    def __init__(self, secret: bytes, cluster: str, node: str, tenants: Mapping[str, bytes] | None = None) -> None:
        self.node = node
        self._node = node.encode()
        self._key = node_record_key(secret, cluster, node)
        self._tenant_keys = {name: tenant_record_key(s, cluster, name, node) for name, s in (tenants or {}).items()}

    def seal(self, fingerprint: str, block_hash: bytes, record: BlockRecord) -> bytes:
        """The seal of `record` as `block_hash` of `fingerprint` on this node."""
        message = _message(fingerprint, block_hash, self._node, record.fields())
        seal = _mac(self._key, message)
        tenant = fingerprint_tenant(fingerprint)
        if tenant:
            key = self._tenant_keys.get(tenant)
            if key is not None:  # a tenant this node was not given: its readers drop the record (a miss)
                seal += _mac(key, message)
        return seal

    def sign(self, fingerprint: str, block_hash: bytes, record: BlockRecord) -> BlockRecord:
        """`record` with its seal."""
        return BlockRecord(record.tier, record.region, record.offset, record.size, record.digest, record.codec,
                           record.stored, self.seal(fingerprint, block_hash, record))

    def encode(self, fingerprint: str, block_hash: bytes, record: BlockRecord) -> bytes:
        """`record` encoded with its seal: what goes into etcd and into replies."""
        fields = record.fields()
        return fields + self.seal(fingerprint, block_hash, record)


class RecordVerifier:
    """A reader's side: whether an encoded record was sealed by the node it is listed under. Built
    from the cluster secret (checks the node's MAC), or with `tenant`, from that tenant's secret
    (checks the tenant MAC, on that tenant's fingerprints only). `refused` counts the records that
    failed."""

    def __init__(self, secret: bytes, cluster: str, tenant: str = "") -> None:
        self._secret, self._cluster, self.tenant = secret, cluster, tenant
        self._keys: dict[str, bytes] = {}  # node -> key (derived on first use)
        self._lock = threading.Lock()
        self.refused = 0

    def _node_key(self, node: str) -> bytes:
        key = self._keys.get(node)
        if key is None:
            key = (tenant_record_key(self._secret, self._cluster, self.tenant, node) if self.tenant
                   else node_record_key(self._secret, self._cluster, node))
            self._keys[node] = key
        return key

    def check(self, fingerprint: str, block_hash: bytes, node: str, raw: bytes) -> bool:
        """Whether `raw` (an encoded record) is `node`'s, for `block_hash` of `fingerprint`."""
        end = BlockRecord.fields_size(raw)
        if self.tenant:
            if fingerprint_tenant(fingerprint) != self.tenant:
                return self._refuse()  # a tenant checks only its own records
            tag = raw[end + MAC_BYTES : end + 2 * MAC_BYTES]
        else:
            tag = raw[end : end + MAC_BYTES]
        if len(tag) != MAC_BYTES:
            return self._refuse()
        expected = _mac(self._node_key(node), _message(fingerprint, block_hash, node.encode(), raw[:end]))
        return hmac.compare_digest(tag, expected) or self._refuse()

    def _refuse(self) -> bool:
        with self._lock:
            self.refused += 1
        return False
