"""kvstore ModelFingerprints from a vLLM config: everything that makes two engines' KV blocks
interchangeable (duck-typed, so it works across vLLM versions without importing vLLM).

Each (pipeline stage, tensor rank) stores its own blocks under its own fingerprint; the scheduler
asks about all of them. MLA keeps one latent cache replicated across TP ranks: one copy is stored,
under a fingerprint that names no TP rank.
"""
from __future__ import annotations

from typing import Any

from ...keys import ModelFingerprint


# Block-outer, token-major: a block's bytes across K and V are one run per layer, so loads land
# with one op per layer and saves copy one slice. CPU's attention backend has a fixed layout.
GPU_KV_LAYOUT = "BLNHC"


def device_type(vllm_config: Any) -> str:
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))


def required_layout(vllm_config: Any) -> str | None:
    """The KV-cache layout the connector asks vLLM for (None: the platform's own)."""
    return None if device_type(vllm_config) == "cpu" else GPU_KV_LAYOUT


def layout_name(vllm_config: Any, extra: dict) -> str:
    """The fingerprint's KV layout: the same on the scheduler and on every worker."""
    layout = required_layout(vllm_config)
    return str(extra.get("kv_layout", f"vllm-paged:{device_type(vllm_config)}" + (f":{layout}" if layout else "")))


def uses_mla(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def _stage_layers(model: Any, pp_rank: int, pp_size: int) -> tuple[int, int]:
    total = int(model.get_total_num_hidden_layers())
    try:
        from vllm.distributed.utils import get_pp_indices  # honours VLLM_PP_LAYER_PARTITION

        return get_pp_indices(total, pp_rank, pp_size)
    except ImportError:  # an even split, vLLM's default
        per, rest = divmod(total, pp_size)
        start = pp_rank * per + min(pp_rank, rest)
        return start, start + per + (1 if pp_rank < rest else 0)


def fingerprint_from_vllm(vllm_config: Any, tp_rank: int = 0, extra: dict | None = None,
                          pp_rank: int = 0) -> ModelFingerprint:
    """The fingerprint of one rank's KV blocks."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    extra = extra or {}
    dtype = str(getattr(model, "dtype", "auto")).replace("torch.", "")
    kv_dtype = str(getattr(cache, "cache_dtype", "auto"))
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1))
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1))
    if uses_mla(vllm_config):
        tp_rank, tp_size = 0, 1  # the latent cache is the same on every TP rank
    start, end = _stage_layers(model, pp_rank, pp_size) if pp_size > 1 else (0, int(model.get_total_num_hidden_layers()))
    return ModelFingerprint(
        model_id=str(model.model),
        revision=str(getattr(model, "revision", None) or ""),
        dtype=dtype if kv_dtype == "auto" else kv_dtype,
        block_size=int(cache.block_size),
        num_layers=end - start,
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_size=int(model.get_head_size()),
        kv_layout=layout_name(vllm_config, extra),
        tp_rank=int(tp_rank),
        tp_world_size=tp_size,
        tokenizer_id=str(getattr(model, "tokenizer", "") or ""),
        adapter_id=str(extra.get("adapter_id", "")),
        tenant=str(extra.get("tenant", "")),
        cache_salt=str(extra.get("cache_salt", "")),
        pp_rank=int(pp_rank),
        pp_world_size=pp_size,
        layer_start=int(start) if pp_size > 1 else 0,
    )


def all_rank_fingerprints(vllm_config: Any, extra: dict | None = None) -> list[ModelFingerprint]:
    """One fingerprint per rank that stores blocks: the scheduler's lookups must find them all."""
    parallel = vllm_config.parallel_config
    tp_size = 1 if uses_mla(vllm_config) else int(getattr(parallel, "tensor_parallel_size", 1))
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1))
    return [fingerprint_from_vllm(vllm_config, tp, extra, pp) for pp in range(pp_size) for tp in range(tp_size)]
