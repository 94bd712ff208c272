"""kvstore.compat.mooncake answers Mooncake Store's calls as Mooncake does (the answers below were
read off mooncake-transfer-engine 0.3.13 with a master and a segment), on the embedded store and
on a cluster of daemons in their own processes."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from kvstore.compat.mooncake import (CHUNK_BYTES, INTERNAL_ERROR, INVALID_PARAMS, NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND,
                                     VALUES, MooncakeDistributedStore,
                                     ReplicateConfig)

SECRET = "mooncake-compat-secret-0123456789"


@pytest.fixture(params=["embedded", "cluster"])
def store(request, etcd_server, spawn_daemon):
    s = MooncakeDistributedStore()
    if request.param == "embedded":
        assert s.setup("localhost", "memory://", 256 << 20) == 0
    else:
        cluster = uuid.uuid4().hex[:8]
        spawn_daemon("mc-node", etcd_server.url, cluster, dram="256MiB", secret=SECRET)
        assert s.setup("localhost", etcd_server.url, secret=SECRET, cluster=cluster) == 0
        assert s.is_exist("anything") == 0 and s.health_check() == 0
    yield s
    s.close()


def test_keys_values_and_missing_keys_answer_as_mooncake(store):
    """Kills: a missing key answered with an exception or None instead of b""/0/-704; a put of an
    existing key overwriting it (Mooncake keeps the first value; upsert replaces)."""
    assert store.get("nope") == b"" and store.is_exist("nope") == 0
    assert store.get_size("nope") == OBJECT_NOT_FOUND and store.remove("nope") == OBJECT_NOT_FOUND
    assert store.put("k", b"hello") == 0 and store.put("k", b"world!!") == 0
    assert store.get("k") == b"hello" and store.get_size("k") == 5 and store.is_exist("k") == 1
    assert store.put_batch(["a", "b"], [b"1", b"22"]) == 0
    assert store.get_batch(["a", "b", "zz"]) == [b"1", b"22", b""]
    assert store.batch_is_exist(["a", "zz"]) == [1, 0]
    assert store.upsert("k", b"new") == 0 and store.get("k") == b"new"
    assert store.remove("k") == 0 and store.is_exist("k") == 0
    assert store.batch_remove(["a", "zz"]) == [0, OBJECT_NOT_FOUND]
    assert store.put("r", b"two copies", ReplicateConfig(replica_num=1)) == 0


def test_caller_buffers_are_read_and_written_only_where_registered(store):
    """Kills: a get into a buffer larger than the value reported as a miss (it says how much it
    filled), and an address outside every registered buffer read or written."""
    src, dst = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    src[:5] = np.frombuffer(b"abcde", np.uint8)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert store.batch_put_from(["x", "y"], [src.ctypes.data, src.ctypes.data + 1], [5, 3]) == [0, 0]
    assert store.get("y") == b"bcd"
    got = store.batch_get_into(["x", "nope", "x"], [dst.ctypes.data, dst.ctypes.data, dst.ctypes.data], [64, 64, 2])
    assert got == [5, OBJECT_NOT_FOUND, INVALID_PARAMS]  # read 5 bytes; missing; buffer too small
    assert bytes(dst[:5]) == b"abcde"
    stray = np.zeros(64, np.uint8)  # never registered
    assert store.get_into("x", stray.ctypes.data, 64) == INVALID_PARAMS and not stray.any()
    assert store.put_from("z", stray.ctypes.data, 8) == INVALID_PARAMS and store.is_exist("z") == 0
    assert store.get_into("x", dst.ctypes.data + 60, 8) == INVALID_PARAMS  # runs past the registered end
    assert store.unregister_buffer(dst.ctypes.data) == 0
    assert store.get_into("x", dst.ctypes.data, 64) == INVALID_PARAMS


def test_tensors_and_values_larger_than_a_block_round_trip(store):
    """Kills: a value over one block's cap (64 MiB) refused or truncated, and a tensor back with
    another dtype or shape."""
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    assert store.put_tensor("t", t) == 0
    back = store.get_tensor("t")
    assert back.dtype == torch.bfloat16 and back.shape == (2, 3, 4) and torch.equal(back, t)
    assert store.get_tensor("nope") is None
    big = np.random.default_rng(0).integers(0, 256, CHUNK_BYTES + 12345, dtype=np.uint8)
    assert store.put("big", big) == 0 and store.get_size("big") == big.nbytes
    assert store.get("big") == big.tobytes()
    assert store.remove("big") == 0 and store.is_exist("big") == 0


@pytest.mark.parametrize("mode", ["embedded", "cluster"])
def test_a_batch_answers_each_key_with_its_own_status(mode, etcd_server, spawn_daemon):
    """A value no node has room for fails alone with Mooncake's NO_AVAILABLE_HANDLE (-200), which
    vLLM's Mooncake connector reads as "full: skip"; the others in its batch are stored and say 0.
    Kills: a batch put whose one failure fails (or hides) every key of the round (one put_many for
    the whole batch), and a full store reported as a generic INTERNAL_ERROR."""
    s = MooncakeDistributedStore()
    if mode == "embedded":
        assert s.setup("localhost", "memory://", 16 << 20) == 0
    else:
        cluster = uuid.uuid4().hex[:8]
        spawn_daemon("mc-small", etcd_server.url, cluster, dram="16MiB", secret=SECRET)
        assert s.setup("localhost", etcd_server.url, secret=SECRET, cluster=cluster) == 0
    try:
        small, huge = np.full(4096, 7, np.uint8), np.zeros(32 << 20, np.uint8)  # huge: over the node's arena
        for buf in (small, huge):
            assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        got = s.batch_put_from(["s1", "huge", "s2"], [small.ctypes.data, huge.ctypes.data, small.ctypes.data + 1],
                               [4096, huge.nbytes, 4095])
        assert got == [0, NO_AVAILABLE_HANDLE, 0]
        assert s.get("s1") == bytes(small) and s.get("s2") == bytes(small[1:]) and s.is_exist("huge") == 0
        assert s.put_batch(["s3", "huge"], [b"x", bytes(huge)]) == NO_AVAILABLE_HANDLE and s.get("s3") == b"x"
    finally:
        s.close()


def test_an_upsert_that_cannot_remove_the_old_value_says_so(etcd_server, spawn_daemon):
    """Kills: an upsert whose remove failed on a node it could not reach (its record still in the
    index) and whose put then kept the old value, as "exists", while answering 0; and a remove
    that reports such a failure as "not found"."""
    cluster = uuid.uuid4().hex[:8]
    daemons = [spawn_daemon(f"mc-{i}", etcd_server.url, cluster, dram="64MiB", secret=SECRET) for i in range(2)]
    s = MooncakeDistributedStore()
    assert s.setup("localhost", etcd_server.url, secret=SECRET, cluster=cluster) == 0
    try:
        assert s.put_batch(["k", "j"], [b"old", b"old-j"], ReplicateConfig(replica_num=2)) == 0
        on_both = lambda m: all(len(m.lookup(VALUES, s._hash(k))) == 2 for k in ("k", "j"))  # noqa: E731
        assert s.client.mirror.wait_until(on_both, 10)
        daemons[0].kill()  # its records stay in the index until its lease ends
        assert s.upsert("k", b"new") == INTERNAL_ERROR
        assert s.upsert_batch(["j"], [b"new-j"]) == INTERNAL_ERROR
        assert s.get("k") != b"new" and s.get("j") != b"new-j"  # nothing claimed stored that is not
    finally:
        s.close()
