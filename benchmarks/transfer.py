"""Transfer benchmark: ours (shm, tcp) side by side with memcpy, loopback sockets (threaded pairs
and iperf3) and Mooncake's Transfer Engine, in one run, two processes, medians of several repetitions.

    python -m benchmarks.transfer [--json PATH] [--quick] [--streams N] [--reps R] [--systems LIST]

One record per (system, transport, op, block size): gbps (1e9 bytes/s) of a batch covering
--batch-mib, and p50/p99 latency of single ops of that size (null where a system has none).
Systems: kvstore (transports shm, tcp, tcp-aead), memcpy, socket (python, iperf3), mooncake, ucx
(kvstore and ucx-raw over ucx-sm and ucx-tcp, and ucx_perftest); one not installed here is left
out with a line saying why, and its ratios are null (n/a). JSON: `records`, `ratios`, `meta`.
`--quick` (the test suite's run): 16 MiB batches, 2 repetitions, fewer latency samples.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from benchmarks import ucx_records as ucx_bench
from benchmarks.records import write_json
from kvstore_testing import processes
from kvstore_testing.ports import free_port
from transfer import Engine, Read, Write

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # else Mooncake uses the external address
# Its TCP lanes reject batches deeper than ~2048 ops here (a rejected batch also leaves the lanes
# busy), so its 64 MiB batches of small blocks go in sub-batches of this many ops.
MOONCAKE_MAX_BATCH = 1024

KIB, MIB = 1024, 1 << 20
BLOCKS = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB]
SYSTEMS = ("kvstore", "memcpy", "socket", "mooncake", "ucx")


@dataclass
class Record:
    system: str
    transport: str
    op: str
    block_bytes: int
    gbps: float | None
    p50_us: float | None
    p99_us: float | None


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def measure(batch: Callable[[], None], single: Callable[[], None], batch_bytes: int, reps: int,
            lat_iters: int) -> tuple[float, float, float]:
    """(median GB/s of `batch`, p50 us, p99 us of `single`) after one warm-up of each."""
    batch()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        batch()
        times.append(time.perf_counter() - started)
    single()
    lat = []
    for _ in range(lat_iters):
        started = time.perf_counter()
        single()
        lat.append((time.perf_counter() - started) * 1e6)
    return batch_bytes / statistics.median(times) / 1e9, percentile(lat, 0.5), percentile(lat, 0.99)


def latency_iters(block: int, quick: bool) -> int:
    base = 400 if block <= 64 * KIB else 60 if block <= MIB else 12
    return max(5, base // 4) if quick else base


# --- the target process -------------------------------------------------------------------
def serve(size: int) -> None:
    """Owns the target memory: our engine exports it; Mooncake (if installed) registers it too."""
    engine = Engine("bench-target", secret=os.environ["KVT_BENCH_SECRET"], wire="plain")  # initiators pick
    region = engine.allocate(size)
    hello: dict = {"descriptor": engine.export().to_json(), "region": region.id,
                   "ucx": bool(engine.export().ucx_tls)}  # UCX_TLS from main(), when ucx is benchmarked
    try:
        from mooncake.engine import TransferEngine as MooncakeEngine

        mc = MooncakeEngine()
        if mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0:
            address = _address_of(region.buffer)
            if mc.register_memory(address, size) == 0:
                hello["mooncake"] = {"target": f"127.0.0.1:{mc.get_rpc_port()}", "address": address}
    except Exception as exc:  # noqa: BLE001 - reported in the table, the run goes on
        hello["mooncake_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(hello), flush=True)
    sys.stdin.readline()
    engine.close()


def _address_of(buffer: memoryview) -> int:
    from transfer import _native

    return _native.buffer_address(buffer)[0]


# --- systems ------------------------------------------------------------------------------
def bench_ours(hello: dict, args: argparse.Namespace, out: list[Record]) -> None:
    # "tcp" is plaintext (trusted network); "tcp-aead" authenticates and encrypts every frame.
    for transport in ("shm", "tcp", "tcp-aead"):
        wire = "aead" if transport == "tcp-aead" else "plain"
        with Engine("bench-initiator", listen=None, secret=os.environ["KVT_BENCH_SECRET"], wire=wire,
                    streams=args.streams) as engine:
            local = engine.allocate(args.batch)
            np.frombuffer(local.buffer, np.uint8)[:] = 1
            peer = engine.connect(hello["descriptor"], transport=transport.split("-")[0], streams=args.streams)
            remote = peer.region(hello["region"])
            for block in args.blocks:
                for name, op in (("write", Write), ("read", Read)):
                    ops = [op(local, o, remote, o, block) for o in range(0, args.batch, block)]
                    one = [op(local, 0, remote, 0, block)]
                    gbps, p50, p99 = measure(lambda: engine.transfer(ops), lambda: engine.transfer(one),
                                             len(ops) * block, args.reps, latency_iters(block, args.quick))
                    out.append(Record("kvstore", transport, name, block, gbps, p50, p99))
                    report(out[-1])
            peer.close()


def bench_memcpy(args: argparse.Namespace, out: list[Record]) -> None:
    src = np.ones(args.batch, np.uint8)
    dst = np.zeros(args.batch, np.uint8)
    for block in args.blocks:
        for name, (a, b) in (("write", (dst, src)), ("read", (src, dst))):
            slices = [slice(o, o + block) for o in range(0, args.batch, block)]

            def batch() -> None:
                for s in slices:
                    np.copyto(a[s], b[s])

            def single() -> None:
                np.copyto(a[:block], b[:block])

            gbps, p50, p99 = measure(batch, single, args.batch, args.reps, latency_iters(block, args.quick))
            out.append(Record("memcpy", "local", name, block, gbps, p50, p99))
            report(out[-1])


def bench_mooncake(hello: dict, args: argparse.Namespace, out: list[Record]) -> None:
    info = hello.get("mooncake")
    if info is None:
        print(f"  mooncake: not measured ({hello.get('mooncake_error', 'not installed')})")
        return
    from mooncake.engine import TransferEngine as MooncakeEngine

    mc = MooncakeEngine()
    if mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        print("  mooncake: initialize failed")
        return
    local = np.ones(args.batch, np.uint8)
    base = local.ctypes.data
    mc.register_memory(base, args.batch)
    target, remote = info["target"], info["address"]
    for block in args.blocks:
        offsets = list(range(0, args.batch, block))
        for name, batch_fn, single_fn in (("write", mc.batch_transfer_sync_write, mc.transfer_sync_write),
                                          ("read", mc.batch_transfer_sync_read, mc.transfer_sync_read)):
            locals_ = [base + o for o in offsets]
            remotes = [remote + o for o in offsets]
            lengths = [block] * len(offsets)
            chunk = MOONCAKE_MAX_BATCH

            def batch() -> None:
                for i in range(0, len(offsets), chunk):
                    if batch_fn(target, locals_[i : i + chunk], remotes[i : i + chunk], lengths[i : i + chunk]) != 0:
                        raise RuntimeError("mooncake batch transfer failed")

            def single() -> None:
                if single_fn(target, base, remote, block) != 0:
                    raise RuntimeError("mooncake transfer failed")

            gbps, p50, p99 = measure(batch, single, args.batch, args.reps, latency_iters(block, args.quick))
            out.append(Record("mooncake", "tcp", name, block, gbps, p50, p99))
            report(out[-1])


def bench_socket(args: argparse.Namespace, out: list[Record]) -> None:
    """The physical limit of loopback TCP with the same streams: a threaded Python socket pair (one
    sender and one receiver thread per stream) and, where installed, iperf3. The ratios take the
    faster: iperf3 before 3.16 runs all its streams on one thread, which understates the limit."""
    server = None
    if shutil.which("iperf3"):
        port = free_port()
        server = processes.spawn(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
    tools = [("python", python_socket)] + ([("iperf3", functools.partial(iperf3, port))] if server else [])
    try:
        for block in args.blocks:
            for name in ("write", "read"):
                for tool, measure_once in tools:
                    samples = [measure_once(block, name == "read", args) for _ in range(args.reps)]
                    out.append(Record("socket", tool, name, block, statistics.median(samples), None, None))
                    report(out[-1])
    finally:
        if server is not None:
            processes.stop(server)


def iperf3(port: int, block: int, reverse: bool, args: argparse.Namespace) -> float:
    # A stream has no message boundaries; iperf3 caps its write size at 1 MiB.
    cmd = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P", str(args.streams), "-l", str(min(block, MIB)),
           "-n", str(max(args.batch, 256 * MIB)), "-J"] + (["-R"] if reverse else [])
    for _ in range(20):  # "server busy" or not yet listening: try again shortly
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        try:
            return json.loads(done.stdout)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
        except (ValueError, KeyError):
            time.sleep(0.2)
    raise RuntimeError(f"iperf3 failed: {done.stderr or done.stdout[-500:]}")


def python_socket(block: int, reverse: bool, args: argparse.Namespace) -> float:
    """GB/s of block-sized sends over `args.streams` loopback connections, each stream moving its own
    slice of a batch-sized source into a sink of its own (both touched before the clock starts):
    a batch of ops moves distinct memory, and one block sent over and over would stay in cache."""
    per_stream = max(block, args.batch // args.streams // block * block)
    total = max(per_stream, 256 * MIB // args.streams // per_stream * per_stream)
    source = memoryview(np.random.default_rng(0).integers(0, 256, per_stream * args.streams, dtype=np.uint8))
    sinks = [memoryview(np.ones(per_stream, np.uint8)) for _ in range(args.streams)]
    failures: list[BaseException] = []

    def receive(conn: socket.socket, sink: memoryview) -> None:
        left = total
        while left:
            at = (total - left) % per_stream
            got = conn.recv_into(sink[at:], min(per_stream - at, left))
            if not got:
                raise ConnectionError("loopback peer closed")
            left -= got

    def send(conn: socket.socket, part: memoryview) -> None:
        for sent in range(0, total, block):
            at = sent % per_stream
            conn.sendall(part[at : at + block])

    def guarded(fn: Callable[..., None], *fn_args: object) -> None:
        try:
            fn(*fn_args)
        except BaseException as exc:  # reported after the join, not lost in the thread
            failures.append(exc)

    listener = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(args.streams):
        client = socket.create_connection(listener.getsockname())
        pairs.append((client, listener.accept()[0]))
    listener.close()
    threads = []
    for k, (client, server) in enumerate(pairs):
        for conn in (client, server):
            conn.settimeout(30)  # a dead peer fails the sample instead of hanging it
        sender, receiver = (server, client) if reverse else (client, server)
        part = source[k * per_stream : (k + 1) * per_stream]
        threads += [threading.Thread(target=guarded, args=(send, sender, part)),
                    threading.Thread(target=guarded, args=(receive, receiver, sinks[k]))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    for client, server in pairs:
        client.close()
        server.close()
    if failures:
        raise RuntimeError(f"loopback socket sample failed: {failures[0]!r}")
    return total * args.streams / seconds / 1e9


# --- report -------------------------------------------------------------------------------
def report(r: Record) -> None:
    lat = f"{r.p50_us:10.1f}{r.p99_us:10.1f}" if r.p50_us is not None else f"{'-':>10}{'-':>10}"
    print(f"  {r.system:<9}{r.transport:<9}{r.op:<6}{human(r.block_bytes):>7}{r.gbps:9.2f}{lat}", flush=True)


def human(n: int) -> str:
    return f"{n // MIB}M" if n >= MIB else f"{n // KIB}K"


def ratios(records: list[Record]) -> list[tuple[str, float | None]]:
    """The issue's targets as ratios of this run's numbers."""
    def get(system: str, transport: str, op: str, block: int, field: str = "gbps") -> float | None:
        for r in records:
            if (r.system, r.transport, r.op, r.block_bytes) == (system, transport, op, block):
                return getattr(r, field)
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b in (None, 0) else a / b

    def socket_limit(op: str, block: int) -> float | None:
        known = [r.gbps for r in records if (r.system, r.op, r.block_bytes) == ("socket", op, block)]
        return max(known) if known else None

    rows = []
    for op in ("read", "write"):
        for block in (MIB, 16 * MIB):
            rows.append((f"shm/memcpy {op} {human(block)} (>=0.80)",
                         ratio(get("kvstore", "shm", op, block), get("memcpy", "local", op, block))))
            rows.append((f"tcp/socket {op} {human(block)} (>=0.85)",
                         ratio(get("kvstore", "tcp", op, block), socket_limit(op, block))))
        for block in (64 * KIB, MIB, 16 * MIB):
            rows.append((f"tcp/mooncake {op} {human(block)} (>=1.20)",
                         ratio(get("kvstore", "tcp", op, block), get("mooncake", "tcp", op, block))))
        rows.append((f"mooncake/tcp p50 latency {op} 4K (>=1.00)",
                     ratio(get("mooncake", "tcp", op, 4 * KIB, "p50_us"), get("kvstore", "tcp", op, 4 * KIB, "p50_us"))))
    return rows + ucx_bench.ratios(get, ratio, human, ucx_bench.TLS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--streams", type=int, default=4, help="TCP streams for ours, iperf3 -P")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per batch (median)")
    parser.add_argument("--batch-mib", type=int, default=None, help="MiB per batch (default 64; 16 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="the test suite's run: 16 MiB batches, 2 repetitions, fewer latency samples")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--ucx-tls", action="append", choices=ucx_bench.TLS, help="UCX_TLS of the ucx records (repeat)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch_mib is None:
        args.batch_mib = 16 if args.quick else 64
    if args.quick:
        args.reps = min(args.reps, 2)
    if args.batch_mib < 16 or args.reps < 1 or args.streams < 1:
        parser.error("--batch-mib must be at least 16 (the largest block), --reps and --streams at least 1")
    args.batch = args.batch_mib * MIB
    args.blocks = BLOCKS
    if args.serve:
        serve(args.batch)
        return 0
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    os.environ["MC_TCP_LANES_PER_PEER"] = str(args.streams)  # same parallelism as ours (both processes)
    os.environ.setdefault("KVT_BENCH_SECRET", secrets.token_hex(16))  # inherited by the target process
    child = processes.spawn([sys.executable, "-m", "benchmarks.transfer", "--serve", "--batch-mib", str(args.batch_mib)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=ucx_bench.target_env() if "ucx" in systems else None)
    records: list[Record] = []
    try:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the target process exited with {child.wait(10)} before serving")
        hello = json.loads(line)
        print(f"  {'system':<9}{'path':<8}{'op':<6}{'block':>7}{'GB/s':>9}{'p50 us':>10}{'p99 us':>10}")
        if "kvstore" in systems:
            bench_ours(hello, args, records)
        if "memcpy" in systems:
            bench_memcpy(args, records)
        if "socket" in systems:
            bench_socket(args, records)
        if "mooncake" in systems:
            bench_mooncake(hello, args, records)
        if "ucx" in systems:
            args.ucx_tls = args.ucx_tls or list(ucx_bench.TLS)
            ucx_bench.bench_ucx(hello, args, records, Record, latency_iters, report)
            ucx_bench.bench_perftest(args, records, Record, report)
    finally:
        try:
            child.stdin.write("\n")
            child.stdin.flush()
        except OSError:  # it is gone already
            pass
        processes.stop(child, grace=30)
    print("\n  targets (ratios in this run)")
    summary = ratios(records)
    for label, value in summary:
        print(f"  {label:<44}{'n/a' if value is None else f'{value:.2f}':>8}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(),
                "cpus": os.cpu_count(), "streams": args.streams, "reps": args.reps, "batch_bytes": args.batch}
        write_json(args.json, {"meta": meta, "records": [asdict(r) for r in records], "ratios": dict(summary),
                               "systems": systems})
    return 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.transfer"))
