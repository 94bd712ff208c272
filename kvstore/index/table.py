"""One fingerprint's blocks in the index mirror: records by hash (a dict, for lookups) and a flat
numpy hash index of placement ids (for match()).

A dict lookup per block costs a chain of dependent cache and TLB misses once the table holds a
million blocks (about 120 ns each here), so a 4,096-block match took 0.5 ms. The index is instead
probed by a small native function (cpp/index_probe.cpp) that prefetches rows ahead, so their misses
overlap, and stops at the prompt's first absent block.

The index has two levels of single-slot tables (level 0 addressed by the hash's first 8 bytes,
level 1, half the size, by its last 8) and a small overflow dict: a block lives in the first
level whose slot was free when it arrived (about 80 %, then 19 %, then 1 %). There are no probe
chains, so a removal just clears the slot.
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol, Sequence

import numpy as np
from transfer._native import index_prefix

from ..keys import HASH_BYTES

_ROW = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("pid", "<i4")])  # packed: 20 bytes a slot (cpp/index_probe.cpp)
EMPTY = -1
NO_IDS = np.zeros(0, np.int32)
_MIN_SLOTS = 1024
_GROW_AT = 0.75  # level-0 load factor that triggers a rehash to twice the entries


def _level(slots: int) -> np.ndarray:
    rows = np.zeros(slots, _ROW)
    rows["pid"] = EMPTY
    return rows


def _slots_for(count: int) -> int:
    return max(_MIN_SLOTS, 1 << max(0, (2 * count - 1).bit_length()))


def as_words(hashes: Sequence[bytes]) -> np.ndarray:
    """16-byte hashes as an (n, 2) array of little-endian u64 (ValueError if one is not 16 bytes)."""
    joined = b"".join(hashes)
    if len(joined) != HASH_BYTES * len(hashes):
        raise ValueError("block hashes are 16 bytes")
    return np.frombuffer(joined, "<u8").reshape(-1, 2)


class HashIndex:
    """16-byte hash -> placement id (int32), see the module docstring. Not thread-safe by itself."""

    def __init__(self, expected: int = 0) -> None:
        self._resize(_slots_for(expected))
        self.count = 0

    def _resize(self, slots: int) -> None:
        self.l0, self.l1 = _level(slots), _level(slots // 2)
        self.m0, self.m1 = np.uint64(slots - 1), np.uint64(slots // 2 - 1)
        self.overflow: dict[bytes, int] = {}
        # (k0, k1, pid) field views and mask per level, for one-key work with Python ints
        self._fields = [(lv["k0"], lv["k1"], lv["pid"], int(m), by_k1)
                        for lv, m, by_k1 in ((self.l0, self.m0, False), (self.l1, self.m1, True))]

    @property
    def nbytes(self) -> int:
        return self.l0.nbytes + self.l1.nbytes

    # --- reads -----------------------------------------------------------------------------
    def prefix(self, hashes: Sequence[bytes]) -> np.ndarray:
        """Placement ids of the leading run of `hashes` that are all present (a hash that is not 16
        bytes is never present)."""
        ids = np.empty(len(hashes), np.int32)
        return ids[:index_prefix(self.l0, self.l1, self.overflow, hashes, ids)]

    def _where(self, k0: int, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
        for keys0, keys1, pids, mask, by_k1 in self._fields:
            slot = (k1 if by_k1 else k0) & mask
            if pids.item(slot) >= 0 and keys0.item(slot) == k0 and keys1.item(slot) == k1:
                return keys0, keys1, pids, slot
        return None

    def words(self) -> np.ndarray:
        """Every hash held, as (n, 2) u64 words."""
        live = [np.stack([level["k0"], level["k1"]], 1)[level["pid"] >= 0] for level in (self.l0, self.l1)]
        spilled = np.frombuffer(b"".join(self.overflow), "<u8").reshape(-1, 2)
        return np.concatenate(live + [spilled])

    # --- writes ----------------------------------------------------------------------------
    def set(self, h: bytes, pid: int) -> None:
        """Insert or update one hash."""
        k0, k1 = int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")
        found = self._where(k0, k1)
        if found is not None:
            found[2][found[3]] = pid
            return
        if h in self.overflow:
            self.overflow[h] = pid
            return
        for keys0, keys1, pids, mask, by_k1 in self._fields:
            slot = (k1 if by_k1 else k0) & mask
            if pids.item(slot) < 0:
                keys0[slot], keys1[slot] = k0, k1
                pids[slot] = pid  # last: a slot is live only once its key is in place
                break
        else:
            self.overflow[h] = pid
        self.count += 1
        self._maybe_grow()

    def remove(self, h: bytes) -> bool:
        found = self._where(int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little"))
        if found is not None:
            keys0, keys1, pids, slot = found
            pids[slot] = EMPTY  # first: the slot is dead before its key goes
            keys0[slot] = keys1[slot] = 0
        elif self.overflow.pop(h, None) is None:
            return False
        self.count -= 1
        return True

    def add(self, words: np.ndarray, pids: np.ndarray) -> None:
        """Insert hashes known to be distinct and absent, in bulk."""
        self.reserve(self.count + len(words))
        left = np.arange(len(words))
        for level, mask, column in ((self.l0, self.m0, 0), (self.l1, self.m1, 1)):
            slots = (words[left, column] & mask).astype(np.intp)
            free = np.flatnonzero(level["pid"][slots] < 0)
            taken, first = np.unique(slots[free], return_index=True)  # one winner per slot
            winners = left[free[first]]
            level["k0"][taken], level["k1"][taken] = words[winners, 0], words[winners, 1]
            level["pid"][taken] = pids[winners]  # last: a slot is live only once its key is in place
            placed = np.zeros(len(left), bool)
            placed[free[first]] = True
            left = left[~placed]
        for i in left.tolist():
            self.overflow[words[i].tobytes()] = int(pids[i])
        self.count += len(words)

    def reserve(self, count: int) -> None:
        """Make room for `count` entries without a rehash on the way."""
        if count > _GROW_AT * len(self.l0):
            self._rehash(_slots_for(count))

    def _maybe_grow(self) -> None:
        if self.count > _GROW_AT * len(self.l0):
            self._rehash(_slots_for(self.count))

    def _rehash(self, slots: int) -> None:
        live = [level[level["pid"] >= 0] for level in (self.l0, self.l1)]
        spilled = list(self.overflow.items())
        words = np.concatenate([np.stack([rows["k0"], rows["k1"]], 1) for rows in live]
                               + [np.frombuffer(b"".join(h for h, _ in spilled), "<u8").reshape(-1, 2)])
        pids = np.concatenate([rows["pid"] for rows in live] + [np.array([p for _, p in spilled], np.int32)])
        self._resize(slots)
        self.count = 0
        self.add(np.ascontiguousarray(words), pids.astype(np.int32))


class Presence(Protocol):
    """Told which blocks appear in a mirror's current snapshot and which go (the host index's
    shared table, kvstore.index.shared_table)."""

    def appeared(self, fingerprint: str, words: np.ndarray) -> None: ...

    def one_appeared(self, fingerprint: str, h: bytes) -> None: ...

    def one_gone(self, fingerprint: str, h: bytes) -> None: ...

    def reset(self, blocks: dict[str, np.ndarray]) -> None: ...


class BlockTable:
    """One fingerprint's blocks. `records` maps hash -> node-numbered record bytes (a tuple of them
    when replicated) and is read without a lock; the index is read and written under `lock`.
    `presence`, where set, is told each block that appears or goes, under that lock."""

    def __init__(self, fingerprint: str = "", indexed: bool = True) -> None:
        self.fingerprint = fingerprint
        self.records: dict[bytes, bytes | tuple[bytes, ...]] = {}
        # None where a shared table answers match() for this mirror (the host index's): the
        # placements of a prefix are then read from the records (MirrorTables.prefix_ids)
        self.index: HashIndex | None = HashIndex() if indexed else None
        self.lock = threading.Lock()
        self.presence: Presence | None = None

    def __len__(self) -> int:
        return len(self.records)

    def prefix(self, hashes: Sequence[bytes],
               placement_of: Callable[[tuple[bytes, ...]], int] | None = None) -> np.ndarray:
        """Placement ids of the leading run of `hashes` held; without an index, from the records
        (`placement_of` interns a block's replicas: kvstore.index.mirror_tables)."""
        with self.lock:
            if self.index is not None:
                return self.index.prefix(hashes)
        if placement_of is None:
            raise ValueError("a table without an index needs placement_of")
        ids, records = [], self.records
        for h in hashes:
            if type(h) is not bytes:  # what the native probe reads too: any 16 bytes-like, nothing else
                if not isinstance(h, (bytes, bytearray, memoryview)):
                    break
                h = bytes(h)
            entry = records.get(h)
            if entry is None:
                break
            ids.append(placement_of(entry if isinstance(entry, tuple) else (entry,)))
        return np.array(ids, np.int32)

    def set(self, h: bytes, record: bytes | tuple[bytes, ...], pid: int) -> None:
        with self.lock:
            new = h not in self.records
            self.records[h] = record
            if self.index is not None:
                self.index.set(h, pid)
            if new and self.presence is not None:
                self.presence.one_appeared(self.fingerprint, h)

    def remove(self, h: bytes) -> None:
        with self.lock:
            if self.index is not None:
                self.index.remove(h)
            if self.records.pop(h, None) is not None and self.presence is not None:
                self.presence.one_gone(self.fingerprint, h)

    def add(self, hashes: list[bytes], records: list[bytes], pids: np.ndarray) -> None:
        """Bulk insert of distinct hashes not in the table yet."""
        words = as_words(hashes)
        with self.lock:
            self.records.update(zip(hashes, records))
            if self.index is not None:
                self.index.add(words, pids)
            if self.presence is not None:
                self.presence.appeared(self.fingerprint, words)

    def words(self) -> np.ndarray:
        with self.lock:
            return as_words(list(self.records)) if self.index is None else self.index.words()

    def reserve(self, count: int) -> None:
        with self.lock:
            if self.index is not None:
                self.index.reserve(count)
