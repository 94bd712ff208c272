"""A kvstore ModelFingerprint from a vLLM config: everything that makes two engines' KV blocks
interchangeable (duck-typed, so it works across vLLM versions without importing vLLM)."""
from __future__ import annotations

from typing import Any

from ...keys import ModelFingerprint


def fingerprint_from_vllm(vllm_config: Any, tp_rank: int = 0, extra: dict | None = None) -> ModelFingerprint:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    extra = extra or {}
    dtype = str(getattr(model, "dtype", "auto")).replace("torch.", "")
    kv_dtype = str(getattr(cache, "cache_dtype", "auto"))
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))
    return ModelFingerprint(
        model_id=str(model.model),
        revision=str(getattr(model, "revision", None) or ""),
        dtype=dtype if kv_dtype == "auto" else kv_dtype,
        block_size=int(cache.block_size),
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_size=int(model.get_head_size()),
        kv_layout=str(extra.get("kv_layout", f"vllm-paged:{device}")),
        tp_rank=int(tp_rank),
        tp_world_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        tokenizer_id=str(getattr(model, "tokenizer", "") or ""),
        adapter_id=str(extra.get("adapter_id", "")),
        tenant=str(extra.get("tenant", "")),
        cache_salt=str(extra.get("cache_salt", "")),
    )
