"""Run one vLLM engine (single process) over prompts and print JSON results: used by the demo,
the tests and the TTFT benchmark to put engines in processes of their own.

    python -m kvstore.integrations.vllm.engine_run '{"model": PATH, "connector": {...} | null,
        "prompts": [[ids...], ...], "max_tokens": 8, "kv_transfer_params": [...] | null}'
"""
from __future__ import annotations

import json
import os
import sys
import time


def engine(model: str, connector: dict | None, kv_space_gib: int = 1):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if connector is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm.connector",
            kv_role=connector.get("role", "kv_both"), kv_connector_extra_config=connector.get("extra", {}),
            kv_load_failure_policy="recompute")  # a failed load costs a recompute, never a failed request
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=4096, max_num_seqs=4,
               max_num_batched_tokens=4096, disable_log_stats=True, **kwargs)


def connector_stats() -> dict:
    """What the worker-side connector of this process moved (single-process engines only)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        connector.flush_saves()  # saves run in the background: count them once they are stored
        return dict(connector.totals.data)
    except Exception:  # noqa: BLE001 - no connector in this engine
        return {}


def run(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = engine(spec["model"], spec.get("connector"))
    params = spec.get("kv_transfer_params") or [None] * len(spec["prompts"])
    results = []
    for prompt, transfer in zip(spec["prompts"], params):
        sampling = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), logprobs=0,
                                  extra_args={"kv_transfer_params": transfer} if transfer else None)
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", None) if metrics else None
        results.append({"tokens": list(out.outputs[0].token_ids), "logprob": out.outputs[0].cumulative_logprob,
                        "seconds": seconds, "ttft": ttft if ttft else seconds,
                        "kv_transfer_params": out.kv_transfer_params})
        if spec.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()  # the next prompt must not hit vLLM's own cache
    return {"results": results, "stats": connector_stats()}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
