"""Soak: a small cluster under steady mixed load for N minutes; what grows, what slows down.

    python -m benchmarks.soak --minutes 5 --json PATH
    python -m benchmarks.soak --quick --json PATH      # 30 seconds (CI), 7.5-second buckets

3 daemons (`kvstore serve`, each with a small DRAM tier and a small NVMe tier) on a real etcd, and
several client processes doing random puts, gets and removes (50% gets, 40% puts, 10% removes) over a
key space 1.3x the cluster's capacity (DRAM + NVMe), with DRAM a third of it: every node demotes
from DRAM to NVMe and evicts from NVMe all the time. Each client first runs flat out for the warm-up
(`--warmup`), measures its own rate, then holds `--load` (0.7) of it for the rest of the run: the
cluster at about 70% of what it can do, not saturated, so latency that creeps up is a finding, not
a queue.

Reported: every process's RSS, open file descriptors and threads (from /proc) every `--sample`
seconds; per op and per bucket (`--bucket`, a minute by default) p50/p99 latency and count;
errors by type; wrong bytes (a get that returned bytes other than the block's — must be 0). The
verdicts: `growth` (each process's last sample over its first after the warm-up, for RSS, fds and
threads: target <= 10%) and `p99_ratio` (each op's worst later bucket p99 over its first bucket
after the warm-up: target <= 2). Recorded, not enforced: a run exits 1 only on wrong bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.records import write_json
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore_testing import processes
from kvstore_testing.etcd import EtcdServer

FP = ModelFingerprint("soak", "float16", 16, 2, 2, 64, kv_layout="bytes")  # BLOCK-sized blocks, free-form
BLOCK = 64 * 1024
TIMEOUT = 2.0
DRAM_MIB, DISK_MIB = 4, 8  # per node: DRAM a third of the node's capacity
NODES = 3
# etcd as it should run under churn: without compaction it keeps every revision of every key (its
# memory grew 47% in a minute of this load); with it, history older than 30 s is dropped.
# etcd also keeps its raft log in memory until --snapshot-count entries (100,000 in etcd 3.4): at this
# load's ~160 revisions/s its RSS grew 17 MiB a minute for 8 minutes (74 -> 174 MiB) with the
# database in use flat at 7 MiB; 10,000 entries bound it.
ETCD_ARGS = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "30s", "--snapshot-count", "10000")
OPS = ("get", "put", "remove")
# Latency histogram bins: 1 us to 100 s, 100 per decade (a bin is 2.3% wide). A client keeps counts,
# not every latency: a list of floats grew its RSS by 4 MiB in 8 minutes, which is the soak's own
# bookkeeping, not the client's.
EDGES = np.logspace(-6, 2, 801)
MIX = (0.5, 0.4, 0.1)


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


def key_space(seed: int) -> list[bytes]:
    """1.3x the cluster's capacity in blocks: puts of new keys evict older ones all the time."""
    capacity = NODES * (DRAM_MIB + DISK_MIB) * (1 << 20) // BLOCK
    return external_hashes(list(range(seed, seed + int(1.3 * capacity))), FP)


def quantile(counts: np.ndarray, q: float) -> float:
    """The `q` quantile of a histogram over EDGES: the upper edge of the bin it falls in (seconds)."""
    cumulative = np.cumsum(counts)
    index = int(np.searchsorted(cumulative, q * cumulative[-1]))
    return float(EDGES[min(index, len(EDGES) - 1)])


