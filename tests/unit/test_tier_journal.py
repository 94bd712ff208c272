"""kvstore.tiers.journal's replay, without a daemon: later entries win, deletes remove only the
place they name, entries whose fields do not fit the tier and extents that overlap a newer entry's
are dropped and counted, and a torn or damaged tail is cut there (what came before it stands)."""
from __future__ import annotations

from kvstore.tiers.journal import DELETE, LABEL_BYTES, PUT, encode_entry, replay

SIZE = 1 << 20  # the tier file
FP = "model-a"
H1, H2, H3 = b"1" * 16, b"2" * 16, b"3" * 16
D = b"d" * 32
KEY = b"k" * 32
START = b"header mac......"  # the chain's first `previous` (the header's MAC in a journal)


class Chain:
    """Entries as a journal writes them: each MAC covers the one before."""

    def __init__(self, key: bytes = KEY) -> None:
        self.key, self.last = key, START

    def entry(self, op: int, block_hash: bytes, offset: int, size: int = 0, stored: int = 0, codec: int = 0,
              digest: bytes = bytes(32)) -> bytes:
        raw, self.last = encode_entry(self.key, self.last, op, FP, block_hash, offset, size, stored, codec, digest)
        return raw

    def put(self, block_hash: bytes, offset: int, size: int = 8192, stored: int = 0, codec: int = 0) -> bytes:
        return self.entry(PUT, block_hash, offset, size, stored or size, codec, D)


def replayed(body: bytes):
    return replay(body, SIZE, 0, KEY, START)


def test_later_entries_win_and_deletes_name_a_place():
    """Kills: a replay that keeps a block's first place, or a delete of an old place that removes
    the block's newer one."""
    c = Chain()
    body = c.put(H1, LABEL_BYTES) + c.put(H2, LABEL_BYTES + 8192) + c.put(H1, LABEL_BYTES + 16384) \
        + c.entry(DELETE, H1, LABEL_BYTES) + c.entry(DELETE, H2, LABEL_BYTES + 8192)
    entries, dropped, torn = replayed(body)
    assert [(e.block_hash, e.offset) for e in entries] == [(H1, LABEL_BYTES + 16384)]
    assert dropped == 0 and torn == 0


def test_fields_that_do_not_fit_and_overlaps_are_dropped_and_counted():
    """Kills: trusting an entry's offset and sizes (a block read from the label, past the tier's
    end, or from another block's bytes)."""
    c = Chain()
    body = (c.put(H1, 0)  # in the label
            + c.put(H2, SIZE - 4096)  # past the end
            + c.put(H3, LABEL_BYTES + 100)  # not aligned
            + c.entry(PUT, b"4" * 16, LABEL_BYTES, 8192, 4096, 0, D)  # raw, yet stored != size
            + c.entry(PUT, b"5" * 16, LABEL_BYTES, 8192, 4096, 9, D)  # a codec not known
            + c.put(b"6" * 16, LABEL_BYTES) + c.put(b"7" * 16, LABEL_BYTES + 4096))  # overlaps: the newer stands
    entries, dropped, torn = replayed(body)
    assert [e.block_hash for e in entries] == [b"7" * 16]
    assert dropped == 6 and torn == 0


def test_a_torn_or_damaged_tail_is_cut_there():
    """Kills: a replay that reads past a damaged entry (its MAC) or trips on a short one."""
    c = Chain()
    good = c.put(H1, LABEL_BYTES) + c.put(H2, LABEL_BYTES + 8192)
    last = c.put(H3, LABEL_BYTES + 16384)
    after = c.put(b"9" * 16, LABEL_BYTES + 65536)
    for tail in (last[:-5], last[:-1] + bytes([last[-1] ^ 1])):
        entries, dropped, torn = replayed(good + tail + after)
        assert [e.block_hash for e in entries] == [H1, H2]
        assert torn > 0 and dropped == 0


def test_entries_forged_reordered_or_replayed_without_the_key_end_the_journal():
    """Every entry's MAC is keyed and covers the entry before it. Kills: an entry accepted under
    another key (written without the cluster secret), entries accepted out of order, and an old
    entry replayed after a delete (a block the tier gave up, back under its key)."""
    c = Chain()
    first, second = c.put(H1, LABEL_BYTES), c.put(H2, LABEL_BYTES + 8192)
    forger = Chain(key=b"x" * 32)
    forger.last = c.last
    forged = forger.put(H3, LABEL_BYTES + 16384)
    entries, _, torn = replayed(first + second + forged)
    assert [e.block_hash for e in entries] == [H1, H2] and torn == len(forged)
    entries, _, torn = replayed(second + first)  # reordered
    assert entries == [] and torn == len(second + first)
    delete = c.entry(DELETE, H1, LABEL_BYTES)
    entries, _, torn = replayed(first + second + delete + first)  # the put of H1 again, replayed
    assert [e.block_hash for e in entries] == [H2] and torn == len(first)
