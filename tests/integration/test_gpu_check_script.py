"""scripts/gpu-check.sh in CPU-only mode, as CI runs it: it builds the native module the way a bare
CUDA machine would (PyTorch's pybind11 headers, the EVP declarations it carries), runs the CPU
checks (host regions through the Transfer Engine; the connector's staged copy path in every KV
cache layout) and records each CUDA part as skipped with its reason, in one JSON."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(600)
def test_gpu_check_runs_in_cpu_only_mode(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "gpu-check.json"
    env = dict(os.environ, GPU_CHECK_BARE="1")
    done = subprocess.run([os.path.join(ROOT, "scripts", "gpu-check.sh"), str(out), "--cpu-only"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["mode"] == "cpu-only" and doc["ok"] is True
    assert doc["build"]["openssl"].startswith("declarations from") and "torch" in doc["build"]["pybind11"]
    status = {c["name"]: c for c in doc["checks"]}
    for name in ("build native module", "transfer engine: host regions",
                 "connector copy path: CPU tensors, every layout"):
        assert status[name]["status"] == "passed", status[name]
    assert len(status["connector copy path: CPU tensors, every layout"]["detail"]["layouts"]) == 7
    skipped = [c for c in doc["checks"] if c["status"] == "skipped"]
    assert {c["name"] for c in skipped} == {"transfer engine: CUDA regions", "bandwidth device<->host",
                                            "connector copy path: CUDA tensors, every layout"}
    assert all("CUDA" in c["reason"] for c in skipped)
    assert not (tmp_path / "build").exists() and not list(tmp_path.glob("*.so"))  # nothing left behind
