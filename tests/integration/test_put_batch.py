"""`Client.put_batch`: one result per key over real daemons (real etcd, `kvstore serve` processes),
so a caller retries exactly the keys that failed, and knows why each did."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

import kvstore.client.put_path as put_path
from kvstore import Client
from kvstore.client import KeyPut
from kvstore.errors import NoStoreNodes, PutFailed, WrongSize
from kvstore.keys import ModelFingerprint, external_hashes

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64)  # blocks of exactly FP.block_bytes (32 KiB)
BLOCK = FP.block_bytes


def content(h: bytes, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def read_back(client: Client, hashes: list[bytes]) -> bool:
    outs = [np.zeros(BLOCK, np.uint8) for _ in hashes]
    return all(client.get_many(hashes, outs)) and all(np.array_equal(o, content(h)) for o, h in zip(outs, hashes))


def test_a_node_killed_mid_batch_fails_only_the_keys_it_did_not_take(etcd_server, spawn_daemon):
    """A batch of 128 blocks goes to node `a` in two rounds (its DRAM is 8 MiB: rounds of 2 MiB);
    `a` is killed after the first, and one block is oversize. The first round's keys are stored,
    the second round's fail with NoStoreNodes naming `a`, the oversize one with WrongSize (never
    sent); the caller retries exactly those, which land on `b`.
    Kills: one error for the whole batch (every key given the first failure's error)."""
    cluster = uuid.uuid4().hex[:8]
    doomed = spawn_daemon("a", etcd_server.url, cluster, dram="8MiB")
    spawn_daemon("b", etcd_server.url, cluster, dram="64MiB")
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=2.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 2, 10)
        hashes = external_hashes(range(128), FP)
        oversize = 100
        items = [(h, content(h, BLOCK + 4096 if i == oversize else BLOCK)) for i, h in enumerate(hashes)]
        real_round, rounds = client.puts.put_round, []

        def kill_after_the_first(name, batch, keys, since):
            rounds.append(keys)
            if len(rounds) == 2:
                doomed.kill()  # between rounds: the second one meets a dead node
            return real_round(name, batch, keys, since)

        client.puts.put_round = kill_after_the_first
        results = client.put_batch(items, exclude={"b"})
        client.puts.put_round = real_round

        assert len(rounds) == 2 and len(results) == 128 and all(isinstance(r, KeyPut) for r in results)
        assert [r.key for r in results] == hashes
        first = set(rounds[0])
        assert len(first) == 64 and oversize not in first
        for i, result in enumerate(results):
            if i in first:
                assert result.ok and result.nodes == ("a",) and result.error is None, (i, result)
            elif i == oversize:
                assert isinstance(result.error, WrongSize) and not result.nodes
                assert str(BLOCK) in result.reason  # says which size it should have been
            else:
                assert isinstance(result.error, NoStoreNodes) and not result.nodes, (i, result)
                assert result.reason.startswith("a: "), result.reason

        failed = [i for i, r in enumerate(results) if not r.ok]
        assert len(failed) == 64
        retried = client.put_batch([(hashes[i], content(hashes[i])) for i in failed])
        assert all(r.ok and r.nodes == ("b",) for r in retried), retried
        assert read_back(client, [hashes[i] for i in failed])


def test_a_node_that_refuses_some_blocks_of_a_round_fails_only_those(etcd_server, spawn_daemon, monkeypatch):
    """One node, one round of 8 small blocks (checked by the node before it answers); 3 of them
    arrive with a digest their bytes do not have, as a corrupted transfer would look to the node.
    The node refuses those 3 ("digest mismatch"), put_batch says PutFailed for exactly them with the
    node's reason and stores the other 5; a retry of the 3 stores them. put_many over the same kind
    of batch still raises PutFailed for the round, as it always did.
    Kills: one error for the whole batch, and a node's refusal of some blocks counted against every
    block of its round."""
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("solo", etcd_server.url, cluster)
    digests = put_path.block_digests
    bad: set[bytes] = set()

    def flip(hs, values):
        return [bytes([value[0] ^ 1]) + value[1:] if h in bad else value for h, value in zip(hs, digests(hs, values))]

    monkeypatch.setattr(put_path, "block_digests", flip)
    with Client(etcd_server.url, cluster=cluster, fingerprint=FP, timeout=2.0) as client:
        assert client.mirror.wait_until(lambda m: len(m.nodes) == 1, 10)
        hashes = external_hashes(range(100, 108), FP)
        bad.update(hashes[i] for i in (1, 4, 6))
        results = client.put_batch([(h, content(h)) for h in hashes])
        for i, result in enumerate(results):
            if hashes[i] in bad:
                assert isinstance(result.error, PutFailed) and not result.nodes
                assert result.reason.startswith("solo: ") and "digest mismatch" in result.reason, result.reason
            else:
                assert result.ok and result.nodes == ("solo",), (i, result)
        assert read_back(client, [h for h in hashes if h not in bad])

        bad.clear()
        retried = client.put_batch([(r.key, content(r.key)) for r in results if not r.ok])
        assert len(retried) == 3 and all(r.ok for r in retried)
        assert read_back(client, hashes)

        more = external_hashes(range(200, 204), FP)
        bad.add(more[2])
        with pytest.raises(PutFailed, match="refused 1 of 4 blocks"):
            client.put_many([(h, content(h)) for h in more])
