"""Scale benchmark: what the block index costs as a fleet grows, per etcd shard and per host.

    python -m benchmarks.scale [--quick] [--json PATH] [--shards 1,2,4] [--blocks 1000000,10000000]

Four kinds of record, each against real local etcd servers and real kvstore processes:

- `publish`: block records partitioned by block hash over N etcd servers (shards), each written by
  its own publisher process the way a daemon publishes (one batch in flight, the next gathering
  whatever arrived meanwhile, 128 records per transaction) at increasing offered rates, and watched
  by a follower in that process. Per step: blocks/s etcd took (each shard and all), publish →
  visible lag p50/p99 (a record's arrival at the publisher → the shard's watch event carrying it),
  and each etcd's CPU per block written.
- `mirror_load`: the index spread over N shards by block hash (kvstore.index.shards), loaded by a
  reader's mirror (`open_mirror`: for several shards, one IndexMirror per shard side by side);
  blocks/s.
- `lookup`: a host index (a `kvstore serve` daemon holding the host's one mirror, of every shard)
  over the indexed blocks; a 4,096-block prompt's `match()` from another process, p50/p99, through
  the host's shared table (kvstore.index.shared_table) and, for comparison, over the daemon's
  socket (`socket_p50_us`). The `mirror_load` record carries the same prompts matched in-process
  by the loaded mirror (`match_p50_us`): what a process with its own mirror pays.
- `host_memory`: worker processes attached to that host index against one mirror of their own:
  what each worker's resident memory grew by opening a client and asking a question, but the
  pages of the host's shared table it mapped (the daemon's: counted once, in the daemon's growth).

What it proves and what not: the `publish` records measure each shard's etcd taking its part of the
hash space from the writer a node runs per shard (NodeSession, as a sharded node does), not one
node's ShardedSession splitting its batches (which adds a split and N transactions per batch); they
are the inputs of docs/architecture.md's extrapolation.
On a machine with fewer cores than shards × (etcd + publisher) the shards share the CPUs: there
the CPU per block written, flat or not as shards are added, is the figure that carries over.

`--quick` (the test suite's run): shards 1 and 2, two short publish steps, 20,000 blocks, 1 and 2
workers. JSON: `records` (every figure), `targets` and `meta`.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from kvstore import Client
from kvstore.daemon.session import NodeSession
from kvstore.index import open_mirror
from kvstore.index.shards import shard_of
from kvstore.index.records import Layout, NodeRecord
from kvstore.keys import external_hashes
from kvstore.metadata import open_metadata
from kvstore_testing import processes
from kvstore_testing.etcd import EtcdServer

from benchmarks.metadata import FP, percentile, records
from benchmarks.records import write_json

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 10M records outgrow etcd's default 2 GiB quota; fewer raft entries kept in memory between
# snapshots (docs/operations.md's advice) keep a filling etcd's memory down.
ETCD_ARGS = ["--quota-backend-bytes", str(8 << 30), "--snapshot-count", "10000"]
TICK = 0.01  # seconds between a publisher's arrivals (an open loop: arrivals never wait for etcd)
GRACE_S = 5.0  # after the offered window, how long the watch may take to show the last batch published
SUSTAINED_BACKLOG_S = 0.25  # a step is sustained when its backlog at the end is at most this much of arrivals
PUBLISH_CLUSTER, INDEX_CLUSTER = "scale-publish", "scale-index"


# -- publish: one child process per shard ---------------------------------------------------------

async def publish_at_rate(url: str, name: str, rate: float, seconds: float, first: int) -> dict:
    """Offer `rate` blocks/s for `seconds` to the etcd at `url` as a daemon's publisher would, and
    follow them on a watch of the same etcd (see module docstring)."""
    layout = Layout(PUBLISH_CLUSTER)
    session = NodeSession(open_metadata(url, timeout=30), layout, NodeRecord(name, "x"), ttl=600)
    await session.start()
    watcher = open_metadata(url, timeout=30)
    watch = await watcher.watch(layout.blocks_prefix().encode())
    per_tick = max(1, round(rate * TICK))
    ticks = max(1, int(seconds / TICK))
    items = records(first, per_tick * ticks)  # made before the clock starts
    seen: list[tuple[int, float, int]] = []  # (revision, when the watch delivered it, blocks), in order

    async def follow() -> None:
        async for batch in watch.batches():
            seen.append((batch[-1].revision, time.perf_counter(), len(batch)))

    following = asyncio.create_task(follow())
    pending: list[tuple[float, int]] = []  # (arrival, records) not yet taken by a batch
    batches: list[tuple[list[tuple[float, int]], int]] = []  # (arrivals, revision) of each batch published
    arrived = asyncio.Event()

    async def publisher() -> None:
        taken = 0
        while True:
            if not pending:
                arrived.clear()
                await arrived.wait()
                continue
            batch, pending[:] = list(pending), []
            count = sum(n for _, n in batch)
            revision = await session.publish(FP.digest, items[taken : taken + count])
            taken += count
            batches.append((batch, revision))

    publishing = asyncio.create_task(publisher())
    start = time.perf_counter()
    for tick in range(ticks):
        delay = start + tick * TICK - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pending.append((time.perf_counter(), per_tick))
        arrived.set()
    window_end = time.perf_counter()
    # Past its capacity a publisher falls behind without bound, and takes its backlog as one batch
    # (as a daemon's does): count what became visible on the watch within the window, not batches.
    visible = sum(n for _, when, n in seen if when <= window_end)
    backlog = per_tick * ticks - visible
    await asyncio.sleep(min(GRACE_S, 1.0))  # the batch in flight, if it is small
    publishing.cancel()
    await asyncio.gather(publishing, return_exceptions=True)  # its end (a cancelled call) seen here, not logged
    if batches:
        last = batches[-1][1]
        deadline = time.perf_counter() + GRACE_S
        while (not seen or seen[-1][0] < last) and time.perf_counter() < deadline:
            await asyncio.sleep(0.005)
    following.cancel()
    await watch.cancel()
    revisions = [r for r, _, _ in seen]
    lags: list[float] = []  # the records of every batch published, from arrival to visible
    for arrivals, revision in batches:
        at = bisect.bisect_left(revisions, revision)
        shown = seen[at][1] if at < len(seen) else float("inf")
        for when, count in arrivals:
            lags.extend([(shown - when) * 1e3] * count)
    await session.metadata.close()
    await watcher.close()
    if not lags:
        raise RuntimeError(f"etcd at {url} took no batch within {seconds} s and a {GRACE_S:g} s grace")
    return {"blocks": sum(n for _, _, n in seen), "blocks_per_s": visible / (window_end - start),
            "backlog_at_window_end": backlog, "sustained": backlog <= rate * SUSTAINED_BACKLOG_S,
            "visible_lag_p50_ms": percentile(lags, 0.5), "visible_lag_p99_ms": percentile(lags, 0.99)}


def publisher_main() -> None:
    """A publisher child: argv URL NAME RATE SECONDS FIRST; prints `ready`, starts on a line on
    stdin, prints its result as one JSON line."""
    url, name, rate, seconds, first = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    import kvstore.daemon.session  # noqa: F401 - imported before `ready`: the steps time publishing, not imports
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(asyncio.run(publish_at_rate(url, name, rate, seconds, first))), flush=True)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def publish_step(shards: list[EtcdServer], rate: float, seconds: float, first: int) -> dict:
    """One offered rate (blocks/s, all shards together) for `seconds`; the `publish` record."""
    children = [processes.spawn([sys.executable, "-c", "from benchmarks.scale import publisher_main; publisher_main()",
                                 etcd.url, f"pub-{i}", str(rate / len(shards)), str(seconds),
                                 str(first + i * 100_000_000)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=CHECKOUT)
                for i, etcd in enumerate(shards)]
    try:
        for child in children:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a publisher exited with {child.wait(10)} before it was ready")
        cpu = [cpu_seconds(etcd.proc.pid) for etcd in shards]
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        results = []
        for child in children:
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"a publisher exited with {child.wait(10)} before its result")
            results.append(json.loads(line))
        cpu = [cpu_seconds(etcd.proc.pid) - before for etcd, before in zip(shards, cpu)]
    finally:
        for child in children:
            processes.stop(child, grace=5)
    return {"kind": "publish", "shards": len(shards), "offered_blocks_per_s": rate, "seconds": seconds,
            "blocks_per_s": sum(r["blocks_per_s"] for r in results),
            "per_shard_blocks_per_s": [r["blocks_per_s"] for r in results],
            "backlog_at_window_end": sum(r["backlog_at_window_end"] for r in results),
            "sustained": all(r["sustained"] for r in results),
            "visible_lag_p50_ms": max(r["visible_lag_p50_ms"] for r in results),
            "visible_lag_p99_ms": max(r["visible_lag_p99_ms"] for r in results),
            # every block etcd took, the batch in flight at the window's end included
            "etcd_cpu_us_per_block": sum(cpu) * 1e6 / max(1, sum(r["blocks"] for r in results))}


# -- the index spread over shards: fill, then mirrors loading it ------------------------------------

def fill(shards: list[EtcdServer], total: int) -> float:
    """`total` blocks, each block's record on the shard its hash picks (kvstore.index.shards), with
    a few transactions in flight per shard; seconds taken (setup, not a figure)."""
    async def run() -> None:
        sessions = [NodeSession(open_metadata(etcd.url, timeout=120), Layout(INDEX_CLUSTER), NodeRecord("bulk", "x"),
                                ttl=3600, place=(i, len(shards))) for i, etcd in enumerate(shards)]
        await asyncio.gather(*[session.start() for session in sessions])
        chunk, in_flight = 1024, 8
        for first in range(0, total, chunk * in_flight):
            items = records(first, min(chunk * in_flight, total - first))
            parts: list[list] = [[] for _ in shards]
            for item in items:
                parts[shard_of(item[0], len(shards))].append(item)
            await asyncio.gather(*[session.publish(FP.digest, part[i : i + chunk])
                                   for session, part in zip(sessions, parts) for i in range(0, len(part), chunk)])
        for session in sessions:  # the leases outlive the benchmark's use of the index
            await session.metadata.close()

    started = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - started


def data_bytes(etcd: EtcdServer) -> int:
    """What an etcd's data dir holds on disk (its bbolt database and WAL)."""
    return sum(os.path.getsize(os.path.join(top, name)) for top, _, names in os.walk(etcd.data_dir) for name in names)


