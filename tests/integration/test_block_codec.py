"""Coded blocks against real daemons and etcd: an NVMe tier with `--disk-codec lz4` holds bf16 KV
coded, and every read path gives back the raw bytes, checked after decoding: the same-host tier fd
(decoded in the client), the engine over TCP, the framed wire with `Client(wire_codec="lz4")`, and
a restart of a persistent tier (a damaged frame there is dropped, never served)."""
from __future__ import annotations

import os
import uuid

import numpy as np

from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

from tests_support import until

from .test_persistent_tier import counters, restored

FP = ModelFingerprint("tiny-llama", "bfloat16", 16, 2, 2, 64, kv_layout="bytes")
BLOCK = 64 * 1024
FLAGS = ["--keep-disk", "--disk-codec", "lz4"]


def content(h: bytes) -> np.ndarray:
    """Synthetic bf16 KV: normal values truncated from float32, as bytes."""
    x = np.random.default_rng(int.from_bytes(h[:8], "little")).standard_normal(BLOCK // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def client(etcd_server, cluster: str, **kwargs) -> Client:
    c = Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=3.0, **kwargs)
    assert c.mirror.wait_until(lambda m: len(m.nodes) >= 1, 10)
    return c


def read_all(etcd_server, cluster: str, hashes: list[bytes], **kwargs) -> tuple[list[bytes], dict]:
    """Those of `hashes` read back byte for byte, and the client's stats."""
    with client(etcd_server, cluster, **kwargs) as c:
        assert c.mirror.wait_until(lambda m: all(m.lookup(FP, h) for h in hashes), 10)
        good = []
        for h in hashes:
            out = np.zeros(BLOCK, np.uint8)
            if c.get(h, out):
                assert np.array_equal(out, content(h)), f"wrong bytes for {h.hex()}"
                good.append(h)
        return good, dict(c.stats)


def test_coded_nvme_blocks_read_right_on_every_path_and_after_a_restart(etcd_server, spawn_daemon, tmp_path):
    """Kills: a client that reads a coded block's record as raw bytes (every coded block a miss),
    decoding that drops or reorders bytes (wrong bytes), a wire codec that sends raw (no saving),
    a journal that loses a block's codec across a restart, and a restore that trusts a frame that
    decodes: one damaged on disk is dropped and counted, never served."""
    cluster = uuid.uuid4().hex[:8]
    daemon = spawn_daemon("coder", etcd_server.url, cluster, dram="2MiB", disk="32MiB", extra=FLAGS)
    hashes = external_hashes(range(80), FP)
    with client(etcd_server, cluster) as c:
        for start in range(0, len(hashes), 8):
            c.put_many([(h, content(h)) for h in hashes[start : start + 8]])
    assert until(lambda: counters(daemon).get("disk_codec_coded_blocks", 0) >= 40, 30)
    with client(etcd_server, cluster) as c:
        records = c.reads.lookup("coder", c._fp(None), hashes)
    coded = [h for h, r in zip(hashes, records) if r is not None and r.codec]
    assert len(coded) >= 40 and all(r.stored < r.size for r in records if r is not None and r.codec)

    good, stats = read_all(etcd_server, cluster, hashes)  # same host: the tier fd, decoded here
    assert good == hashes and stats["nvme_fd_reads"] >= len(coded)
    # (hits promote NVMe blocks back to DRAM: fewer coded ones are left for the next reader)
    good, stats = read_all(etcd_server, cluster, hashes, transport="tcp")  # the engine: frames, decoded here
    assert good == hashes and stats["coded_reads"] > 0
    good, stats = read_all(etcd_server, cluster, hashes, transport="tcp", wire_codec="lz4")
    assert good == hashes and stats["wire_read_raw_bytes"] == len(hashes) * BLOCK
    assert stats["wire_read_bytes"] < 0.9 * stats["wire_read_raw_bytes"]  # DRAM blocks coded on the way too

    with client(etcd_server, cluster) as c:  # where they are now (hits promoted some)
        records = c.reads.lookup("coder", c._fp(None), hashes)
    on_nvme = [h for h, r in zip(hashes, records) if r is not None and r.tier == "nvme"]
    coded = [h for h, r in zip(hashes, records) if r is not None and r.codec]
    assert len(coded) >= 10
    daemon.kill()
    victim = coded[5]
    offset = records[hashes.index(victim)].offset
    fd = os.open(tmp_path / "nvme-coder" / "coder.tier", os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x00" * 64, offset + 300)  # inside the frame's first (lz4) plane
    finally:
        os.close(fd)
    daemon = spawn_daemon("coder", etcd_server.url, cluster, dram="2MiB", disk="32MiB", extra=FLAGS)
    after = restored(daemon)
    assert after.get("restore_corrupt_blocks") == 1 and after.get("restored_blocks", 0) >= len(on_nvme) - 1
    rest = [h for h in on_nvme if h != victim]
    good, _ = read_all(etcd_server, cluster, rest)
    assert good == rest
    with client(etcd_server, cluster) as c:
        assert c.reads.lookup("coder", c._fp(None), [victim]) == [None]
