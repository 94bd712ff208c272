"""The tier report an engine's answer carries (kv_transfer_params["kvstore_hits"]) under vLLM's real
Scheduler (model outputs mocked): device (vLLM's own prefix cache), host, disk and p2p tokens that
sum to exactly the cached tokens vLLM itself reports for the request (its PrefillStats, the
`prompt_tokens_details.cached_tokens` of `--enable-prompt-tokens-details`)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vllm extra is part of the test install (scripts/install-test-deps.sh)")

from kvstore.integrations.vllm.hits import HITS_KEY  # noqa: E402
from kvstore.integrations.vllm.request_keys import request_hashes  # noqa: E402
from kvstore.integrations.vllm.tiny_model import build_tiny_model  # noqa: E402
from vllm_harness import BLOCK, Harness, plain_request  # noqa: E402
from vllm_harness import close_harness_stores  # noqa: E402,F401 - autouse: each test closes its stores


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("hits-model")))


def finished(h: Harness) -> dict[str, tuple[dict | None, int | None]]:
    """Each finished request's tier report and vLLM's own cached-token count for it."""
    params, cached = {}, {}
    for outs in h.outputs:
        for eco in outs.values():
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    cached[o.request_id] = o.prefill_stats.num_cached_tokens
                if o.finished:
                    params[o.request_id] = o.kv_transfer_params
    return {r: ((p or {}).get(HITS_KEY), cached.get(r)) for r, p in params.items()}


def test_the_tier_report_splits_exactly_what_vllm_counts_as_cached(model, tmp_path):
    """Kills: device hits left out (the split no longer sums to vLLM's cached tokens), NVMe hits
    reported as host, a report only when vLLM keeps statistics."""
    h = Harness(model, dram="256KiB", disk=str(tmp_path / "nvme"), disk_size="8MiB")
    h.scheduler.connector_prefix_cache_stats = None  # as with statistics off: vLLM never asks for sources
    cold = list(range(100, 100 + 3 * BLOCK + 4))
    h.seed_store(cold, 3)
    for i in range(6):  # newer blocks push the cold prompt's out of DRAM, down to the NVMe tier
        h.seed_store(list(range(1000 + 200 * i, 1000 + 200 * i + 3 * BLOCK)), 3)
    keys = request_hashes(h.chain, plain_request(cold))[:3]
    assert h.store.mirror.wait_until(
        lambda m: all({r.tier for r in m.lookup(h.fingerprint, k).values()} == {"nvme"} for k in keys), 10)
    hot = list(range(1000 + 200 * 5, 1000 + 200 * 5 + 3 * BLOCK))  # the last seeded: still in DRAM
    h.add("cold", cold)
    h.add("hot-head", hot[:BLOCK + 3])  # one block from the pool; vLLM then holds it itself
    h.run_until_empty()
    h.add("hot", hot + [5, 6, 7])  # its first block in vLLM's cache, the next two in the pool
    h.add("new", list(range(5000, 5000 + 2 * BLOCK)))
    h.run_until_empty()
    got = finished(h)
    assert got["cold"][0] == {"device": 0, "host": 0, "disk": 3 * BLOCK, "p2p": 0}
    assert got["hot-head"][0] == {"device": 0, "host": BLOCK, "disk": 0, "p2p": 0}
    assert got["hot"][0] == {"device": BLOCK, "host": 2 * BLOCK, "disk": 0, "p2p": 0}
    assert got["new"][0] == {"device": 0, "host": 0, "disk": 0, "p2p": 0}
    for rid, (hits, cached) in got.items():
        assert cached is not None and sum(hits.values()) == cached, (rid, hits, cached)
