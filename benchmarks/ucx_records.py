"""The ucx records of `python -m benchmarks.transfer`: our engine over UCX, and the same UCX transport
driven raw (ucp_put_nbx/ucp_get_nbx on the same ucxx endpoint and rkey, writes ended by
ucp_ep_flush_nbx so both sides count a write done when it landed, polled in a tight loop, no
Engine/Batch/plan on the path) in the same run, against the same target process; and, for scale,
UCX's own C benchmark `ucx_perftest` (ucp_put_bw, ucp_get) on the same transports.

UCX_TLS per record: "tcp" (UCX's RMA emulation over TCP) and "sm" (one-sided cross-memory attach; no
peer-failure handling there, so the run opts in: a dying target would abort the benchmark).

`python -m benchmarks.transfer_ucx` runs these records alone (`benchmarks.transfer --systems ucx`).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import subprocess
import time
from typing import Callable

import numpy as np

from kvstore_testing import processes
from transfer import Engine, Read, Write

TLS = ("sm", "tcp")
TARGET_TLS = "sm,tcp"  # what the target process offers; each initiator picks one


def target_env() -> dict[str, str]:
    """Environment for the target process: its engine (ucx="auto") offers UCX over TARGET_TLS."""
    return dict(os.environ, UCX_TLS=TARGET_TLS, UCX_WARN_UNUSED_ENV_VARS="n")


def unavailable() -> str | None:
    from transfer.ucx_routes import unavailable as why

    return why()


def _raw_runner(engine: Engine, peer, remote, local) -> Callable[[list[tuple[bool, int, int, int]]], None]:
    """put/get straight on the engine's UCX endpoint: the floor our route is measured against."""
    from transfer import ucx_api as U

    lib, endpoint, node = U.lib(), peer._ucx, engine._ucx
    memory = endpoint.rkey(remote.id)
    param = U.RequestParam(op_attr_mask=U.OP_FIELD_MEMH, memh=local._ucx.memh)
    flush = U.RequestParam()
    ep, rkey, base, rbase, worker = endpoint.handle, memory.handle, local._ucx.address, memory.address, node.worker.handle

    def run(ops: list[tuple[bool, int, int, int]]) -> None:
        pending = []
        for write, loff, roff, n in ops:
            call = lib.ucp_put_nbx if write else lib.ucp_get_nbx
            ptr = call(ep, base + loff, n, rbase + roff, rkey, ctypes.byref(param))
            status = U.status_of(ptr)
            if status is None:
                pending.append(ptr)
            elif status != U.UCS_OK:
                raise RuntimeError(U.status_text(status))
        if any(write for write, *_ in ops):  # a put is done once it landed, as ours reports it
            ptr = lib.ucp_ep_flush_nbx(ep, ctypes.byref(flush))
            if U.status_of(ptr) is None:
                pending.append(ptr)
        while pending:
            lib.ucp_worker_progress(worker)
            left = []
            for ptr in pending:
                status = lib.ucp_request_check_status(ptr)
                if status == U.UCS_INPROGRESS:
                    left.append(ptr)
                    continue
                lib.ucp_request_free(ptr)
                if status != U.UCS_OK:
                    raise RuntimeError(U.status_text(status))
            pending = left

    return run


