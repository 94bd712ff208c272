"""scripts/gpu-check.sh in CPU-only mode, as CI runs it: it builds the native module the way a bare
CUDA machine would (PyTorch's pybind11 headers, the EVP declarations it carries), runs the CPU
checks (host regions through the Transfer Engine; the connector's per-block and batched copy paths
in every KV cache layout and kernel split; small steps of benchmarks.kv_copy; steps saved and
loaded through an embedded kvstore, byte for byte; BLAKE3 digests on 1..CPUs threads; a verified
batch get beside an unhashed one) and records each CUDA part as skipped with its reason, in one JSON."""
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
                 "connector copy path: CPU tensors, every layout", "connector batched path: CPU tensors, every layout",
                 "kv_copy: a step through the connector's batched path beside a plain copy",
                 "store: a step saved and loaded through the batched path, byte for byte (cpu)",
                 "store: a same-host batch get, every block verified, against no digest and memcpy"):
        assert status[name]["status"] == "passed", status[name]
    assert len(status["connector copy path: CPU tensors, every layout"]["detail"]["layouts"]) == 7
    assert len(status["connector batched path: CPU tensors, every layout"]["detail"]["layouts"]) == 14
    skipped = [c for c in doc["checks"] if c["status"] == "skipped"]
    assert {c["name"] for c in skipped} == {
        "transfer engine: CUDA regions", "bandwidth device<->host", "connector copy path: CUDA tensors, every layout",
        "connector batched path: CUDA tensors, every layout", "transfer engine: CUDA regions beside a pinned copy (1 GiB)",
        "hand-off: KV device -> store -> other device tensors", "profile: a Llama-3-8B-shaped layer stack (random weights)"}
    assert all("CUDA" in c["reason"] for c in skipped)
    layouts = {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "LBHNC/2", "LBNHC/2"}
    copies = {(r["direction"], r["block_tokens"], r["layout"], r["digests"]) for r in doc["records"]
              if r["kind"] == "kv_copy" and r["device"] == "cpu" and r["gbps"] > 0 and r["limit_gbps"] > 0}
    assert copies == {(d, b, layout, g) for b in (16, 64) for layout in layouts
                      for d, g in (("save", "off"), ("save", "on"), ("load", "off"))}
    stored = [r for r in doc["records"] if r["kind"] == "store"]
    assert {(r["layout"], r["block_tokens"]) for r in stored} == {(layout, b) for layout in layouts for b in (16, 64)}
    assert all(r["wrong_bytes"] == 0 and r["save_gbps"] > 0 and r["load_gbps"] > 0 for r in stored)
    rates = [r for r in doc["records"] if r["kind"] == "digest_rate"]
    assert rates and rates[0]["threads"] == 1 and all(r["gbps"] > 0 for r in rates)
    [verified] = [r for r in doc["records"] if r["kind"] == "verified_get"]
    assert verified["cpus"] >= 1 and verified["verified_over_unhashed"] > 0 and verified["memcpy_gbps"] > 0
    assert len(verified["verified_over_unhashed_rounds"]) == verified["rounds"]
    assert not (tmp_path / "build").exists() and not list(tmp_path.glob("*.so"))  # nothing left behind


def test_only_wheels_for_this_python_are_unpacked(monkeypatch):
    """A checkout carrying another machine's wheels (cp312 ones fetched for a GPU machine) must not
    shadow this Python's own packages: a cp312 grpcio in front of a 3.11 interpreter broke every
    store part's import."""
    import sys

    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import gpu_check

    here = f"cp3{sys.version_info.minor}"
    other = f"cp3{sys.version_info.minor + 1}"
    assert gpu_check.wheel_fits(f"grpcio-1.85.3-{here}-{here}-manylinux2014_x86_64.whl")
    assert not gpu_check.wheel_fits(f"grpcio-1.85.3-{other}-{other}-manylinux2014_x86_64.whl")
    assert gpu_check.wheel_fits("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl")
    assert not gpu_check.wheel_fits(f"protobuf-7.36.2-{other}-abi3-manylinux2014_x86_64.whl")
    assert gpu_check.wheel_fits("typing_extensions-4.16.0-py3-none-any.whl")
    assert not gpu_check.wheel_fits("not-a-wheel.whl")
