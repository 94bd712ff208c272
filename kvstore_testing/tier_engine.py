"""Run one vLLM engine (one process) whose OffloadingConnector has kvstore as its secondary tier
(vLLM's tiered spec with host copies in place of its device kernel: benchmarks/offloading_peer.py)
over prompts, and print JSON: each prompt's output tokens and what the tier moved.

    python -m kvstore_testing.tier_engine '{"model": PATH, "metadata": "etcd://...", "prompts": [[ids...]],
        "max_tokens": 8, "tier": {...extra tier settings}, "settle": true}'

With "reset_to_version" (and the tier's "weight_version_file"), the version is then rewritten, vLLM's
cache reset with its connector, and the prompts run again ("after_reset": tier hits and loads since).
With "settle" (the default), after each prompt the engine keeps stepping (one-token requests of an unrelated prompt) until the
tier has stored or found held every full chunk of the prompt, so that the next engine finds them.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CPU_TIER_BYTES = 64 << 20
SETTLE_S = 60.0


def transfer_config(metadata: str, tier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The kv_transfer_config of an engine with kvstore as its OffloadingConnector's secondary tier."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "spec_name": "HostTieringOffloadingSpec", "spec_module_path": "benchmarks.offloading_peer",
                "cpu_bytes_to_use": CPU_TIER_BYTES,
                "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.integrations.vllm.offload_tier",
                                     "metadata": metadata, **(tier or {})}]}}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process: its tier readable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=2,
              max_num_batched_tokens=2048, disable_log_stats=True,
              kv_transfer_config=KVTransferConfig(**transfer_config(spec["metadata"], spec.get("tier"))))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    tier = scheduler.connector.connector_scheduler.manager.secondary_tiers[0]
    block = scheduler.cache_config.block_size
    sampling = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8))
    nudge = SamplingParams(temperature=0, max_tokens=1)
    outputs = []
    for i, prompt in enumerate(spec["prompts"]):
        out = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
        want = len(prompt) // block if spec.get("settle", True) else 0
        deadline = time.monotonic() + SETTLE_S
        while tier.totals["stored"] + tier.totals["already_held"] + tier.totals["failed_stores"] < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tier stored {tier.totals} of {want} chunks in {SETTLE_S} s")
            llm.generate([{"prompt_token_ids": [3 + i, 4, 5]}], nudge, use_tqdm=False)  # steps the engine
    result: dict[str, Any] = {}
    if spec.get("reset_to_version"):
        # An in-place weight update as an RL loop does it: the new version written where the tier
        # reads it, then vLLM's reset with its connector (which drains the tier), then the prompts again.
        with open(spec["tier"]["weight_version_file"], "w") as f:
            f.write(spec["reset_to_version"])
        before = dict(tier.totals)
        if not llm.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM refused the reset")
        again = [list(llm.generate([{"prompt_token_ids": p}], sampling, use_tqdm=False)[0].outputs[0].token_ids)
                 for p in spec["prompts"]]
        result["after_reset"] = {"tokens": again, "hits": tier.totals["hits"] - before["hits"],
                                 "loaded": tier.totals["loaded"] - before["loaded"]}
    return {**result, "tokens": outputs, "tier": dict(tier.totals), "block_size": block,
            "fingerprint": tier.fingerprint.digest,
            "cpu_tier_file": f"/dev/shm/vllm_offload_{scheduler.vllm_config.kv_transfer_config.engine_id}.mmap"}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
