"""The host index's shared table (kvstore.index.shared_table): what the daemon writes is what a
worker's probe of the read-only mapping answers, through growth, spills, removals, a shard's
snapshot swapped in, a change under way and the daemon's death."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.index import shared_table
from kvstore.index.shared_table import SEQ, SharedTable, SharedTableView, fingerprint_salt
from kvstore.index.table import as_words
from transfer import _native

pytestmark = pytest.mark.skipif(not shared_table.supported(), reason="shared tables need Linux on x86-64")


def hashes(first: int, count: int) -> list[bytes]:
    return [os.urandom(8) + i.to_bytes(8, "little") for i in range(first, first + count)]


def view_of(table: SharedTable) -> SharedTableView:
    fd = table.reader_fd()
    try:
        return SharedTableView(fd, table.salt_key)
    finally:
        os.close(fd)


def during_inserts(monkeypatch, look) -> list:
    """What `look()` returns each time the table starts an insert (as a rebuild does, key batch by
    key batch): a reader's view while the writer is mid-way."""
    seen, insert = [], SharedTable._insert

    def watched(self, source, keys):
        seen.append(look())
        return insert(self, source, keys)

    monkeypatch.setattr(SharedTable, "_insert", watched)
    return seen


@pytest.fixture
def table():
    t = SharedTable()
    t.beat(stale=False, loading=False)
    yield t
    t.close()


def test_a_probe_answers_what_the_daemon_wrote_and_removed(table):
    """Kills: a removal not written to the shared table (a worker would plan loads of blocks gone)."""
    blocks = hashes(0, 3000)
    table.of_shard(0).appeared("fp", as_words(blocks))
    view = view_of(table)
    assert view.prefix("fp", blocks) == (3000, False, False)
    table.gone("fp", as_words(blocks[1000:1001]))
    assert view.prefix("fp", blocks)[0] == 1000
    assert view.prefix("fp", blocks[1001:])[0] == 1999
    assert table.count == 2999


def test_fingerprints_share_one_table_but_never_each_others_blocks(table):
    """Kills: keys without the fingerprint's salt (another model's block with the same hash, or a
    tenant's, would count as held)."""
    blocks = hashes(0, 50)
    table.of_shard(0).appeared("model-a", as_words(blocks))
    view = view_of(table)
    assert view.prefix("model-a", blocks)[0] == 50
    assert view.prefix("model-b", blocks)[0] == 0
    assert fingerprint_salt("model-a", table.salt_key) != fingerprint_salt("model-b", table.salt_key)
    assert fingerprint_salt("model-a", table.salt_key) != fingerprint_salt("model-a", bytes(16))
    assert view_of(table).prefix("model-a", blocks)[0] == 50
    fd = table.reader_fd()
    try:  # a key computed without the table's salt key finds nothing
        assert SharedTableView(fd, bytes(16)).prefix("model-a", blocks)[0] == 0
    finally:
        os.close(fd)


def test_a_table_outgrown_is_retired_and_its_successor_holds_everything(table):
    """Kills: a growth that loses blocks, or that leaves readers on the old table (which no longer
    changes) instead of retiring it."""
    first = hashes(0, 500)
    table.of_shard(0).appeared("fp", as_words(first))
    old = view_of(table)
    more = hashes(500, 20_000)
    table.of_shard(1).appeared("fp", as_words(more))
    assert old.retired and old.prefix("fp", first) is None
    new = view_of(table)
    assert new.prefix("fp", first)[0] == 500 and new.prefix("fp", more)[0] == 20_000
    table.of_shard(1).reset({})  # the growth kept each block's shard
    assert view_of(table).prefix("fp", first)[0] == 500 and view_of(table).prefix("fp", more)[0] == 0


def test_blocks_that_spill_past_both_levels_are_found_and_removed(table):
    """Kills: a probe that ignores level 2, or a removal there that ends the chains running
    through it (blocks after it in the chain would read as absent)."""
    slots0, slots1 = table._file.slots[:2]
    # Keys whose level-0 and level-1 slots are all the same (after the salt): every one after the
    # first two spills, into one chain.
    s0, s1 = fingerprint_salt("fp", table.salt_key)
    keys = [(((i << 20) | 5) ^ s0, ((i << 20) | 7) ^ s1) for i in range(1, 31)]
    blocks = [a.to_bytes(8, "little") + b.to_bytes(8, "little") for a, b in keys]
    assert all((a ^ s0) % slots0 == 5 and (b ^ s1) % slots1 == 7 for a, b in keys)
    table.of_shard(0).appeared("fp", as_words(blocks))
    assert table._file.spilled == 28
    view = view_of(table)
    assert view.prefix("fp", blocks)[0] == 30
    table.gone("fp", as_words(blocks[10:11]))  # in the middle of the chain
    assert view.prefix("fp", blocks)[0] == 10
    assert view.prefix("fp", blocks[11:])[0] == 19


