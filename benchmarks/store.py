"""Store benchmark: our daemon and client in separate processes, side by side in one run with
Mooncake Store and Redis on loopback, and our NVMe tier against a direct O_DIRECT read.

    python -m benchmarks.store [--json PATH] [--quick] [--rounds N] [--check BASELINE]
    python -m benchmarks.store --check BASELINE --results PATH   (compare a saved run, measure nothing)

Records: system, path (shm|tcp|tls|nvme|nvme-tcp), op (put|get), block_bytes, batch, gbps, p50_us, p99_us.
System `limit` is this machine's ceiling for a batch, timed per call in each round: `memcpy` of the
blocks and `loopback` TCP over as many streams as our client opens (benchmarks/limits.py).
A batch of 32 is one put_many/get_many (Mooncake: batch_put_from/batch_get_into; Redis: a pipeline);
gbps counts the batch's bytes over its median time; p50/p99 are of whole calls.
`shm` is a same-host client (puts over the daemon's unix socket, gets from its mapped arena),
`tls` a client over TCP of a second daemon started with --tls-cert (system `tls`), `nvme` a
same-host client reading the NVMe tier through the tier file's fd (O_DIRECT into page-aligned
buffers), `nvme-tcp` the same gets forced over TCP (the daemon reads the file).
Also: `visibility` (put return -> another client's mirror lists the block) and `burst` (256
concurrent 64 KiB puts over 3 daemons: blocks per node).

Gets verify every block's digest, as clients do by default (on the digest pool, wave by wave as
the copy lands). Two more same-host 32 x 1 MiB get rows, measured call by call in turn with the
default's, say what that costs: `shm-once`, the client run with KVSTORE_VERIFY=once (a re-read of a
DRAM slot it verified, whose seal number holds, is not hashed again: kvstore.client.reads), and
`shm-unhashed`, the same get with no digest taken at all (the limit of any skip).

`--check BASELINE` (a saved `--json` document) compares this run's target ratios with the
baseline's and exits 1 when one moved the wrong way by more than the noise: its tolerance is the
larger of the spread of its per-round values (in the baseline and in this run) and CHECK_FLOOR of its
median. Ratios only, ours against a peer or a limit measured in the same run: never absolute times.

Side by side means turn by turn: in each of `--rounds` rounds every system is set up at once (our
node and Mooncake's segment owner with 2 GiB each), and for each block size, batch and op the
systems (and, at the 32 x 1 MiB get, the limits) take turns of 5 timed calls, each turn after one
untimed call, who goes first rotating (`interleaved`). A burst of load elsewhere on the machine
then falls on every system alike instead of on whichever ran during it. Each target ratio is the
median of its per-round ratios. NVMe, visibility and burst run once, after the rounds.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import mmap
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from benchmarks.limits import LoopbackBatch, memcpy_batch  # noqa: E402
from kvstore import Client  # noqa: E402
from kvstore.client.reads import VerifiedSlots  # noqa: E402
from kvstore.index import IndexMirror  # noqa: E402
from benchmarks.records import write_json  # noqa: E402
from kvstore.keys import ModelFingerprint, external_hashes  # noqa: E402
from kvstore_testing import processes  # noqa: E402
from kvstore_testing.etcd import EtcdServer  # noqa: E402
from kvstore_testing.ports import free_port  # noqa: E402
from transfer.engine import DEFAULT_LOCAL_WORKERS, DEFAULT_STREAMS  # noqa: E402

KIB, MIB = 1024, 1 << 20
BLOCKS = [64 * KIB, 1 * MIB, 4 * MIB]
BATCH = 32
# Blocks of every size in BLOCKS under one name: free-form ("bytes"), not the model geometry's size.
FP = ModelFingerprint("bench-model", "float16", 128, 32, 8, 128, kv_layout="bytes")


@dataclass
class Record:
    system: str
    path: str
    op: str
    block_bytes: int
    batch: int
    gbps: float
    p50_us: float
    p99_us: float
    round: int = 0


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


# A ratio that moved against its target by more than this share of its median, or by more than the
# spread of its per-round values where that is larger, fails `--check`.
CHECK_FLOOR = 0.15
WARMUP_S = 2.0  # every system's client first runs small puts this long (connections, caches, interpreter)
NVME_PASSES = 5  # paired passes of dd and our NVMe gets
SETTLE_S = 0.3  # after a cleanup, for the node's publish window and etcd to go idle


def removed_and_settled(client: Client, hashes: list[bytes], fingerprint=FP) -> None:
    """Remove blocks, then wait until this client's mirror has taken in the removals and the node's
    publisher has gone quiet: the tail of a cleanup (thousands of watch events decoded here) would
    otherwise land in the next measurement."""
    client.remove(hashes, fingerprint=fingerprint)
    ends = [hashes[0], hashes[-1]] if hashes else []
    if not client.mirror.wait_until(lambda m: not any(m.contains(fingerprint, h) for h in ends), 30):
        raise RuntimeError("removed blocks still listed after 30 s")
    time.sleep(SETTLE_S)


def timed(fn: Callable[[int], None], reps: int) -> list[float]:
    """Seconds per call of fn(rep), after one warm-up call (rep -1)."""
    fn(-1)
    samples = []
    for rep in range(reps):
        started = time.perf_counter()
        fn(rep)
        samples.append(time.perf_counter() - started)
    return samples


Key = tuple[str, str, str]  # (system, path, op) of a record
Calls = dict[Key, Callable[[int], None]]  # one call of each system at a step, by its record's key
Step = tuple[str, int, int, Calls]  # (op, block_bytes, batch, calls)


def interleaved(calls: Calls, reps: int, run: int = 5) -> dict[Key, list[float]]:
    """Seconds per call of each of `calls`, the systems taking turns, `run` timed calls each, who
    goes first rotating: a burst of load elsewhere on the machine falls on every system alike, not
    on whichever ran during it. Each turn starts with a call that is not timed (rep -1): it takes
    what the system before left running (our node verifies a large put after answering it), and
    the system's own timed calls run back to back, as a user's would."""
    keys = list(calls)
    samples: dict[Key, list[float]] = {key: [] for key in keys}
    turn = 0
    while any(len(samples[key]) < reps for key in keys):
        for key in keys[turn:] + keys[:turn]:
            todo = min(run, reps - len(samples[key]))
            if todo <= 0:
                continue
            calls[key](-1)
            for _ in range(todo):
                started = time.perf_counter()
                calls[key](len(samples[key]))
                samples[key].append(time.perf_counter() - started)
        turn = (turn + 1) % len(keys)
    return samples


def record(out: list[Record], system: str, path: str, op: str, block: int, batch: int, samples: list[float]) -> None:
    r = Record(system, path, op, block, batch, batch * block / statistics.median(samples) / 1e9,
               percentile(samples, 0.5) * 1e6, percentile(samples, 0.99) * 1e6)
    out.append(r)
    print(f"  {system:<9}{path:<9}{op:<5}{block // KIB:>6}K{batch:>4}{r.gbps:9.2f}{r.p50_us:11.0f}{r.p99_us:11.0f}",
          flush=True)


def reps_for(block: int, batch: int, quick: bool) -> int:
    base = 10 if batch > 1 else (40 if block <= MIB else 20)
    return max(3, base // 3) if quick else base


# --- ours --------------------------------------------------------------------------------------
def start_daemon(etcd: EtcdServer, name: str, dram: str, disk_dir: str | None, disk: str, *extra: str,
                 cluster: str = "bench") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--node", name, "--metadata", etcd.url, "--cluster", cluster,
           "--dram", dram, "--lease-ttl", "30", "--insecure", *extra]
    if disk_dir:
        cmd += ["--disk-dir", disk_dir, "--disk", disk]
    proc = processes.spawn(cmd, stdout=subprocess.PIPE, text=True)
    if not proc.stdout.readline():
        processes.stop(proc)
        raise RuntimeError(f"kvstore serve --node {name} exited with {proc.returncode} before serving")
    return proc


def self_signed(where: str) -> tuple[str, str]:
    """A key and certificate for 127.0.0.1 (openssl), for the `tls` path's daemon."""
    key, cert = os.path.join(where, "key.pem"), os.path.join(where, "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=kvstore-bench", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def ours_steps(etcd: EtcdServer, args: argparse.Namespace, tls: bool = False) -> Iterator[Step]:
    """Our side of each step (see `side_by_side`): a daemon, a same-host client (`shm`) and one
    forced over TCP (`tcp`); at the 32 x 1 MiB get step also `shm-once` and `shm-unhashed` (the
    same-host get with KVSTORE_VERIFY=once, its blocks read before, and with no digest at all).
    `tls`: also a second daemon started with --tls-cert and a client of it over TCP (`tls`: its
    control wire inside TLS; the bytes of large puts and gets still go by the Transfer Engine)."""
    daemon = start_daemon(etcd, "bench-dram", "2GiB", None, "0")  # as Mooncake's segment owner
    daemons = [daemon]
    counter = itertools.count()
    clients: dict[str, Client] = {}
    mirror = IndexMirror(etcd.url, "bench").start()  # one for both clients, as one process would have
    certs = tempfile.TemporaryDirectory(prefix="kvstore-bench-tls-")
    try:
        paths = [("shm", "bench-dram"), ("tcp", "bench-dram")]
        if tls:
            key, cert = self_signed(certs.name)
            daemons.append(start_daemon(etcd, "bench-tls", "2GiB", None, "0", "--tls-cert", cert, "--tls-key", key,
                                        cluster="bench-tls"))
            paths.append(("tls", "bench-tls"))
        for path, node in paths:
            client = clients[path] = Client(etcd.url, cluster="bench-tls" if path == "tls" else "bench", fingerprint=FP,
                                            mirror=None if path == "tls" else mirror,
                                            transport="auto" if path == "shm" else "tcp",
                                            tls_ca=cert if path == "tls" else None)
            client.mirror.wait_until(lambda m: node in m.nodes, 10)
            warm = np.zeros(64 * KIB, np.uint8)
            warm_hashes = []
            until = time.monotonic() + WARMUP_S
            while time.monotonic() < until:
                warm_hashes.append(external_hashes([10**9 + next(counter)], FP)[0])
                client.put(warm_hashes[-1], warm)
            removed_and_settled(client, warm_hashes)
        for block in BLOCKS:
            data = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8) for i in range(BATCH)]
            outs = {path: [np.zeros(block, np.uint8) for _ in range(BATCH)] for path in clients}
            for batch in (1, BATCH):
                written: dict[str, list[list[bytes]]] = {path: [] for path in clients}

                def put(rep: int, path: str) -> None:
                    first = next(counter) * BATCH
                    hashes = external_hashes(range(first, first + batch), FP)
                    clients[path].put_many(list(zip(hashes, data[:batch])))
                    written[path].append(hashes)

                yield "put", block, batch, {("kvstore", path, "put"): functools.partial(put, path=path)
                                            for path in clients}
                calls: Calls = {}
                for path, client in clients.items():
                    target = written[path][-1]
                    client.mirror.wait_until(lambda m: all(client.contains(h) for h in target), 10)
                    calls[("kvstore", path, "get")] = functools.partial(get, client, target, outs[path][:batch],
                                                                        client.reads.nodes.verified)
                if block == MIB and batch == BATCH:
                    shm = clients["shm"]
                    unhashed = VerifiedSlots(mode="once")
                    unhashed.trusted = lambda view, record, number: True  # type: ignore[method-assign]
                    for path, verified in (("shm-once", VerifiedSlots(mode="once")), ("shm-unhashed", unhashed)):
                        calls[("kvstore", path, "get")] = functools.partial(get, shm, written["shm"][-1],
                                                                            outs["shm"][:batch], verified)
                yield "get", block, batch, calls
                for path, client in clients.items():
                    if not all(np.array_equal(o, d) for o, d in zip(outs[path][:batch], data)):
                        raise RuntimeError(f"{path} get returned other bytes")
                    removed_and_settled(client, [h for hashes in written[path] for h in hashes])
    finally:
        for client in clients.values():
            client.close()
        mirror.stop()
        processes.stop_together(daemons, grace=15)
        certs.cleanup()


