"""`python -m benchmarks.store --check BASELINE`: a store ratio that moved against its target by more
than its noise fails the run (exit 1, a line naming it); one within its noise, an absolute time, or
the NVMe tier's drifting ratios do not. Compared on saved runs (`--results`), and once on a quick
measured run, as a user runs it."""
from __future__ import annotations

import json
import shutil

import pytest

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (scripts/install-test-deps.sh)")

GET = "shm batch get / mooncake batch get 1M (>=3)"
P50 = "shm single put 64K p50 / mooncake put p50 (<=1.0)"
VERIFY = "shm batch get verified / unhashed 1M (>=0.8)"


def run_doc(ratios: dict, rounds: list[dict]) -> dict:
    return {"meta": {}, "records": [], "ratios": ratios, "per_round_ratios": rounds}


def write(tmp_path, name: str, doc: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def baseline(tmp_path) -> str:
    rounds = [{GET: 5.0, P50: 0.60, VERIFY: 0.95, "shm single put 64K p50 us (<=500)": 110.0,
               "nvme batch get 1M / dd O_DIRECT (>=0.9)": 1.2},
              {GET: 5.8, P50: 0.62, VERIFY: 1.00, "shm single put 64K p50 us (<=500)": 115.0,
               "nvme batch get 1M / dd O_DIRECT (>=0.9)": 1.2},
              {GET: 7.0, P50: 0.57, VERIFY: 1.02, "shm single put 64K p50 us (<=500)": 120.0,
               "nvme batch get 1M / dd O_DIRECT (>=0.9)": 1.2}]
    medians = {k: sorted(r[k] for r in rounds)[1] for k in rounds[0]}
    return write(tmp_path, "baseline.json", run_doc(medians, rounds))


def test_ratios_within_their_noise_pass(run_benchmark, tmp_path, baseline):
    """Kills: a check that fails on noise (a drop smaller than the baseline's own spread across
    rounds) or on an absolute time or the NVMe tier's ratio, which it must not compare."""
    now = {GET: 4.0, P50: 0.68, VERIFY: 0.9, "shm single put 64K p50 us (<=500)": 900.0,
           "nvme batch get 1M / dd O_DIRECT (>=0.9)": 0.3}
    run = run_benchmark("store", "--check", baseline, "--results", write(tmp_path, "now.json", run_doc(now, [now])),
                        timeout=60)
    assert run.code == 0, run.output
    assert "every ratio within its noise" in run.output and "FAIL" not in run.output


@pytest.mark.parametrize("label, value", [(GET, 3.0), (P50, 0.80), (VERIFY, 0.5)])
def test_a_ratio_moved_beyond_its_noise_fails_the_run(run_benchmark, tmp_path, baseline, label, value):
    """Kills: a check that never fails, or reads every target the same way (a p50 ratio, whose
    target is a ceiling, got worse by going up)."""
    now = {GET: 5.8, P50: 0.62, VERIFY: 1.0, label: value}
    run = run_benchmark("store", "--check", baseline, "--results", write(tmp_path, "now.json", run_doc(now, [now])),
                        timeout=60)
    assert run.code == 1, run.output
    assert f"FAIL {label}" in run.output and "1 ratio(s) moved beyond their noise" in run.output


def test_a_baseline_that_is_not_a_run_is_one_line(run_benchmark, tmp_path):
    run = run_benchmark("store", "--check", write(tmp_path, "bad.json", {"x": 1}), "--results",
                        write(tmp_path, "bad2.json", {"x": 1}), timeout=60)
    assert run.code == 2 and "Traceback" not in run.output and "not a store benchmark" in run.output


@needs_etcd
def test_a_quick_run_checks_itself_against_a_baseline(run_benchmark, tmp_path):
    """The check on a measured run (ours and the memcpy limit only), against a baseline its ratios
    clear whatever this machine's load: the run passes, and says which ratios it compared."""
    low = {VERIFY: 0.01, "shm batch get / memcpy 1M (limit)": 0.001}
    run = run_benchmark("store", "--quick", "--systems", "kvstore,limits", "--check",
                        write(tmp_path, "baseline.json", run_doc(low, [low])), timeout=240)
    assert run.code == 0 and run.left_behind == [], run.output[-3000:]
    assert f"check: ok   {VERIFY}" in run.output and "every ratio within its noise" in run.output
    assert run.records["ratios"][VERIFY] > 0  # the pair the check compares was measured
