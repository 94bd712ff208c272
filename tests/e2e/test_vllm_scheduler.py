"""The connector under vLLM's real Scheduler, model outputs mocked (no forward pass): async loads,
a failed load leading to recompute, an abort during a load, preemption — and the scheduler ends
empty every time."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstore.integrations.vllm.handoff import make_params  # noqa: E402
from kvstore.integrations.vllm.request_keys import request_hashes  # noqa: E402
from vllm_harness import BLOCK, Harness, plain_request  # noqa: E402
from vllm_harness import close_harness_stores  # noqa: E402,F401 - autouse: each test closes its stores


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("sched-model")))


def test_async_load_lands_in_the_kv_cache_then_everything_drains(model):
    h = Harness(model, sync_load_blocks=0)  # force the asynchronous path
    prompt = list(range(3, 3 + 4 * BLOCK + 5))
    h.seed_store(prompt, 4)
    request = h.add("r1", prompt)
    h.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    deadline = time.monotonic() + 10  # the first load also opens the connection to the store
    while request.status != RequestStatus.RUNNING and time.monotonic() < deadline:
        h.step()
        time.sleep(0.005)
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens >= 4 * BLOCK
    block_ids = h.scheduler.kv_cache_manager.get_block_ids("r1")[0]
    for i in range(4):
        assert torch.all(h.kv[block_ids[i]].reshape(-1) == float(i + 1))
    h.run_until_empty()
    assert h.worker.totals.data["loaded_blocks"] == 4


@pytest.mark.parametrize("mode", [{"sync_load_blocks": 0}, {"layerwise_load_blocks": 1}], ids=["async", "layer-by-layer"])
def test_failed_load_leads_to_recompute_not_garbage(model, mode):
    h = Harness(model, **mode)
    prompt = list(range(3, 3 + 3 * BLOCK + 2))
    h.seed_store(prompt, 3)
    daemon_store = h.store.daemon.store
    for _, slot in daemon_store.keys():  # the bytes rot under the index: every checksum must fail
        daemon_store.dram.region.buffer[slot.offset : slot.offset + 64] = bytes(64)
    request = h.add("r1", prompt)
    h.run_until_empty()
    assert request.is_finished() and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(h.errors) == 3 and h.worker.totals.data["load_failures"] == 3


def test_abort_during_load_frees_everything(model):
    h = Harness(model, sync_load_blocks=0)
    prompt = list(range(3, 3 + 2 * BLOCK + 3))
    h.seed_store(prompt, 2)
    gate = threading.Event()
    original = h.store.get_many

    def slow_get_many(*args, **kwargs):
        gate.wait(10)
        return original(*args, **kwargs)

    h.store.get_many = slow_get_many
    try:
        request = h.add("r1", prompt)
        h.step()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        h.scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
        h.step()
        assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < h.num_blocks - 1  # still held
        gate.set()
        h.run_until_empty()
    finally:
        h.store.get_many = original


def test_preemption_resumes_and_drains(model):
    h = Harness(model, num_blocks=12)
    prompts = {f"r{i}": list(range(10 + 50 * i, 10 + 50 * i + 4 * BLOCK)) for i in range(2)}
    requests = [h.add(rid, p, max_tokens=40) for rid, p in prompts.items()]
    h.run_until_empty()
    assert all(r.is_finished() for r in requests)
    assert sum(r.num_preemptions for r in requests) >= 1


def signed_params(h: Harness, prompt: list[int], blocks: int, **kwargs) -> dict:
    """Hand-off parameters as this deployment's prefill signs them for `prompt` (process-local
    store: this process's key)."""
    keys = request_hashes(h.chain, plain_request(prompt))
    return make_params(h.worker.handoff_key, h.chain.digest, prompt, blocks, blocks * BLOCK, keys[blocks - 1],
                       **kwargs)


def decode_request(h: Harness, req_id: str, prompt: list[int], params: dict, **kwargs) -> Request:
    return Request(req_id, prompt, SamplingParams(temperature=0, max_tokens=2, extra_args={"kv_transfer_params": params}),
                   None, block_hasher=h.block_hasher, **kwargs)


