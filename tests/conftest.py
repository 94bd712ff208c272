"""Shared fixtures: Transfer Engine peers running in their own processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvstore_testing.etcd import DATA_DIR_ENV, EtcdServer

ROOT = Path(__file__).resolve().parent.parent
from doc_pages import PAGES, page_id, runs_with_engines
from peer_process import pattern
from tests_support import wait_until_stopped

# Every etcd the suite starts (its own, and the benchmarks' it runs) keeps its data in memory: on
# disk, its WAL fsync waited behind a neighbouring test's tier file and stalled every read past a
# client's timeout (a mirror that "could not load a snapshot" in 3 s).
if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
    os.environ.setdefault(DATA_DIR_ENV, "/dev/shm")

# vLLM's engine processes forked rather than spawned on CPU (as vLLM does on CUDA): a `vllm serve`
# starts in about half the time. See kvstore_testing/vllm_fork/sitecustomize.py for why it is safe
# and which tests still spawn theirs; KVSTORE_TEST_VLLM_FORK=0 (for the run, or one process's
# environment) starts them as users' are.
VLLM_FORK_HOOK = str(ROOT / "kvstore_testing" / "vllm_fork")
if os.environ.get("KVSTORE_TEST_VLLM_FORK", "1") != "0" and \
        VLLM_FORK_HOOK not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (VLLM_FORK_HOOK, os.environ.get("PYTHONPATH")) if p)


# The suite runs on two xdist workers (`pytest -n 2 --dist loadgroup`, the README's test command).
# Tests that start vLLM engines or Ray take both cores and gigabytes each: they run one after
# another on one worker (one group), while the other worker takes the rest; two of them at once
# on a 2-core machine only trade places in the queue for a core.
ENGINE_HEAVY_FILES = ("tests/e2e/", "tests/unit/test_ray_app.py", "tests/benchmarks/test_demo.py",
                      "tests/benchmarks/test_vllm_ttft_hybrid.py")
DOC_PAGES_TEST = "tests/docs/test_examples.py"  # of its pages, those that run vLLM or use fixed ports:
ENGINE_PAGES = {page_id(page) for page in PAGES if runs_with_engines(page)}
ENGINE_HEAVY_BENCHMARKS = ("serving", "vllm_ttft", "wrong_kv")  # tests/benchmarks tests that run these start vLLM engines
# End-to-end files that start no engine: vLLM's scheduler in-process with model outputs mocked (the
# vllm_harness), about 90 s of one core between them. Any worker takes them, so the engine group,
# the suite's longest queue, does not wait for them.
IN_PROCESS_VLLM_FILES = ("tests/e2e/test_vllm_shapes.py", "tests/e2e/test_vllm_batched_copy.py",
                         "tests/e2e/test_vllm_scheduler.py", "tests/e2e/test_vllm_identity.py",
                         "tests/e2e/test_vllm_hybrid.py", "tests/e2e/test_vllm_hits.py")


def engine_heavy(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    if path.startswith(IN_PROCESS_VLLM_FILES):
        return False
    if path == DOC_PAGES_TEST:
        page = name.partition("[")[2].rstrip("]")
        return page in ENGINE_PAGES
    return path.startswith(ENGINE_HEAVY_FILES) or (
        path.startswith("tests/benchmarks/") and any(b in name for b in ENGINE_HEAVY_BENCHMARKS))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (it names items by them)
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if engine_heavy(item.nodeid):
            item.add_marker(pytest.mark.xdist_group("engines"))


# Skips that mean a dependency of the test install is missing: the install (scripts/install-test-deps.sh)
# provides every one, so such a skip is a broken install, not a test that does not apply here. They
# fail the run (after the summary lists every skip and its reason); skips for what no install can
# provide (a GPU, root, docker, kubectl) stay skips.
MISSING_DEPENDENCY = ("could not import", "part of the test install", "extra is part of", "needs the vllm extra",
                      "the gateway extra", "needs etcd", "part of the deploy extra")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    return str(crash.message if crash is not None else longrepr)


def _skips(config) -> dict[str, list[str]]:
    """reason -> node ids of every skip this run."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reasons: dict[str, list[str]] = {}
    for report in (reporter.stats.get("skipped", []) if reporter is not None else []):
        reasons.setdefault(_skip_reason(report), []).append(report.nodeid)
    return reasons


