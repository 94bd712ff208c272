"""A rolling restart of store daemons with persistent NVMe tiers: the hit ratio before and after.

Three daemons on one etcd hold blocks in DRAM and on NVMe; each in turn gets SIGTERM and is started
again on the same --disk-dir, and once it has verified its tier (`kvstore_tier_restore_pending`
0) the next one goes. After every restart a fresh client reads every block back: hits, wrong bytes
(a read that returned other bytes: must be 0), blocks no node lists any more (lost). Modes:

- `kept`: `--keep-disk --persist-on-stop` (DRAM blocks demoted on SIGTERM, the tier served again);
- `kept-replicas-2`: the same with `--replicas 2` (replicated blocks must not be lost);
- `not-kept`: neither flag, as before persistent tiers: a restarted node comes back empty.

`python -m benchmarks.restart [--quick] [--json PATH]`.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import grpc
import numpy as np

from benchmarks.records import write_json
from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore_testing import processes
from kvstore_testing.etcd import EtcdServer
from kvstore_testing.node_status import node_counters

KIB, MIB = 1024, 1 << 20
FP = ModelFingerprint("bench-restart", "bfloat16", 128, 4, 4, 64, kv_layout="bytes")
NODES = ("n1", "n2", "n3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def content(h: bytes, size: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, size, dtype=np.uint8)


class Node:
    def __init__(self, name: str, etcd: EtcdServer, cluster: str, folder: str, flags: list[str], dram: str,
                 disk: str) -> None:
        self.name, self.flags = name, flags
        self.cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--node", name, "--metadata", etcd.url, "--cluster",
                    cluster, "--dram", dram, "--disk-dir", os.path.join(folder, name), "--disk-size", disk,
                    "--insecure", "--lease-ttl", "3", "--timeout", "3", *flags]
        self.proc: subprocess.Popen | None = None
        self.control = ""

    def start(self) -> None:
        import json

        self.proc = processes.spawn(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon {self.name} did not start")
        self.control = json.loads(line)["control"]

    def counters(self) -> dict[str, float]:
        return node_counters(self.control)

    def wait_restored(self, timeout: float = 120) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            try:
                if self.counters().get("restore_pending", 1) == 0:
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not finish restoring in {timeout} s")

    def stop(self) -> float:
        started = time.monotonic()
        processes.stop(self.proc, grace=60)
        return time.monotonic() - started


def survey(etcd: EtcdServer, cluster: str, hashes: list[bytes], size: int) -> dict:
    """Read every block with a fresh client: hits, wrong bytes, blocks listed nowhere."""
    with Client(etcd.url, cluster=cluster, fingerprint=FP, timeout=5) as c:
        c.mirror.wait_until(lambda m: len(m.nodes) == len(NODES), 20)
        time.sleep(0.5)  # the watch brings the last publishes
        listed = sum(1 for h in hashes if c.mirror.lookup(FP, h))
        hits = wrong = 0
        out = np.empty(size, np.uint8)
        for h in hashes:
            if c.get(h, out):
                if np.array_equal(out, content(h, size)):
                    hits += 1
                else:
                    wrong += 1
    return {"hit_ratio": hits / len(hashes), "wrong": wrong, "lost": len(hashes) - listed}


def run_mode(mode: str, flags: list[str], count: int, size: int, dram: str, disk: str, restarts: int) -> dict:
    folder = tempfile.mkdtemp(prefix="kvstore-bench-restart-")
    cluster = f"restart-{uuid.uuid4().hex[:6]}"
    nodes: list[Node] = []
    try:
        with EtcdServer() as etcd:
            nodes = [Node(n, etcd, cluster, folder, flags, dram, disk) for n in NODES]
            for node in nodes:
                node.start()
            hashes = external_hashes(range(count), FP)
            with Client(etcd.url, cluster=cluster, fingerprint=FP, timeout=5) as c:
                c.mirror.wait_until(lambda m: len(m.nodes) == len(NODES), 20)
                for start in range(0, count, 8):
                    c.put_many([(h, content(h, size)) for h in hashes[start : start + 8]])
            before = survey(etcd, cluster, hashes, size)
            steps = []
            for node in nodes[:restarts]:
                stop_s = node.stop()
                node.start()
                restore_s = node.wait_restored()
                counters = node.counters()
                after = survey(etcd, cluster, hashes, size)
                steps.append({"node": node.name, "stop_s": stop_s, "restore_s": restore_s,
                              "restored_blocks": counters.get("restored_blocks", 0),
                              "corrupt": counters.get("restore_corrupt_blocks", 0), **after})
                print(f"  {mode:<16} restarted {node.name}: stop {stop_s:.1f} s, restore {restore_s:.1f} s "
                      f"({counters.get('restored_blocks', 0):.0f} blocks), hit ratio {after['hit_ratio']:.3f}, "
                      f"wrong {after['wrong']}, lost {after['lost']}", flush=True)
    finally:
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                processes.stop(node.proc, grace=10)
        shutil.rmtree(folder, ignore_errors=True)
    last = steps[-1]
    return {"mode": mode, "flags": flags, "blocks": count, "block_bytes": size, "before": before, "steps": steps,
            "hit_ratio_before": before["hit_ratio"], "hit_ratio_after": last["hit_ratio"],
            "after_over_before": last["hit_ratio"] / before["hit_ratio"] if before["hit_ratio"] else None,
            "wrong": sum(s["wrong"] for s in steps) + before["wrong"], "lost_after": last["lost"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--quick", action="store_true", help="fewer blocks, two modes, one node restarted")
    args = parser.parse_args(argv)
    count, size = (60, 256 * KIB) if args.quick else (300, 256 * KIB)
    dram, disk = ("4MiB", "16MiB") if args.quick else ("16MiB", "96MiB")
    kept = ["--keep-disk", "--persist-on-stop"]
    modes = [("kept", kept), ("not-kept", [])] if args.quick else \
        [("kept", kept), ("kept-replicas-2", kept + ["--replicas", "2"]), ("not-kept", [])]
    restarts = 1 if args.quick else len(NODES)
    records = [run_mode(mode, flags, count, size, dram, disk, restarts) for mode, flags in modes]
    print(f"\n  {'mode':<16}{'blocks':>7}{'hits before':>12}{'hits after':>11}{'after/before':>13}{'wrong':>6}"
          f"{'lost':>5}{'restore s':>10}")
    for r in records:
        ratio = "-" if r["after_over_before"] is None else f"{r['after_over_before']:.3f}"
        restore = max(s["restore_s"] for s in r["steps"])
        print(f"  {r['mode']:<16}{r['blocks']:>7}{r['hit_ratio_before']:>12.3f}{r['hit_ratio_after']:>11.3f}"
              f"{ratio:>13}{r['wrong']:>6}{r['lost_after']:>5}{restore:>10.1f}")
    if args.json:
        write_json(args.json, {"machine": platform.node(), "cpus": os.cpu_count(),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "load": os.getloadavg()[0], "quick": args.quick, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(processes.run_main(main))
