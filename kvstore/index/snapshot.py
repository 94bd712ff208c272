"""Reading every block record at one revision, fast: many small key ranges in parallel.

etcd 3.4 walks every key of a requested range even when it returns only `limit` of them, so
paging through a million keys with `limit` alone costs O(n^2) (about 30 s here). Instead each
request covers a small range: the first page of a range tells how many keys it holds, and what is
left of the fingerprint it ended in is cut into cells of the block-hash hex space
(`blocks/<fp>/<hex prefix>`) expected to hold about half a page each, read a few at a time.
Every page is pinned to the same revision, so together they are one consistent snapshot.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from ..errors import MetadataTimeout
from ..metadata import Metadata, Page, prefix_end

PAGE = 8192  # keys a request returns at most (~1.1 MiB)
PARALLEL = 8  # requests in flight: etcd serves them on several cores while we decode
RETRIES = 3  # a page that times out is retried with twice the timeout
_HEX = b"0123456789abcdef"


_SPACE = 16 ** 8  # cells are cut at 8-hex-digit points of the block-hash space


def _point(base: bytes, key: bytes) -> int | None:
    """Where `key` sits in `base`'s 8-digit hex space (rounded down): 0 before it, _SPACE after,
    None inside but not hex."""
    if not key.startswith(base):
        return 0 if key < base else _SPACE
    tail = key[len(base):len(base) + 8]
    run = len(tail) - len(tail.lstrip(_HEX)) if tail else 0
    if run == 0:
        return 0 if not tail or tail[0] < 0x30 else None
    return int(tail[:run].ljust(8, b"0"), 16)


def hex_cells(base: bytes, start: bytes, end: bytes, parts: int) -> list[tuple[bytes, bytes]]:
    """[start, end) cut into up to `parts` ranges of equal share of `base`'s hash hex space (one
    range when the keys there are not hex)."""
    low, high = _point(base, start), _point(base, end)
    if low is None or high is None or parts <= 1:
        return [(start, end)]
    cuts = []
    for k in range(1, parts):
        cut = base + b"%08x" % (low + (high - low) * k // parts)
        if start < cut < end and (not cuts or cut > cuts[-1]):
            cuts.append(cut)
    bounds = [start, *cuts, end]
    return list(zip(bounds, bounds[1:]))


class _Loader:
    def __init__(self, metadata: Metadata, prefix: bytes, revision: int, on_page: Callable[[Page], None],
                 page: int, parallel: int, timeout: float) -> None:
        self.metadata, self.prefix, self.revision, self.on_page = metadata, prefix, revision, on_page
        self.page, self.parallel, self.timeout = page, parallel, timeout
        self.queue: asyncio.Queue[tuple[bytes, bytes] | None] = asyncio.Queue()
        self.pending = 0
        self.keys = 0

    def push(self, start: bytes, end: bytes) -> None:
        if start < end:
            self.pending += 1
            self.queue.put_nowait((start, end))

    async def fetch(self, start: bytes, end: bytes) -> Page:
        timeout = self.timeout
        for attempt in range(RETRIES):
            try:
                return await self.metadata.range_page(start, end, revision=self.revision, limit=self.page,
                                                      timeout=timeout)
            except MetadataTimeout:
                if attempt == RETRIES - 1:
                    raise
                timeout *= 2  # a big range costs etcd time in proportion to its keys, not a fixed bound
        raise AssertionError("unreachable")

    def split(self, page: Page, end: bytes) -> None:
        """Queue what is left of [.., end) after `page`: the rest of its last fingerprint in hex
        cells sized from the remaining count, the fingerprints after it as one range."""
        last = page.keys[-1]
        after = last + b"\0"
        slash = last.find(b"/", len(self.prefix))
        if slash < 0:  # not a block key: keep paging
            self.push(after, end)
            return
        base = last[:slash + 1]
        stop = min(prefix_end(base), end)
        self.push(stop, end)
        # Hashes are uniform: cells of 3/4 of a page usually come back whole in one request.
        remaining = page.count - len(page.keys)
        for cell in hex_cells(base, after, stop, -(-4 * remaining // (3 * self.page))):
            self.push(*cell)

    async def worker(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            start, end = item
            page = await self.fetch(start, end)
            if page.keys:
                self.keys += len(page.keys)
                self.on_page(page)
                if page.more:
                    self.split(page, end)
            self.pending -= 1
            if self.pending == 0:
                for _ in range(self.parallel):
                    self.queue.put_nowait(None)

    async def run(self) -> int:
        for cell in hex_cells(self.prefix, self.prefix, prefix_end(self.prefix), 16):
            self.push(*cell)
        workers = [asyncio.create_task(self.worker()) for _ in range(self.parallel)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
        return self.keys


async def load_prefix(metadata: Metadata, prefix: bytes, revision: int, on_page: Callable[[Page], None], *,
                      timeout: float, page: int | None = None, parallel: int | None = None) -> int:
    """Hand every key under `prefix` as of `revision` to `on_page`, a page at a time (pages come
    in no particular order, never overlap, and each is sorted); returns how many keys there were.
    Each request has its own timeout; the whole load has none."""
    return await _Loader(metadata, prefix, revision, on_page, page or PAGE, parallel or PARALLEL, timeout).run()
