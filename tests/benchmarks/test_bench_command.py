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
    ("scale", ["--shards", "1,zero"], "--shards must be comma-separated whole numbers"),
    ("scale", ["--blocks", "100"], "--blocks must be at least 8192"),
    ("conductor", ["--write", "/no/such/dir/report.md"], "--write: no such directory"),
    ("gateway", ["--requests", "0"], "--requests must be at least 1"),
    ("faults", ["--clients", "0"], "--clients and --shards must be at least 1"),
    ("vllm_ttft", ["--prompt-tokens", "99999"], "--prompt-tokens must be within"),
    ("fleet", ["--routers", "ours,nginx"], "--routers: unknown nginx"),
    ("fleet", ["--fault", "melt:0:1"], "the kind must be one of"),
    ("tenant_timing", ["--trials", "1"], "--trials must be at least 2"),
])
def test_bad_arguments_are_one_line(name, args, says):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert says in done.stderr.strip().splitlines()[-1], done.stderr


@pytest.mark.parametrize("line, says", [('{"timestamp": 5, "input_length": 10, "output_length": 2}', "'hash_ids'"),
                                        ("{not json", "not JSON"),
                                        ('{"timestamp": 1, "input_length": 0, "output_length": 2, "hash_ids": []}',
                                         "'input_length' must be an integer of at least 1")])
def test_fleet_names_the_malformed_trace_line(tmp_path, line, says):
    """Kills: a bad trace row as a traceback, or an error that does not say which line to fix."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n' + line + "\n")
    done = subprocess.run([sys.executable, "-m", "benchmarks.fleet", "--trace", str(trace)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"{trace} line 2" in last and says in last, done.stderr


def test_fleet_a_peer_installed_but_not_on_path_is_one_line_naming_it(tmp_path):
    """Kills: a peer whose program is not on PATH shown as rows of n/a after the other routers ran
    (or as a traceback): the run is refused before anything starts, in one line naming the peer.
    vllm-router (the bench extra, not the test install) counts as installed by its distribution's
    metadata, given here on PYTHONPATH whether or not pip installed it."""
    import os

    installed = tmp_path / "vllm_router-0.1.17.dist-info"
    installed.mkdir()
    (installed / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-router\nVersion: 0.1.17\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", "benchmarks.fleet", "--routers", "ours,kv_aware", "--minutes", "0.1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": path})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "vllm-router kv_aware" in last and "not on PATH" in last, done.stderr


def test_fleet_dynamo_not_installed_is_one_line_naming_it(tmp_path):
    """Kills: the Dynamo peer's check raising ModuleNotFoundError (a traceback) where the `dynamo`
    package is absent altogether, instead of the one line that says how to install it; and a
    `dynamo` package without its KV router (`dynamo.llm`) taken as installed."""
    import os

    from benchmarks.fleet import importlib_missing

    assert importlib_missing("kvstore_no_such_package.llm") and not importlib_missing("json.decoder")
    (tmp_path / "dynamo").mkdir()
    (tmp_path / "dynamo" / "__init__.py").write_text("")  # a `dynamo` without its KV router
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", "benchmarks.fleet", "--routers", "ours,dynamo", "--minutes", "0.1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "dynamo (ai-dynamo 1.6.1) is not installed" in last, done.stderr
