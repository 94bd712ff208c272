"""Metadata benchmark against a real local etcd: batched vs one-per-block publishing, index
mirror snapshot load (rate, vs etcd handing over the same keys with no decoding), convergence
after a publish, match() latency against a large index, mirror memory per block, and a mirror
scoped to one small model's fingerprint (`IndexMirror(fingerprints=...)`) in that large index:
its load time and memory against the whole mirror's. The host index (one mirror per host) and
the index over several etcd shards: `benchmarks.scale`.

    python -m benchmarks.metadata [--json PATH] [--blocks 1000000] [--quick]

`--quick` (the test suite's run): 100,000 blocks, fewer samples. JSON: `results`
(every figure printed, by name) and `meta`.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import sys
import threading
import time
import tracemalloc

from kvstore.daemon.session import NodeSession
from kvstore.index import IndexMirror
from kvstore.index.records import BlockRecord, Layout, NodeRecord
from kvstore.index.snapshot import load_prefix
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore.metadata import open_metadata
from kvstore_testing import processes
from kvstore_testing.etcd import EtcdServer

from benchmarks.records import write_json

FP = ModelFingerprint("bench-model", "float16", 128, 32, 8, 128)
SMALL = ModelFingerprint("bench-small-model", "float16", 128, 16, 8, 128)  # the scoped mirror's model
SMALL_BLOCKS = 10_000


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def records(start: int, count: int, fp: ModelFingerprint = FP) -> list[tuple[bytes, BlockRecord]]:
    hashes = external_hashes(range(start, start + count), fp)
    return [(h, BlockRecord("dram", 1, (start + i) * 4096, 4096, (start + i).to_bytes(32, "little")))
            for i, h in enumerate(hashes)]


async def publish_rates(url: str, layout: Layout, batched_blocks: int, single_blocks: int) -> dict:
    session = NodeSession(open_metadata(url), layout, NodeRecord("rate", "x"), ttl=60)
    await session.start()
    batch = records(10_000_000, batched_blocks)
    started = time.perf_counter()
    await session.publish(FP.digest, batch)
    batched = batched_blocks / (time.perf_counter() - started)
    singles = records(20_000_000, single_blocks)
    started = time.perf_counter()
    for item in singles:
        await session.publish(FP.digest, [item])
    single = single_blocks / (time.perf_counter() - started)
    await session.close()
    return {"publish_batched_blocks_per_s": batched, "publish_single_blocks_per_s": single,
            "publish_batched_over_single": batched / single}


async def fill(url: str, layout: Layout, total: int, node: str, fp: ModelFingerprint = FP) -> NodeSession:
    """Publish `total` blocks of `fp` with a few transactions in flight at once."""
    # Setup, not a figure: a long timeout, so a busy etcd slows the fill instead of failing it.
    session = NodeSession(open_metadata(url, timeout=60), layout, NodeRecord(node, "x"), ttl=600)
    await session.start()
    chunk, in_flight = 128 * 8, 8
    starts = list(range(0, total, chunk))
    for i in range(0, len(starts), in_flight):
        await asyncio.gather(*[session.publish(fp.digest, records(s, min(chunk, total - s), fp))
                               for s in starts[i : i + in_flight]])
    return session


def convergence(url: str, layout: Layout, mirror: IndexMirror, samples: int) -> dict:
    async def run() -> tuple[list[float], list[float]]:
        session = NodeSession(open_metadata(url), layout, NodeRecord("conv", "x"), ttl=60)
        await session.start()
        after_ack, end_to_end = [], []
        for i in range(samples):
            item = records(30_000_000 + i, 1)
            started = time.perf_counter()
            revision = await session.publish(FP.digest, item)
            acked = time.perf_counter()
            await asyncio.to_thread(mirror.wait_for_revision, revision, 5)
            done = time.perf_counter()
            after_ack.append((done - acked) * 1e3)
            end_to_end.append((done - started) * 1e3)
        await session.close()
        return after_ack, end_to_end

    after_ack, end_to_end = asyncio.run(run())
    return {"convergence_p50_ms": percentile(after_ack, 0.5), "convergence_p99_ms": percentile(after_ack, 0.99),
            "publish_to_visible_p50_ms": percentile(end_to_end, 0.5),
            "publish_to_visible_p99_ms": percentile(end_to_end, 0.99)}


def snapshot_load(url: str, cluster: str) -> dict:
    """Time a mirror's full load (no tracemalloc), and when its first blocks became visible."""
    gc.collect()
    mirror, first = IndexMirror(url, cluster, timeout=10), []

    def spot() -> None:  # the first partial answer, seen from another thread
        while not first and not mirror.wait_loaded(0.002):
            if mirror.block_count:
                first.append(time.perf_counter() - started)

    watcher = threading.Thread(target=spot)
    started = time.perf_counter()
    watcher.start()
    mirror.start(wait=600)
    seconds = time.perf_counter() - started
    watcher.join()
    blocks = mirror.block_count
    mirror.stop()
    first = first or [seconds]
    return {"snapshot_load_seconds": seconds, "snapshot_load_blocks_per_s": blocks / seconds,
            "snapshot_first_blocks_visible_s": first[0]}