def mirror_load(shards: list[EtcdServer], total: int) -> dict:
    """The index's mirror as a reader starts it (one IndexMirror per shard, loading side by side,
    for several shards); the `mirror_load` record."""
    mirror = open_mirror(";".join(etcd.url for etcd in shards), INDEX_CLUSTER, timeout=30)
    started = time.perf_counter()
    mirror.start(wait=900)
    seconds = time.perf_counter() - started
    loaded = mirror.block_count
    try:
        if loaded != total:
            raise RuntimeError(f"the mirror loaded {loaded:,} blocks of {total:,}")
        in_process = lookups(mirror, total)  # the same prompts as the host lookups: their baseline
    finally:
        mirror.stop()
    return {"kind": "mirror_load", "shards": len(shards), "indexed_blocks": total, "seconds": seconds,
            "blocks_per_s": total / seconds, "match_p50_us": percentile(in_process, 0.5),
            "match_p99_us": percentile(in_process, 0.99)}


# -- the host index: lookups from another process, memory of attached workers ----------------------

WORKER = """
import json, os, sys
from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

def rss():  # resident bytes but shared memory (the host's table: the daemon's, counted there once)
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return (int(fields["VmRSS"].split()[0]) - int(fields["RssShmem"].split()[0])) * 1024

url, cluster, index, secret = sys.argv[1:5]
fp = ModelFingerprint("bench-model", "float16", 128, 32, 8, 128)
base = rss()
client = Client(url, cluster=cluster, secret=secret, index=index, timeout=10)
if index == "own":
    client.mirror.wait_loaded(600)
assert client.match_prefix(external_hashes(range(16), fp), fp) == 16
print(json.dumps({"bytes": rss() - base}), flush=True)
sys.stdin.readline()  # held until every worker has answered: they live side by side
client.close()
"""


