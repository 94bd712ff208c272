"""Where things live in the metadata service, and how records are encoded.

    /kvstore/<cluster>/nodes/<node>                     NodeRecord (JSON)      on the node's lease
    /kvstore/<cluster>/segments/<node>                  engine descriptor      on the node's lease
    /kvstore/<cluster>/blocks/<fingerprint>/<hash>/<node>  BlockRecord (66 B; 71 coded; +16 a tenant's)  on the node's lease

A block key ends in the owning node so that each replica lives and dies with its own node's lease,
and two nodes publishing the same block never overwrite each other.

A record is its fields, then its seal: the MACs of the node that published it (kvstore.index.signatures),
which a reader checks before it trusts the record's place and digest.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass, field

from ..errors import InvalidRecord
from ..integrity import DIGEST_BYTES
from ..keys import HASH_BYTES

MAC_BYTES = 16  # one MAC of a record's seal (kvstore.index.signatures)

TIERS = ("dram", "nvme")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")  # node and fingerprint names (fullmatch)
NAME_RULE = "1-128 chars of [A-Za-z0-9_.:-]"
_BLOCK = struct.Struct(f"<BBIQI{DIGEST_BYTES}s")  # version, tier, region, offset, size, digest
# 4: the fields of version 2 (the block's 32-byte BLAKE3 digest, kvstore.integrity), then the seal:
# the publishing node's MAC under a key derived from the cluster secret (16 bytes), and for a tenant's
# fingerprint one under a key derived from that tenant's secret (16 more). Versions 1 (an xxh3-64
# checksum anyone could forge a match for), 2 and 3 (unsigned: anyone who could write etcd chose
# what readers accepted) are refused, never read as version 4.
BLOCK_RECORD_VERSION = 4
BLOCK_FIELDS_BYTES = _BLOCK.size
BLOCK_RECORD_BYTES = _BLOCK.size + MAC_BYTES  # the common record: untenanted, raw
# 5: a block stored coded (kvstore.codec, an NVMe tier with --disk-codec): version 4's fields, then
# the codec (u8, never 0) and the bytes stored (u32), then the seal. `size` stays the block's own
# (raw) size and the digest is over those raw bytes. A raw block's record is version 4.
_CODED = struct.Struct(f"<BBIQI{DIGEST_BYTES}sBI")
CODED_RECORD_VERSION = 5
CODED_RECORD_BYTES = _CODED.size + MAC_BYTES
SEAL_SIZES = (MAC_BYTES, 2 * MAC_BYTES)  # the node's MAC; and a tenant's
UNSIGNED = bytes(MAC_BYTES)  # the seal a record encoded without one gets: no reader accepts it
MAX_BLOCK_BYTES = 64 << 20  # the largest block a node takes (one reservation, one record)


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRecord(f"{kind} name {name!r} must be {NAME_RULE}")
    return name


@dataclass(frozen=True)
class NodeRecord:
    """A store node: where to reach it and what it holds."""

    name: str
    endpoint: str  # admin/control address
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> capacity bytes
    host: str = ""
    version: str = "0.1.0"
    used: dict[str, int] = field(default_factory=dict)  # tier -> bytes used (refreshed periodically)
    draining: bool = False  # accepts no new puts
    replicas: int = 1  # the cluster's replica count as this node was started with (`--replicas`)
    secured: bool = True  # callers must know the cluster secret (False: started with --insecure)

    def encode(self) -> bytes:
        check_name("node", self.name)
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "NodeRecord":
        try:
            data = json.loads(raw)
            return cls(name=data["name"], endpoint=data["endpoint"], tiers=dict(data.get("tiers", {})),
                       host=data.get("host", ""), version=data.get("version", ""), used=dict(data.get("used", {})),
                       draining=bool(data.get("draining", False)), replicas=max(1, int(data.get("replicas", 1))),
                       secured=bool(data.get("secured", True)))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRecord(f"bad node record: {exc}") from exc


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """Where one replica of a block sits on its node."""

    tier: str
    region: int
    offset: int
    size: int  # the block's bytes (raw, as its writer put it)
    digest: bytes  # of the block's bytes (kvstore.integrity.block_digest)
    codec: int = 0  # kvstore.codec id of what is stored at `offset` (0: the raw bytes)
    stored: int = 0  # bytes stored at `offset` when coded (0 when raw: `size`)
    # The publishing node's MACs over the fields (kvstore.index.signatures.RecordSigner); b"" until
    # signed. Not part of a record's equality: two records are equal when they name the same place.
    seal: bytes = field(default=b"", compare=False)

    @property
    def span(self) -> int:
        """Bytes at `offset` to read: the stored frame when coded, else the block."""
        return self.stored if self.codec else self.size

    def fields(self) -> bytes:
        """The record without its seal: what the seal's MACs cover (with fingerprint, hash and node)."""
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            raise InvalidRecord(f"cannot encode {self!r}: the digest is {DIGEST_BYTES} bytes")
        try:
            if self.codec:
                if not 0 < self.stored:
                    raise ValueError("a coded block stores at least one byte")
                return _CODED.pack(CODED_RECORD_VERSION, TIERS.index(self.tier), self.region, self.offset, self.size,
                                   self.digest, self.codec, self.stored)
            return _BLOCK.pack(BLOCK_RECORD_VERSION, TIERS.index(self.tier), self.region, self.offset, self.size,
                               self.digest)
        except (ValueError, struct.error) as exc:
            raise InvalidRecord(f"cannot encode {self!r}: {exc}") from exc

    def encode(self) -> bytes:
        """Fields and seal; a record not signed yet gets UNSIGNED, a seal no reader accepts."""
        if self.seal and len(self.seal) not in SEAL_SIZES:
            raise InvalidRecord(f"a record's seal is {' or '.join(map(str, SEAL_SIZES))} bytes, not {len(self.seal)}")
        return self.fields() + (self.seal or UNSIGNED)

    @staticmethod
    def fields_size(raw: bytes) -> int:
        """Where the fields of an encoded record end (its seal follows), from its version byte."""
        return _CODED.size if raw[:1] == bytes([CODED_RECORD_VERSION]) else _BLOCK.size

    @classmethod
    def decode(cls, raw: bytes) -> "BlockRecord":
        # The version first: an older node's record is named as such, whatever its length.
        if raw[:1] and raw[0] not in (BLOCK_RECORD_VERSION, CODED_RECORD_VERSION):
            raise InvalidRecord(f"block record version {raw[0]} not understood (this node reads versions "
                                f"{BLOCK_RECORD_VERSION} and {CODED_RECORD_VERSION}: every node of a cluster runs "
                                "one release)")
        layout = _CODED if raw[:1] == bytes([CODED_RECORD_VERSION]) else _BLOCK
        if len(raw) - layout.size not in SEAL_SIZES:
            raise InvalidRecord(f"block record of {len(raw)} bytes, expected "
                                f"{' or '.join(str(layout.size + n) for n in SEAL_SIZES)}")
        if layout is _CODED:
            _, tier, region, offset, size, digest, codec, stored = _CODED.unpack_from(raw)
            if not codec or not stored:
                raise InvalidRecord("a coded block record without its codec or stored size")
        else:
            _, tier, region, offset, size, digest = _BLOCK.unpack_from(raw)
            codec = stored = 0
        if tier >= len(TIERS):
            raise InvalidRecord(f"block record tier {tier} not understood")
        # Bounded before anything is allocated for it: a reader sizes its buffers (and a coded
        # block's decode) from these fields before the bytes' digest can be checked.
        if size > MAX_BLOCK_BYTES:
            raise InvalidRecord(f"block record of a {size}-byte block: blocks are at most {MAX_BLOCK_BYTES} bytes")
        if codec and stored > size:
            raise InvalidRecord(f"coded block record storing {stored} bytes of a {size}-byte block: a frame is "
                                "kept only when it is smaller than the block")
        return cls(TIERS[tier], region, offset, size, digest, codec, stored, bytes(raw[layout.size:]))


@dataclass(frozen=True)
class Layout:
    """Key names of one cluster."""

    cluster: str = "default"

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)

    @property
    def root(self) -> str:
        return f"/kvstore/{self.cluster}/"

    @property
    def shard_key(self) -> str:
        """Where a shard of a sharded index records its place (kvstore.index.shards): under the
        root, where the cluster's etcd roles reach; a mirror's tables ignore it."""
        return f"{self.root}shard"

    def node_key(self, node: str) -> str:
        return f"{self.root}nodes/{check_name('node', node)}"

    def segment_key(self, node: str) -> str:
        return f"{self.root}segments/{check_name('node', node)}"

    def blocks_prefix(self, fingerprint: str | None = None) -> str:
        return f"{self.root}blocks/" + (f"{fingerprint}/" if fingerprint else "")

    def block_key(self, fingerprint: str, block_hash: bytes, node: str) -> str:
        if len(block_hash) != HASH_BYTES:
            raise InvalidRecord(f"block hash must be {HASH_BYTES} bytes, got {len(block_hash)}")
        return f"{self.root}blocks/{fingerprint}/{block_hash.hex()}/{check_name('node', node)}"
