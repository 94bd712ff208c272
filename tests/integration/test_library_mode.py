"""Library mode (`kvstore.open`) as the README's tour uses it: what a user gets right or is told
plainly, and what it leaves on disk."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvstore
from kvstore.errors import InvalidConfig, StoreClosed, WrongSize

FP = kvstore.ModelFingerprint("tour", "float16", block_size=4, num_layers=2, num_kv_heads=2, head_size=8)
BLOCK = FP.block_bytes  # 2 x 2 layers x 4 tokens x 2 heads x 8 x 2 bytes = 512


def blocks_for(hashes: list[bytes]) -> list[np.ndarray]:
    return [np.full(BLOCK // 2, i + 1, dtype=np.float16) for i in range(len(hashes))]


def test_put_many_takes_a_zip_and_get_many_reads_the_matched_prefix_into_the_first_buffers(tmp_path):
    """The tour's own lines: `put_many(zip(...))` stores every block and `get_many(hashes[:n], outs)`
    fills the first n buffers. Kills: put_many walking its input twice (a zip is empty the second
    time: 0 stored, no error) and get_many refusing more buffers than hashes (WrongSize)."""
    tokens = list(range(30))  # 7 full blocks of 4 and a tail
    with kvstore.open("memory://", dram="16MiB", disk=str(tmp_path / "kv"), disk_size="1MiB", fingerprint=FP) as store:
        hashes = kvstore.chain_hashes(FP, tokens)
        blocks = blocks_for(hashes)
        assert store.put_many(zip(hashes[:5], blocks[:5])) == 5
        n = store.match_prefix(hashes)
        assert n == 5
        outs = [np.zeros_like(b) for b in blocks]
        assert store.get_many(hashes[:n], outs) == [True] * n
        assert all(np.array_equal(o, b) for o, b in zip(outs[:n], blocks[:n]))
        assert not outs[n].any()  # the buffers past the match are left alone
        with pytest.raises(WrongSize, match="only 1 buffers"):
            store.get_many(hashes[:2], outs[:1])


def test_control_calls_go_straight_to_the_daemon_in_this_process(tmp_path):
    """Library mode: puts, gets, the NVMe tier's fd and refusals with their typed errors, all
    without a connection to the daemon's unix socket. Kills: the embedded store talking to its own
    daemon over the socket (one authenticated connection, a session, framing and HMACs per call),
    and an in-process path that loses a refusal's type."""
    with kvstore.open("memory://", dram="16MiB", disk=str(tmp_path / "kv"), disk_size="1MiB", fingerprint=FP) as store:
        hashes = kvstore.chain_hashes(FP, list(range(40)))
        blocks = blocks_for(hashes)
        assert store.put_many(zip(hashes, blocks)) == len(hashes)
        outs = [np.zeros_like(b) for b in blocks]
        assert store.get_many(hashes, outs) == [True] * len(hashes)
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
        assert store.stats["local_puts"] >= 1  # the one-round-trip put, bytes with the request
        node = store.links.local(store.daemon.config.node)
        assert node is not None and node.tier() is not None  # the NVMe tier's fd, handed over in-process
        with pytest.raises(WrongSize):
            node.call({"op": "lookup", "fp": FP.digest, "hashes": ["00"]})
        assert store.daemon.local._open[False] == 0  # no connection was made to the unix socket
    big = kvstore.ModelFingerprint("tour-big", "float16", 4, 2, 2, 8, kv_layout="bytes")
    with kvstore.open("memory://", dram="64MiB", fingerprint=big) as store:
        large = [np.full(1 << 20, i, np.uint8) for i in range(6)]  # past one request's bytes: reserve, write, commit
        big_hashes = kvstore.chain_hashes(big, list(range(24)))
        assert store.put_many(zip(big_hashes, large)) == 6 and store.stats["local_puts"] == 0
        got = [np.zeros(1 << 20, np.uint8) for _ in large]
        assert store.get_many(big_hashes, got) == [True] * 6
        assert all(np.array_equal(g, b) for g, b in zip(got, large))
        assert store.daemon.local._open[False] == 0


def test_a_block_of_the_wrong_size_for_the_fingerprint_is_refused_at_put_and_at_get():
    """A block whose size is not the fingerprint's geometry would be matched as cached and then
    fail every read (a silent False). Kills: no size check at put (the block is accepted and
    counted by match_prefix) and a buffer of another size at get being a silent miss."""
    with kvstore.open("memory://", dram="16MiB", fingerprint=FP) as store:
        h = kvstore.chain_hashes(FP, [1, 2, 3, 4])[0]
        with pytest.raises(WrongSize, match="512 bytes"):
            store.put(h, np.zeros(100, dtype=np.uint8))
        assert store.match_prefix([h]) == 0
        store.put(h, np.ones(BLOCK, dtype=np.uint8))
        with pytest.raises(WrongSize, match="buffer of 256 bytes"):
            store.get(h, np.zeros(256, dtype=np.uint8))
    free_form = kvstore.ModelFingerprint("tour", "float16", 4, 2, 2, 8, kv_layout="bytes")
    with kvstore.open("memory://", dram="16MiB", fingerprint=free_form) as store:
        g = kvstore.chain_hashes(free_form, [5, 6, 7, 8])[0]
        assert store.put(g, np.ones(100, dtype=np.uint8)) == 1


