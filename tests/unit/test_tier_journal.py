"""kvstore.tiers.journal's replay, without a daemon: later entries win, deletes remove only the
place they name, entries whose fields do not fit the tier and extents that overlap a newer entry's
are dropped and counted, and a torn or damaged tail is cut there (what came before it stands)."""
from __future__ import annotations

from kvstore.tiers.journal import DELETE, LABEL_BYTES, PUT, encode_entry, replay

SIZE = 1 << 20  # the tier file
FP = "model-a"
H1, H2, H3 = b"1" * 16, b"2" * 16, b"3" * 16
D = b"d" * 32


def put(block_hash: bytes, offset: int, size: int = 8192, stored: int = 0, codec: int = 0) -> bytes:
    return encode_entry(PUT, FP, block_hash, offset, size, stored or size, codec, D)


def test_later_entries_win_and_deletes_name_a_place():
    """Kills: a replay that keeps a block's first place, or a delete of an old place that removes
    the block's newer one."""
    body = put(H1, LABEL_BYTES) + put(H2, LABEL_BYTES + 8192) + put(H1, LABEL_BYTES + 16384) \
        + encode_entry(DELETE, FP, H1, LABEL_BYTES) + encode_entry(DELETE, FP, H2, LABEL_BYTES + 8192)
    entries, dropped, torn = replay(body, SIZE, 0)
    assert [(e.block_hash, e.offset) for e in entries] == [(H1, LABEL_BYTES + 16384)]
    assert dropped == 0 and torn == 0


def test_fields_that_do_not_fit_and_overlaps_are_dropped_and_counted():
    """Kills: trusting an entry's offset and sizes (a block read from the label, past the tier's
    end, or from another block's bytes)."""
    body = (put(H1, 0)  # in the label
            + put(H2, SIZE - 4096)  # past the end
            + put(H3, LABEL_BYTES + 100)  # not aligned
            + encode_entry(PUT, FP, b"4" * 16, LABEL_BYTES, 8192, 4096, 0, D)  # raw, yet stored != size
            + encode_entry(PUT, FP, b"5" * 16, LABEL_BYTES, 8192, 4096, 9, D)  # a codec not known
            + put(b"6" * 16, LABEL_BYTES) + put(b"7" * 16, LABEL_BYTES + 4096))  # overlaps: the newer stands
    entries, dropped, torn = replay(body, SIZE, 0)
    assert [e.block_hash for e in entries] == [b"7" * 16]
    assert dropped == 6 and torn == 0


def test_a_torn_or_damaged_tail_is_cut_there():
    """Kills: a replay that reads past a damaged entry (its CRC) or trips on a short one."""
    good = put(H1, LABEL_BYTES) + put(H2, LABEL_BYTES + 8192)
    last = put(H3, LABEL_BYTES + 16384)
    for tail in (last[:-5], last[:-1] + bytes([last[-1] ^ 1])):
        entries, dropped, torn = replay(good + tail + put(b"9" * 16, LABEL_BYTES + 65536), SIZE, 0)
        assert [e.block_hash for e in entries] == [H1, H2]
        assert torn > 0 and dropped == 0
