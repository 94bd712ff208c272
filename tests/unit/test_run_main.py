"""How a benchmark's command line ends when the store under it fails: one line and exit code 1.
(In a process of its own: run_main stops every registered child when it returns, and this
worker's fixtures may have some.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import sys
from kvstore.errors import MetadataTimeout
from kvstore_testing import processes
from transfer.errors import PeerUnreachable

errors = {"metadata": MetadataTimeout("etcd at http://127.0.0.1:1 did not answer within 10 s"),
          "peer": PeerUnreachable("node a is gone"), "bug": ValueError("a bug")}

def main(argv):
    raise errors[argv[0]]

sys.exit(processes.run_main(main, sys.argv[1:], prog="python -m benchmarks.x"))
"""


@pytest.mark.parametrize("kind, line", [
    ("metadata", "python -m benchmarks.x: MetadataTimeout: etcd at http://127.0.0.1:1 did not answer within 10 s"),
    ("peer", "python -m benchmarks.x: PeerUnreachable: node a is gone")])
def test_a_typed_store_error_ends_the_program_with_one_line(kind, line):
    """Kills: run_main letting typed errors through (before, `python -m benchmarks.metadata`
    against an etcd that timed out ended in a traceback)."""
    done = subprocess.run([sys.executable, "-c", PROGRAM, kind], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (1, line + "\n")


def test_a_bug_still_shows_its_traceback():
    done = subprocess.run([sys.executable, "-c", PROGRAM, "bug"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" in done.stderr and "ValueError: a bug" in done.stderr
