"""A daemon starting while etcd is too slow to answer: its registration is tried again within a
bound, and a start that cannot register still ends in one line. Real etcd (frozen with SIGSTOP, as
a loaded machine can hold it past a deadline), the daemon in a process of its own."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests_support import until

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd")


def serve(node: str, url: str) -> list[str]:
    return [sys.executable, "-m", "kvstore.cli", "serve", "--node", node, "--metadata", url, "--insecure",
            "--dram", "16MiB", "--timeout", "1"]


def test_a_daemon_whose_registration_times_out_once_tries_again_and_serves(fresh_etcd, tmp_path):
    """The broken variant this kills: a daemon that exits at its first start-up call etcd answers
    late ("cannot start ...: MetadataTimeout: etcd did not answer in time"), as one did in a loaded
    run of the suite. etcd is frozen before the daemon starts and resumed only once the daemon has
    said it timed out and will try again: without the retry it has exited by then."""
    log = tmp_path / "daemon.log"
    os.kill(fresh_etcd.proc.pid, signal.SIGSTOP)
    try:
        with open(log, "w") as err:
            daemon = subprocess.Popen(serve("slow-start", fresh_etcd.url), stdout=subprocess.PIPE, stderr=err,
                                      text=True)
        said = until(lambda: "trying again" in log.read_text() or daemon.poll() is not None, timeout=60)
    finally:
        os.kill(fresh_etcd.proc.pid, signal.SIGCONT)
    try:
        assert said and daemon.poll() is None, log.read_text()[-2000:]
        hello = daemon.stdout.readline()
        assert hello, log.read_text()[-2000:]
        assert json.loads(hello)["node"] == "slow-start"
    finally:
        daemon.terminate()
        daemon.wait(30)


def test_a_daemon_that_cannot_register_in_time_exits_in_one_line(fresh_etcd):
    """The broken variant this kills: a retry without an end (a daemon that never starts and never
    says so) or a traceback. etcd stays frozen: the start fails after its attempts, in one line."""
    os.kill(fresh_etcd.proc.pid, signal.SIGSTOP)
    try:
        done = subprocess.run(serve("never-starts", fresh_etcd.url), capture_output=True, text=True, timeout=60)
    finally:
        os.kill(fresh_etcd.proc.pid, signal.SIGCONT)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("trying again") == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstore serve: cannot start never-starts: MetadataTimeout:"), done.stderr[-2000:]