def _missing_dependencies(config) -> dict[str, list[str]]:
    return {reason: ids for reason, ids in _skips(config).items() if any(m in reason for m in MISSING_DEPENDENCY)}


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Every skip with its reason; a line when one of them is a missing dependency."""
    reasons = _skips(config)
    if not reasons:
        return
    terminalreporter.section("skipped, and why")
    for reason, nodeids in sorted(reasons.items()):
        terminalreporter.write_line(f"{len(nodeids):4d}  {reason}  (e.g. {nodeids[0]})")
    missing = _missing_dependencies(config)
    if missing:
        terminalreporter.write_line(f"{sum(map(len, missing.values()))} tests skipped for a dependency the test "
                                    "install provides: the install is broken (run scripts/install-test-deps.sh); "
                                    "the run fails", red=True)


def pytest_sessionfinish(session, exitstatus) -> None:
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) and \
            _missing_dependencies(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@dataclass
class PeerProcess:
    """Handle on tests/helpers/peer_process.py running in a child process."""

    proc: subprocess.Popen
    descriptor: str
    regions: dict[str, int]
    size: int
    seed: int

    def sha(self, region: str, offset: int = 0, length: int | None = None) -> str:
        length = self.size - offset if length is None else length
        self.proc.stdin.write(json.dumps({"cmd": "sha", "region": region, "offset": offset, "length": length}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["sha"]

    def call(self, **cmd) -> dict:
        """One command on the peer's stdin (peer_process.py), its one-line answer."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def expected(self) -> np.ndarray:
        return pattern(self.seed, self.size)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def spawn_peer() -> Iterator:
    started: list[PeerProcess] = []

    def spawn(size: int = 4 << 20, seed: int = 1, secret: str | None = None, stall: float = 10.0,
              extra: list[str] | None = None) -> PeerProcess:
        cmd = [sys.executable, str(ROOT / "tests" / "helpers" / "peer_process.py"), "--size", str(size),
               "--seed", str(seed), "--stall", str(stall)] + (extra or [])
        if secret is not None:
            cmd += ["--secret", secret]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        hello = json.loads(proc.stdout.readline())
        peer = PeerProcess(proc, hello["descriptor"], hello["regions"], size, seed)
        started.append(peer)
        return peer

    yield spawn
    for peer in started:
        peer.stop()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """A real etcd shared by the session; tests isolate themselves by key prefix."""
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="session")
def second_etcd_server() -> Iterator[EtcdServer]:
    """Another real etcd: the second shard of a sharded index (kvstore.index.shards)."""
    with EtcdServer() as server:
        yield server


@pytest.fixture(params=["one-etcd", "two-shards"])
def index_url(request, etcd_server) -> str:
    """The metadata URL of an index in one etcd, or sharded over two: a test taking it runs with both."""
    if request.param == "one-etcd":
        return etcd_server.url
    return f"{etcd_server.url};{request.getfixturevalue('second_etcd_server').url}"


@pytest.fixture
def fresh_etcd() -> Iterator[EtcdServer]:
    """An etcd of the test's own, for tests that kill or restart it."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    import uuid

    return f"/test/{uuid.uuid4().hex[:12]}/"


@pytest.fixture(params=["memory", "etcd"])
def metadata_url(request) -> str:
    """The same suite against both backends."""
    if request.param == "memory":
        import uuid

        return f"memory://{uuid.uuid4().hex[:12]}"
    return request.getfixturevalue("etcd_server").url


@dataclass
class DaemonProcess:
    """A `kvstore serve` daemon in its own process."""

    name: str
    proc: subprocess.Popen
    control: str
    metrics_port: int | None
    log_path: Path | None = None  # its stderr (log lines), in a file: a pipe nobody reads would fill and stall it

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self) -> int:
        self.proc.terminate()
        return self.proc.wait(15)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_until_stopped(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def spawn_daemon(tmp_path) -> Iterator:
    """Start store daemons as separate processes; all are killed at the end of the test."""
    started: list[DaemonProcess] = []

    def spawn(name: str, metadata: str, cluster: str, *, dram: str = "64MiB", disk: str | None = None,
              secret: str | None = None, extra: list[str] | None = None, lease_ttl: int = 3,
              env: dict | None = None) -> DaemonProcess:
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--node", name, "--metadata", metadata,
               "--cluster", cluster, "--dram", dram, "--lease-ttl", str(lease_ttl), "--timeout", "2",
               "--metrics-port", "0"]
        if disk:
            cmd += ["--disk-dir", str(tmp_path / f"nvme-{name}"), "--disk-size", disk]
        if secret:
            secret_file = tmp_path / f"secret-{name}"
            secret_file.write_text(secret)
            secret_file.chmod(0o600)  # a daemon refuses a secret file others may read
            cmd += ["--secret-file", str(secret_file)]
            if not any(arg in ("--admin-token-file", "--token-file") for arg in extra or []):
                cmd += ["--admin-token-file", str(tmp_path / f"admin-token-{cluster}")]  # not in ~/.kvstore
        else:
            cmd += ["--insecure"]
        log_path = tmp_path / f"daemon-{name}-{len(started)}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd + (extra or []), stdout=subprocess.PIPE, stderr=log, text=True,
                                    cwd=ROOT, env=env)
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise RuntimeError(f"daemon {name} failed to start: {log_path.read_text()[-2000:]}")
        hello = json.loads(line)
        daemon = DaemonProcess(name, proc, hello["control"], hello["metrics_port"], log_path)
        started.append(daemon)
        return daemon

    yield spawn
    for daemon in started:
        if daemon.proc.poll() is None:
            try:
                daemon.resume()
            except OSError:
                pass
            daemon.kill()
