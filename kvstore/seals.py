"""The seal table: which sealing of a block each slot of a daemon's DRAM arena holds, shared
read-only with the clients on the daemon's host, so that a reader can tell that a slot still holds
the very bytes it verified before (and, with KVSTORE_VERIFY=once, skip hashing them again:
kvstore.client.reads.VerifiedSlots).

One 64-bit number per 4 KiB unit of the arena (slots start on unit boundaries): the sealing number of
the slot that starts there, 0 where none does or where its bytes are not to be trusted. The daemon
alone writes it, under its store lock:
- a DRAM slot whose bytes it verified (a commit's or the verifier's pass, a promotion's check) gets a
  new number when it is sealed; numbers are never reused while the daemon runs;
- a sealed DRAM slot's number is cleared *before* its extent goes back to the allocator (dropped,
  evicted, demoted, removed, found corrupt), and so before anyone can be given that extent to write.
So while a slot's number stays the same, the slot has not been freed, and no write that the store
hands out (a put's, a promotion's) can have landed in it: its bytes are those of that sealing.

What the numbers cannot see: a write that no slot hand-out explains. A client on the daemon's host
maps the arena to write its puts, and a write into a slot reserved for it could land after the
reservation expired and the extent went to another block: no slot sealed over such an extent is
numbered until that client's process has exited, or ever when the writer is not known (BlockStore
taints). A process of the daemon's user that
writes a sealed slot in place (the uid may: it maps the arena, or opens its file through /proc), or
memory that flips a bit, changes bytes without changing a number: only a hash sees that, which is
why clients hash every read unless told they may trust the host (KVSTORE_VERIFY=once).

The memfd is sealed against growing, shrinking and (where the kernel has F_SEAL_FUTURE_WRITE) any new
writable mapping, and clients get a read-only descriptor: no client can forge a number.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
import weakref

from .memfd import reader_fd, writer_memfd

ALIGN = 4096  # as kvstore.tiers.allocator.ALIGN: every slot starts on a unit
MAGIC = b"KVSEALS1"
HEADER = 16  # magic, incarnation (random: a restarted daemon's table is another table)


class SealTable:
    """The daemon's side: one writable mapping, numbers set and cleared under the store lock."""

    def __init__(self, arena_bytes: int, name: str = "kvstore-seals") -> None:
        self.units = max(1, arena_bytes // ALIGN)
        self.size = HEADER + 8 * self.units
        self.incarnation = secrets.randbits(63) or 1
        self._fd, self._map = writer_memfd(name, self.size)
        self._map[:HEADER] = MAGIC + struct.pack("<Q", self.incarnation)
        self._numbers = memoryview(self._map)[HEADER:].cast("Q")
        self._closed = weakref.finalize(self, os.close, self._fd)  # a store dropped without close()
        self._last = 0

    def sealed(self, offset: int) -> None:
        """The slot at `offset` holds bytes the daemon verified just now: a new number."""
        self._last += 1
        self._numbers[offset // ALIGN] = self._last

    def cleared(self, offset: int) -> None:
        """The slot at `offset` is about to be freed (or must not be trusted): no number."""
        self._numbers[offset // ALIGN] = 0

    def number(self, offset: int) -> int:
        return self._numbers[offset // ALIGN]

    def reader_fd(self) -> int:
        """A new read-only descriptor of the table, for a client (the caller closes it)."""
        return reader_fd(self._fd)

    def close(self) -> None:
        self._numbers.release()
        self._map.close()
        self._closed()


class SealView:
    """A client's read-only view of a node's seal table (see the module docstring)."""

    def __init__(self, fd: int, region: int, size: int) -> None:
        self.region = region  # the arena's engine region id
        length = os.fstat(fd).st_size
        if length < HEADER + 8 or (length - HEADER) % 8:
            raise ValueError(f"a seal table of {length} bytes")
        self._map = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        if self._map[:8] != MAGIC:
            self._map.close()
            raise ValueError("not a seal table")
        (self.incarnation,) = struct.unpack_from("<Q", self._map, 8)
        self._numbers = memoryview(self._map)[HEADER:].cast("Q")
        self.units = len(self._numbers)
        if size > self.units * ALIGN:
            self.close()
            raise ValueError(f"a seal table of {self.units} units for an arena of {size} bytes")

    def number(self, offset: int) -> int:
        """The sealing number of the slot starting at `offset` now (0: none, or not trusted)."""
        unit = offset // ALIGN
        return self._numbers[unit] if offset % ALIGN == 0 and 0 <= unit < self.units else 0

    def close(self) -> None:
        self._numbers.release()
        self._map.close()
