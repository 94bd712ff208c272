"""No benchmark leaves a process behind, whatever goes wrong: a benchmark that fails with its
children up, or is interrupted (Ctrl-C, SIGTERM, SIGHUP) while they start, still stops every one
of them (their process groups too: vLLM's engine core), through kvstore_testing.processes. What
outlives a run is found by reaper.py (a child subreaper: every descendant comes back to it).

A failure is injected with KVSTORE_TESTING_FAIL_AFTER_SPAWNS=N: the benchmark's Nth child
starts, then the call that started it raises, as a bug after that point would."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import time

import pytest

from bench_run import Started, describe, descendants
from kvstore_testing.processes import FAIL_AFTER_ENV

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (scripts/install-test-deps.sh)")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")


def crash_after(tmp_path, name: str, spawns: int, *args: str, timeout: float = 120.0) -> tuple[int, str, list[str]]:
    return Started(name, ["--quick", *args], tmp_path / "reaper.json", timeout, env={FAIL_AFTER_ENV: str(spawns)}).finish()


@needs_etcd
@needs_vllm
def test_serving_failing_with_its_engines_up_leaves_nothing(tmp_path):
    """The broken variant this kills: benchmarks.serving raising once its `vllm serve` engines run
    (--quick: two, children 3 and 4 after etcd and the store daemon), as its clean-up's
    AttributeError at the end of the first mode did, which left three `vllm serve` processes (and
    their engine cores) running. The first and the daemon are stopped by the mode's own clean-up
    (Rig); the second, whose start raised, by the benchmark's exit path (run_main)."""
    code, output, left = crash_after(tmp_path, "serving", 4)
    assert "InjectedFailure" in output, output[-3000:]
    assert code == 1, output[-3000:]
    assert left == [], left


@pytest.mark.parametrize("name, spawns, what", [
    pytest.param("transfer", 1, "its target process", id="transfer"),
    pytest.param("metadata", 1, "etcd", marks=needs_etcd, id="metadata"),
    pytest.param("scale", 2, "etcd and a publisher", marks=needs_etcd, id="scale"),
    pytest.param("store", 2, "etcd and a kvstore serve daemon", marks=needs_etcd, id="store"),
    pytest.param("faults", 3, "etcd and two kvstore serve daemons", marks=needs_etcd, id="faults"),
    pytest.param("gateway", 1, "a conductor serve gateway", id="gateway"),
    pytest.param("vllm_ttft", 3, "etcd, the daemon and the process its engines fork from", marks=[needs_etcd, needs_vllm],
                 id="vllm_ttft"),
])
def test_benchmark_failing_with_children_up_leaves_nothing(tmp_path, name, spawns, what):
    """The broken variant this kills: each benchmark raising right after it started `what`
    (before, a benchmark's children outlived any exception its own `finally` did not cover)."""
    code, output, left = crash_after(tmp_path, name, spawns)
    assert "InjectedFailure" in output, output[-3000:]
    assert code == 1, output[-3000:]
    assert left == [], left


def wait_for_children(run: Started, needle: str, count: int, timeout: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [d for d in map(describe, descendants(run.proc.pid)) if needle in d]
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {count} x {needle!r} within {timeout} s: "
                         f"{[describe(p) for p in descendants(run.proc.pid)]}")


@pytest.mark.parametrize("name, args, sig, needle, count", [
    pytest.param("serving", ["--modes", "pd"], signal.SIGTERM, "VLLM::EngineCore", 1, marks=[needs_etcd, needs_vllm],
                 id="serving-SIGTERM"),
    # Two: the fork server and an engine run forked from it (same command line).
    pytest.param("vllm_ttft", [], signal.SIGINT, "kvstore_testing.engine_fork", 2, marks=[needs_etcd, needs_vllm],
                 id="vllm_ttft-SIGINT"),
    pytest.param("store", [], signal.SIGINT, "kvstore.cli serve", 1, marks=needs_etcd, id="store-SIGINT"),
    pytest.param("transfer", [], signal.SIGHUP, "benchmarks.transfer --serve", 1, id="transfer-SIGHUP"),
])
def test_interrupted_benchmark_leaves_nothing(tmp_path, name, args, sig, needle, count):
    """The broken variant this kills: a benchmark stopped from outside (Ctrl-C, `kill`, a closed
    terminal) while its children run: before, SIGTERM and SIGHUP ended Python at once, no
    `finally` ran, and etcd, daemons and `vllm serve` engines with their engine cores (each in a
    group of its own) lived on. Serving is stopped once an engine core runs (P/D only: 2 engines);
    vllm_ttft once an engine runs forked from its fork server, that run frozen (SIGSTOP) first so it
    cannot end on its own: a fork that left the server's group (os.setsid in the child) outlives it."""
    run = Started(name, ["--quick", *args], tmp_path / "reaper.json", timeout=240)
    try:
        found = wait_for_children(run, needle, count, timeout=180)  # serving: an engine core, its vllm serve's child
        time.sleep(0.5)  # the children are past their start
        if count > 1:  # the newest: the run forked from the first
            os.kill(max(int(d.split(":")[0]) for d in found), signal.SIGSTOP)
        run.signal(sig)
    finally:
        code, output, left = run.finish()
    assert left == [], left
    assert code == 128 + sig, output[-3000:]
    assert "interrupted" in output, output[-3000:]