def raw_fetch(url: str, layout: Layout) -> dict:
    """The same parallel ranges with nothing done to the pages: what etcd and gRPC alone cost."""
    async def run() -> tuple[int, float]:
        metadata = open_metadata(url, timeout=10)
        revision = (await metadata.range_page(layout.root.encode() + b"nodes/", layout.root.encode() + b"nodes0")).revision
        started = time.perf_counter()
        count = await load_prefix(metadata, layout.blocks_prefix().encode(), revision, lambda page: None, timeout=10)
        seconds = time.perf_counter() - started
        await metadata.close()
        return count, seconds

    count, seconds = asyncio.run(run())
    return {"raw_fetch_blocks_per_s": count / seconds}


def held_by_mirror(url: str, cluster: str, fingerprints: list | None = None) -> tuple[int, int]:
    """(blocks, bytes) a mirror holds after a full load, by tracemalloc (a separate, slower load)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    mirror = IndexMirror(url, cluster, timeout=10, fingerprints=fingerprints).start(wait=600)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    blocks = mirror.block_count
    mirror.stop()
    return blocks, held


def mirror_memory(url: str, cluster: str) -> dict:
    blocks, held = held_by_mirror(url, cluster)
    return {"mirror_blocks": blocks, "mirror_bytes_per_block": held / max(blocks, 1)}


def scoped_mirror(url: str, cluster: str, full_seconds: float, full_bytes_per_block: float, total: int) -> dict:
    """A mirror of SMALL's blocks only, in the index that also holds FP's `total`: load time (no
    tracemalloc), then its memory (tracemalloc), each against the whole mirror's."""
    gc.collect()
    started = time.perf_counter()
    mirror = IndexMirror(url, cluster, timeout=10, fingerprints=[SMALL]).start(wait=600)
    seconds = time.perf_counter() - started
    blocks = mirror.block_count
    mirror.stop()
    _, held = held_by_mirror(url, cluster, [SMALL])
    return {"scoped_mirror_blocks": blocks, "scoped_load_seconds": seconds,
            "scoped_load_over_full": seconds / full_seconds, "scoped_mirror_bytes": held,
            "scoped_bytes_over_full": held / (full_bytes_per_block * (total + blocks))}


