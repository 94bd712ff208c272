"""The host index's shared table: which blocks the host's one mirror holds, in shared memory that
the host's worker processes probe themselves, so `match()` costs no round trip to the daemon.

The daemon (kvstore.daemon.host_index) writes it; each worker gets a read-only descriptor of it
over the same-host socket and maps it. It holds presence only — a key per block held anywhere,
the block hash XORed with a per-fingerprint salt (keyed by a random key handed over with the
table, so no one without it can aim a hash at another fingerprint's key), so every fingerprint
shares one table — never records: where a block is and its seals still come from the daemon (`lookup`, `prefix`).

Layout (little-endian): a 64-byte header of u64 words — magic, sequence, state (retired),
heartbeat, slots of levels 0, 1 and 2, flags (stale, loading) — then the three levels' 20-byte rows (k0, k1, pid), as the
mirror's own index (kvstore.index.table) but with the overflow in shared memory too: level 0 is
addressed by k0, level 1 by k1, level 2 (the few that find both taken) by linear probing from
k0 ^ k1, where a pid of -1 ends a chain and -2 marks a removed entry. A row's pid is the index
shard that listed the block (0 for one etcd), so a shard's view can be replaced alone.

Consistency: a sequence lock. The writer makes the sequence odd, changes rows, makes it even; a
probe (cpp/index_probe.cpp, `shared_prefix`) that saw it odd or moved answers -1 and is tried
again. Stores are ordered on x86-64 (TSO), which this relies on: elsewhere no table is offered and
workers ask the daemon. A table outgrown, or one shard's snapshot swapped in, is built anew beside
the old one, which readers use whole until it is marked retired; a worker then asks for the new
one.

Liveness: the daemon holds an exclusive flock on the table's memfd for as long as it writes it;
the kernel drops it the moment the daemon dies, however it dies, and a worker's non-blocking
shared lock then succeeds (about 2 us a try). The daemon also stamps the header every BEAT_S with
CLOCK_MONOTONIC (one clock for the whole host) and the mirror's stale and loading flags. A worker
takes no answer from a table whose daemon is gone or whose stamp is older than DEAD_AFTER_S (a
daemon that hangs): it asks the daemon over its socket instead, which fails over to the worker's
own mirror in one logged line (kvstore.index.host_mirror).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import platform
import secrets
import struct
import threading
import time
import weakref
import contextlib
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np

from transfer import _native

from ..memfd import reader_fd, writer_memfd
from .table import _ROW

log = logging.getLogger(__name__)
MAGIC = b"KVHIDX01"
HEADER = 64
SEQ, STATE, BEAT, SLOTS, FLAGS = 1, 2, 3, 4, 7  # header word numbers (SLOTS: three words)
RETIRED = 1  # STATE bit, set under the sequence lock, never cleared
STALE, LOADING = 1, 2  # FLAGS bits, stamped with the heartbeat
EMPTY, GONE = -1, -2  # pid of a free row; of a removed level-2 row (a chain goes on through it)
BEAT_S = 0.1
DEAD_AFTER_S = 1.0  # a stamp older than this: the daemon is stuck, its table not trusted
PROBE_TRIES = 50  # probes that met a change under way before the daemon is asked instead
_MIN_SLOTS = 1024
_GROW_AT = 0.75  # level-0 load factor that moves the table to a larger one


def supported() -> bool:
    """Whether this host can share a table (the sequence lock relies on x86-64's store order)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and \
        hasattr(_native, "shared_prefix")


def fingerprint_salt(fingerprint: str, key: bytes) -> tuple[int, int]:
    """Two u64 words XORed into a fingerprint's block hashes (one table holds every fingerprint),
    keyed by the table's random salt key."""
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=16, key=key, person=b"kvstore-hostidx").digest()
    return struct.unpack("<QQ", digest)


def _slots_for(count: int) -> int:
    return max(_MIN_SLOTS, 1 << max(0, (2 * count - 1).bit_length()))


