"""The mirror's numpy hash index and the snapshot loader's range cutting, against plain references."""
from __future__ import annotations

import os
import random

import numpy as np

from kvstore.index_load import hex_cells
from kvstore.index_table import HashIndex, as_words


def _present(index: HashIndex, h: bytes) -> int:
    found = index.prefix([h])
    return int(found[0]) if len(found) else -1


def test_hash_index_agrees_with_a_dict_through_inserts_removals_bulk_adds_and_rehashes():
    rnd = random.Random(7)
    index, reference = HashIndex(), {}
    keys = [os.urandom(16) for _ in range(6000)]
    for step in range(20000):
        h = rnd.choice(keys)
        if rnd.random() < 0.6:
            index.set(h, step % 50)
            reference[h] = step % 50
        else:
            assert index.remove(h) == (h in reference)
            reference.pop(h, None)
        if step % 5000 == 0:  # bulk adds of new keys in between, crossing several rehashes
            fresh = [os.urandom(16) for _ in range(3000)]
            index.add(as_words(fresh), np.full(len(fresh), 3, np.int32))
            reference.update(dict.fromkeys(fresh, 3))
            keys += fresh
    assert index.count == len(reference) and index.overflow  # the overflow level was exercised
    for h in keys:
        assert _present(index, h) == reference.get(h, -1)


def test_prefix_stops_at_the_first_absent_or_malformed_hash():
    index = HashIndex()
    keys = [os.urandom(16) for _ in range(5000)]
    index.add(as_words(keys), np.arange(5000, dtype=np.int32))
    assert index.prefix(keys).tolist() == list(range(5000))
    assert len(index.prefix(keys[:100] + [os.urandom(16)] + keys[100:])) == 100
    assert len(index.prefix(keys[:7] + [b"short"] + keys[7:])) == 7
    assert len(index.prefix([])) == 0
    index.remove(keys[30])
    assert len(index.prefix(keys)) == 30


def _cover(cells, start, end):
    assert cells[0][0] == start and cells[-1][1] == end
    for (a, b), (c, _) in zip(cells, cells[1:]):
        assert a < b == c  # contiguous, no overlap, no gap


def test_hex_cells_partition_the_range_exactly():
    rnd = random.Random(3)
    base = b"/k/blocks/fp/"
    keys = sorted({base + os.urandom(16).hex().encode() + b"/n" for _ in range(2000)}
                  | {base + b"zz/odd", base + b"-x", base + b"9:/y", base + b"/"})
    end = base[:-1] + b"0"
    for parts in (1, 2, 7, 16, 300):
        start = rnd.choice(keys) + b"\0"
        cells = hex_cells(base, start, end, parts)
        _cover(cells, start, end)
        inside = [k for k in keys if start <= k < end]
        assert sum(1 for k in inside for a, b in cells if a <= k < b) == len(inside)
    assert hex_cells(base, base + b"zz", end, 50) == [(base + b"zz", end)]
    sizes = [sum(1 for k in keys if a <= k < b) for a, b in hex_cells(base, base, end, 16)]
    assert max(sizes) < 2.5 * len(keys) / 16  # even shares of uniform hashes
