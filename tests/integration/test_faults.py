"""Bounded fault-injection run (the CI version of `python -m benchmarks.faults`): kill -9 of a
daemon, SIGSTOP of a daemon, etcd kill + restart, under verified load with replicas=2."""
from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import faults


@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd")
def test_bounded_fault_injection_loses_and_corrupts_nothing(tmp_path):
    out = tmp_path / "faults.json"
    code = faults.main(["--quick", "--json", str(out), "--clients", "2"])
    records = json.loads(out.read_text())
    assert [r["fault"] for r in records] == ["kill -9 daemon", "SIGSTOP daemon", "etcd kill+restart"]
    for r in records:
        assert r["ops"] > 0, r
        assert r["wrong_bytes"] == 0 and r["lost_blocks"] == 0 and r["calls_past_timeout"] == 0, r
        assert r["recovery_s"] is not None and r["recovery_s"] < 30, r
    assert code == 0
