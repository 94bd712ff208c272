"""`kvstore bench NAME` covers every benchmark, and a benchmark given bad arguments says so in one
line (exit code 2), before it starts anything."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks import BENCHMARKS

from bench_run import ROOT


def test_every_benchmark_module_is_a_kvstore_bench_name():
    runnable = {path.stem for path in (ROOT / "benchmarks").glob("*.py")
                if re.search(r"^def main\(", path.read_text(), re.M)}
    assert runnable == set(BENCHMARKS)


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_kvstore_bench_lists_every_benchmark_and_refuses_others():
    shown = kvstore("bench", "--help")
    assert shown.returncode == 0
    assert all(name in shown.stdout for name in BENCHMARKS)
    wrong = kvstore("bench", "no-such-benchmark")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr and "no-such-benchmark" in wrong.stderr


def test_kvstore_bench_passes_arguments_through():
    done = kvstore("bench", "transfer_ucx", "--systems", "kvstore")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("python -m benchmarks.transfer_ucx: error: --systems")


@pytest.mark.parametrize("name, args, says", [
    ("serving", ["--modes", "pd,sideways"], "--modes: unknown sideways"),
    ("serving", ["--routers", "kvstore,nginx"], "--routers: unknown nginx"),
    ("serving", ["--engines", "1"], "--engines must be at least 2"),
    ("transfer", ["--systems", "kvstore,rdma"], "--systems: unknown rdma"),
    ("store", ["--rounds", "0"], "--rounds must be at least 1"),
    ("metadata", ["--blocks", "100"], "--blocks must be at least 4096"),
    ("conductor", ["--write", "/no/such/dir/report.md"], "--write: no such directory"),
    ("gateway", ["--requests", "0"], "--requests must be at least 1"),
    ("faults", ["--clients", "0"], "--clients must be at least 1"),
    ("vllm_ttft", ["--prompt-tokens", "99999"], "--prompt-tokens must be within"),
])
def test_bad_arguments_are_one_line(name, args, says):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert says in done.stderr.strip().splitlines()[-1], done.stderr
