"""`python -m benchmarks.vllm_ttft --model hybrid --quick`: a sliding-window/full hybrid on real
vLLM (CPU) with our connector, vLLM's hybrid KV cache manager on, against the same engine with it
forced off (the quick run leaves out the engine without a connector). The KV capacity vLLM reports
is a function of the configuration (not of timing), so its target is asserted; the quick run's
TTFTs are a smoke test's."""
from __future__ import annotations

import importlib.util
import math
import shutil

import pytest

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (scripts/install-test-deps.sh)")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@needs_etcd
@needs_vllm
@pytest.mark.timeout(600)
def test_vllm_ttft_hybrid_quick(run_benchmark):
    run = run_benchmark("vllm_ttft", "--model", "hybrid", "--quick", timeout=540)
    assert run.left_behind == [], run.left_behind
    assert run.code == 0 and run.records is not None, run.output[-5000:]
    doc = run.records
    records = {(r["system"], r["phase"]): r for r in doc["records"]}
    assert set(records) == {(s, p) for s in ("kvstore", "kvstore-hma-off") for p in ("first_sight", "warm")}
    assert all(positive(v) for r in records.values() for v in r["samples_ms"])
    capacity = doc["capacity"]
    assert capacity["kvstore"]["hybrid_kv_cache_manager"] is True
    assert capacity["kvstore"]["groups"] == ["sliding_window", "full_attention"]
    assert capacity["kvstore-hma-off"]["hybrid_kv_cache_manager"] is False
    ratios = {r["ratio"]: r for r in doc["ratios"]}
    kept = ratios["kvstore capacity / kvstore-hma-off capacity"]
    assert kept["direction"] == ">=" and kept["met"] and kept["value"] >= 1.8, kept
    ours = doc["totals"]["kvstore"]  # the warm pass loaded what the first one saved, in both groups
    assert ours["saved_blocks"] > 0 and ours["loaded_blocks"] > 0 and ours["hit_tokens"] > 0
    assert ours["load_failures"] == 0 and ours["dropped_blocks"] == 0
