"""One suite, two backends: the in-process store and a real etcd behave the same."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.errors import InvalidKey, InvalidValue, LeaseExpired, ValueTooLarge, WatchCompacted
from kvstore.metadata import Compare, Delete, Put, open_metadata


async def test_put_get_delete_range(metadata_url, prefix):
    md = open_metadata(metadata_url)
    try:
        r1 = await md.put(prefix + "a", b"1")
        r2 = await md.put(prefix + "b", "2")
        assert r2 > r1
        kv = await md.get(prefix + "a")
        assert kv.value == b"1" and kv.version == 1 and kv.mod_revision == r1
        await md.put(prefix + "a", b"11")
        assert (await md.get(prefix + "a")).version == 2
        items, revision = await md.range(prefix)
        assert [(i.key, i.value) for i in items] == [((prefix + "a").encode(), b"11"), ((prefix + "b").encode(), b"2")]
        assert revision >= r2
        assert await md.delete(prefix + "a") is True
        assert await md.delete(prefix + "a") is False
        assert await md.get(prefix + "a") is None
    finally:
        await md.close()


async def test_deleting_only_absent_keys_names_no_revision(metadata_url, prefix):
    """Kills: delete_many of keys already gone answering the store's current revision, which may
    be another prefix's write: a node's remove handed it to clients, whose mirrors of this prefix
    never see it and waited out their timeout."""
    md = open_metadata(metadata_url)
    try:
        written = await md.put_many([Put(f"{prefix}k{i}".encode(), b"v") for i in range(3)])
        assert await md.delete_many([f"{prefix}k{i}" for i in range(3)]) > written
        await md.put(prefix + "other", b"moves the store's revision")
        assert await md.delete_many([f"{prefix}k{i}" for i in range(3)]) == 0
        assert (await md.txn([], [Delete((prefix + "k0").encode())])).changed is False
    finally:
        await md.close()


async def test_range_pages_through_many_keys(metadata_url, prefix):
    md = open_metadata(metadata_url)
    try:
        await md.put_many([Put(f"{prefix}{i:06d}".encode(), b"v" * 10) for i in range(25_000)], chunk=128)
        items, _ = await md.range(prefix)
        assert len(items) == 25_000 and items[0].key.endswith(b"000000") and items[-1].key.endswith(b"024999")
    finally:
        await md.close()


async def test_txn_create_if_absent_has_one_winner(metadata_url, prefix):
    md_a, md_b = open_metadata(metadata_url), open_metadata(metadata_url)
    key = (prefix + "block").encode()
    try:
        async def claim(md, value):
            return (await md.txn([Compare(key, "version", "==", 0)], [Put(key, value)])).succeeded

        results = await asyncio.gather(*[claim(md_a if i % 2 else md_b, f"writer-{i}".encode()) for i in range(20)])
        assert sum(results) == 1
        winner = f"writer-{results.index(True)}".encode()
        assert (await md_a.get(key)).value == winner == (await md_b.get(key)).value
        failed = await md_a.txn([Compare(key, "value", "==", b"nope")], [Delete(key)], [Put(key + b"/seen", b"x")])
        assert not failed.succeeded and (await md_a.get(key + b"/seen")) is not None
    finally:
        await md_a.close()
        await md_b.close()


async def test_put_many_uses_one_txn_per_128(metadata_url, prefix):
    md = open_metadata(metadata_url)
    try:
        await md.put_many([Put(f"{prefix}k{i}".encode(), b"v") for i in range(300)])
        items = (await md.range(prefix + "k"))[0]
        assert len(items) == 300
        # ceil(300 / 128) transactions, one revision each (counted on the keys themselves: the
        # shared etcd's own revision also moves when an earlier test's lease expires meanwhile)
        assert len({kv.mod_revision for kv in items}) == 3
    finally:
        await md.close()


async def test_lease_expiry_and_revoke(metadata_url, prefix):
    md = open_metadata(metadata_url)
    try:
        short = await md.lease_grant(1)
        kept = await md.lease_grant(1)
        await md.put(prefix + "short", b"x", lease=short)
        await md.put_many([Put(f"{prefix}kept{i}".encode(), b"x", kept.id) for i in range(3)])
        deadline = time.monotonic() + 8
        while await md.get(prefix + "short") is not None:
            assert time.monotonic() < deadline, "expired lease kept its key"
            await md.lease_keepalive(kept)
            await asyncio.sleep(0.2)
        assert len((await md.range(prefix + "kept"))[0]) == 3
        with pytest.raises(LeaseExpired):
            await md.lease_keepalive(short)
        with pytest.raises(LeaseExpired):
            await md.put(prefix + "late", b"x", lease=short)
        await md.lease_revoke(kept)
        assert (await md.range(prefix + "kept"))[0] == []
    finally:
        await md.close()


async def test_watch_sees_puts_deletes_and_lease_expiry(metadata_url, prefix):
    md = open_metadata(metadata_url)
    try:
        start = await md.put(prefix + "before", b"0")
        watch = await md.watch(prefix, start_revision=start)
        lease = await md.lease_grant(1)
        await md.put(prefix + "a", b"1")
        await md.put(prefix + "leased", b"2", lease=lease)
        await md.delete(prefix + "a")
        await md.put("/elsewhere/" + prefix, b"not mine")
        seen = []

        async def collect():
            async for event in watch:
                seen.append((event.kind, event.key.decode()[len(prefix):]))
                if len(seen) == 5:
                    return

        await asyncio.wait_for(collect(), 10)
        assert seen == [("put", "before"), ("put", "a"), ("put", "leased"), ("delete", "a"), ("delete", "leased")]
        await watch.cancel()
    finally:
        await md.close()


async def test_watch_from_compacted_revision_is_refused(metadata_url, prefix):
    md = open_metadata(metadata_url)
    try:
        first = await md.put(prefix + "x", b"1")
        latest = await md.put(prefix + "x", b"2")
        await md.compact(latest)
        with pytest.raises(WatchCompacted):
            watch = await md.watch(prefix, start_revision=first)
            async for _ in watch:
                break
    finally:
        await md.close()


async def test_bad_input_gets_typed_errors(metadata_url, prefix):
    md = open_metadata(metadata_url)
    try:
        with pytest.raises(InvalidKey):
            await md.put("", b"x")
        with pytest.raises(InvalidKey):
            await md.put(42, b"x")  # type: ignore[arg-type]
        with pytest.raises(InvalidValue):
            await md.put(prefix + "k", 3.14)  # type: ignore[arg-type]
        with pytest.raises(ValueTooLarge):
            await md.put(prefix + "k", b"x" * (2 << 20))
        with pytest.raises(InvalidKey):
            await md.put_many([Put(b"", b"x")])
        assert (await md.range(prefix))[0] == []  # nothing half-written
    finally:
        await md.close()


async def test_batches_fit_an_etcd_that_takes_fewer_operations_per_transaction(prefix):
    """An etcd run with a lower --max-txn-ops than the default refuses our 128-op transactions:
    batches are split further instead of failing (a daemon's publisher would retry forever)."""
    from kvstore_testing.etcd import EtcdServer

    with EtcdServer(extra_args=["--max-txn-ops", "16"]) as server:
        md = open_metadata(server.url)
        try:
            with pytest.raises(ValueTooLarge):  # the limit is real
                await md.txn([], [Put(f"{prefix}x{i}".encode(), b"v") for i in range(17)])
            await md.put_many([Put(f"{prefix}{i:03d}".encode(), b"v") for i in range(100)])
            items, _ = await md.range(prefix)
            assert len(items) == 100
            await md.delete_many([item.key for item in items])
            assert (await md.range(prefix))[0] == []
        finally:
            await md.close()