def test_a_shards_snapshot_swapped_in_replaces_only_its_own_blocks(table):
    """Kills: a reset that clears every shard's rows (a sharded host index would lose the other
    shards' blocks at each reload of one)."""
    a, b = hashes(0, 300), hashes(300, 300)
    table.of_shard(0).appeared("fp", as_words(a))
    table.of_shard(1).appeared("fp", as_words(b))
    table.of_shard(1).reset({"fp": as_words(b[:100])})
    view = view_of(table)
    assert view.prefix("fp", a)[0] == 300
    assert view.prefix("fp", b)[0] == 100
    assert table.count == 400


def test_a_probe_during_a_change_is_not_answered_from_the_table(table):
    """Kills: a probe that ignores the sequence lock (it would read rows half written)."""
    blocks = hashes(0, 10)
    table.of_shard(0).appeared("fp", as_words(blocks))
    view = view_of(table)
    header = table._file.header
    header[SEQ] += 1  # a change under way, as the daemon leaves it mid-write
    try:
        assert _native.shared_prefix(view._map, blocks, *fingerprint_salt("fp", table.salt_key)) == -1
        assert view.prefix("fp", blocks) is None
    finally:
        header[SEQ] += 1
    assert view.prefix("fp", blocks)[0] == 10


def test_flags_and_a_silent_daemon(table, monkeypatch):
    """Kills: the mirror's stale flag not carried to workers, and a table trusted after its daemon
    stopped stamping it (a hung daemon's view no longer follows the index)."""
    blocks = hashes(0, 4)
    table.of_shard(0).appeared("fp", as_words(blocks))
    table.beat(stale=True, loading=True)
    view = view_of(table)
    assert view.prefix("fp", blocks) == (4, True, True)
    monkeypatch.setattr(shared_table, "DEAD_AFTER_S", 0.0)
    assert view.prefix("fp", blocks) is None


def test_a_dead_daemons_table_is_not_used_at_once():
    """Kills: liveness by the stamp alone (for a second after a kill -9 a worker would answer from a
    table nobody updates)."""
    child = textwrap.dedent("""
        import os, socket, sys, time
        from kvstore.index.shared_table import SharedTable
        from kvstore.index.table import as_words
        sock = socket.socket(fileno=int(sys.argv[1]))
        table = SharedTable()
        table.of_shard(0).appeared("fp", as_words([bytes(range(16))]))
        table.beat(False, False)
        socket.send_fds(sock, [table.salt_key], [table.reader_fd()])
        sock.recv(1)  # until told to die
        os._exit(0)
    """)
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", child, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        key, fds, _, _ = socket.recv_fds(ours, 16, 1)
        view = SharedTableView(fds[0], key)
        os.close(fds[0])
        assert view.prefix("fp", [bytes(range(16))])[0] == 1 and view.writer_alive
        ours.send(b"x")
        proc.wait(10)
        assert not view.writer_alive
        assert view.prefix("fp", [bytes(range(16))]) is None  # its stamp is still fresh
    finally:
        proc.kill()
        ours.close()


def test_a_table_closed_by_its_daemon_is_retired(table):
    blocks = hashes(0, 3)
    table.of_shard(0).appeared("fp", as_words(blocks))
    view = view_of(table)
    table.close()
    assert view.retired and view.prefix("fp", blocks) is None


def test_what_is_not_a_table_is_refused():
    with pytest.raises(ValueError):
        _native.shared_prefix(bytearray(64), [bytes(16)], 0, 0)
    header = np.zeros(8, "<u8")
    header[0] = int.from_bytes(shared_table.MAGIC, "little")
    header[4:7] = 1024  # levels the buffer does not hold
    with pytest.raises(ValueError):
        _native.shared_prefix(header.view(np.uint8), [bytes(16)], 0, 0)
    r, w = os.pipe()
    os.close(w)
    try:
        with pytest.raises((ValueError, OSError)):
            SharedTableView(r, bytes(16))
    finally:
        os.close(r)


def test_pages_that_grow_the_table_past_its_spill_level_all_arrive(table):
    """Kills: a growth that fails while the insert that caused it still holds the old table's rows
    (seen: the mirror's first load stopped at 8,192 blocks of 20,000)."""
    blocks = hashes(0, 20_000)
    for start in range(0, len(blocks), 4096):
        table.of_shard(0).appeared("fp", as_words(blocks[start:start + 4096]))
    assert not table.closed and table.count == 20_000
    assert view_of(table).prefix("fp", blocks)[0] == 20_000