def match_latency(mirror: IndexMirror, total: int) -> dict:
    out = {}
    for length in (16, 256, 4096):
        hashes = external_hashes(range(total // 2, total // 2 + length), FP)  # all present
        for _ in range(50):
            mirror.match(FP, hashes)
        samples = []
        for _ in range(400 if length < 4096 else 100):
            started = time.perf_counter()
            result = mirror.match(FP, hashes)
            samples.append((time.perf_counter() - started) * 1e6)
        assert result.length == length, (result.length, length)
        out[f"match_{length}_p50_us"] = percentile(samples, 0.5)
        out[f"match_{length}_p99_us"] = percentile(samples, 0.99)
        samples = []
        for _ in range(100 if length < 4096 else 30):
            started = time.perf_counter()
            mirror.node_prefix_lengths(FP, hashes)
            samples.append((time.perf_counter() - started) * 1e6)
        out[f"node_prefix_{length}_p50_us"] = percentile(samples, 0.5)
    samples = []  # a different prompt every time: nothing of it in the CPU caches
    for i in range(60):
        hashes = external_hashes(range(i * 9_973 % max(total - 4096, 1), i * 9_973 % max(total - 4096, 1) + 4096), FP)
        started = time.perf_counter()
        mirror.match(FP, hashes)
        samples.append((time.perf_counter() - started) * 1e6)
    out["match_4096_fresh_prompt_p50_us"] = percentile(samples, 0.5)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.metadata", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="index size for match() and memory")
    parser.add_argument("--quick", action="store_true", help="smaller index and fewer samples")
    args = parser.parse_args(argv)
    if args.blocks < 4096:
        parser.error("--blocks must be at least 4096 (match() is timed on 4,096-block prompts)")
    total = min(args.blocks, 100_000) if args.quick else args.blocks
    results: dict = {}
    with EtcdServer() as etcd:
        layout = Layout("bench")
        print(f"etcd {etcd.url}; publishing rates ...", flush=True)
        results.update(asyncio.run(publish_rates(etcd.url, layout, 5_000 if args.quick else 20_000,
                                                 300 if args.quick else 1_000)))
        print(f"filling the index with {total:,} blocks ...", flush=True)
        started = time.perf_counter()

        async def do_fill():
            await fill(etcd.url, layout, total, "bulk")
            await fill(etcd.url, layout, SMALL_BLOCKS, "small", SMALL)

        asyncio.run(do_fill())
        results["fill_seconds"] = time.perf_counter() - started
        print("snapshot loads ...", flush=True)
        results.update(raw_fetch(etcd.url, layout))
        results.update(snapshot_load(etcd.url, "bench"))
        results["load_over_raw_fetch"] = results["snapshot_load_blocks_per_s"] / results["raw_fetch_blocks_per_s"]
        results.update(mirror_memory(etcd.url, "bench"))
        results.update(scoped_mirror(etcd.url, "bench", results["snapshot_load_seconds"],
                                     results["mirror_bytes_per_block"], total))
        mirror = IndexMirror(etcd.url, "bench", timeout=10).start(wait=600)
        print("match() latency ...", flush=True)
        results.update(match_latency(mirror, total))
        print("convergence ...", flush=True)
        results.update(convergence(etcd.url, layout, mirror, 100 if args.quick else 300))
        mirror.stop()

    targets = [
        ("batched publish / one-per-block (>= 20)", results["publish_batched_over_single"], 20, True),
        ("match() 256 blocks p50 us (<= 50)", results["match_256_p50_us"], 50, False),
        ("match() 4096 blocks p50 us (<= 100)", results["match_4096_p50_us"], 100, False),
        ("snapshot load blocks/s (>= 200,000)", results["snapshot_load_blocks_per_s"], 200_000, True),
        ("convergence p99 ms (<= 50)", results["convergence_p99_ms"], 50, False),
        ("mirror bytes per block (<= 300)", results["mirror_bytes_per_block"], 300, False),
    ]
    print()
    for key, value in results.items():
        print(f"  {key:<34}{value:>14,.2f}" if isinstance(value, float) else f"  {key:<34}{value:>14,}")
    print("\n  targets")
    for label, value, bound, higher in targets:
        met = value >= bound if higher else value <= bound
        print(f"  {label:<42}{value:>12,.2f}  {'met' if met else 'NOT met'}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "index_blocks": total}
        write_json(args.json, {"meta": meta, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.metadata"))
