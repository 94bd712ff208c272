"""Measured engine profiles (conductor.sim.engine.profile): the profile scripts/gpu-check.sh writes
joins the stand-ins' cost models under its own name, from the committed JSON or from
KVSTORE_PROFILE_FILES, without replacing a cited one."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from conductor.sim.engine import profile as profiles

ROOT = Path(__file__).resolve().parents[2]


def measured(name: str, **changes) -> dict:
    entry = asdict(profiles.H100_LLAMA3_8B)
    entry.update(name=name, gemm_efficiency=0.61, step_overhead_ms=2.25, **changes)
    return entry


def test_a_measured_profile_file_adds_profiles_by_name(tmp_path, monkeypatch):
    """Kills: measured files ignored, a cited profile replaced by a measured one of its name, and
    an incomplete entry that breaks every profile's loading."""
    path = tmp_path / "gpu-check.json"
    incomplete = {"name": "half", "params": 1.0}
    path.write_text(json.dumps({"profiles": [measured("h200-llama3-8b-measured"), measured("h100-llama3-8b"),
                                             incomplete]}))
    monkeypatch.setenv("KVSTORE_PROFILE_FILES", str(path))
    try:
        module = importlib.reload(profiles)
        got = module.get_profile("h200-llama3-8b-measured")
        assert got.gemm_efficiency == 0.61 and got.step_overhead_ms == 2.25
        assert got.step_ms([module.Chunk(4096, 0)]) > 0 and got.cost_model()["prefill_ms_per_token"] > 0
        assert module.get_profile("h100-llama3-8b").gemm_efficiency == 0.5  # the cited one stays
        assert "half" not in module.PROFILES
    finally:
        monkeypatch.delenv("KVSTORE_PROFILE_FILES")
        importlib.reload(profiles)


def test_the_fleet_benchmark_takes_a_measured_profile_by_name(tmp_path):
    """`benchmarks.fleet --profile NAME` accepts a measured profile (its own process, as a user
    runs it). Kills: a fleet that knows only the cited profiles."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"profiles": [measured("h200-llama3-8b-measured")]}))
    probe = ("from benchmarks import fleet; args = fleet.parse_args(['--profile', 'h200-llama3-8b-measured']); "
             "fleet.check(args); print(args.profile)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVSTORE_PROFILE_FILES": str(path)})
    assert done.returncode == 0 and done.stdout.strip() == "h200-llama3-8b-measured", done.stderr[-2000:]
