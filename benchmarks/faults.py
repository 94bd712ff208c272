"""Fault-injection report: a real cluster under load while faults are injected one after another.

    python -m benchmarks.faults --json PATH            # every fault this machine can inject
    python -m benchmarks.faults --quick --json PATH    # bounded (CI): full NVMe tier, kill -9, SIGSTOP,
                                                       # etcd leader killed

A cluster of 3 daemons (`kvstore serve`, replicas=2, a cluster secret) on a real etcd; client threads
put blocks (replicas=2) and read back blocks already stored on both replicas, verifying every byte.
Faults come one after another, each after the last one's recovery, in this order: a fault that
lowers replica counts (the full tier's evictions, its node's graceful stop) right before kill -9 of
the node holding the other replicas, so a repair that comes too late shows as lost blocks.
Per fault: `ops` (client calls during the phase), `wrong_bytes` (bytes a read returned that differ
from what was stored — must be 0), `lost_blocks` (blocks stored on 2 replicas that no longer read back
after recovery — must be 0), `calls_past_timeout` (client calls that took longer than their bound:
per node tried, each remote step's timeout, plus 1 s — must be 0), `recovery_s` (from healing the
fault until every such block reads back and a new put lands on 2 replicas), `errors` (typed errors
clients saw, by type — allowed, they are how faults surface).
The partition fault runs node-2 in its own network namespace (and host name: another host to the
clients, reached over TCP) behind a veth pair and takes the link down; the others then listen on the
veth's host address. The full-NVMe fault adds a node with 1 MiB of DRAM and 2 MiB of NVMe; every put
goes to it and node-1 (then killed) until FILL_BLOCKS more blocks are stored, so it fills at once,
demotes and evicts replicas it was given, and is read first (its name sorts first); its counters are
in the record (`node_counters`: hits, demotions, promotions, NVMe evictions, refused reservations)
and it stops with SIGTERM (a graceful stop). Loss: `iptables -m statistic` (Debian's `iptables`,
from scripts/install-test-deps.sh) drops 5% of the packets in and out of node-2's namespace.
`tc netem` is not available in this VM's kernel, so the 50 ms delay is reported as not run.

The metadata service is a 3-member etcd cluster (kvstore_testing.etcd.EtcdCluster); clients and
daemons are given every member (`etcd://h:p1,h:p2,h:p3`) and fail over. With `--shards N` the
block index is spread over it and N-1 more etcd servers (kvstore.index.shards), and the etcd faults
hit the first shard only: the other shards' blocks must not notice. etcd faults: the leader
SIGKILLed (started again at the heal), the leader cut off from the other members while its clients
still reach it (peer relays stop moving its bytes), and every member killed and restarted. For them
`outage_s` is the time from the fault until a put lands on 2 replicas with its records published
(publish="sync"). The rolling restart stops every daemon gracefully in turn and starts it again,
without its disk (an empty node: restarting with the NVMe tier's contents is not part of this run),
waiting for repair to put every stored block back on 2 nodes before the next; its note gives each
node's time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.records import write_json
from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore_testing import processes
from kvstore_testing.etcd import EtcdCluster

FP = ModelFingerprint("faults", "float16", 16, 2, 2, 64, kv_layout="bytes")  # BLOCK-sized blocks, free-form
BLOCK = 32 * 1024
TIMEOUT = 2.0  # every remote call of clients and daemons
LEASE_TTL = 4
MAX_STORED = 1500  # bounded working set: no eviction on the main nodes, so a missing block is a lost block
FAULT_WAIT_S = 30.0  # past the hold, how long a phase waits for its fault to show (a full tier evicting)
FILL_BLOCKS = 300  # of MAX_STORED, left for the full-tier fault's puts (the others stop at the rest)
KILLED = "node-1"  # kill -9's node, the full node's partner
FULL_NODE = "full-node"  # the full-tier fault's node; named to sort first: it is read first, and it is
# the replica repairer ("the holder with the smallest name") of the blocks it holds
NETNS_HOST, NETNS_PEER = "10.231.7.1", "10.231.7.2"


def content(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


@dataclass
class FaultResult:
    fault: str
    ops: int = 0
    wrong_bytes: int = 0
    lost_blocks: int = 0
    calls_past_timeout: int = 0
    recovery_s: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    note: str = ""
    node_counters: dict[str, int] = field(default_factory=dict)  # the faulty node's own (full-tier fault)
    outage_s: float | None = None  # etcd and rolling-restart faults: from the fault until a put lands on 2
    # replicas and its node has published it to etcd (publish="sync"): how long new blocks could not be stored


class Netns:
    """A network namespace joined to the host by a veth pair (root only)."""

    def __init__(self) -> None:
        self.name, self.host_if = f"kvf-{uuid.uuid4().hex[:6]}", f"kvf{uuid.uuid4().hex[:6]}"
        peer_if = self.host_if + "p"
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", peer_if],
                    ["ip", "link", "set", peer_if, "netns", self.name],
                    ["ip", "addr", "add", f"{NETNS_HOST}/24", "dev", self.host_if],
                    ["ip", "link", "set", self.host_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{NETNS_PEER}/24", "dev", peer_if],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", peer_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)

    def link(self, up: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_if, "up" if up else "down"], check=True, capture_output=True)

    def loss(self, on: bool, probability: float = 0.05) -> None:
        """Drop `probability` of the packets entering and leaving the namespace."""
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(["ip", "netns", "exec", self.name, "iptables", "-A" if on else "-D", chain, "-m",
                            "statistic", "--mode", "random", "--probability", str(probability), "-j", "DROP"],
                           check=True, capture_output=True)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "unshare", "hostname"))


class Cluster:
    def __init__(self, workdir: str, netns: Netns | None, shards: int = 1) -> None:
        self.workdir, self.netns = workdir, netns
        self.cluster = uuid.uuid4().hex[:8]
        self.secret_file = os.path.join(workdir, "secret")
        with open(self.secret_file, "w") as f:
            f.write(uuid.uuid4().hex)
        os.chmod(self.secret_file, 0o600)
        self.secret = open(self.secret_file).read()
        # 3 members, clients listened for on every interface (the namespaced daemon reaches them over the veth)
        client_host = "0.0.0.0" if netns is not None else "127.0.0.1"
        self.etcd = EtcdCluster(3, os.path.join(workdir, "etcd"), client_host=client_host).start()
        # With --shards N, the index's other shards: one etcd each (the faults hit the first shard).
        self.other_shards = [EtcdCluster(1, os.path.join(workdir, f"etcd-shard-{i}"), client_host=client_host).start()
                             for i in range(1, shards)]
        self.daemons: dict[str, subprocess.Popen] = {}
        self.control: dict[str, str] = {}
        self.leaving: list[subprocess.Popen] = []  # stopped gracefully, reaped at close

    @property
    def url(self) -> str:
        """Every etcd member (clients and daemons fail over between them); each shard's, ';' apart."""
        return ";".join(shard.url for shard in [self.etcd, *self.other_shards])

    def url_at(self, host: str) -> str:
        return ";".join("etcd://" + ",".join(f"{host}:{shard.client_port[n]}" for n in shard.names)
                        for shard in [self.etcd, *self.other_shards])

    def spawn(self, name: str, dram: str = "64MiB", disk: str | None = None) -> None:
        in_ns = self.netns is not None and name == "node-2"
        # With a namespace, the host's daemons listen on the veth's host address, which the
        # namespace reaches and the host still does when the link is down: every node reaches
        # every other, the partitioned one aside.
        host = NETNS_PEER if in_ns else (NETNS_HOST if self.netns is not None else "127.0.0.1")
        metadata = self.url_at(NETNS_HOST) if in_ns else self.url
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--node", name, "--metadata", metadata, "--cluster",
               self.cluster, "--dram", dram, "--replicas", "2", "--lease-ttl", str(LEASE_TTL), "--timeout",
               str(TIMEOUT), "--secret-file", self.secret_file, "--listen", f"{host}:0", "--engine-listen", f"{host}:0",
               "--admin-token-file", os.path.join(self.workdir, "admin-token")]  # not in ~/.kvstore
        if disk:
            cmd += ["--disk-dir", os.path.join(self.workdir, f"nvme-{name}"), "--disk", disk]
        if in_ns:
            # A host name of its own (a UTS namespace): it is another host to everyone, so clients
            # reach it over TCP. On this host's name it would be offered the same-host path (an
            # abstract unix socket, which does not cross network namespaces) and refuse every call.
            cmd = ["ip", "netns", "exec", self.netns.name, "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', f"{self.netns.name}-host", *cmd]
        with open(self.log_path(name), "a") as log:  # read back when a fault loses blocks (repair_log)
            proc = processes.spawn(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        line = proc.stdout.readline()
        if not line:
            processes.stop(proc)
            raise RuntimeError(f"daemon {name} did not start")
        self.daemons[name], self.control[name] = proc, json.loads(line)["control"]

    def log_path(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.log")

    def repair_log(self, lines: int = 30) -> str:
        """The daemons' last replica-repair and hand-off lines, every run of every node."""
        said = []
        for log in sorted(Path(self.workdir).glob("*.log")):
            said += [line for line in log.read_text(errors="replace").splitlines()
                     if "repair" in line or "handed off" in line or "handing off" in line]
        return "\n".join(sorted(said)[-lines:])  # lines start with their time: merged in time order

    def counters(self, name: str) -> dict[str, float]:
        """The node's own counters (admin API): evictions, demotions, ..."""
        import grpc

        from kvstore.admin.v1 import admin_pb2, admin_pb2_grpc

        with grpc.insecure_channel(self.control[name]) as channel:
            status = admin_pb2_grpc.AdminStub(channel).GetNodeStatus(admin_pb2.NodeStatusRequest(), timeout=5)
        return dict(status.counters)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.daemons.pop(name)
        proc.send_signal(sig)
        processes.stop(proc, grace=20)  # reaped (SIGKILL if `sig` did not end it)

    def leave(self, name: str) -> None:
        """Stop `name` gracefully (SIGTERM) and return once it has left the index, not once its
        process has ended: the next fault does not wait out its teardown, as a real one would not."""
        from kvstore.index import open_mirror

        proc = self.daemons.pop(name)
        self.leaving.append(proc)
        with open_mirror(self.url, self.cluster, timeout=TIMEOUT) as mirror:
            proc.send_signal(signal.SIGTERM)
            if not mirror.wait_until(lambda m: name not in m.nodes, 30):
                processes.stop(proc, grace=20)

    def close(self) -> None:
        for proc in self.daemons.values():
            processes.kill(proc)
        self.daemons.clear()
        for proc in self.leaving:
            processes.stop(proc, grace=20)
        for shard in [self.etcd, *self.other_shards]:
            shard.cleanup()


class Load:
    """Client threads doing verified puts and gets; records everything per phase."""

    def __init__(self, cluster: Cluster, threads: int) -> None:
        self.cluster, self.threads = cluster, threads
        self.stored: list[bytes] = []  # blocks acknowledged on 2 replicas
        self.cap = MAX_STORED - FILL_BLOCKS  # puts stop at this many stored blocks
        # (node, partners, every node): each put goes to that node and one partner (the full-tier fault)
        self.pin: tuple[str, list[str], list[str]] | None = None
        self.lock = threading.Lock()
        self.result = FaultResult("warm-up")
        self.stop = threading.Event()
        self.next_id = 1 + random.randrange(1 << 30)
        self.workers = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def _fresh_hash(self) -> bytes:
        with self.lock:
            self.next_id += 1
            return external_hashes([self.next_id], FP)[0]

    def _run(self) -> None:
        client = Client(self.cluster.url, cluster=self.cluster.cluster, fingerprint=FP, secret=self.cluster.secret,
                        timeout=TIMEOUT, replicas=2)
        rng = random.Random()
        try:
            while not self.stop.is_set():
                with self.lock:
                    can_put = len(self.stored) < self.cap
                    # While puts are pinned, half the gets read what was just stored (as a prefix is
                    # read again soon after it was written): the full node is read, not only written.
                    recent = self.pin is not None and rng.random() < 0.5
                    target = rng.choice(self.stored[-64:] if recent else self.stored) if self.stored else None
                if target is None or (can_put and rng.random() < 0.3):
                    self._op(lambda: self._put(client), put=True)
                else:
                    self._op(lambda: self._get(client, target), put=False)
        finally:
            client.close()

    def _put(self, client: Client) -> None:
        h = self._fresh_hash()
        exclude: set[str] = set()
        pin = self.pin
        if pin is not None:  # placement spreads puts by free space: pinned, they fill one node
            node, partners, everyone = pin
            exclude = set(everyone) - {node, random.choice(partners)}
        if client.put_many([(h, content(h))], exclude=exclude) >= 2:
            with self.lock:
                self.stored.append(h)

    def _get(self, client: Client, h: bytes) -> None:
        out = np.zeros(BLOCK, np.uint8)
        if client.get(h, out):
            wrong = int(np.count_nonzero(out != content(h)))
            if wrong:
                with self.lock:
                    self.result.wrong_bytes += wrong

    def _op(self, call, put: bool) -> None:
        # Bound: every node the call may try (3 for a put, 2 replicas for a get) times its remote
        # steps (reserve, transfer, commit / connect, read), each within TIMEOUT, plus 1 s.
        bound = (3 * 3 if put else 2 * 2) * TIMEOUT + 1.0
        started = time.monotonic()
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - typed errors are how faults surface; counted
            with self.lock:
                self.result.errors[type(exc).__name__] = self.result.errors.get(type(exc).__name__, 0) + 1
        took = time.monotonic() - started
        with self.lock:
            self.result.ops += 1
            if took > bound:
                self.result.calls_past_timeout += 1
        if took < 0.002:
            time.sleep(0.002)  # a dead cluster answers at once: do not spin

    def phase(self, name: str) -> FaultResult:
        with self.lock:
            done, self.result = self.result, FaultResult(name)
        return done

    def close(self) -> None:
        self.stop.set()
        for w in self.workers:
            w.join(30)


def verify(cluster: Cluster, hashes: list[bytes], timeout: float) -> tuple[int, float | None]:
    """(blocks that do not read back, seconds until all did and a new put landed twice)."""
    started = time.monotonic()
    with Client(cluster.url, cluster=cluster.cluster, fingerprint=FP, secret=cluster.secret, timeout=TIMEOUT,
                replicas=2) as client:
        missing = list(hashes)
        while time.monotonic() - started < timeout:
            still = []
            for h in missing:
                out = np.zeros(BLOCK, np.uint8)
                try:
                    if client.get(h, out) and np.array_equal(out, content(h)):
                        continue
                except Exception:  # noqa: BLE001 - retried until the deadline
                    pass
                still.append(h)
            missing = still
            if not missing:
                probe = external_hashes([random.randrange(1 << 40)], FP)[0]
                try:
                    if client.put_many([(probe, content(probe))]) >= 2:
                        return 0, time.monotonic() - started
                except Exception:  # noqa: BLE001
                    pass
            time.sleep(0.25)
        return len(missing), None


def first_put(client: Client, since: float, timeout: float) -> float | None:
    """Seconds from `since` until a fresh block lands on 2 replicas with its records in etcd (the
    client's publish="sync" waits for the nodes' publish); None if none did within `timeout`."""
    while time.monotonic() - since < timeout:
        probe = external_hashes([random.randrange(1 << 40)], FP)[0]
        try:
            if client.put_many([(probe, content(probe))]) >= 2:
                return time.monotonic() - since
        except Exception:  # noqa: BLE001 - the outage: tried again until it ends
            pass
        time.sleep(0.05)
    return None


def replicated(cluster: Cluster, hashes: list[bytes], timeout: float) -> float | None:
    """Seconds until the index lists every block of `hashes` on 2 nodes (repair done); None if not
    within `timeout`."""
    from kvstore.index import open_mirror

    started = time.monotonic()
    with open_mirror(cluster.url, cluster.cluster, timeout=TIMEOUT) as mirror:
        if mirror.wait_until(lambda m: all(len(m.lookup(FP, h)) >= 2 for h in hashes), timeout):
            return time.monotonic() - started
    return None


def rolling_restart(cluster: Cluster, load: "Load", timeout: float) -> str:
    """Every daemon in turn: a graceful stop (it leaves the index), started again on the same name
    (without its disk: an empty node), then until repair has put every stored block back on 2 nodes
    before the next one goes. Per node: seconds until the repair was done."""
    took = []
    for name in sorted(cluster.daemons):
        started = time.monotonic()
        cluster.leave(name)
        cluster.spawn(name)
        with load.lock:
            stored = list(load.stored)
        repaired = replicated(cluster, stored, timeout)
        took.append(f"{name} {'not repaired' if repaired is None else f'{time.monotonic() - started:.1f}s'}")
    return "restarted without disks, one at a time, each once its blocks were back on 2 nodes: " + ", ".join(took)


def run(args: argparse.Namespace) -> list[FaultResult]:
    workdir = tempfile.mkdtemp(prefix="kvstore-faults-")
    netns = Netns() if (not args.quick and Netns.available()) else None
    cluster = None
    results: list[FaultResult] = []
    load = None
    try:
        cluster = Cluster(workdir, netns, args.shards)
        for i in range(3):
            cluster.spawn(f"node-{i}")
        load = Load(cluster, args.clients)
        load.start()
        time.sleep(args.warmup)
        hold = args.hold

        def phase(name: str, inject, heal, *, outage: bool = False, note: str = "",
                  happened: Callable[[], bool] | None = None) -> None:
            """`inject`; with `outage`, time until a put lands and is published; the rest of `hold`
            (and, with `happened`, until the fault has shown, for at most FAULT_WAIT_S more); `heal`;
            then until every stored block reads back (recovery_s, from the heal)."""
            prober = (Client(cluster.url, cluster=cluster.cluster, fingerprint=FP, secret=cluster.secret,
                             timeout=TIMEOUT, replicas=2, publish="sync") if outage else None)
            outage_s: list[float | None] = [None]
            probing = None
            try:
                load.phase(name)
                started = time.monotonic()
                said = inject()
                if prober is not None:  # beside the hold and the heal: an outage may last until the heal
                    probing = threading.Thread(target=lambda: outage_s.__setitem__(
                        0, first_put(prober, started, hold + args.recovery_timeout)), daemon=True)
                    probing.start()
                time.sleep(hold)  # from the fault in place, as before the outage was measured
                until_shown = time.monotonic() + FAULT_WAIT_S
                while happened is not None and not happened() and time.monotonic() < until_shown:
                    time.sleep(0.2)
                heal()
            finally:
                if probing is not None:
                    probing.join(hold + args.recovery_timeout + 9 * TIMEOUT)
                if prober is not None:
                    prober.close()
            down = outage_s[0]
            with load.lock:
                snapshot = list(load.stored)
            lost, recovery = verify(cluster, snapshot, args.recovery_timeout)
            result = load.phase("between")
            result.fault, result.lost_blocks, result.recovery_s = name, lost, recovery
            result.outage_s = down
            result.note = "; ".join(x for x in (note, said if isinstance(said, str) else "") if x)
            results.append(result)
            if lost:  # what the nodes said about repair, for whoever reads a failed run
                print(f"{name}: {lost} blocks lost; the daemons' repair lines:\n{cluster.repair_log()}", file=sys.stderr)
            print(f"  {name:<24}{result.ops:>7}{result.wrong_bytes:>8}{result.lost_blocks:>7}"
                  f"{result.calls_past_timeout:>9}{'-' if recovery is None else f'{recovery:.2f}':>10}"
                  f"{'-' if down is None else f'{down:.2f}':>10}  {dict(result.errors)}", flush=True)

        print(f"  {'fault':<24}{'ops':>7}{'wrong':>8}{'lost':>7}{'late':>9}{'recov s':>10}{'outage s':>10}"
              "  typed errors")
        etcd = cluster.etcd
        victim: list[str] = []  # the etcd member a fault took down, for its heal

        def kill_leader() -> str:
            victim[:] = [etcd.leader()]
            etcd.kill(victim[0])
            return f"killed {victim[0]} (the leader)"

        def partition_leader() -> str:
            victim[:] = [etcd.leader()]
            etcd.partition(victim[0])
            return f"cut {victim[0]} (the leader) off from the other members; its clients still reach it"
        pid = lambda name: cluster.daemons[name].pid  # noqa: E731
        # First, while clients still put new blocks (the working set is capped), and right before
        # kill -9 of its partner: a node whose DRAM and NVMe are full demotes, then evicts, replicas
        # of acknowledged blocks, then stops gracefully. Placement would spread puts by free space
        # and never fill it (as a client's same-host node fills): here every put goes to it and
        # KILLED until FILL_BLOCKS more blocks are stored.
        seen: dict[str, float] = {}
        everyone = sorted(cluster.daemons) + [FULL_NODE]

        def fill() -> None:
            cluster.spawn(FULL_NODE, dram="1MiB", disk="2MiB")
            with load.lock:
                load.pin, load.cap = (FULL_NODE, [KILLED], everyone), MAX_STORED

        def heal_full() -> None:
            load.pin = None
            seen.update(cluster.counters(FULL_NODE))
            cluster.leave(FULL_NODE)

        def evicting() -> bool:
            try:
                return cluster.counters(FULL_NODE).get("evictions_nvme", 0) > 0
            except Exception:  # noqa: BLE001 - asked again until the wait ends; heal_full reads them once more
                return False

        # Full means evicting: a loaded machine puts fewer blocks in one hold than a quiet one.
        phase("full NVMe tier", fill, heal_full, happened=evicting)
        counted = {"hits": seen.get("hits_dram", 0) + seen.get("hits_nvme", 0), "demotions": seen.get("demotions", 0),
                   "promotions": seen.get("promotions", 0), "evictions_nvme": seen.get("evictions_nvme", 0),
                   "refused_reservations": seen.get("allocation_failures_nvme", 0)
                   + seen.get("allocation_failures_dram", 0)}
        results[-1].node_counters = {k: int(v) for k, v in counted.items()}
        results[-1].note = (f"{FULL_NODE}: {counted['hits']:.0f} hits, {counted['demotions']:.0f} demotions, "
                            f"{counted['evictions_nvme']:.0f} NVMe evictions, "
                            f"{counted['refused_reservations']:.0f} refused reservations")
        phase("kill -9 daemon", lambda: cluster.kill(KILLED), lambda: cluster.spawn(KILLED))
        phase("SIGSTOP daemon", lambda: os.kill(pid("node-0"), signal.SIGSTOP),
              lambda: os.kill(pid("node-0"), signal.SIGCONT))
        phase("etcd leader killed", kill_leader, lambda: etcd.start_member(victim[0]), outage=True)
        if not args.quick:
            phase("etcd member partitioned", partition_leader, lambda: etcd.heal(victim[0]), outage=True)
            phase("etcd kill+restart", etcd.kill_all, etcd.start_all, outage=True, note="every member")
            saved, hold = hold, 0.0
            phase("rolling restart", lambda: rolling_restart(cluster, load, args.recovery_timeout), lambda: None)
            hold = saved
            hold, saved = LEASE_TTL + 3, hold
            phase("lease expiry", lambda: os.kill(pid("node-1"), signal.SIGSTOP),
                  lambda: os.kill(pid("node-1"), signal.SIGCONT))
            hold = saved
            if netns is not None:
                phase("partition", lambda: netns.link(False), lambda: netns.link(True))
                if shutil.which("iptables"):
                    phase("5% packet loss", lambda: netns.loss(True), lambda: netns.loss(False))
                else:
                    results.append(FaultResult("5% packet loss", note="not run: needs iptables"))
            results.append(FaultResult("50 ms delay", note="not run: this kernel has no tc netem qdisc"))

    finally:
        if load is not None:
            load.close()
        if cluster is not None:
            cluster.close()
        if netns is not None:
            netns.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("kvstore").setLevel(logging.ERROR)  # per-op warnings are what the table sums up
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the per-fault records here")
    parser.add_argument("--quick", action="store_true",
                        help="bounded run: full NVMe tier, kill -9, SIGSTOP, etcd leader killed; short phases")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=None)
    parser.add_argument("--hold", type=float, default=None, help="seconds each fault lasts")
    parser.add_argument("--recovery-timeout", type=float, default=30.0)
    parser.add_argument("--shards", type=int, default=1,
                        help="spread the block index over this many etcd clusters (the etcd faults hit the first)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1.5 if args.quick else 4.0)
    args.hold = args.hold if args.hold is not None else (2.0 if args.quick else 4.0)
    if args.clients < 1 or args.hold <= 0 or args.warmup < 0 or args.recovery_timeout <= 0 or args.shards < 1:
        parser.error("--clients and --shards must be at least 1, --hold and --recovery-timeout above 0, --warmup >= 0")
    results = run(args)
    if args.json:
        write_json(args.json, [asdict(r) for r in results])
    bad = [r for r in results if r.wrong_bytes or r.lost_blocks or r.calls_past_timeout]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.faults"))
