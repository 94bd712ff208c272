"""What an index mirror knows and how changes go into it: the `Snapshot` of nodes, segments and
block tables, and the `MirrorTables` every snapshot of one mirror shares (node numbers, the
interned placements of replicas) with the code that applies a key's change, a watch event's or a
snapshot page's, to a snapshot. Callers hold the mirror's apply lock (kvstore.index.mirror)."""
from __future__ import annotations

import binascii
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvalidRecord
from ..keys import HASH_BYTES
from ..metadata import Page
from .records import BLOCK_RECORD_BYTES, BLOCK_RECORD_VERSION, MAC_BYTES, TIERS, BlockRecord, Layout, NodeRecord, \
    check_name
from .table import BlockTable, Presence, as_words

log = logging.getLogger(__name__)
# The records a page of one fingerprint takes in bulk: the common one (raw, the node's MAC), and a
# tenant's (with the tenant's MAC too); anything else goes through the one-key path.
_RECORD_SIZES = (BLOCK_RECORD_BYTES, BLOCK_RECORD_BYTES + MAC_BYTES)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one block is held: (node, tier) per replica. Shared by every block placed alike."""

    locations: tuple[tuple[str, str], ...]
    nodes: frozenset[str]


def node_prefix_lengths(ids: np.ndarray, placements: list[Placement]) -> dict[str, int]:
    """For each node, how many of the leading blocks (their placement ids) it holds itself."""
    if not len(ids):
        return {}
    lengths: dict[str, int] = {}
    alive = set(placements[int(ids[0])].nodes)
    for start in (np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist():  # where the placement changes
        nodes = placements[int(ids[start])].nodes
        for node in alive - nodes:
            lengths[node] = start
        alive &= nodes
        if not alive:
            return lengths
    for node in alive:
        lengths[node] = len(ids)
    return lengths


class Snapshot:
    """Everything the mirror knows; replaced whole on resync."""

    def __init__(self, indexed: bool = True) -> None:
        self.indexed = indexed  # False: its block tables keep no match() index (a shared table answers)
        self.nodes: dict[str, NodeRecord] = {}
        self.segments: dict[str, str] = {}
        # fingerprint -> its blocks. A record is the encoded BlockRecord prefixed with the owner's
        # node number (u16).
        self.blocks: dict[str, BlockTable] = {}
        self.presence: Presence | None = None  # told of blocks appearing and going while current

    def table(self, fingerprint: str) -> BlockTable:
        table = self.blocks.get(fingerprint)
        if table is None:
            table = self.blocks[fingerprint] = BlockTable(fingerprint, self.indexed)
            table.presence = self.presence
        return table

    def share(self, presence: Presence | None) -> None:
        """Tell `presence` (None: nobody) of this snapshot's blocks from now on, starting with all
        of them."""
        self.presence = presence
        for table in list(self.blocks.values()):
            with table.lock:
                table.presence = presence
        if presence is not None:
            presence.reset({fp: table.words() for fp, table in list(self.blocks.items())})

    @property
    def block_count(self) -> int:
        return sum(len(t) for t in list(self.blocks.values()))


class MirrorTables:
    """Node numbers (a record is kept prefixed with its node's u16 number), interned placements
    (every block placed alike shares one), and applying changes to a snapshot."""

    def __init__(self, layout: Layout) -> None:
        self.root = layout.root.encode()
        self.blocks_prefix = layout.blocks_prefix().encode()
        self.node_names: list[str] = []
        self._node_numbers: dict[str, int] = {}
        self._node_tags: dict[bytes, bytes] = {}  # b"/<node>" (a key's tail) -> its u16 number
        self.placements: list[Placement] = []  # placement id -> placement; append-only
        self._placement_ids: dict[frozenset, int] = {}
        self._single = np.full(0, -1, np.int32)  # node * len(TIERS) + tier -> id of that lone replica
        self.malformed = 0  # entries ignored as malformed

    def node_of(self, raw: bytes) -> str:
        """The node of a kept record (its u16 prefix)."""
        return self.node_names[int.from_bytes(raw[:2], "little")]

    def node_number(self, node: str) -> int:
        number = self._node_numbers.get(node)
        if number is None:
            check_name("node", node)
            number = self._node_numbers[node] = len(self.node_names)
            self.node_names.append(node)
        return number

    def placement_id(self, raws: tuple[bytes, ...]) -> int:
        spots = frozenset((int.from_bytes(r[:2], "little"), r[3]) for r in raws)
        pid = self._placement_ids.get(spots)
        if pid is None:
            locations = tuple(sorted((self.node_names[n], TIERS[t]) for n, t in spots))
            pid = self._placement_ids[spots] = len(self.placements)
            self.placements.append(Placement(locations, frozenset(n for n, _ in locations)))
        return pid

    def apply(self, snap: Snapshot, kind: str, key: bytes, value: bytes) -> tuple[str, bytes, str] | None:
        """Apply one key's change; returns the block replica it was about, if any."""
        rest = key[len(self.root):].decode()
        section, _, name = rest.partition("/")
        if section == "blocks":
            fingerprint, hash_hex, node = name.split("/", 2)
            replica = (fingerprint, bytes.fromhex(hash_hex), node)
            self.apply_block(snap, kind, *replica, value)
            return replica
        elif section == "nodes":
            if kind == "put":
                snap.nodes[name] = NodeRecord.decode(value)
            else:
                snap.nodes.pop(name, None)
        elif section == "segments":
            if kind == "put":
                snap.segments[name] = value.decode()
            else:
                snap.segments.pop(name, None)

    def apply_block(self, snap: Snapshot, kind: str, fingerprint: str, block_hash: bytes, node: str,
                     value: bytes) -> None:
        if len(block_hash) != HASH_BYTES:
            raise InvalidRecord(f"block hash of {len(block_hash)} bytes")
        table = snap.table(fingerprint)
        number = self.node_number(node).to_bytes(2, "little")
        entry = table.records.get(block_hash)
        if kind == "put":
            if entry == number + value:  # known already: the watch echoing a putting client's own block
                return
            BlockRecord.decode(value)  # refuse what we could not serve later
        raws = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        kept = tuple(r for r in raws if r[:2] != number)
        if kind == "put":
            kept = tuple(sorted(kept + (number + value,)))
        if kept:
            table.set(block_hash, kept[0] if len(kept) == 1 else kept, self.placement_id(kept))
        elif entry is not None:
            table.remove(block_hash)

    def apply_slowly(self, snap: Snapshot, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        for key, value in zip(keys, values):
            try:
                self.apply(snap, "put", key, value)
            except (InvalidRecord, ValueError, UnicodeDecodeError) as exc:
                self.malformed += 1
                if self.malformed <= 10:
                    log.warning("ignoring malformed index entry %r: %s", key[:200], exc)

    def single_ids(self, codes: np.ndarray) -> np.ndarray:
        """Placement id of each lone replica (node * len(TIERS) + tier), interning new ones."""
        top = int(codes.max()) + 1
        if top > len(self._single):
            grown = np.full(max(top, 2 * len(self._single)), -1, np.int32)
            grown[:len(self._single)] = self._single
            self._single = grown
        pids = self._single[codes]
        if (pids < 0).any():
            for code in np.unique(codes[pids < 0]).tolist():
                node, tier = divmod(code, len(TIERS))
                raw = node.to_bytes(2, "little") + bytes((BLOCK_RECORD_VERSION, tier))
                self._single[code] = self.placement_id((raw,))
            pids = self._single[codes]
        return pids

    def load_page(self, snap: Snapshot, page: Page) -> None:
        """A page of block records in bulk; anything unusual (replicas in the page, blocks already
        known, malformed entries) goes through the one-key path."""
        keys, values, n = page.keys, page.values, len(page.keys)
        first, plen = keys[0], len(self.blocks_prefix)
        cut = first.find(b"/", plen) + 1
        base = first[:cut]
        if not cut or not keys[-1].startswith(base) or not first.startswith(self.blocks_prefix):
            return self.apply_slowly(snap, keys, values)  # spans fingerprints (sorted: ends decide)
        try:
            fingerprint = base[plen:-1].decode("ascii")
            unhex = binascii.a2b_hex
            hashes = [unhex(k[cut:cut + 32]) for k in keys]
            tags = [k[cut + 32:] for k in keys]
            numbers = list(map(self._node_tags.get, tags))
            if None in numbers:
                for tag in set(tags) - self._node_tags.keys():
                    if not tag.startswith(b"/"):
                        raise ValueError("hash is not 32 hex digits")
                    self._node_tags[tag] = self.node_number(tag[1:].decode("ascii")).to_bytes(2, "little")
                numbers = list(map(self._node_tags.get, tags))
            size = len(values[0])
            joined = b"".join(values)
            if size not in _RECORD_SIZES or len(joined) != size * n:
                raise ValueError("record of the wrong size")
            heads = np.frombuffer(joined, np.uint8).reshape(n, size)[:, :2]
            if (heads[:, 0] != BLOCK_RECORD_VERSION).any() or (heads[:, 1] >= len(TIERS)).any():
                raise ValueError("record version or tier not understood")
        except (ValueError, InvalidRecord, UnicodeDecodeError):
            return self.apply_slowly(snap, keys, values)
        table = snap.table(fingerprint)
        words = as_words(hashes)
        odd = np.zeros(n, bool)  # replicas side by side in the page, or blocks the table has already
        same = (words[1:] == words[:-1]).all(1)
        odd[1:] |= same
        odd[:-1] |= same
        known = table.records.keys() & hashes
        if known:
            odd |= np.fromiter((h in known for h in hashes), bool, n)
        codes = np.frombuffer(b"".join(numbers), "<u2").astype(np.int64) * len(TIERS) + heads[:, 1]
        pids = self.single_ids(codes)
        records = list(map(bytes.__add__, numbers, values))
        if page.more:
            table.reserve(len(table) + page.count)
        if odd.any():
            normal = np.flatnonzero(~odd).tolist()
            table.add([hashes[i] for i in normal], [records[i] for i in normal], pids[normal])
            rest = np.flatnonzero(odd).tolist()
            self.apply_slowly(snap, [keys[i] for i in rest], [values[i] for i in rest])
        else:
            table.add(hashes, records, pids)