def test_a_write_that_fails_retires_the_table_and_spares_the_mirror(table, monkeypatch, caplog):
    """Kills: a shared table's failure raised into the mirror that told it (its load or watch
    would stop, and the daemon's own answers go stale with it)."""
    view = view_of(table)

    def broken(*args):
        raise MemoryError("no room for a larger table")

    monkeypatch.setattr(table, "_insert", broken)
    table.of_shard(0).appeared("fp", as_words(hashes(0, 5)))  # no exception
    assert table.closed and view.retired and view.prefix("fp", hashes(0, 1)) is None
    assert "retired" in caplog.text


def test_a_snapshot_swapped_in_never_shows_readers_an_empty_table(table, monkeypatch):
    """Kills: a reset that clears a shard's rows in place and fills them again in a later change
    (between the two, every worker's probe read the shard's blocks as gone)."""
    blocks = hashes(0, 100)
    table.of_shard(0).appeared("fp", as_words(blocks))
    old = view_of(table)
    seen = during_inserts(monkeypatch, lambda: _native.shared_prefix(old._map, blocks,
                                                                     *fingerprint_salt("fp", table.salt_key)))
    table.of_shard(0).reset({"fp": as_words(blocks)})
    assert seen and all(n in (100, -1) for n in seen), seen
    assert old.retired and view_of(table).prefix("fp", blocks)[0] == 100


def test_a_key_named_twice_in_one_batch_is_held_once(table):
    """Kills: a batch insert that stores a repeated key in two rows (its removal would leave one)."""
    blocks = hashes(0, 10)
    table.of_shard(0).appeared("fp", as_words(blocks + blocks[3:4]))
    assert table.count == 10
    table.gone("fp", as_words(blocks[3:4]))
    assert view_of(table).prefix("fp", blocks)[0] == 3 and table.count == 9


def test_a_growth_that_fails_retires_the_old_table_too(table, monkeypatch):
    """Kills: a failed growth that leaves readers on the old table, frozen from then on."""
    blocks = hashes(0, 10)
    table.of_shard(0).appeared("fp", as_words(blocks))
    old = view_of(table)

    def no_room(slots):
        raise OSError("no memory for a larger table")

    monkeypatch.setattr(shared_table, "_File", no_room)
    table.of_shard(0).appeared("fp", as_words(hashes(10, 5000)))  # needs a larger table
    assert table.closed and old.retired and old.prefix("fp", blocks) is None


def test_a_host_index_whose_mirror_fails_to_start_keeps_no_table():
    """Kills: a shared table (a memfd and a heartbeat thread) made for every question while the
    mirror cannot start (a shard map refused): the daemon ran out of descriptors."""
    import threading

    from kvstore.daemon.host_index import HostIndex
    from kvstore.daemon.operations import OpFailed
    from kvstore.errors import ShardMapMismatch

    tables = []

    class Refused:
        def on_replica_removed(self, listener):
            pass

        def share_presence(self, presence_of):
            tables.append(presence_of(0).table)

        def start(self, wait, keep_trying):
            raise ShardMapMismatch("this etcd is shard 1 of 2, not 0 of 2")

    index = HostIndex(Refused, 1.0, verifier=None)
    before = threading.active_count()
    for _ in range(5):
        with pytest.raises((ShardMapMismatch, OpFailed)):
            index.table("")
    assert len(tables) == 5 and all(t.closed for t in tables)
    assert threading.active_count() == before


def test_readers_keep_a_stamped_whole_table_while_a_new_one_is_built(table, monkeypatch):
    """Kills: a rebuild that moves the heartbeat (and the daemon's own probe) to the table being
    built: the table readers use went unstamped for the whole rebuild (seconds at millions of
    blocks), then every worker fell back to the socket, which waited on the rebuild."""
    blocks = hashes(0, 200)
    table.of_shard(0).appeared("fp", as_words(blocks))
    old = view_of(table)

    def meanwhile():
        table.beat(stale=False, loading=False)  # as the heartbeat thread would
        return old.alive, table.prefix("fp", blocks)

    seen = during_inserts(monkeypatch, meanwhile)
    table._file.header[shared_table.BEAT] = 0  # only a stamp during the rebuild keeps it alive
    table.of_shard(0).reset({"fp": as_words(blocks)})
    assert seen and all(alive and n == 200 for alive, n in seen), seen
    assert old.retired and view_of(table).alive


def test_a_closed_table_hands_out_no_descriptor(table):
    """Kills: reader_fd() on a table given up opening whatever file now has its descriptor number."""
    table.close()
    with pytest.raises(OSError):
        table.reader_fd()