def process_rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def workers_memory(url: str, cluster: str, secret: str, index: str, count: int) -> list[int]:
    """RSS each of `count` worker processes gained opening a client (`index` own or host) and
    asking one question, all alive at once."""
    procs = [processes.spawn([sys.executable, "-c", WORKER, url, cluster, index, secret], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        grown = []
        for proc in procs:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a {index}-index worker exited with {proc.wait(10)}")
            grown.append(json.loads(line)["bytes"])
        return grown
    finally:
        for proc in procs:
            processes.release(proc)


def lookups(mirror, total: int, rounds: int = 110) -> list[float]:
    """Microseconds of each 4,096-block match, a different prompt each round (the first 10 warm
    the path and are not counted)."""
    samples = []
    for i in range(rounds):
        first = (i * 9_973) % (total - 4096)
        hashes = external_hashes(range(first, first + 4096), FP)
        started = time.perf_counter()
        length = mirror.match(FP, hashes).length
        elapsed = (time.perf_counter() - started) * 1e6
        assert length == 4096, length
        if i >= 10:
            samples.append(elapsed)
    return samples


def host_index(shards: list[EtcdServer], total: int, worker_counts: tuple[int, ...], where: str) -> list[dict]:
    """A `kvstore serve` daemon holding the host's mirror of the index's `total` blocks (over the
    shards): `lookup` (a 4,096-block match from this process) and `host_memory` records (workers
    attached to it against one worker with a mirror of its own)."""
    url = ";".join(etcd.url for etcd in shards)
    secret = os.urandom(16).hex()
    secret_file = os.path.join(where, "secret")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secret)
    daemon, _ = processes.start_store_daemon(["--node", "host-index", "--metadata", url, "--cluster",
                                              INDEX_CLUSTER, "--dram", "64MiB", "--secret-file", secret_file,
                                              "--admin-token-file", os.path.join(where, "admin-token"),
                                              "--metrics-port", "0"])
    out = []
    try:
        before = process_rss(daemon.pid)
        client = Client(url, cluster=INDEX_CLUSTER, secret=secret, index="host", timeout=30)
        deadline = time.monotonic() + 900
        while client.mirror.status().get("loading") or client.mirror.block_count < total:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the host index holds {client.mirror.block_count:,} blocks of {total:,}")
            time.sleep(0.05)
        daemon_bytes = process_rss(daemon.pid) - before
        table = lookups(client.mirror, total)
        missed = client.mirror.table_misses
        if client.mirror.own is not None:
            raise RuntimeError("the host index stopped answering during the lookups (see the log above)")
        client.mirror.use_table = False
        socket = lookups(client.mirror, total)
        client.close()
        out.append({"kind": "lookup", "shards": len(shards), "indexed_blocks": total, "workers": 1, "prompt_blocks": 4096,
                    "path": "shared table", "p50_us": percentile(table, 0.5), "p99_us": percentile(table, 0.99),
                    "table_misses": missed, "socket_p50_us": percentile(socket, 0.5),
                    "socket_p99_us": percentile(socket, 0.99)})
        single = workers_memory(url, INDEX_CLUSTER, secret, "own", 1)[0]
        for count in worker_counts:
            attached = sum(workers_memory(url, INDEX_CLUSTER, secret, "host", count)) + daemon_bytes
            out.append({"kind": "host_memory", "shards": len(shards), "indexed_blocks": total, "workers": count,
                        "bytes": attached, "single_mirror_bytes": single, "over_single_mirror": attached / single})
    finally:
        processes.stop(daemon, grace=10)
    return out


# -- the run ---------------------------------------------------------------------------------------

def counts(text: str, what: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (argparse type)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be at least 1, got {text!r}")
    return sorted(set(values))


def targets(rows: list[dict], workers: int) -> list[dict]:
    """The issue's targets from the records (a target whose records this run lacks is left out)."""
    out = []

    def add(label: str, value: float, bound: float, higher: bool) -> None:
        out.append({"target": label, "value": value, "bound": bound, "met": value >= bound if higher else value <= bound})

    by_kind = {kind: [r for r in rows if r["kind"] == kind] for kind in ("publish", "mirror_load", "lookup", "host_memory")}
    smallest = min((r["indexed_blocks"] for r in by_kind["lookup"]), default=None)
    for r in by_kind["host_memory"]:
        if r["workers"] == workers and r["indexed_blocks"] == smallest:
            add(f"{workers} workers on the host index / one mirror ({r['indexed_blocks']:,} blocks, "
                f"{r['shards']} shard(s), <= 1.2)",
                r["over_single_mirror"], 1.2, False)
    for r in by_kind["lookup"]:
        if r["indexed_blocks"] == smallest:
            add(f"host lookup of 4,096 blocks p50 us ({r['indexed_blocks']:,} blocks, {r['shards']} shard(s), <= 100)",
                r["p50_us"], 100, False)
            own = [m for m in by_kind["mirror_load"] if (m["indexed_blocks"], m["shards"]) == (smallest, r["shards"])]
            if own:  # the same prompts matched in-process by a mirror of one's own, in the same run
                add(f"host lookup p50 / an own mirror's in-process match ({r['indexed_blocks']:,} blocks, "
                    f"{r['shards']} shard(s), <= 1.2)", r["p50_us"] / own[0]["match_p50_us"], 1.2, False)
    best: dict[int, dict] = {}  # each shard count's step with the most blocks/s: its capacity
    for r in by_kind["publish"]:
        if r["blocks_per_s"] > best.get(r["shards"], {}).get("blocks_per_s", 0.0):
            best[r["shards"]] = r
    if len(best) > 1 and 1 in best:
        most = max(best)
        add(f"publish capacity, {most} shards / 1 (>= {0.8 * most:.1f})",
            best[most]["blocks_per_s"] / best[1]["blocks_per_s"], 0.8 * most, True)
        # At capacity every shard's batches are full: the CPU per block compares like with like.
        add(f"etcd CPU per block written at capacity, {most} shards / 1 (flat: <= 1.2)",
            best[most]["etcd_cpu_us_per_block"] / best[1]["etcd_cpu_us_per_block"], 1.2, False)
    largest = max(by_kind["mirror_load"], key=lambda r: (r["indexed_blocks"], r["shards"]), default=None)
    if largest is not None:
        add(f"mirror load over {largest['shards']} shards, {largest['indexed_blocks']:,} blocks, blocks/s (>= 300,000)",
            largest["blocks_per_s"], 300_000, True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--quick", action="store_true", help="the test suite's short run")
    parser.add_argument("--shards", type=lambda t: counts(t, "--shards"), default=[1, 2, 4],
                        help="etcd shard counts (default 1,2,4)")
    parser.add_argument("--blocks", type=lambda t: counts(t, "--blocks"), default=[1_000_000, 10_000_000],
                        help="indexed blocks for the load, lookup and memory records (default 1000000,10000000)")
    parser.add_argument("--rates", type=lambda t: counts(t, "--rates"), default=[5_000, 10_000, 20_000, 40_000, 80_000],
                        help="offered publish rates, blocks/s over all shards")
    parser.add_argument("--seconds", type=float, default=8.0, help="each publish step's offered window")
    parser.add_argument("--index-shards", type=lambda t: counts(t, "--index-shards"), default=None,
                        help="shard counts the index of --blocks is spread over for the load, lookup and memory "
                             "records (default: 1 and the largest of --shards)")
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.blocks, args.rates, args.seconds = [1, 2], [20_000], [2_000, 8_000], 1.5
        args.index_shards = None
    if min(args.blocks) < 8192:
        parser.error("--blocks must be at least 8192 (lookups take 4,096-block prompts at several places)")
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    workers = 2 if args.quick else 8
    rows: list[dict] = []
    for n in args.shards:
        shards = []
        try:
            for _ in range(n):
                shards.append(EtcdServer(extra_args=ETCD_ARGS).start())
            for i, rate in enumerate(args.rates):
                print(f"publish: {n} shard(s), {rate:,} blocks/s offered ...", flush=True)
                rows.append(publish_step(shards, rate, args.seconds, 1_000_000_000 + i * 10_000_000))
        finally:
            for etcd in shards:
                etcd.cleanup()
    for total in args.blocks:
        for n in args.index_shards or sorted({1, max(args.shards)}):
            shards = []
            try:
                for _ in range(n):
                    shards.append(EtcdServer(extra_args=ETCD_ARGS).start())
                print(f"filling {n} shard(s) with {total:,} blocks ...", flush=True)
                fill_seconds = fill(shards, total)
                print(f"  {fill_seconds:.1f} s; mirrors loading ...", flush=True)
                rows.append({**mirror_load(shards, total), "fill_blocks_per_s": total / fill_seconds,
                             "etcd_bytes_per_block": sum(map(data_bytes, shards)) / total})
                print("  host index ...", flush=True)
                with tempfile.TemporaryDirectory(prefix="kvstore-bench-scale-") as where:
                    rows.extend(host_index(shards, total, (1, workers), where))
            finally:
                for etcd in shards:
                    etcd.cleanup()
    goals = targets(rows, workers)
    print()
    print(f"  {'kind':<12}{'shards':>7}{'blocks':>12}{'workers':>8}  figures")
    for r in rows:
        figures = {k: v for k, v in r.items() if k not in ("kind", "shards", "indexed_blocks", "workers")}
        text = "  ".join(f"{k}={v:,.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()
                         if not isinstance(v, list))
        blocks, workers_ = f"{r['indexed_blocks']:,}" if "indexed_blocks" in r else "-", r.get("workers", "-")
        print(f"  {r['kind']:<12}{r['shards']:>7}{blocks:>12}{workers_:>8}  {text}")
    print("\n  targets")
    for goal in goals:
        print(f"  {goal['target']:<78}{goal['value']:>12,.2f}  {'met' if goal['met'] else 'NOT met'}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "command": "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:])}
        write_json(args.json, {"meta": meta, "records": rows, "targets": goals})
    return 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.scale"))