class _File:
    """One table's memfd, mapped writable here (kvstore.memfd: nobody can map it writable again)."""

    def __init__(self, slots: int) -> None:
        self.slots = (slots, slots // 2, max(64, slots // 16))
        self.size = HEADER + _ROW.itemsize * sum(self.slots)
        self.fd, self.map = writer_memfd("kvstore-host-index", self.size, lock=True)  # locked while we live
        self.header = np.frombuffer(self.map, "<u8", HEADER // 8)
        self.words = memoryview(self.map)[:HEADER].cast("Q")  # the header again, for one-word changes in ints
        self.header[0] = int.from_bytes(MAGIC, "little")
        self.header[SLOTS:SLOTS + 3] = self.slots
        offset, self.levels = HEADER, []
        for count in self.slots:
            rows = np.frombuffer(self.map, _ROW, count, offset)
            rows["pid"] = EMPTY
            self.levels.append(rows)
            offset += rows.nbytes
        self.masks = [np.uint64(n - 1) for n in self.slots]
        # (k0s, k1s, pids, mask, addressed by k1) of levels 0 and 1, for one-key work with Python ints
        self.fields = [(rows["k0"], rows["k1"], rows["pid"], n - 1, by_k1)
                       for rows, n, by_k1 in zip(self.levels[:2], self.slots[:2], (False, True))]
        self.spill_at: dict[tuple[int, int], int] = {}  # key -> its level-2 row
        self.spilled = 0  # level-2 rows in use, removed ones included (they lengthen chains)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """Every key held, (n, 2), and its source."""
        rows = np.concatenate([level[level["pid"] >= 0] for level in self.levels])
        return np.stack([rows["k0"], rows["k1"]], 1), rows["pid"]

    def close(self) -> None:
        """Unmapped once no array of it is left (a caller's frame may still hold one), unlocked now."""
        self.words.release()
        del self.header, self.levels, self.fields
        try:
            self.map.close()
        except BufferError:
            pass
        os.close(self.fd)


class SharedTable:
    """The daemon's side (see the module docstring). Thread-safe: a sharded index's mirrors write
    from their own threads. Its salt key is random: only clients handed the table can compute a
    block's key, so nobody can aim a block of theirs at another fingerprint's row."""

    def __init__(self, expected: int = 0) -> None:
        self._lock = threading.Lock()
        self._file = _File(_slots_for(expected))
        self._shown = self._file  # the table readers are given and the heartbeat stamps (not one being built)
        self._building = 0  # rebuilds under way (one may nest in another)
        self.count = 0
        self.salt_key = secrets.token_bytes(16)
        self._salts: dict[str, tuple[int, int]] = {}  # fingerprint -> its salt
        self.closed = False

    # --- what a reader is given -----------------------------------------------------------------
    def reader_fd(self) -> int:
        """A new read-only descriptor of the current table (the caller closes it); OSError once the
        table is given up."""
        with self._lock:
            if self.closed:
                raise OSError("the shared table was given up")
            return reader_fd(self._file.fd)

    def prefix(self, fingerprint: str, hashes: Sequence[bytes]) -> int | None:
        """The daemon's own probe (for a question that came over the socket), as a worker's: no
        lock, so a long change does not hold it up; None when the table cannot answer now."""
        salt = self._salt(fingerprint)
        for attempt in range(PROBE_TRIES):
            file = self._shown
            table = getattr(file, "map", None)
            if self.closed or table is None or table.closed:
                return None
            try:
                length = _native.shared_prefix(table, hashes, *salt)
            except ValueError:  # unmapped between the check and the probe: retired, try the one shown now
                continue
            if length >= 0:
                return length
            if attempt:
                time.sleep(0)
        return None

    def beat(self, stale: bool, loading: bool) -> None:
        """Stamp the header: alive now, with the mirror's flags. No lock: a long change (a snapshot
        swapped in) must not silence the stamp of the table readers use meanwhile."""
        header = getattr(self._shown, "header", None)
        if header is not None and not self.closed:
            header[FLAGS] = (STALE if stale else 0) | (LOADING if loading else 0)
            header[BEAT] = time.monotonic_ns()

    def close(self) -> None:
        """Retire the table: readers stop trusting it at once and ask the daemon."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._retire(self._file)

    def _retire(self, file: _File) -> None:
        with self._changing(file):
            file.header[STATE] |= RETIRED
        file.close()

    # --- changes --------------------------------------------------------------------------------
    def _salt(self, fingerprint: str) -> tuple[int, int]:
        salt = self._salts.get(fingerprint)
        if salt is None:
            salt = self._salts[fingerprint] = fingerprint_salt(fingerprint, self.salt_key)
        return salt

    def salted(self, fingerprint: str, words: np.ndarray) -> np.ndarray:
        return words ^ np.array(self._salt(fingerprint), "<u8")

    @contextmanager
    def _writing(self) -> Iterator[bool]:
        """The lock, and whether to write; a write that fails retires the table (its readers ask
        the daemon from then on) instead of failing the mirror that told it."""
        with self._lock:
            try:
                yield not self.closed
            except Exception:  # noqa: BLE001 - the mirror must go on; the table is given up
                self._give_up()

    def _give_up(self) -> None:
        """(Under the lock, in an exception handler.)"""
        log.exception("the host index's shared table failed: retired, workers ask the daemon")
        self.closed = True
        with contextlib.suppress(Exception):
            self._retire(self._file)

    def appeared(self, source: int, fingerprint: str, words: np.ndarray) -> None:
        """Blocks (their (n, 2) hash words) now held somewhere, listed by index shard `source`."""
        if len(words):
            with self._writing() as live:
                if live:
                    self._insert(source, self.salted(fingerprint, words))

    def gone(self, fingerprint: str, words: np.ndarray) -> None:
        """Blocks no longer held anywhere."""
        if len(words):
            with self._writing() as live:
                if live:
                    file = self._file
                    with self._changing(file):
                        for k0, k1 in self.salted(fingerprint, words).tolist():
                            self._remove_one(file, k0, k1)

    # One block at a time, as watch events come: Python ints and no context managers (a watch
    # applies thousands a second; numpy for one key cost ten times the change itself).
    def _key(self, fingerprint: str, h: bytes) -> tuple[int, int]:
        salt = self._salt(fingerprint)
        return int.from_bytes(h[:8], "little") ^ salt[0], int.from_bytes(h[8:16], "little") ^ salt[1]

    def _one(self, fingerprint: str, h: bytes, change: Callable[[_File, int, int], None]) -> None:
        k0, k1 = self._key(fingerprint, h)
        with self._lock:
            if self.closed:
                return
            try:
                change(self._file, k0, k1)
            except Exception:  # noqa: BLE001 - as _writing: the table is given up, the mirror goes on
                self._give_up()

    def one_appeared(self, source: int, fingerprint: str, h: bytes) -> None:
        self._one(fingerprint, h, lambda file, k0, k1: self._add_one(file, source, k0, k1))

    def one_gone(self, fingerprint: str, h: bytes) -> None:
        self._one(fingerprint, h, self._gone_one)

    def _add_one(self, file: _File, source: int, k0: int, k1: int) -> None:
        if self._find_one(file, k0, k1) is not None:
            return
        placed = False
        if self.count + 1 <= _GROW_AT * file.slots[0]:
            file.words[SEQ] += 1
            try:
                placed = self._insert_one(file, source, k0, k1)
            finally:
                file.words[SEQ] += 1
        if placed:
            self.count += 1
        else:  # outgrown, or the spill level full of chains
            self._rebuild(add=(source, np.array([[k0, k1]], "<u8")), at_least=2 * file.slots[0])

    def _gone_one(self, file: _File, k0: int, k1: int) -> None:
        file.words[SEQ] += 1
        try:
            self._remove_one(file, k0, k1)
        finally:
            file.words[SEQ] += 1

    def reset(self, source: int, blocks: dict[str, np.ndarray]) -> None:
        """Shard `source`'s blocks are exactly these now (a snapshot swapped in): built into a new
        table beside the old one, which readers use whole until it is retired."""
        with self._writing() as live:
            if live:
                keys = [self.salted(fp, words) for fp, words in blocks.items() if len(words)]
                self._rebuild(drop=source, add=(source, np.concatenate(keys) if keys else np.zeros((0, 2), "<u8")))

    @contextmanager
    def _changing(self, file: _File) -> Iterator[None]:
        header = file.header
        header[SEQ] += 1  # odd: a probe now in flight answers -1 and tries again
        try:
            yield
        finally:
            header[SEQ] += 1

    def _insert(self, source: int, keys: np.ndarray) -> None:
        """Keys not in the table yet (a key named twice in one batch is taken once)."""
        file = self._file
        if len(keys) == 1:
            k0, k1 = keys[0].tolist()
            if self._find_one(file, k0, k1) is None:
                if self.count + 1 > _GROW_AT * file.slots[0]:
                    return self._rebuild(add=(source, keys))
                with self._changing(file):
                    placed = self._insert_one(file, source, k0, k1)
                if not placed:  # the spill level is full of chains
                    return self._rebuild(add=(source, keys), at_least=2 * file.slots[0])
                self.count += 1
            return None
        keys = np.unique(keys, axis=0)
        if self.count + len(keys) > _GROW_AT * file.slots[0]:
            return self._rebuild(add=(source, keys))
        with self._changing(file):
            left = np.arange(len(keys))
            for level, mask, column in zip(file.levels[:2], file.masks[:2], (0, 1)):
                slots = (keys[left, column] & mask).astype(np.intp)
                free = np.flatnonzero(level["pid"][slots] < 0)
                taken, first = np.unique(slots[free], return_index=True)  # one winner per slot
                winners = left[free[first]]
                level["k0"][taken], level["k1"][taken] = keys[winners, 0], keys[winners, 1]
                level["pid"][taken] = source
                placed = np.zeros(len(left), bool)
                placed[free[first]] = True
                left = left[~placed]
            self.count += len(keys) - len(left)
            rest = left.tolist()
            while rest and self._spill(file, source, *keys[rest[0]].tolist()):
                rest.pop(0)
                self.count += 1
        if rest:  # the spill level is full of chains: a table twice the size takes the rest
            self._rebuild(add=(source, keys[rest]), at_least=2 * file.slots[0])
        return None

    @staticmethod
    def _insert_one(file: _File, source: int, k0: int, k1: int) -> bool:
        for k0s, k1s, pids, mask, by_k1 in file.fields:
            slot = (k1 if by_k1 else k0) & mask
            if pids.item(slot) < 0:
                k0s[slot], k1s[slot] = k0, k1
                pids[slot] = source
                return True
        return SharedTable._spill(file, source, k0, k1)

    @staticmethod
    def _spill(file: _File, source: int, k0: int, k1: int) -> bool:
        rows, mask = file.levels[2], int(file.masks[2])
        if file.spilled >= len(rows) // 2:
            return False
        pids = rows["pid"]
        slot = (k0 ^ k1) & mask
        while pids.item(slot) >= 0:
            slot = (slot + 1) & mask
        if pids.item(slot) == EMPTY:
            file.spilled += 1
        rows["k0"][slot], rows["k1"][slot] = k0, k1
        pids[slot] = source
        file.spill_at[(k0, k1)] = slot
        return True

    @staticmethod
    def _find_one(file: _File, k0: int, k1: int) -> tuple[np.ndarray, int] | None:
        """(pids of its level, its row), or None."""
        for k0s, k1s, pids, mask, by_k1 in file.fields:
            slot = (k1 if by_k1 else k0) & mask
            if pids.item(slot) >= 0 and k0s.item(slot) == k0 and k1s.item(slot) == k1:
                return pids, slot
        slot = file.spill_at.get((k0, k1))
        return None if slot is None else (file.levels[2]["pid"], slot)

    def _remove_one(self, file: _File, k0: int, k1: int) -> None:
        for k0s, k1s, pids, mask, by_k1 in file.fields:  # every level: a key is never in two, but if
            slot = (k1 if by_k1 else k0) & mask         # it were, none of its rows may outlive it
            if pids.item(slot) >= 0 and k0s.item(slot) == k0 and k1s.item(slot) == k1:
                pids[slot] = EMPTY
                k0s[slot] = k1s[slot] = 0
                self.count -= 1
        slot = file.spill_at.pop((k0, k1), None)
        if slot is not None:
            file.levels[2]["pid"][slot] = GONE  # a chain goes on through it
            self.count -= 1

    def _rebuild(self, drop: int | None = None, add: tuple[int, np.ndarray] | None = None,
                 at_least: int = 0) -> None:
        """Every key (but source `drop`'s), and `add`'s, into a new table sized for them; the old one
        is retired once the new one is whole (its readers ask for the new one)."""
        old, old_count = self._file, self.count
        keys, pids = old.live()
        if drop is not None:
            keys, pids = keys[pids != drop], pids[pids != drop]
        extra = 0 if add is None else len(add[1])
        new = _File(max(_slots_for(len(keys) + extra), at_least))
        self._file, self.count = new, 0
        self._building += 1
        try:
            for source in np.unique(pids).tolist():
                self._insert(source, keys[pids == source])
            if add is not None and extra:
                self._insert(*add)
        except BaseException:
            if self._file is new:
                self._file, self.count = old, old_count
                new.close()
            else:  # a nested rebuild replaced `new`: the old table must not linger unretired
                self._retire(old)
            raise
        finally:
            self._building -= 1
        if self._building:  # a rebuild nested in another's: that one shows the table when it is whole
            if old is not self._shown:  # (never shown: nobody reads it)
                old.close()
            return
        self._file.header[FLAGS] = old.header[FLAGS]
        self._file.header[BEAT] = time.monotonic_ns()
        self._shown = self._file
        self._retire(old)

    def of_shard(self, source: int) -> "ShardPresence":
        """What index shard `source`'s mirror tells (kvstore.index.table.Presence)."""
        return ShardPresence(self, source)


class ShardPresence:
    """One index shard's face of the table: the blocks its mirror's current snapshot holds."""

    def __init__(self, table: SharedTable, source: int) -> None:
        self.table, self.source = table, source

    def appeared(self, fingerprint: str, words: np.ndarray) -> None:
        self.table.appeared(self.source, fingerprint, words)

    def one_appeared(self, fingerprint: str, h: bytes) -> None:
        self.table.one_appeared(self.source, fingerprint, h)

    def one_gone(self, fingerprint: str, h: bytes) -> None:
        self.table.one_gone(fingerprint, h)

    def reset(self, blocks: dict[str, np.ndarray]) -> None:
        self.table.reset(self.source, blocks)


class SharedTableView:
    """A worker's read-only mapping of the host's table (see the module docstring)."""

    def __init__(self, fd: int, salt_key: bytes) -> None:
        """`fd` stays the caller's; the view keeps a duplicate (its lock tells the daemon's life).
        `salt_key`: the table's, handed over with it."""
        size = os.fstat(fd).st_size
        if size < HEADER:
            raise ValueError(f"a host index table of {size} bytes")
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        if self._map[:8] != MAGIC:
            self._map.close()
            raise ValueError("not a host index table")
        self._fd = os.dup(fd)
        self._closed = weakref.finalize(self, os.close, self._fd)
        self._salt_key = salt_key
        self._salts: dict[str, tuple[int, int]] = {}

    def _word(self, number: int) -> int:
        return struct.unpack_from("<Q", self._map, number * 8)[0]

    @property
    def retired(self) -> bool:
        return bool(self._word(STATE) & RETIRED)

    @property
    def writer_alive(self) -> bool:
        """Whether the daemon that writes the table still holds it (see the module docstring)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    @property
    def alive(self) -> bool:
        """Not retired, stamped within DEAD_AFTER_S, and its daemon still holds it."""
        return not self.retired and time.monotonic_ns() - self._word(BEAT) < DEAD_AFTER_S * 1e9 and self.writer_alive

    def prefix(self, fingerprint: str, hashes: Sequence[bytes]) -> tuple[int, bool, bool] | None:
        """(leading blocks held, stale, loading), or None where the table cannot answer now (retired,
        its daemon silent, or changing under every try): ask the daemon instead."""
        salt = self._salts.get(fingerprint)
        if salt is None:
            salt = self._salts[fingerprint] = fingerprint_salt(fingerprint, self._salt_key)
        for attempt in range(PROBE_TRIES):
            length = _native.shared_prefix(self._map, hashes, *salt)
            if length >= 0:
                flags = self._word(FLAGS)
                if not self.alive:
                    return None
                return length, bool(flags & STALE), bool(flags & LOADING)
            if self.retired:
                return None
            if attempt:
                time.sleep(0)  # the daemon is mid-change: let it finish
        return None

    def close(self) -> None:
        self._map.close()
        self._closed()