def test_a_block_larger_than_any_nodes_dram_says_so():
    """Kills: the node's wire validation message ('sizes: 1 integers in 0..N') reaching the user."""
    free_form = kvstore.ModelFingerprint("big", "float16", 4, 2, 2, 8, kv_layout="bytes")
    with kvstore.open("memory://", dram="1MiB", fingerprint=free_form) as store:
        with pytest.raises(WrongSize, match="larger than every store node's DRAM tier"):
            store.put(kvstore.external_hashes([1], free_form)[0], np.zeros(2 << 20, dtype=np.uint8))


def test_a_closed_store_answers_nothing():
    """Kills: match_prefix answering from the mirror of a closed store."""
    store = kvstore.open("memory://", dram="16MiB", fingerprint=FP)
    h = kvstore.chain_hashes(FP, [1, 2, 3, 4])
    store.put_many(zip(h, blocks_for(h)))
    store.close()
    store.close()  # twice is fine
    with pytest.raises(StoreClosed):
        store.match_prefix(h)
    with pytest.raises(StoreClosed):
        store.put_many(zip(h, blocks_for(h)))


def test_the_tier_file_goes_with_the_store_unless_kept(tmp_path):
    """Kills: a preallocated tier file left behind by close() (the tour once left 64 GiB)."""
    folder = tmp_path / "kv"
    with kvstore.open("memory://", dram="16MiB", disk=str(folder), disk_size="4MiB", fingerprint=FP):
        pass
    assert os.listdir(folder) == []
    with kvstore.open("memory://", dram="16MiB", disk=str(folder), disk_size="4MiB", keep_disk=True, fingerprint=FP):
        pass
    assert sorted(os.listdir(folder)) == ["local.journal", "local.tier"]  # a persistent tier: its journal stays too


def test_a_killed_process_leaves_no_tier_file(tmp_path):
    """The tier file is unlinked as soon as the engine holds it open. Kills: removing it only in
    close(), which a kill -9 never reaches."""
    folder = tmp_path / "kv"
    script = textwrap.dedent(f"""
        import sys, kvstore
        store = kvstore.open("memory://", dram="16MiB", disk={str(folder)!r}, disk_size="8MiB")
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.listdir(folder) == []


def test_a_tier_path_that_cannot_work_is_one_typed_error(tmp_path):
    """Kills: bare FileExistsError/FileNotFoundError, directories created along a mistyped path,
    and a disk size the disk cannot hold being preallocated (or half of it left as a file)."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(InvalidConfig, match="is not a directory"):
        kvstore.open("memory://", dram="1MiB", disk=str(not_a_dir), disk_size="1MiB")
    with pytest.raises(InvalidConfig, match="does not exist"):
        kvstore.open("memory://", dram="1MiB", disk=str(tmp_path / "no" / "such" / "dir"), disk_size="1MiB")
    assert not (tmp_path / "no").exists()
    with pytest.raises(InvalidConfig, match="does not fit"):
        kvstore.open("memory://", dram="1MiB", disk=str(tmp_path / "kv"), disk_size="1000000TiB")
    assert os.listdir(tmp_path / "kv") == []
    with pytest.raises(InvalidConfig, match="not a size"):
        kvstore.open("memory://", dram="16XB")


def test_fewer_replicas_than_asked_say_why(caplog):
    """Kills: a put placed on fewer nodes than asked logging an empty reason ('stored 1 of 3
    replicas: ') when no node refused it: there were just not enough nodes."""
    import numpy as np

    import kvstore

    fp = kvstore.ModelFingerprint("m", "float32", 4, 1, 1, 8)
    with kvstore.open("memory://few-replicas", dram="8MiB", fingerprint=fp) as store:
        caplog.set_level("WARNING", logger="kvstore.client.client")
        hashes = kvstore.chain_hashes(fp, list(range(8)))
        store.put_many([(h, np.zeros(fp.block_bytes, np.uint8)) for h in hashes], replicas=3)
    said = [r.getMessage() for r in caplog.records if "replicas" in r.getMessage()]
    assert said and all("the cluster has 1 live node" in line for line in said), said
