"""Runs a local etcd (Debian's etcd-server) on free loopback ports with a temporary data dir:
for tests, benchmarks and trying a cluster on one machine. `EtcdServer` is one member;
`EtcdCluster(3)` is a cluster of members in processes of their own that can be killed, restarted,
hung and partitioned one by one (`python -m kvstore_testing.etcd --members 3` runs one by hand)."""
from __future__ import annotations

import abc
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Sequence

from kvstore_testing import processes
from kvstore_testing.ports import free_port

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout



DATA_DIR_ENV = "KVSTORE_TEST_ETCD_DIR"


def data_parent() -> str | None:
    """Where a started etcd keeps its data: $KVSTORE_TEST_ETCD_DIR when it names a directory (the
    test suite points it at /dev/shm: an etcd whose WAL fsync waits behind another test's disk
    writes stalls every read for seconds, and a test's data needs no disk), else the system's temp
    directory (benchmarks measuring etcd run on a real disk)."""
    where = os.environ.get(DATA_DIR_ENV)
    return where if where and os.path.isdir(where) and os.access(where, os.W_OK) else None

class _Scratch(abc.ABC):
    """`with` for a scratch etcd: start() on entry (cleanup() if it fails), cleanup() on exit."""

    @abc.abstractmethod
    def start(self): ...

    @abc.abstractmethod
    def cleanup(self) -> None: ...

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class EtcdServer(_Scratch):
    """One etcd member. `start()` waits until it reports healthy; `kill()`/`start()` restart it on
    the same ports and data, like a crashed and recovered server."""

    def __init__(self, data_dir: str | None = None, extra_args: Sequence[str] = ()) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd not found: install Debian's etcd-server (scripts/install-test-deps.sh)")
        self.binary = binary
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvstore-etcd-", dir=data_parent())
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.extra_args = list(extra_args)  # more etcd flags, e.g. a lower --max-txn-ops

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = processes.spawn(
            [self.binary, "--name", "kvstore-test", "--data-dir", self.data_dir,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvstore-test={peer}", "--logger", "zap", "--log-level", "error", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as reply:
                    if b'"health":"true"' in reply.read():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    def kill(self) -> None:
        if self.proc is not None:
            processes.kill(self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            processes.stop(self.proc, grace=10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _healthy(client_port: int, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{client_port}/health", timeout=timeout) as reply:
            return b'"health":"true"' in reply.read()
    except OSError:
        return False


def _status(client_port: int, timeout: float = 1.0) -> dict | None:
    """A member's maintenance status (etcd's JSON gateway): member_id, leader, raftTerm, ...; None if it
    does not answer."""
    request = urllib.request.Request(f"http://127.0.0.1:{client_port}/v3/maintenance/status", data=b"{}",
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status = json.loads(reply.read())
    except (OSError, ValueError):
        return None
    return {"member_id": status.get("header", {}).get("member_id"), "leader": status.get("leader"),
            "term": int(status.get("raftTerm", 0) or 0)}


class EtcdCluster(_Scratch):
    """A local etcd cluster of `members` (3 by default), each member its own process with its own data
    directory, client and peer ports on loopback. Peer traffic goes through relays in a process of
    their own (kvstore_testing.etcd_proxy), so a member can be partitioned from the others while its
    clients still reach it.

        with EtcdCluster(3) as cluster:
            cluster.url                     # etcd://127.0.0.1:P0,127.0.0.1:P1,127.0.0.1:P2
            leader = cluster.leader()       # a member's name, e.g. "etcd-1"
            cluster.kill(leader)            # SIGKILL; cluster.start_member(leader) brings it back
            cluster.partition("etcd-0")     # cut off from the others; cluster.heal() ends it
            cluster.pause("etcd-2")         # SIGSTOP (hung); cluster.resume("etcd-2")

    Heartbeat and election timeout are etcd's defaults (100 ms, 1 s) unless given; pre-vote is on, so a
    member coming back from a partition does not unseat a working leader."""

    def __init__(self, members: int = 3, data_dir: str | None = None, extra_args: Sequence[str] = (),
                 heartbeat_ms: int = 100, election_ms: int = 1000, client_host: str = "127.0.0.1") -> None:
        if members < 1:
            raise ValueError("an etcd cluster needs at least one member")
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd not found: install Debian's etcd-server (scripts/install-test-deps.sh)")
        self.binary = binary
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvstore-etcd-cluster-", dir=data_parent())
        os.makedirs(self.data_dir, exist_ok=True)
        self.names = [f"etcd-{i}" for i in range(members)]
        self.client_port = {n: free_port() for n in self.names}
        self.peer_port = {n: free_port() for n in self.names}  # advertised: the relay in front of the member
        self.listen_peer_port = {n: free_port() for n in self.names}  # where the member listens
        self.procs: dict[str, subprocess.Popen] = {}
        self.paused: set[str] = set()
        self.extra_args = list(extra_args)
        self.timing = ["--heartbeat-interval", str(heartbeat_ms), "--election-timeout", str(election_ms)]
        self.token = f"kvstore-{os.path.basename(self.data_dir)}"
        self.member_ids: dict[str, str] = {}  # etcd's member id (decimal, as its JSON gateway writes it)
        self.relay: subprocess.Popen | None = None
        self._relay_lock = threading.Lock()
        self.client_host = client_host  # where clients are listened for ("0.0.0.0": other namespaces too)

    # --- addresses -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Every member: etcd://127.0.0.1:P0,127.0.0.1:P1,..."""
        return "etcd://" + ",".join(f"127.0.0.1:{self.client_port[n]}" for n in self.names)

    def member_url(self, name: str) -> str:
        return f"etcd://127.0.0.1:{self.client_port[name]}"

    def url_from(self, first: str) -> str:
        """Every member, `first` listed first (a handle starts at the first endpoint)."""
        order = [first] + [n for n in self.names if n != first]
        return "etcd://" + ",".join(f"127.0.0.1:{self.client_port[n]}" for n in order)

    def name_of(self, port: int) -> str:
        return next(n for n, p in self.client_port.items() if p == port)

    # --- lifetime ----------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        """The relays, then every member at once (each waits for a quorum), then until all are healthy."""
        members = [{"name": n, "listen": self.peer_port[n], "target": self.listen_peer_port[n]} for n in self.names]
        self.relay = processes.spawn([sys.executable, "-m", "kvstore_testing.etcd_proxy", json.dumps(members)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=_ROOT)
        if self._relay_line(timeout=10) != "ready":
            self.cleanup()
            raise RuntimeError("etcd peer relays did not start")
        for name in self.names:
            self._spawn(name)
        self.wait_healthy(timeout)
        return self

    def _spawn(self, name: str) -> None:
        client = f"http://127.0.0.1:{self.client_port[name]}"
        listen = f"http://{self.client_host}:{self.client_port[name]}"
        initial = ",".join(f"{n}=http://127.0.0.1:{self.peer_port[n]}" for n in self.names)
        log = open(os.path.join(self.data_dir, f"{name}.log"), "ab")
        try:
            self.procs[name] = processes.spawn(
                [self.binary, "--name", name, "--data-dir", os.path.join(self.data_dir, name),
                 "--listen-client-urls", listen, "--advertise-client-urls", client,
                 "--listen-peer-urls", f"http://127.0.0.1:{self.listen_peer_port[name]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port[name]}",
                 "--initial-cluster", initial, "--initial-cluster-token", self.token,
                 "--initial-cluster-state", "new", "--pre-vote", *self.timing,
                 "--logger", "zap", "--log-level", "warn", *self.extra_args],
                stdout=subprocess.DEVNULL, stderr=log)
        finally:
            log.close()
        self._tell_pids()

    def _relay_line(self, timeout: float) -> str:
        """The relays' next line on stdout, waited for at most `timeout` seconds."""
        assert self.relay is not None and self.relay.stdout is not None
        ready, _, _ = select.select([self.relay.stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"etcd peer relays silent for {timeout}s")
        return self.relay.stdout.readline().strip()

    def _relay(self, command: str) -> None:
        with self._relay_lock:
            if self.relay is None or processes.exited(self.relay):
                raise RuntimeError("etcd peer relays are not running")
            self.relay.stdin.write(command + "\n")
            self.relay.stdin.flush()
            answer = self._relay_line(timeout=10)
        if answer != "ok":
            raise RuntimeError(f"etcd peer relays: {command!r}: {answer}")

    def _tell_pids(self) -> None:
        live = {n: p.pid for n, p in self.procs.items() if not processes.exited(p)}
        if live and self.relay is not None:
            self._relay("pids " + " ".join(f"{n}={pid}" for n, pid in live.items()))

    def running(self) -> list[str]:
        return [n for n in self.names if n in self.procs and not processes.exited(self.procs[n])]

    def wait_healthy(self, timeout: float = 30.0, members: Sequence[str] | None = None) -> None:
        """Until every running member (or those of `members`) answers /health and a majority of the
        cluster agrees on one leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            names = list(members) if members is not None else [n for n in self.running() if n not in self.paused]
            for name in names:
                proc = self.procs.get(name)
                if proc is None or processes.exited(proc):
                    raise RuntimeError(f"etcd member {name} is not running (log: {self.data_dir}/{name}.log)")
            if names and all(_healthy(self.client_port[n]) for n in names):
                try:
                    self.leader(timeout=0.5)
                    return
                except RuntimeError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd cluster not healthy within {timeout}s (logs in {self.data_dir})")

    def leader(self, timeout: float = 10.0) -> str:
        """The member a majority of the cluster names as its leader (waited for up to `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            votes: dict[str, int] = {}
            answered = {}
            for name in self.running():
                if name in self.paused:
                    continue
                status = _status(self.client_port[name])
                if status is None:
                    continue
                answered[name] = status
                self.member_ids[name] = status["member_id"]
                if status["leader"] not in (None, "0", 0):
                    votes[status["leader"]] = votes.get(status["leader"], 0) + 1
            for leader_id, count in votes.items():
                if count > len(self.names) // 2:
                    for name, member_id in self.member_ids.items():
                        if member_id == leader_id and name in answered:
                            return name
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no etcd leader a majority agrees on within {timeout}s: {answered}")
            time.sleep(0.05)

    def followers(self) -> list[str]:
        leader = self.leader()
        return [n for n in self.running() if n != leader]

    # --- faults ----------------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """SIGKILL one member (its data stays: start_member brings it back)."""
        proc = self.procs.pop(name, None)
        self.paused.discard(name)
        if proc is not None:
            processes.kill(proc)

    def stop_member(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        self.paused.discard(name)
        if proc is not None:
            processes.stop(proc, grace=10)

    def start_member(self, name: str, timeout: float = 30.0) -> None:
        """Start a stopped or killed member again on its ports and data; return once it is healthy."""
        if name in self.procs and not processes.exited(self.procs[name]):
            raise RuntimeError(f"etcd member {name} is running")
        self._spawn(name)
        self.wait_healthy(timeout, members=[name])

    def kill_all(self) -> None:
        """SIGKILL every member (the whole cluster down; their data stays)."""
        for name in list(self.procs):
            self.kill(name)

    def start_all(self, timeout: float = 30.0) -> None:
        """Start every member that is not running, all at once (each waits for a quorum), and return
        once the cluster is healthy."""
        for name in self.names:
            if name not in self.procs or processes.exited(self.procs[name]):
                self._spawn(name)
        self.wait_healthy(timeout)

    def pause(self, name: str) -> None:
        """SIGSTOP: the member hangs (its sockets stay open, nothing answers)."""
        os.kill(self.procs[name].pid, signal.SIGSTOP)
        self.paused.add(name)

    def resume(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGCONT)
        self.paused.discard(name)

    def partition(self, name: str) -> None:
        """Cut `name` off from every other member (its clients still reach it)."""
        self._tell_pids()
        self._relay(f"partition {name}")

    def heal(self, name: str | None = None) -> None:
        self._relay("heal" + (f" {name}" if name else ""))

    # --- the end -----------------------------------------------------------------------------------
    def cleanup(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            if name in self.paused:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except OSError:
                    pass
            processes.stop(proc, grace=5)
        self.paused.clear()
        if self.relay is not None:
            processes.stop(self.relay, grace=2)
            self.relay = None
        shutil.rmtree(self.data_dir, ignore_errors=True)


if __name__ == "__main__":  # a scratch etcd (or cluster: --members 3) for manual runs
    count = int(sys.argv[sys.argv.index("--members") + 1]) if "--members" in sys.argv else 1
    with (EtcdCluster(count) if count > 1 else EtcdServer()) as server:
        print(server.url, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    os._exit(0)
