"""Run one vLLM engine (single process) over prompts and print JSON results: used by the tests and
benchmarks to put engines in processes of their own (from a checkout; not part of the product).

    python -m kvstore_testing.engine_run '{"model": PATH, "connector": {...} | null,
        "prompts": [[ids...], ...], "max_tokens": 8, "kv_transfer_params": [...] | null,
        "loras": [{"name": "a", "id": 1, "path": DIR} | null, ...] | null,
        "engine": {"max_model_len": 4096, "disable_hybrid_kv_cache_manager": false, ...}}'

The result's "engine" says what vLLM made of the model: whether its hybrid KV cache manager is on,
its KV cache groups (kind, window, layers) and the KV capacity it reports (tokens, concurrency).
"""
from __future__ import annotations

import json
import sys
import time

from kvstore.integrations.vllm.local_engine import engine


def engine_info(llm) -> dict:
    """What vLLM made of the model (single-process engines): the hybrid KV cache manager's state,
    the KV cache groups, the KV capacity it reports."""
    config = llm.llm_engine.vllm_config
    info = {"hybrid_kv_cache_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager,
            "kv_cache_size_tokens": config.cache_config.kv_cache_size_tokens,
            "max_concurrency": config.cache_config.kv_cache_max_concurrency,
            "max_model_len": config.model_config.max_model_len}
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        info["num_blocks"] = scheduler.kv_cache_config.num_blocks
        info["groups"] = [{"kind": get_kv_cache_spec_kind(g.kv_cache_spec).value, "layers": len(g.layer_names),
                           "window": get_kv_cache_spec_sliding_window(g.kv_cache_spec)}
                          for g in scheduler.kv_cache_config.kv_cache_groups]
    except AttributeError:  # a multi-process engine: the scheduler lives elsewhere
        pass
    return info


def worker_connector():
    """The worker-side connector of this process (single-process engines), or None: no connector in
    this engine, or it lives in another process."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()
    except Exception:  # noqa: BLE001 - vLLM asserts when no transfer group was set up
        return None


def flush_saves() -> None:
    """Wait for the connector's background saves; nothing to wait for without ours."""
    flush = getattr(worker_connector(), "flush_saves", None)
    if flush is not None and not flush():
        raise RuntimeError("the kvstore connector's background saves were still running after 30 s")


def connector_stats() -> dict:
    """What the worker-side connector of this process moved, once its saves are stored."""
    flush_saves()
    totals = getattr(worker_connector(), "totals", None)
    return dict(totals.data) if totals is not None else {}


def _lora_request(lora: dict | None):
    if not lora:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora["name"], int(lora["id"]), lora["path"])


def run(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = engine(spec["model"], spec.get("connector"), **spec.get("engine", {}))
    params = spec.get("kv_transfer_params") or [None] * len(spec["prompts"])
    loras = spec.get("loras") or [None] * len(spec["prompts"])
    results = []
    for prompt, transfer, lora in zip(spec["prompts"], params, loras):
        sampling = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), logprobs=0,
                                  extra_args={"kv_transfer_params": transfer} if transfer else None)
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False,
                           lora_request=_lora_request(lora))[0]
        seconds = time.perf_counter() - started
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", None) if metrics else None
        results.append({"tokens": list(out.outputs[0].token_ids), "logprob": out.outputs[0].cumulative_logprob,
                        "seconds": seconds, "ttft": ttft if ttft else seconds,
                        "kv_transfer_params": out.kv_transfer_params})
        if spec.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()  # the next prompt must not hit vLLM's own cache
        flush_saves()  # and finds what this one saved, however late the background writer ran
    return {"results": results, "stats": connector_stats(), "engine": engine_info(llm)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