def wait_status(h: Harness, request: Request, status: RequestStatus, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while request.status != status and time.monotonic() < deadline and not request.is_finished():
        h.step()
        time.sleep(0.005)


def test_decode_waits_on_the_index_for_blocks_still_being_written(model):
    h = Harness(model, role="kv_consumer", process_local=True, remote_wait_s=10)
    prompt = list(range(21, 21 + 3 * BLOCK + 4))
    request = decode_request(h, "d1", prompt, signed_params(h, prompt, 3))
    h.scheduler.add_request(request)
    h.step()  # the scheduler asks once and parks the request; nothing is stored yet
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    writer = threading.Timer(0.5, h.seed_store, args=(prompt, 3))  # the prefill's saves land later
    writer.start()
    wait_status(h, request, RequestStatus.RUNNING)
    writer.join()
    assert h.worker.totals.data["loaded_blocks"] == 3 and not h.errors
    h.run_until_empty()


def test_a_handoff_whose_blocks_are_published_loads_inside_the_first_step(model):
    """A decode whose prefill's blocks are all in the index already (the common case: the prefill
    answered after its saves) loads them inside the step, as an ordinary small load: no
    WAITING_FOR_REMOTE_KVS round trip and no hop through the waiter and the load pool, each of
    which cost a GIL switch interval (5 ms) or a scheduler step. Kills: every hand-off loaded
    asynchronously (the demo's hand-off took 30-170 ms for 3 blocks of a tiny model)."""
    h = Harness(model, role="kv_consumer", process_local=True, remote_wait_s=10)
    prompt = list(range(71, 71 + 3 * BLOCK + 4))
    h.seed_store(prompt, 3)
    request = decode_request(h, "d1", prompt, signed_params(h, prompt, 3))
    h.scheduler.add_request(request)
    h.step()
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens >= 3 * BLOCK
    assert h.worker.totals.data["loaded_blocks"] == 3 and h.worker.totals.data.get("handoff_wait_seconds", 0) == 0
    h.run_until_empty()


def test_waiting_handoffs_never_hold_up_other_loads(model):
    """Hand-offs wait for their blocks off the load pool: three decodes whose prefill never
    delivers must not delay an ordinary load behind them. Kills: waiting on a load-pool thread
    (two threads: the ordinary load would start only when a hand-off's budget ran out)."""
    h = Harness(model, role="kv_both", process_local=True, remote_wait_s=30, sync_load_blocks=0)
    waiting = []
    for i in range(3):
        prompt = list(range(100 + 40 * i, 100 + 40 * i + 2 * BLOCK + 3))
        waiting.append(decode_request(h, f"d{i}", prompt, signed_params(h, prompt, 2)))
        h.scheduler.add_request(waiting[-1])
    h.step()
    assert h.worker._handoffs.waiting == 3
    ordinary = list(range(300, 300 + 2 * BLOCK + 5))
    h.seed_store(ordinary, 2)
    request = h.add("plain", ordinary)
    wait_status(h, request, RequestStatus.RUNNING)
    assert request.status == RequestStatus.RUNNING and h.worker._handoffs.waiting == 3
    assert h.worker.totals.data["loaded_blocks"] == 2
    for r in waiting:  # their prefill never delivers: abort them (they end at once, nothing loading)
        h.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    h.run_until_empty()
    assert h.worker._handoffs.waiting == 0


def test_producer_promises_blocks_only_to_remote_decode_prefills(model):
    h = Harness(model, role="kv_producer", process_local=True)
    prompt = list(range(31, 31 + 2 * BLOCK + 4))
    asked = Request("p1", prompt, SamplingParams(temperature=0, max_tokens=1,
                                                 extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
                    None, block_hasher=h.block_hasher)
    plain = Request("p2", prompt[::-1], SamplingParams(temperature=0, max_tokens=1), None, block_hasher=h.block_hasher)
    for r in (asked, plain):
        h.scheduler.add_request(r)
    h.run_until_empty()
    params = {o.request_id: o.kv_transfer_params for outs in h.outputs for eco in outs.values()
              for o in eco.outputs if o.finished}
    assert params["p1"]["kvstore"]["num_blocks"] == 2 and params["p1"]["kvstore"]["prompt_token_ids"] == prompt
    assert "kvstore" not in (params["p2"] or {})  # only the tier report (hits.py)


def test_handoff_params_not_signed_for_their_request_cannot_make_a_decode_wait(model):
    """Any API client can attach plausible kv_transfer_params (the fingerprint digest is no secret):
    without this deployment's MAC, fresh, for this very request (its last promised block's key),
    used once, they load only what the store holds and never wait. Each case has its own prompt, so
    vLLM's own prefix cache never answers for the connector. Kills: waiting on whatever parameters a
    request carries; no age check (the stale case); a MAC that does not bind the request's key
    (the foreign case: parameters signed for the same prompt under another salt); no one-time id (the replayed case)."""
    h = Harness(model, role="kv_consumer", process_local=True, remote_wait_s=30)
    connector = h.scheduler.connector
    prompts = [list(range(51 + 7 * i, 51 + 7 * i + 3 * BLOCK + 4)) for i in range(6)]  # prompts[4]: unused
    forged = make_params(None, h.chain.digest, prompts[0], 3, 3 * BLOCK)  # unsigned
    tampered = signed_params(h, prompts[1], 3)
    tampered["kvstore"]["num_tokens"] = 4 * BLOCK  # a signed body, changed
    stale = signed_params(h, prompts[2], 3, now=time.time() - 3600)
    foreign = signed_params(h, prompts[3], 3)  # signed for this prompt without a salt: the request has one
    replayed = signed_params(h, prompts[5], 3)
    first = decode_request(h, "first-use", prompts[5], replayed)
    h.scheduler.add_request(first)
    h.step()
    assert first.status == RequestStatus.WAITING_FOR_REMOTE_KVS and h.worker._handoffs.waiting == 1
    h.scheduler.finish_requests(["first-use"], RequestStatus.FINISHED_ABORTED)
    h.run_until_empty(seconds=10)
    h.scheduler.reset_prefix_cache()
    for i, params in enumerate((forged, tampered, stale, foreign, replayed)):
        prompt = prompts[5] if params is replayed else prompts[i]
        salt = {"cache_salt": "another-tenant"} if params is foreign else {}
        request = decode_request(h, f"d{i}", prompt, params, **salt)
        refused = connector.refused_handoffs
        h.scheduler.add_request(request)
        h.step()
        assert connector.refused_handoffs == refused + 1, i
        assert h.worker._handoffs.waiting == 0 and request.status != RequestStatus.WAITING_FOR_REMOTE_KVS, i
        h.run_until_empty(seconds=10)
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.worker.totals.data.get("loaded_blocks", 0) == 0


@pytest.mark.parametrize("where", ["store", "bookkeeping"])
def test_an_unexpected_error_in_an_async_load_still_reports_the_load(model, monkeypatch, where):
    """An async load that raises anything (not only the store's typed errors) must still tell vLLM
    it ended, with its blocks failed: else the request stays in WAITING_FOR_REMOTE_KVS for good,
    holding its blocks. Kills: catching only KVStoreError/OSError/RuntimeError/ValueError, and a
    load whose end is reported only when its bookkeeping succeeds."""
    h = Harness(model, sync_load_blocks=0)
    prompt = list(range(61, 61 + 3 * BLOCK + 2))
    h.seed_store(prompt, 3)

    def boom(*args, **kwargs):
        raise LookupError("an error nobody expected")

    monkeypatch.setattr(h.store if where == "store" else h.worker, "get_many" if where == "store" else "_account",
                        boom)
    request = h.add("r1", prompt)
    h.run_until_empty(seconds=15)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED  # recomputed, not stuck
    assert len(h.errors) == 3 and h.worker.totals.data["load_failures"] == 3
