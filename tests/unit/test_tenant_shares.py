"""Tenants' capacity shares in one BlockStore (the daemon's, in this process): who makes room for
whom. Each test names the broken variant it kills; each was seen failing on it."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.daemon.store import BlockStore
from kvstore.errors import AllocationFailed
from kvstore.integrity import block_digest
from kvstore.keys import ModelFingerprint, external_hashes
from transfer import Engine

BLOCK = 64 << 10
FPS = {name: ModelFingerprint("m", "float16", 16, 2, 2, 64, kv_layout="bytes", tenant=name) for name in ("a", "b", "c")}
CLUSTER = ModelFingerprint("m", "float16", 16, 2, 2, 64, kv_layout="bytes")


@pytest.fixture
def engine():
    with Engine("shares-unit", listen=None) as e:
        yield e


def put(store: BlockStore, fp: ModelFingerprint, seed: int) -> bytes:
    h = external_hashes([seed], fp)[0]
    data = np.full(BLOCK, seed % 251, np.uint8)
    slots, _ = store.reserve(fp.digest, [h], [BLOCK])
    token, slot = slots[0]
    store.dram.region.buffer[slot.offset : slot.offset + BLOCK] = data.tobytes()
    assert store.commit(fp.digest, [token], [block_digest(h, data)])[0] == [""]
    return h


def held(store: BlockStore, fp: ModelFingerprint, hashes: list[bytes]) -> int:
    return sum(store.find((fp.digest, h)) is not None for h in hashes)


def test_a_tenant_filling_the_store_does_not_evict_another_within_its_share(engine):
    """Kills: eviction in plain LRU order whatever the shares (A's stream evicted all of B's
    blocks), and a share counted against the wrong tenant."""
    store = BlockStore(engine, engine.allocate(16 * BLOCK), high=1.0, low=1.0, shares={"a": 0.5, "b": 0.25})
    b = [put(store, FPS["b"], i) for i in range(4)]  # b at its share: 4 of 16 blocks
    a = [put(store, FPS["a"], 100 + i) for i in range(40)]  # a streams far past the store
    assert held(store, FPS["b"], b) == 4
    assert held(store, FPS["a"], a) == 12 and held(store, FPS["a"], a[-12:]) == 12  # its newest, its own evicted
    assert store.dram.tenant_bytes == {"a": 12 * BLOCK, "b": 4 * BLOCK}
    usage = {(t, tier): (used, share) for t, tier, used, share in store.tenant_usage()}
    assert usage[("b", "dram")] == (4 * BLOCK, 4 * BLOCK) and usage[("a", "dram")] == (12 * BLOCK, 8 * BLOCK)


def test_a_tenant_over_its_share_evicts_its_own_first_and_others_only_down_to_their_share(engine):
    """Kills: a tenant over its share that evicts others' older blocks before its own, and a
    protection that spares a tenant holding more than its share (b over its share must give room
    back, down to its share and no further)."""
    store = BlockStore(engine, engine.allocate(16 * BLOCK), high=1.0, low=1.0, shares={"a": 0.25, "b": 0.25})
    b = [put(store, FPS["b"], i) for i in range(10)]  # b alone: over its share of 4
    cluster = [put(store, CLUSTER, 50 + i) for i in range(2)]  # the cluster's own: no share
    a = [put(store, FPS["a"], 100 + i) for i in range(4)]  # a up to its share: room from free space
    assert held(store, FPS["b"], b) == 10 and held(store, FPS["a"], a) == 4
    more = [put(store, FPS["a"], 200 + i) for i in range(3)]  # a over its share: its own oldest go first
    assert held(store, FPS["a"], a + more) == 4 and held(store, FPS["a"], more) == 3
    assert held(store, FPS["b"], b) == 10 and held(store, CLUSTER, cluster) == 2
    c = [put(store, FPS["c"], 300 + i) for i in range(10)]  # c, no share: b gives back down to 4, then the rest
    assert held(store, FPS["b"], b) == 4 and held(store, FPS["b"], b[-4:]) == 4
    assert held(store, FPS["a"], a + more) == 4  # a within its share: untouched
    assert held(store, CLUSTER, cluster) == 0 and held(store, FPS["c"], c) == 8


def test_a_tenant_that_cannot_make_room_without_going_below_anothers_share_is_refused(engine):
    """Kills: protection that gives way when nothing else makes room (a's put took b's last blocks)."""
    store = BlockStore(engine, engine.allocate(8 * BLOCK), high=1.0, low=1.0, shares={"a": 0.5, "b": 0.5})
    b = [put(store, FPS["b"], i) for i in range(4)]
    a = [put(store, FPS["a"], 100 + i) for i in range(4)]
    h = external_hashes([999], CLUSTER)[0]
    with pytest.raises(AllocationFailed, match="within their capacity shares"):
        store.reserve(CLUSTER.digest, [h], [BLOCK])  # the cluster's own block: no share of its own
    assert held(store, FPS["b"], b) == 4 and held(store, FPS["a"], a) == 4


def test_demotion_follows_the_shares_and_the_accounting_follows_the_blocks(engine, tmp_path):
    """DRAM eviction demotes to NVMe: a protected tenant's DRAM blocks are not demoted for another
    tenant, and each tier counts what each tenant holds there as blocks move and go. Kills:
    accounting that misses a move (the NVMe tier's tenant bytes stayed 0 after demotions)."""
    path = tmp_path / "tier"
    path.write_bytes(b"")
    nvme = engine.register_file(str(path), 16 * BLOCK)
    store = BlockStore(engine, engine.allocate(8 * BLOCK), nvme, high=1.0, low=1.0, shares={"b": 0.5})
    b = [put(store, FPS["b"], i) for i in range(4)]
    a = [put(store, FPS["a"], 100 + i) for i in range(12)]
    assert all(store.dram.sealed.get((FPS["b"].digest, h)) is not None for h in b)  # still in DRAM
    assert store.dram.tenant_bytes["b"] == 4 * BLOCK and store.dram.tenant_bytes["a"] == 4 * BLOCK
    assert store.nvme.tenant_bytes["a"] == 8 * BLOCK and held(store, FPS["a"], a) == 12
    store.remove(FPS["a"].digest, a)
    assert store.dram.tenant_bytes["a"] == store.nvme.tenant_bytes["a"] == 0


GOOD = "s3cret-of-sixteen-bytes"


@pytest.mark.parametrize("line, says", [
    (f"acme {GOOD} capacity=120%", "the capacity of tenant 'acme' must be"),
    (f"acme {GOOD} capacity=0", "the capacity of tenant 'acme' must be"),
    (f"acme {GOOD} connections=0", "the connections of tenant 'acme' must be"),
    (f"acme {GOOD} share=3", "'share=3' after the secret of tenant 'acme' is not an option"),
    (f"acme {GOOD} x", "'x' after the secret of tenant 'acme' is not an option"),
    (f"acme {GOOD} capacity=60%\nbeta {GOOD}x capacity=0.5", "the capacity shares add up to 110%"),
])
def test_a_bad_tenant_option_is_refused_in_one_line(tmp_path, capsys, monkeypatch, line, says):
    """`kvstore serve --tenants` with a bad share: exit 2, one line naming the file (and line)."""
    from kvstore.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KVSTORE_SECRET", raising=False)
    path = tmp_path / "tenants"
    path.write_text(line + "\n")
    path.chmod(0o600)
    with pytest.raises(SystemExit) as done:
        main(["serve", "--node", "a", "--metadata", "memory://tenant-options", "--tenants", str(path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err and str(path) in err, err


def test_tenant_options_are_read(tmp_path):
    from kvstore.access import TenantLimits, load_tenants

    path = tmp_path / "tenants"
    path.write_text(f"acme {GOOD} capacity=50% connections=8\n\tbeta\t{GOOD}x\tcapacity=0.25\ngamma {GOOD}y\n")
    path.chmod(0o600)
    tenants = load_tenants(str(path))
    assert tenants == {"acme": GOOD.encode(), "beta": (GOOD + "x").encode(), "gamma": (GOOD + "y").encode()}
    assert tenants.limits == {"acme": TenantLimits(0.5, 8), "beta": TenantLimits(0.25)}
    assert tenants.capacity_share("gamma") is None and tenants.connections("gamma", 256) == 64