def get(client: Client, hashes: list[bytes], outs: list[np.ndarray], verified: VerifiedSlots, rep: int) -> None:
    """One of our gets, verifying as `verified` says (the client's own, or a mode measured beside it)."""
    mine, client.reads.nodes.verified = client.reads.nodes.verified, verified
    try:
        if not all(client.get_many(hashes, outs)):
            raise RuntimeError("benchmark get missed")
    finally:
        client.reads.nodes.verified = mine


def dd_direct_read(path: str, nbytes: int, skip: int = 0) -> float:
    """GB/s of `dd iflag=direct` reading `nbytes` of `path` sequentially from `skip` (bytes, MiB-aligned)."""
    done = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", f"count={nbytes // MIB}",
                           f"skip={skip // MIB}", "iflag=direct"], capture_output=True, text=True, check=True)
    match = re.search(r"copied, ([0-9.]+) s", done.stderr)
    return nbytes / float(match.group(1)) / 1e9


def aligned_zeros(nbytes: int) -> np.ndarray:
    """A page-aligned buffer (what O_DIRECT can read into without a bounce)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


def bench_nvme(etcd: EtcdServer, args: argparse.Namespace, out: list[Record]) -> dict:
    """Gets served from the NVMe tier (no promotion): same host through the tier fd (O_DIRECT in the
    client), and forced over TCP (O_DIRECT at the daemon); vs dd O_DIRECT on the same file."""
    folder = tempfile.mkdtemp(prefix="kvstore-bench-nvme-", dir=args.disk_dir)
    tier = os.path.join(folder, "bench-nvme.tier")  # kept while the daemon runs, for dd; the folder goes at the end
    daemon = start_daemon(etcd, "bench-nvme", "16MiB", folder, "1GiB", "--no-promote", "--keep-disk")
    baseline: dict = {}
    try:
        fp = ModelFingerprint("bench-nvme", "float16", 128, 32, 8, 128, kv_layout="bytes")
        with Client(etcd.url, cluster="bench", fingerprint=fp, transport="auto") as client, \
                Client(etcd.url, cluster="bench", fingerprint=fp, transport="tcp") as remote:
            client.mirror.wait_until(lambda m: "bench-nvme" in m.nodes, 10)
            remote.mirror.wait_until(lambda m: "bench-nvme" in m.nodes, 10)
            for block in (1 * MIB, 4 * MIB):
                hashes = external_hashes(range(block * 1000, block * 1000 + 4 * BATCH), fp)
                data = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8) for i in range(len(hashes))]
                client.put_many(list(zip(hashes, data)), fingerprint=fp)
                remote.mirror.wait_until(lambda m: sum(m.lookup(fp, h).get("bench-nvme", None) is not None
                                                       for h in hashes) == len(hashes), 10)
                on_nvme = [h for h in hashes if remote.mirror.lookup(fp, h)["bench-nvme"].tier == "nvme"][:BATCH]
                outs = [aligned_zeros(block) for _ in on_nvme]
                # dd reads the extents these blocks occupy (written data, not the tier's never-written rest).
                records = [remote.mirror.lookup(fp, h)["bench-nvme"] for h in on_nvme]
                start = min(r.offset for r in records) // MIB * MIB
                span = (max(r.offset + r.size for r in records) - start + MIB - 1) // MIB * MIB
                # The disk's speed drifts by 2x within seconds here: each pass reads those extents with
                # dd and then with each of our paths, back to back; a target is the median of the
                # per-pass ratios.
                dd, samples = [], {"nvme": [], "nvme-tcp": []}
                passes = 2 if args.quick else NVME_PASSES
                per_pass = max(3, reps_for(block, BATCH, args.quick) // passes)
                for turn in range(passes):
                    dd.append(dd_direct_read(tier, span, start))
                    paths = [("nvme", client), ("nvme-tcp", remote)]
                    for path, reader in paths[::-1] if turn % 2 else paths:  # who reads first alternates
                        def get(rep: int, reader=reader) -> None:
                            if not all(reader.get_many(on_nvme, outs, fingerprint=fp)):
                                raise RuntimeError("nvme get missed")

                        samples[path].append(timed(get, per_pass))
                        assert all(np.array_equal(o, data[hashes.index(h)]) for o, h in zip(outs, on_nvme))
                for path, runs in samples.items():
                    record(out, "kvstore", path, "get", block, len(on_nvme), [t for run in runs for t in run])
                    baseline[f"{path}_over_dd_{block // MIB}M"] = statistics.median(
                        len(on_nvme) * block / statistics.median(run) / 1e9 / direct for run, direct in zip(runs, dd))
                baseline[f"dd_direct_read_gbps_{block // MIB}M"] = statistics.median(dd)
                print(f"  dd iflag=direct bs=1M over the same {span // MIB} MiB of the tier file, one per pass: "
                      f"{', '.join(f'{v:.2f}' for v in dd)} GB/s", flush=True)
                if not client.stats["nvme_fd_reads"]:
                    raise RuntimeError("same-host NVMe gets did not use the tier fd")
                client.remove(hashes, fingerprint=fp)
        baseline["dd_direct_read_gbps"] = statistics.mean(v for k, v in baseline.items()
                                                          if k.startswith("dd_direct_read_gbps_"))
    finally:
        processes.stop(daemon, grace=15)
        shutil.rmtree(folder, ignore_errors=True)
    return baseline


def bench_visibility(etcd: EtcdServer, args: argparse.Namespace) -> dict:
    """From a put's return to another client's mirror listing the block (background publishing):
    single puts 5 ms apart, and a stream of back-to-back puts (batches gather)."""
    daemon = start_daemon(etcd, "bench-vis", "256MiB", None, "0")
    fp = ModelFingerprint("bench-vis", "float16", 128, 32, 8, 128, kv_layout="bytes")
    result: dict = {}
    try:
        with Client(etcd.url, cluster="bench", fingerprint=fp) as putter, \
                Client(etcd.url, cluster="bench", fingerprint=fp) as watcher:
            putter.mirror.wait_until(lambda m: "bench-vis" in m.nodes, 10)
            block = np.random.default_rng(0).integers(0, 256, 64 * KIB, dtype=np.uint8)
            count = 50 if args.quick else 200
            for mode in ("single", "stream"):
                first = 0 if mode == "single" else count
                hashes = external_hashes(range(first, first + count), fp)
                returned: list[float] = [0.0] * count
                seen: list[float] = [0.0] * count

                def watch() -> None:
                    for i, h in enumerate(hashes):
                        if not watcher.mirror.wait_until(lambda m: m.contains(fp, h), 10):
                            raise RuntimeError("another client never saw the block")
                        seen[i] = time.perf_counter()

                with ThreadPoolExecutor(1) as pool:
                    done = pool.submit(watch)
                    for i, h in enumerate(hashes):
                        putter.put(h, block)
                        returned[i] = time.perf_counter()
                        if mode == "single":
                            time.sleep(0.005)
                    done.result(30)
                delays = [max(0.0, b - a) for a, b in zip(returned, seen)]
                result[mode] = {"puts": count, "p50_us": percentile(delays, 0.5) * 1e6,
                                "p99_us": percentile(delays, 0.99) * 1e6, "max_us": max(delays) * 1e6}
                print(f"  visibility to another client ({mode} puts): p50 {result[mode]['p50_us']:.0f} us, "
                      f"p99 {result[mode]['p99_us']:.0f} us", flush=True)
    finally:
        processes.stop(daemon, grace=15)
    return result


def bench_burst(etcd: EtcdServer, args: argparse.Namespace) -> dict:
    """256 concurrent 64 KiB puts from one client over 3 same-size daemons: blocks per node."""
    daemons = [start_daemon(etcd, f"bench-burst{i}", "256MiB", None, "0") for i in range(3)]
    fp = ModelFingerprint("bench-burst", "float16", 128, 32, 8, 128, kv_layout="bytes")
    try:
        with Client(etcd.url, cluster="bench", fingerprint=fp) as client:
            client.mirror.wait_until(lambda m: all(f"bench-burst{i}" in m.nodes for i in range(3)), 10)
            hashes = external_hashes(range(256), fp)
            block = np.random.default_rng(0).integers(0, 256, 64 * KIB, dtype=np.uint8)
            started = time.perf_counter()
            with ThreadPoolExecutor(32) as pool:
                stored = sum(pool.map(lambda h: client.put(h, block), hashes))
            took = time.perf_counter() - started
            per_node = {f"bench-burst{i}": 0 for i in range(3)}
            for h in hashes:
                for node in client.mirror.lookup(fp, h):
                    per_node[node] = per_node.get(node, 0) + 1
    finally:
        for daemon in daemons:
            processes.stop(daemon, grace=15)
    counts = list(per_node.values())
    result = {"puts": len(hashes), "stored": stored, "per_node": per_node, "seconds": took,
              "max_over_min": max(counts) / max(min(counts), 1) if min(counts) else float("inf")}
    print(f"  burst: 256 concurrent puts over 3 daemons in {took * 1e3:.0f} ms, blocks per node {counts}, "
          f"max/min {result['max_over_min']:.2f}", flush=True)
    return result


# --- Mooncake Store ----------------------------------------------------------------------------
MOONCAKE_OWNER = """
import os, sys
os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", sys.argv[1], 2 << 30, 16 << 20, "tcp", "", sys.argv[2])
print(rc, flush=True)
sys.stdin.readline()
"""


def mooncake_steps(args: argparse.Namespace) -> Iterator[Step]:
    """Mooncake Store's side of each step (none when it is not installed here)."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        print(f"  mooncake: not measured ({exc})")
        return
    master_bin = shutil.which("mooncake_master")
    if master_bin is None:
        print("  mooncake: not measured (mooncake_master not on PATH)")
        return
    rpc, http = free_port(), free_port()
    master = processes.spawn([master_bin, "--rpc_port", str(rpc), "--rpc_address", "127.0.0.1",
                               "--enable_http_metadata_server", "--http_metadata_server_port", str(http),
                               "--metrics_port", str(free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    owner = None
    try:
        time.sleep(1.5)
        metadata, master_addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        owner = processes.spawn([sys.executable, "-c", MOONCAKE_OWNER, metadata, master_addr], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if owner.stdout.readline().strip() != "0":
            print("  mooncake: segment owner failed to start")
            return
        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master_addr) != 0:
            print("  mooncake: client setup failed")
            return
        counter = itertools.count()
        warm = np.zeros(64 * KIB, np.uint8)
        store.register_buffer(warm.ctypes.data, warm.nbytes)
        warm_keys = []
        until = time.monotonic() + WARMUP_S
        while time.monotonic() < until:
            warm_keys.append(f"warm{len(warm_keys)}")
            store.batch_put_from(warm_keys[-1:], [warm.ctypes.data], [warm.nbytes])
        store.batch_remove(warm_keys)
        store.unregister_buffer(warm.ctypes.data)
        for block in BLOCKS:
            src = np.random.default_rng(0).integers(0, 256, BATCH * block, dtype=np.uint8)
            dst = np.zeros(BATCH * block, np.uint8)
            store.register_buffer(src.ctypes.data, src.nbytes)
            store.register_buffer(dst.ctypes.data, dst.nbytes)
            for batch in (1, BATCH):
                written: list[list[str]] = []

                def put(rep: int) -> None:
                    keys = [f"k{next(counter)}" for _ in range(batch)]
                    codes = store.batch_put_from(keys, [src.ctypes.data + i * block for i in range(batch)], [block] * batch)
                    if any(c != 0 for c in codes):
                        raise RuntimeError(f"mooncake put failed: {codes[:4]}")
                    written.append(keys)

                yield "put", block, batch, {("mooncake", "tcp", "put"): put}
                target = written[-1]

                def get(rep: int) -> None:
                    sizes = store.batch_get_into(target, [dst.ctypes.data + i * block for i in range(batch)], [block] * batch)
                    if any(s != block for s in sizes):
                        raise RuntimeError(f"mooncake get failed: {sizes[:4]}")

                yield "get", block, batch, {("mooncake", "tcp", "get"): get}
                assert np.array_equal(dst[: batch * block], src[: batch * block])
                for keys in written:
                    store.batch_remove(keys)
            store.unregister_buffer(src.ctypes.data)
            store.unregister_buffer(dst.ctypes.data)
        store.close()
    finally:
        if owner is not None:
            processes.release(owner, grace=15)
        processes.kill(master)


# --- Redis -------------------------------------------------------------------------------------
def redis_steps(args: argparse.Namespace) -> Iterator[Step]:
    """Redis's side of each step (none when it is not installed here)."""
    server_bin = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        redis = None
    if server_bin is None or redis is None:
        print("  redis: not measured (needs redis-server and the redis package)")
        return
    port = free_port()
    server = processes.spawn([server_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--protected-mode", "yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=30)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        counter = itertools.count()
        for block in BLOCKS:
            value = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8).tobytes()
            for batch in (1, BATCH):
                written: list[list[str]] = []

                def put(rep: int) -> None:
                    keys = [f"k{next(counter)}" for _ in range(batch)]
                    pipe = client.pipeline(transaction=False)
                    for key in keys:
                        pipe.set(key, value)
                    pipe.execute()
                    written.append(keys)

                yield "put", block, batch, {("redis", "tcp", "put"): put}
                target = written[-1]

                def get(rep: int) -> None:
                    if batch == 1:
                        got = [client.get(target[0])]
                    else:
                        pipe = client.pipeline(transaction=False)
                        for key in target:
                            pipe.get(key)
                        got = pipe.execute()
                    if any(g is None or len(g) != block for g in got):
                        raise RuntimeError("redis get failed")

                yield "get", block, batch, {("redis", "tcp", "get"): get}
                client.delete(*[k for keys in written for k in keys])
    finally:
        processes.stop(server)


def limit_steps(args: argparse.Namespace) -> Iterator[Step]:
    """This machine's limits for a batch of 1 MiB blocks, timed at the 32 x 1 MiB get step beside the
    systems: memcpy (one thread or as many as the engine copies with, whichever is faster here) and
    loopback TCP over as many streams as our client opens (what no store can beat here)."""
    blocks = [np.random.default_rng(i).integers(0, 256, MIB, dtype=np.uint8) for i in range(BATCH)]
    loopback = LoopbackBatch(blocks, DEFAULT_STREAMS)
    try:
        for block in BLOCKS:
            for batch in (1, BATCH):
                yield "put", block, batch, {}
                calls: Calls = {}
                if block == MIB and batch == BATCH:
                    calls = {("limit", "memcpy-1", "copy"): memcpy_batch(blocks, 1),
                             ("limit", f"memcpy-{DEFAULT_LOCAL_WORKERS}", "copy"): memcpy_batch(blocks,
                                                                                          DEFAULT_LOCAL_WORKERS),
                             ("limit", "loopback", "copy"): loopback}
                yield "get", block, batch, calls
    finally:
        loopback.close()


def side_by_side(etcd: EtcdServer | None, args: argparse.Namespace, systems: list[str], out: list[Record]) -> None:
    """One round: every system set up at once, then for each block size, batch and op, the systems
    called in turn, one call each per repetition (`interleaved`)."""
    makers = {"kvstore": lambda: ours_steps(etcd, args, tls="tls" in systems), "mooncake": lambda: mooncake_steps(args),
              "redis": lambda: redis_steps(args), "limits": lambda: limit_steps(args)}
    running = [makers[name]() for name in makers if name in systems]
    try:
        while True:
            steps = [step for step in (next(steps, None) for steps in running)]
            running = [steps for steps, step in zip(running, steps) if step is not None]
            steps = [step for step in steps if step is not None]
            if not steps:
                return
            op, block, batch = steps[0][:3]
            if any(step[:3] != (op, block, batch) for step in steps):
                raise RuntimeError(f"systems out of step: {[step[:3] for step in steps]}")
            calls = {key: call for step in steps for key, call in step[3].items()}
            taken = interleaved(calls, reps_for(block, batch, args.quick))
            copies = [samples for (system, path, _), samples in taken.items() if path.startswith("memcpy-")]
            for (system, path, what), samples in taken.items():
                if not path.startswith("memcpy-"):
                    record(out, system, path, what, block, batch, samples)
            if copies:  # one thread or as many as the engine copies with: the faster
                record(out, "limit", "memcpy", "copy", block, batch, min(copies, key=statistics.median))
    finally:
        for steps in running:
            steps.close()


# --- report ------------------------------------------------------------------------------------
def median_of(values: list[float | None]) -> float | None:
    """Median of the known values (a pair's median is their mean); None when none is known."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def ratios(records: list[Record], nvme: dict) -> list[tuple[str, float | None]]:
    def find(system, path, op, block, batch):
        for r in records:
            if (r.system, r.path, r.op, r.block_bytes, r.batch) == (system, path, op, block, batch):
                return r
        return None

    def get(system, path, op, block, batch):
        r = find(system, path, op, block, batch)
        return None if r is None else r.gbps

    def ratio(a, b):
        return None if a is None or not b else a / b

    shm_put_64k, mc_put_64k = find("kvstore", "shm", "put", 64 * KIB, 1), find("mooncake", "tcp", "put", 64 * KIB, 1)
    rows = [
        ("shm single put 64K p50 us (<=500)", None if shm_put_64k is None else shm_put_64k.p50_us),
        ("shm single put 64K p50 / mooncake put p50 (<=1.0)",
         None if shm_put_64k is None or mc_put_64k is None else shm_put_64k.p50_us / mc_put_64k.p50_us),
        ("shm single put 1M / mooncake put 1M GB/s (>=1.5)", ratio(get("kvstore", "shm", "put", MIB, 1),
                                                                 get("mooncake", "tcp", "put", MIB, 1))),
        ("tcp single put 64K p50 / mooncake put p50", None if find("kvstore", "tcp", "put", 64 * KIB, 1) is None
         or mc_put_64k is None else find("kvstore", "tcp", "put", 64 * KIB, 1).p50_us / mc_put_64k.p50_us),
        ("tcp batch get / mooncake batch_get_into 1M (>=1.5)", ratio(get("kvstore", "tcp", "get", MIB, BATCH),
                                                                   get("mooncake", "tcp", "get", MIB, BATCH))),
        ("tcp batch put / mooncake batch_put_from 1M (>=1.5)", ratio(get("kvstore", "tcp", "put", MIB, BATCH),
                                                                   get("mooncake", "tcp", "put", MIB, BATCH))),
        ("tcp single get / redis GET 1M (>=1.5)", ratio(get("kvstore", "tcp", "get", MIB, 1),
                                                       get("redis", "tcp", "get", MIB, 1))),
        ("shm batch get / mooncake batch get 1M (>=3)", ratio(get("kvstore", "shm", "get", MIB, BATCH),
                                                             get("mooncake", "tcp", "get", MIB, BATCH))),
        ("shm batch put / mooncake batch put 1M (>=3)", ratio(get("kvstore", "shm", "put", MIB, BATCH),
                                                             get("mooncake", "tcp", "put", MIB, BATCH))),
        ("shm batch get verified / unhashed 1M (>=0.8)", ratio(get("kvstore", "shm", "get", MIB, BATCH),
                                                              get("kvstore", "shm-unhashed", "get", MIB, BATCH))),
        ("shm batch get verified once / unhashed 1M", ratio(get("kvstore", "shm-once", "get", MIB, BATCH),
                                                           get("kvstore", "shm-unhashed", "get", MIB, BATCH))),
        ("shm batch get verified once / mooncake batch get 1M", ratio(get("kvstore", "shm-once", "get", MIB, BATCH),
                                                                     get("mooncake", "tcp", "get", MIB, BATCH))),
    ]
    # How close each batch call comes to this machine's limit: no target, the context for the ratios.
    memcpy, loopback = get("limit", "memcpy", "copy", MIB, BATCH), get("limit", "loopback", "copy", MIB, BATCH)
    tls_64k, tcp_64k = find("kvstore", "tls", "put", 64 * KIB, 1), find("kvstore", "tcp", "put", 64 * KIB, 1)
    rows += [
        ("shm batch put / memcpy 1M (limit)", ratio(get("kvstore", "shm", "put", MIB, BATCH), memcpy)),
        ("shm batch get / memcpy 1M (limit)", ratio(get("kvstore", "shm", "get", MIB, BATCH), memcpy)),
        ("shm batch get verified once / memcpy 1M (limit)", ratio(get("kvstore", "shm-once", "get", MIB, BATCH),
                                                                  memcpy)),
        ("tcp batch put / loopback TCP 1M (limit)", ratio(get("kvstore", "tcp", "put", MIB, BATCH), loopback)),
        ("tcp batch get / loopback TCP 1M (limit)", ratio(get("kvstore", "tcp", "get", MIB, BATCH), loopback)),
        ("mooncake batch put / loopback TCP 1M (limit)", ratio(get("mooncake", "tcp", "put", MIB, BATCH), loopback)),
        # The control wire inside TLS (--tls-cert) against the same wire in the clear: what TLS costs.
        ("tls single put 64K p50 / tcp single put 64K p50", None if tls_64k is None or tcp_64k is None
         else tls_64k.p50_us / tcp_64k.p50_us),
        ("tls batch put / tcp batch put 1M", ratio(get("kvstore", "tls", "put", MIB, BATCH),
                                                  get("kvstore", "tcp", "put", MIB, BATCH))),
        ("tls batch get / tcp batch get 1M", ratio(get("kvstore", "tls", "get", MIB, BATCH),
                                                  get("kvstore", "tcp", "get", MIB, BATCH))),
    ]
    for path, target in (("nvme", "0.9"), ("nvme-tcp", "0.7")):
        for block in (MIB, 4 * MIB):  # the median of the paired passes' ratios (bench_nvme)
            rows.append((f"{path} batch get {block // MIB}M / dd O_DIRECT (>={target})",
                         nvme.get(f"{path}_over_dd_{block // MIB}M")))
    return rows


def checked_ratios(doc: dict) -> dict[str, tuple[float, float]]:
    """{label: (median, spread of its per-round values)} of a run's ratios that `--check` compares:
    not absolute figures (a time in us), and not the NVMe tier's (the disk's own speed drifts 2x
    within seconds here, whatever the store does)."""
    out = {}
    for label, value in (doc.get("ratios") or {}).items():
        if value is None or " us " in f"{label} " or label.startswith("nvme"):
            continue
        rounds = [r.get(label) for r in doc.get("per_round_ratios") or []]
        rounds = [v for v in rounds if v is not None] or [value]
        out[label] = (value, max(rounds) - min(rounds))
    return out


def check(current: dict, baseline: dict) -> list[str]:
    """A line for each ratio of `baseline` that `current` moved against its target (up where the
    target is a ceiling, '<=', down otherwise) by more than its tolerance: the larger of the two
    runs' per-round spreads and CHECK_FLOOR of the baseline's median. Empty when none did."""
    now, then = checked_ratios(current), checked_ratios(baseline)
    failures = []
    for label, (base, base_spread) in then.items():
        if label not in now:
            print(f"  check: {label}: not measured in this run (baseline {base:.2f})")
            continue
        value, spread = now[label]
        tolerance = max(base_spread, spread, CHECK_FLOOR * abs(base))
        worse = value - base if "(<=" in label else base - value
        verdict = "FAIL" if worse > tolerance else "ok"
        print(f"  check: {verdict:<4} {label:<56}{value:9.2f}  baseline {base:.2f} +- {tolerance:.2f}")
        if worse > tolerance:
            failures.append(f"{label}: {value:.2f} against {base:.2f} (tolerance {tolerance:.2f})")
    return failures


def load_document(path: str, what: str) -> dict:
    """A saved `--json` document, or one line and exit status 2."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"python -m benchmarks.store: {what} {path}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ratios"), dict):
        print(f"python -m benchmarks.store: {what} {path} is not a store benchmark's --json document", file=sys.stderr)
        raise SystemExit(2)
    return doc


def report_check(current: dict, baseline_path: str) -> int:
    failures = check(current, load_document(baseline_path, "--check"))
    if failures:
        print(f"\n  check against {baseline_path}: {len(failures)} ratio(s) moved beyond their noise:")
        for line in failures:
            print(f"    {line}")
        return 1
    print(f"\n  check against {baseline_path}: every ratio within its noise")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--systems", default="kvstore,tls,nvme,visibility,burst,mooncake,redis,limits")
    parser.add_argument("--disk-dir", default=None, help="where the NVMe tier lives (default: the temp dir)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="paired rounds of ours and the peers (default 3; 1 with --quick)")
    parser.add_argument("--check", metavar="BASELINE",
                        help="a saved --json run: exit 1 when a ratio moved against its target beyond its noise")
    parser.add_argument("--results", metavar="PATH",
                        help="with --check: compare this saved --json run instead of measuring one")
    args = parser.parse_args(argv)
    if args.results:
        if not args.check:
            parser.error("--results needs --check BASELINE")
        return report_check(load_document(args.results, "--results"), args.check)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    systems = args.systems.split(",")
    load_at_start = os.getloadavg()  # what else keeps this machine busy, as the run starts and ends
    records: list[Record] = []
    nvme: dict = {}
    extra: dict = {}
    print(f"  {'system':<9}{'path':<9}{'op':<5}{'block':>7}{'n':>4}{'GB/s':>9}{'p50 us':>11}{'p99 us':>11}")
    per_round: list[list[Record]] = []
    for round_ in range(args.rounds):
        if args.rounds > 1:
            print(f"  -- round {round_ + 1} of {args.rounds}")
        these: list[Record] = []
        if {"kvstore", "mooncake", "redis", "limits"} & set(systems):
            with EtcdServer() as etcd:
                side_by_side(etcd, args, systems, these)
        for r in these:
            r.round = round_
        records += these
        per_round.append(these)
    if {"nvme", "visibility", "burst"} & set(systems):  # once, after the paired rounds
        with EtcdServer() as etcd:
            if "nvme" in systems:
                nvme = bench_nvme(etcd, args, records)
            if "visibility" in systems:
                extra["visibility"] = bench_visibility(etcd, args)
            if "burst" in systems:
                extra["burst"] = bench_burst(etcd, args)
    per_round_ratios = [ratios(these, nvme) for these in per_round]
    summary = [(label, median_of([values[i][1] for values in per_round_ratios]))
               for i, (label, _) in enumerate(per_round_ratios[0])]
    if "burst" in extra:
        summary.append(("burst max/min blocks per node (<=1.3)", extra["burst"]["max_over_min"]))
    print(f"\n  targets (ratios in this run{f', median of {args.rounds} rounds' if args.rounds > 1 else ''})")
    for i, (label, value) in enumerate(summary):
        spread = {v[i][1] for v in per_round_ratios} if i < len(per_round_ratios[0]) else set()
        rounds = "" if len(spread) < 2 else \
            "   (" + ", ".join("n/a" if v[i][1] is None else f"{v[i][1]:.2f}" for v in per_round_ratios) + ")"
        print(f"  {label:<56}{'n/a' if value is None else f'{value:.2f}':>9}{rounds}")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
            "load_average_start": load_at_start, "load_average_end": os.getloadavg()}
    document = {"meta": meta, "records": [asdict(r) for r in records], "nvme_baseline": nvme,
                "ratios": dict(summary), "per_round_ratios": [dict(r) for r in per_round_ratios], **extra}
    if args.json:
        write_json(args.json, document)
    return report_check(document, args.check) if args.check else 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.store"))
