"""First-fit extent allocator over one arena (a shared-memory region or a preallocated file).

Why this one: a model's KV blocks all have one size, so a free list of extents with coalescing
stays nearly unfragmented, and a freed slot is reused at once by the next block of that size.
Offsets and sizes are rounded to 4 KiB so the NVMe tier can use O_DIRECT and DRAM slots start on
page boundaries.
"""
from __future__ import annotations

import bisect

ALIGN = 4096


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ExtentAllocator:
    """Hands out aligned (offset, size) extents of [0, capacity); never more than capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // ALIGN * ALIGN
        self._starts: list[int] = [0] if self.capacity else []
        self._sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def allocate(self, size: int) -> int | None:
        """Offset of a new extent of align_up(size) bytes, or None when no free extent is big enough."""
        need = align_up(size)
        if need <= 0:
            raise ValueError(f"cannot allocate {size} bytes")
        for start in self._starts:
            extent = self._sizes[start]
            if extent >= need:
                del self._sizes[start]
                index = bisect.bisect_left(self._starts, start)
                if extent == need:
                    del self._starts[index]
                else:
                    self._starts[index] = start + need
                    self._sizes[start + need] = extent - need
                self.used += need
                return start
        return None

    def take(self, offset: int, size: int) -> bool:
        """Take the extent [offset, offset + align_up(size)) if it is free, as `allocate` would have
        given it (a tier restored from its journal puts its blocks back where they are); whether it was."""
        need = align_up(size)
        if need <= 0 or offset < 0 or offset % ALIGN or offset + need > self.capacity:
            return False
        index = bisect.bisect_right(self._starts, offset) - 1
        if index < 0:
            return False
        start = self._starts[index]
        extent = self._sizes[start]
        if start + extent < offset + need:
            return False
        del self._sizes[start]
        del self._starts[index]
        if offset > start:  # the free part before it
            self._starts.insert(index, start)
            self._sizes[start] = offset - start
            index += 1
        if start + extent > offset + need:  # and after it
            self._starts.insert(index, offset + need)
            self._sizes[offset + need] = start + extent - offset - need
        self.used += need
        return True

    def release(self, offset: int, size: int) -> None:
        """Give an extent back, merging it with free neighbours."""
        size = align_up(size)
        index = bisect.bisect_left(self._starts, offset)
        if index < len(self._starts) and self._starts[index] < offset + size:
            raise ValueError(f"double free of [{offset}, {offset + size})")
        if index > 0 and self._starts[index - 1] + self._sizes[self._starts[index - 1]] > offset:
            raise ValueError(f"double free of [{offset}, {offset + size})")
        self.used -= size
        start, end = offset, offset + size
        if index < len(self._starts) and self._starts[index] == end:  # merge with the next extent
            end += self._sizes.pop(self._starts[index])
            del self._starts[index]
        if index > 0:  # merge with the previous extent
            prev = self._starts[index - 1]
            if prev + self._sizes[prev] == start:
                self._sizes[prev] = end - prev
                return
        self._starts.insert(index, start)
        self._sizes[start] = end - start