# --- one client process ------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    """Runs in a process of its own: ops until `--until` (a wall-clock time), then one JSON line:
    per bucket and op, the latencies' p50/p99 and count; errors; wrong bytes."""
    import logging

    from kvstore import Client

    logging.getLogger("kvstore").setLevel(logging.ERROR)
    keys = key_space(args.seed)
    rng = random.Random(os.getpid())
    latencies: dict[tuple[int, str], np.ndarray] = defaultdict(lambda: np.zeros(len(EDGES) + 1, np.int64))
    errors: dict[str, int] = defaultdict(int)
    wrong = 0
    out = np.zeros(BLOCK, np.uint8)
    with Client(args.metadata, cluster=args.cluster, fingerprint=FP, timeout=TIMEOUT) as client:
        begin = args.start
        time.sleep(max(0.0, begin - time.time()))  # every client starts at the same moment
        warm_ops, rate = 0, None
        next_at = time.time()
        last_bucket = max(0, int(-(-(args.until - begin) // args.bucket)) - 1)
        while (now := time.time()) < args.until:
            if rate is None and now >= begin + args.warmup:
                rate = max(1.0, args.load * warm_ops / max(now - begin, 1e-3))  # ops/s to hold from now
                next_at = now
            if rate is not None:  # paced: open loop, so a slow call shows as latency, not as fewer calls
                if next_at > now:
                    time.sleep(next_at - now)
                next_at += 1.0 / rate
            op = rng.choices(OPS, MIX)[0]
            h = rng.choice(keys)
            bucket = min(int((time.time() - begin) // args.bucket), last_bucket)  # when the call started
            started = time.monotonic()
            try:
                if op == "put":
                    client.put_many([(h, content(h))])
                elif op == "remove":
                    client.remove([h])
                elif client.get(h, out):
                    bad = int(np.count_nonzero(out != content(h)))
                    wrong += bad
            except Exception as exc:  # noqa: BLE001 - typed errors are counted, not fatal
                errors[type(exc).__name__] += 1
            took = time.monotonic() - started
            latencies[(bucket, op)][int(np.searchsorted(EDGES, took))] += 1
            if rate is None:
                warm_ops += 1
    buckets = []
    for (bucket, op), counts in sorted(latencies.items()):
        buckets.append({"bucket": bucket, "op": op, "count": int(counts.sum()), "p50_ms": quantile(counts, 0.5) * 1e3,
                        "p99_ms": quantile(counts, 0.99) * 1e3})
    print(json.dumps({"pid": os.getpid(), "buckets": buckets, "errors": dict(errors), "wrong_bytes": wrong,
                      "rate": rate}), flush=True)
    return 0


# --- the run -----------------------------------------------------------------------------------
@dataclass
class Sample:
    t_s: float  # since the load started
    process: str
    rss_mib: float
    fds: int
    threads: int


@dataclass
class SoakResult:
    minutes: float
    clients: int
    load: float
    bucket_s: float
    warmup_s: float
    ops: dict[str, int] = field(default_factory=dict)
    rate_ops_s: float = 0.0  # the paced rate, all clients together
    latency: list[dict] = field(default_factory=list)  # per bucket and op: count, p50_ms, p99_ms (clients merged)
    samples: list[Sample] = field(default_factory=list)
    growth: dict[str, dict[str, float]] = field(default_factory=dict)  # process -> rss/fds/threads: last/first - 1
    p99_ratio: dict[str, float] = field(default_factory=dict)  # op -> worst later bucket p99 / first bucket p99
    errors: dict[str, int] = field(default_factory=dict)
    wrong_bytes: int = 0
    node_counters: dict[str, dict[str, int]] = field(default_factory=dict)  # demotions, evictions per node
    etcd_args: list[str] = field(default_factory=list)
    etcd_db: list[dict] = field(default_factory=list)  # per sample: t_s, db_mib (file), in_use_mib, revision


def proc_stats(pid: int) -> tuple[float, int, int] | None:
    """(RSS MiB, open fds, threads) of `pid` from /proc; None once it is gone."""
    try:
        rss, threads = 0.0, 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
        return rss, len(os.listdir(f"/proc/{pid}/fd")), threads
    except OSError:
        return None


def etcd_db(client_port: int) -> dict | None:
    """etcd's database file size, the part of it in use, and its revision (its JSON gateway): tells
    whether its own growth is history kept (in use grows) or a file not defragmented (in use flat)."""
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{client_port}/v3/maintenance/status", data=b"{}",
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=2) as reply:
            status = json.loads(reply.read())
    except (OSError, ValueError):
        return None
    return {"db_mib": round(int(status.get("dbSize", 0)) / (1 << 20), 1),
            "in_use_mib": round(int(status.get("dbSizeInUse", 0)) / (1 << 20), 1),
            "revision": int(status.get("header", {}).get("revision", 0))}


def growth(samples: list[Sample], after: float) -> dict[str, dict[str, float]]:
    """Per process: its last sample over its first at or after `after`, minus 1, for each figure."""
    out: dict[str, dict[str, float]] = {}
    for name in sorted({s.process for s in samples}):
        mine = [s for s in samples if s.process == name and s.t_s >= after]
        if len(mine) < 2:
            continue
        first, last = mine[0], mine[-1]
        out[name] = {k: (getattr(last, k) / getattr(first, k) - 1 if getattr(first, k) else 0.0)
                     for k in ("rss_mib", "fds", "threads")}
    return out


def merge(reports: list[dict]) -> list[dict]:
    """The clients' buckets as one: counts summed, p50/p99 the count-weighted mean of the clients'
    (each client's own percentiles; close enough for a trend across buckets)."""
    acc: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for report in reports:
        for b in report["buckets"]:
            acc[(b["bucket"], b["op"])].append(b)
    merged = []
    for (bucket, op), parts in sorted(acc.items()):
        n = sum(p["count"] for p in parts)
        merged.append({"bucket": bucket, "op": op, "count": n,
                       "p50_ms": sum(p["p50_ms"] * p["count"] for p in parts) / n,
                       "p99_ms": sum(p["p99_ms"] * p["count"] for p in parts) / n})
    return merged


def p99_ratios(latency: list[dict], first_bucket: int, last_bucket: int) -> dict[str, float]:
    """Per op: the worst p99 of the full buckets after `first_bucket` over `first_bucket`'s."""
    out = {}
    for op in OPS:
        rows = {r["bucket"]: r["p99_ms"] for r in latency if r["op"] == op and first_bucket <= r["bucket"] <= last_bucket}
        if first_bucket in rows and len(rows) > 1 and rows[first_bucket] > 0:
            out[op] = max(v for b, v in rows.items() if b != first_bucket) / rows[first_bucket]
    return out


def node_counters(control: str) -> dict[str, int]:
    import grpc

    from kvstore.admin.v1 import admin_pb2, admin_pb2_grpc

    try:
        with grpc.insecure_channel(control) as channel:
            status = admin_pb2_grpc.AdminStub(channel).GetNodeStatus(admin_pb2.NodeStatusRequest(), timeout=5)
    except grpc.RpcError:
        return {}
    keep = ("demotions", "evictions_dram", "evictions_nvme", "promotions", "hits_dram", "hits_nvme")
    return {k: int(v) for k, v in status.counters.items() if k in keep}


def run(args: argparse.Namespace) -> SoakResult:
    workdir = tempfile.mkdtemp(prefix="kvstore-soak-")
    etcd = daemons = None
    workers: list[subprocess.Popen] = []
    result = SoakResult(args.minutes, args.clients, args.load, args.bucket, args.warmup,
                        etcd_args=list(ETCD_ARGS) if args.compaction else [])
    try:
        etcd = EtcdServer(os.path.join(workdir, "etcd"), extra_args=ETCD_ARGS if args.compaction else ()).start()
        cluster = uuid.uuid4().hex[:8]
        daemons = {}
        control = {}
        for i in range(NODES):
            name = f"node-{i}"
            proc = processes.spawn(
                [sys.executable, "-m", "kvstore.cli", "serve", "--node", name, "--metadata", etcd.url, "--cluster",
                 cluster, "--dram", f"{DRAM_MIB}MiB", "--disk-dir", os.path.join(workdir, f"nvme-{name}"),
                 "--disk-size", f"{DISK_MIB}MiB", "--timeout", str(TIMEOUT), "--insecure", "--metrics-port", "0",
                 "--log-level", "warning"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"daemon {name} did not start")
            daemons[name], control[name] = proc, json.loads(line)["control"]
        seconds = args.minutes * 60
        start = time.time() + 2.0  # the workers' common clock: every bucket is the same wall-clock span
        until = start + seconds
        seed = 1 + random.randrange(1 << 30)
        for _ in range(args.clients):
            workers.append(processes.spawn(
                [sys.executable, "-m", "benchmarks.soak", "--worker", "--metadata", etcd.url, "--cluster", cluster,
                 "--seed", str(seed), "--start", repr(start), "--until", repr(until), "--warmup", str(args.warmup),
                 "--load", str(args.load), "--bucket", str(args.bucket)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT))
        watched = {**{n: p.pid for n, p in daemons.items()}, "etcd": etcd.proc.pid,
                   **{f"client-{i}": w.pid for i, w in enumerate(workers)}, "soak": os.getpid()}
        print(f"  {'t s':>6}  " + "  ".join(f"{n:>16}" for n in watched) + "   (RSS MiB/fds/threads)", flush=True)
        while time.time() < until + 0.5:
            t = time.time() - start
            row = []
            for name, pid in watched.items():
                stats = proc_stats(pid)
                if stats is not None and t >= 0:
                    result.samples.append(Sample(round(t, 1), name, round(stats[0], 1), stats[1], stats[2]))
                    row.append(f"{stats[0]:.0f}/{stats[1]}/{stats[2]}")
                else:
                    row.append("-")
            db = etcd_db(etcd.client_port) if t >= 0 else None
            if db is not None:
                result.etcd_db.append({"t_s": round(t, 1), **db})
            if t >= 0:
                print(f"  {t:>6.0f}  " + "  ".join(f"{c:>16}" for c in row)
                      + (f"  etcd db {db['db_mib']}/{db['in_use_mib']} MiB" if db else ""), flush=True)
            time.sleep(max(0.0, min(args.sample, until + 0.5 - time.time())))
        reports = []
        for w in workers:
            out, _ = w.communicate(timeout=60 + 9 * TIMEOUT)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if not lines:
                raise RuntimeError(f"a client ended without a report (exit {w.returncode})")
            reports.append(json.loads(lines[-1]))
        for name, addr in control.items():
            result.node_counters[name] = node_counters(addr)
    finally:
        for w in workers:
            processes.stop(w, grace=5)
        for proc in (daemons or {}).values():
            processes.stop(proc, grace=10)
        if etcd is not None:
            etcd.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    result.latency = merge(reports)
    for report in reports:
        result.wrong_bytes += report["wrong_bytes"]
        for k, v in report["errors"].items():
            result.errors[k] = result.errors.get(k, 0) + v
        result.rate_ops_s += report["rate"] or 0.0
    for r in result.latency:
        result.ops[r["op"]] = result.ops.get(r["op"], 0) + r["count"]
    first = int(args.warmup // args.bucket) + (1 if args.warmup % args.bucket else 0)  # first bucket after warm-up
    last = int(seconds // args.bucket) - 1  # the last full bucket
    result.p99_ratio = p99_ratios(result.latency, first, last)
    result.growth = growth(result.samples, args.warmup)
    return result


def table(result: SoakResult) -> str:
    lines = [f"  {'bucket':>6}  " + "  ".join(f"{op + ' p50/p99 ms':>20}{'n':>7}" for op in OPS)]
    by = {(r["bucket"], r["op"]): r for r in result.latency}
    for bucket in sorted({r["bucket"] for r in result.latency}):
        cells = []
        for op in OPS:
            r = by.get((bucket, op))
            cells.append(f"{r['p50_ms']:>9.2f}/{r['p99_ms']:<10.2f}{r['count']:>7}" if r else f"{'-':>20}{'':>7}")
        lines.append(f"  {bucket * result.bucket_s:>5.0f}s  " + "  ".join(cells))
    lines.append("  growth after warm-up (last/first - 1): " + ", ".join(
        f"{n} rss {g['rss_mib']:+.1%} fds {g['fds']:+.1%} thr {g['threads']:+.1%}" for n, g in result.growth.items()))
    lines.append("  p99 worst bucket / first bucket after warm-up: "
                 + ", ".join(f"{op} {v:.2f}x" for op, v in result.p99_ratio.items()))
    lines.append(f"  paced at {result.rate_ops_s:.0f} ops/s in all; ops {result.ops}; errors {result.errors}; "
                 f"wrong bytes {result.wrong_bytes}; nodes {result.node_counters}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("kvstore").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the record here")
    parser.add_argument("--quick", action="store_true", help="30 seconds, 7.5-second buckets, 7.5 s warm-up, samples every 2.5 s (CI)")
    parser.add_argument("--minutes", type=float, default=None, help="length of the load (default 5; at most 1440)")
    parser.add_argument("--clients", type=int, default=3, help="client processes")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the warm-up's rate held after it")
    parser.add_argument("--warmup", type=float, default=None, help="seconds flat out before pacing (default 60)")
    parser.add_argument("--bucket", type=float, default=None, help="seconds per latency bucket (default 60)")
    parser.add_argument("--sample", type=float, default=None, help="seconds between process samples (default 5)")
    parser.add_argument("--no-compaction", dest="compaction", action="store_false",
                        help="run etcd without auto-compaction and with its default --snapshot-count (its "
                             "history, and memory, then grow for as long as the run)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--metadata", "--cluster"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--seed", "--start", "--until"):
        parser.add_argument(hidden, type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.seed = int(args.seed)
        return worker(args)
    args.minutes = args.minutes if args.minutes is not None else (0.5 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (7.5 if args.quick else 60.0)
    args.bucket = args.bucket if args.bucket is not None else (7.5 if args.quick else 60.0)
    args.sample = args.sample if args.sample is not None else (2.5 if args.quick else 5.0)
    if not 0 < args.minutes <= 1440 or args.clients < 1 or not 0 < args.load <= 1 or args.bucket <= 0 \
            or args.sample <= 0 or not 0 <= args.warmup < args.minutes * 60:
        parser.error("--minutes in (0, 1440], --clients >= 1, --load in (0, 1], --bucket and --sample above 0, "
                     "--warmup shorter than the run")
    result = run(args)
    print(table(result), flush=True)
    if args.json:
        write_json(args.json, asdict(result))
    return 1 if result.wrong_bytes else 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.soak"))
