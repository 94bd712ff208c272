"""The mirror's numpy hash index and the snapshot loader's range cutting, against plain references."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
from transfer._native import index_prefix

from kvstore.index import IndexMirror
from kvstore.index.records import BlockRecord
from kvstore.index.snapshot import hex_cells
from kvstore.index.table import HashIndex, as_words
from kvstore.keys import ModelFingerprint, external_hashes


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


def _key(k0: int, k1: int) -> bytes:
    return k0.to_bytes(8, "little") + k1.to_bytes(8, "little")


def test_prefix_reads_all_three_levels_and_cuts_at_the_first_absent_block():
    index = HashIndex()
    # Same level-0 slot (low bits of k0), same level-1 slot (low bits of k1): one block per level.
    first, second, third = _key(5 << 20, 9 << 20), _key(6 << 20, 7 << 20), _key(7 << 20, 11 << 20)
    for pid, h in enumerate((first, second, third)):
        index.set(h, pid + 10)
    assert index.l0["pid"].max() == 10 and index.l1["pid"].max() == 11 and index.overflow == {third: 12}
    absent = _key(8 << 20, 12 << 20)  # same slots again, stored nowhere
    assert index.prefix([first, second, third]).tolist() == [10, 11, 12]
    assert index.prefix([third, first, absent, second]).tolist() == [12, 10]
    assert index.prefix([absent, first]).tolist() == []
    assert index.prefix((bytearray(third), memoryview(second), first)).tolist() == [12, 11, 10]  # bytes-like
    assert index.prefix([first, b"", second]).tolist() == [10]
    assert index.prefix([first, "x" * 16, second]).tolist() == [10]  # not bytes: never present
    index.remove(first)
    assert index.prefix([second, third, first]).tolist() == [11, 12]


def test_prefix_agrees_with_a_reference_on_random_prompts():
    rnd = random.Random(11)
    index, reference = HashIndex(), {}
    keys = [os.urandom(16) for _ in range(4000)]
    index.add(as_words(keys), np.arange(4000, dtype=np.int32) % 97)
    reference.update(zip(keys, (np.arange(4000) % 97).tolist()))
    for h in rnd.sample(keys, 400):
        index.remove(h)
        del reference[h]
    assert index.overflow
    for _ in range(200):
        prompt = [rnd.choice(keys) if rnd.random() < 0.97 else os.urandom(16) for _ in range(rnd.randrange(300))]
        expected = []
        for h in prompt:
            if h not in reference:
                break
            expected.append(reference[h])
        assert index.prefix(prompt).tolist() == expected


def test_native_prefix_refuses_tables_and_outputs_of_the_wrong_shape():
    index = HashIndex()
    keys = [os.urandom(16) for _ in range(10)]
    with pytest.raises(ValueError):
        index_prefix(index.l0, index.l1, {}, keys, np.empty(9, np.int32))  # no room for every hash
    with pytest.raises(ValueError):
        index_prefix(index.l0[:1000], index.l1, {}, keys, np.empty(10, np.int32))  # not a power of two
    with pytest.raises(ValueError):
        index_prefix(np.zeros(1024, np.int64), index.l1, {}, keys, np.empty(10, np.int32))
    with pytest.raises(TypeError):
        index_prefix(index.l0, index.l1, {}, 5, np.empty(10, np.int32))


def test_mirror_match_of_empty_unknown_partly_and_fully_cached_prompts():
    fp = ModelFingerprint("m", "float16", 4, 2, 2, 64)
    hashes = external_hashes(range(64), fp)
    mirror = IndexMirror("memory://never-started")
    for i, h in enumerate(hashes[:12]):
        mirror.remember(fp, h, "a", BlockRecord("dram", 1, i * 64, 64, i.to_bytes(32, "little")))
    mirror.remember(fp, hashes[3], "b", BlockRecord("nvme", 1, 0, 64, bytes(32)))
    assert mirror.match(fp, []).length == 0
    assert mirror.match(ModelFingerprint("other", "float16", 4, 2, 2, 64), hashes).length == 0
    assert mirror.match(fp, hashes[12:]).length == 0
    result = mirror.match(fp, hashes)
    assert result.length == 12
    assert result.locations[3] == (("a", "dram"), ("b", "nvme")) and result.locations[4] == (("a", "dram"),)
    assert mirror.match(fp, hashes[:12]).length == 12
    assert mirror.match(fp, hashes[5:9] + hashes[:3]).length == 7


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


def test_a_table_without_an_index_answers_prefixes_as_one_with_it():
    """Kills: the records path a host index's mirror takes while its shared table answers match()
    disagreeing with the indexed path (a node's prefix lengths would route to the wrong node):
    ids, a cut at the first absent block, and hashes that are not plain 16-byte bytes."""
    from kvstore.index.table import BlockTable

    hashes = [os.urandom(16) for _ in range(300)]
    placements: dict[tuple[bytes, ...], int] = {}

    def placement_of(raws: tuple[bytes, ...]) -> int:
        return placements.setdefault(raws, len(placements))

    records = [bytes([i % 3]) * 4 for i in range(300)]
    tables = [BlockTable("fp", indexed=True), BlockTable("fp", indexed=False)]
    for table in tables:
        table.add(hashes, records, np.array([placement_of((r,)) for r in records], np.int32))
        table.remove(hashes[200])
    for prompt in (hashes, hashes[:50], hashes[201:], [hashes[0], bytearray(hashes[1])], [hashes[0], b"short"], []):
        ids = [t.prefix(prompt, placement_of).tolist() for t in tables]
        assert ids[0] == ids[1], prompt[:2]
    assert len(tables[1].prefix(hashes, placement_of)) == 200