def interleaved(ours: Callable[[], None], raw: Callable[[], None], iters: int,
                warm: int = 20) -> dict[str, tuple[float, float]]:
    """p50 and p99 (us) of `iters` calls each, ours and raw alternating call by call (after `warm`
    calls of each), so the neighbours' load on a shared machine hits both alike."""
    samples: dict[str, list[float]] = {"kvstore": [], "ucx-raw": []}
    for _ in range(warm):
        ours()
        raw()
    for _ in range(iters):
        for system, fn in (("kvstore", ours), ("ucx-raw", raw)):
            started = time.perf_counter()
            fn()
            samples[system].append((time.perf_counter() - started) * 1e6)
    out = {}
    for system, values in samples.items():
        values.sort()
        out[system] = (values[len(values) // 2], values[min(len(values) - 1, int(0.99 * len(values)))])
    return out


def bench_ucx(hello: dict, args: argparse.Namespace, out: list, record, latency_iters, report) -> None:
    """Ours over UCX and ucx-raw, per UCX_TLS, each op and block size."""
    why = unavailable()
    if why is not None or not hello.get("ucx"):
        print(f"  ucx: not measured ({why or 'the target has no UCX route'})")
        return
    from transfer.ucx import UNSAFE_ENV

    for tls in args.ucx_tls:
        previous = os.environ.get(UNSAFE_ENV)
        if tls == "sm":
            os.environ[UNSAFE_ENV] = "1"
        try:
            with Engine("bench-ucx", listen=None, secret=os.environ["KVT_BENCH_SECRET"], ucx=tls) as engine:
                local = engine.register(np.ones(args.batch, np.uint8))
                peer = engine.connect(hello["descriptor"], transport="ucx")
                remote = peer.region(hello["region"])
                raw = _raw_runner(engine, peer, remote, local)
                for block in args.blocks:
                    for name, op in (("write", Write), ("read", Read)):
                        ops = [op(local, o, remote, o, block) for o in range(0, args.batch, block)]
                        one = [op(local, 0, remote, 0, block)]
                        flat = [(op is Write, o, o, block) for o in range(0, args.batch, block)]
                        iters = latency_iters(block, args.quick)
                        lat = interleaved(lambda: engine.transfer(one), lambda: raw(flat[:1]), iters * 3)
                        reps = args.reps if args.quick else max(args.reps, 5)
                        batch = interleaved(lambda: engine.transfer(ops), lambda: raw(flat), reps, warm=1)
                        for system in ("kvstore", "ucx-raw"):
                            gbps = len(ops) * block / (batch[system][0] / 1e6) / 1e9
                            p50, p99 = lat[system]
                            out.append(record(system, f"ucx-{tls}", name, block, gbps, p50, p99))
                            report(out[-1])
                peer.close()
        finally:
            if previous is None:
                os.environ.pop(UNSAFE_ENV, None)
            else:
                os.environ[UNSAFE_ENV] = previous
        time.sleep(0.1)


def perftest_binary() -> str | None:
    """ucx_perftest from the libucx wheel (or PATH)."""
    try:
        import libucx

        path = os.path.join(os.path.dirname(libucx.__file__), "bin", "ucx_perftest")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("ucx_perftest")


def bench_perftest(args: argparse.Namespace, out: list, record, report) -> None:
    """UCX's own C benchmark on the same transports: ucp_put_bw (write) and ucp_get (read), two
    processes; gbps from its overall bandwidth, p50 from its typical latency (no p99)."""
    binary = perftest_binary()
    if binary is None:
        print("  ucx_perftest: not found")
        return
    lib_dir = os.path.join(os.path.dirname(os.path.dirname(binary)), "lib")
    for tls in args.ucx_tls:
        env = dict(os.environ, UCX_TLS=tls, UCX_WARN_UNUSED_ENV_VARS="n",
                   LD_LIBRARY_PATH=lib_dir + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
        for block in args.blocks:
            for name, test in (("write", "ucp_put_bw"), ("read", "ucp_get")):
                iters = max(20, min(5000, (256 << 20) // block))
                iters = max(5, iters // 20) if args.quick else iters
                final = None
                for _ in range(3):  # a port of its own each time: another process may take the one picked
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        port = s.getsockname()[1]
                    server = processes.spawn([binary, "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)
                    try:
                        deadline = time.monotonic() + 30  # a loaded machine starts UCX slowly
                        while final is None and time.monotonic() < deadline and server.poll() is None:
                            time.sleep(0.1)  # until the server listens
                            done = subprocess.run([binary, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(block),
                                                   "-n", str(iters)], env=env, capture_output=True, text=True,
                                                  timeout=120)
                            final = next((line.split() for line in done.stdout.splitlines()
                                          if line.startswith("Final:")), None)
                    finally:
                        processes.kill(server)
                    if final:
                        break
                if not final:
                    print(f"  ucx_perftest {tls} {test} {block}: no result")
                    continue
                # Final: iters, typical/avg/overall latency (us), avg/overall bandwidth (MB/s = 2^20 B/s), msg rates
                gbps = float(final[6]) * MIB_PER_S / 1e9
                # ucp_put_bw's "typical latency" is the time to post, not to complete: no latency for writes
                p50 = float(final[2]) if name == "read" else None
                out.append(record("ucx_perftest", f"ucx-{tls}", name, block, gbps, p50, None))
                lat = f"{p50:10.1f}" if p50 is not None else f"{'-':>10}"  # report() wants a p99 too
                print(f"  {'perftest':<9}{'ucx-' + tls:<9}{name:<6}{block >> 10:>6}K{gbps:9.2f}{lat}{'-':>10}")


MIB_PER_S = 1 << 20


def ratios(get, ratio, human, tls_list) -> list[tuple[str, float | None]]:
    """The issue's ucx targets: ours >= 0.9x raw at 1 MiB and 16 MiB, 4 KiB p50 <= 1.2x raw."""
    rows = []
    for tls in tls_list:
        path = f"ucx-{tls}"
        for op in ("read", "write"):
            for block in (1 << 20, 16 << 20):
                rows.append((f"{path}/raw {op} {human(block)} (>=0.90)",
                             ratio(get("kvstore", path, op, block), get("ucx-raw", path, op, block))))
            rows.append((f"{path} p50/raw 4K {op} (<=1.20)",
                         ratio(get("kvstore", path, op, 4096, "p50_us"), get("ucx-raw", path, op, 4096, "p50_us"))))
    return rows
