"""kvstore ModelFingerprints from a vLLM config: everything that makes two engines' KV blocks
interchangeable (duck-typed, so it works across vLLM versions without importing vLLM).

Each (pipeline stage, tensor rank) stores its own blocks under its own fingerprint; the scheduler
asks about all of them. MLA keeps one latent cache replicated across TP ranks: one copy is stored,
under a fingerprint that names no TP rank. With hybrid KV cache groups each group is a namespace
of its own (group_fingerprints). What else decides the KV bytes of a model path — quantization,
hf_overrides (rope scaling, windows), the checkpoint's KV-scale scheme, the KV cache layout — goes
into the fingerprint's `revision` as a digest, so differently configured engines never share.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import xxhash

from ...errors import UnsupportedDeployment
from ...keys import ModelFingerprint
from .groups import CacheGroup, is_plain

# Block-outer, token-major: a block's bytes across K and V are one run per layer, so loads land
# with one op per layer and saves copy one slice. CPU's attention backend has a fixed layout.
GPU_KV_LAYOUT = "BLNHC"
# hf config keys that never change a KV byte (bookkeeping of the file, not of the model).
IGNORED_CONFIG_KEYS = ("transformers_version", "_commit_hash", "_name_or_path", "_attn_implementation_autoset",
                       "_attn_implementation_internal", "torch_dtype", "dtype")


def device_type(vllm_config: Any) -> str:
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))


def required_layout(vllm_config: Any) -> str | None:
    """The KV-cache layout the connector asks vLLM for (None: the platform's own)."""
    return None if device_type(vllm_config) == "cpu" else GPU_KV_LAYOUT


def resolved_layout(vllm_config: Any) -> str | None:
    """The layout vLLM resolved for this engine (None: not known yet)."""
    layout = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    return str(layout) if layout else None


def layout_name(vllm_config: Any, extra: dict) -> str:
    """The fingerprint's KV layout: the same on the scheduler and on every worker. It names the
    layout vLLM resolved (the bytes of a block follow it), else the one the connector asks for."""
    layout = resolved_layout(vllm_config) or required_layout(vllm_config)
    return str(extra.get("kv_layout", f"vllm-paged:{device_type(vllm_config)}" + (f":{layout}" if layout else "")))


def uses_mla(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def _jsonable(value: Any) -> Any:
    """A deterministic JSON-able form of a config value (dicts sorted, objects by their repr)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _jsonable(to_dict())
    if callable(value):  # a repr would hold a memory address: different in every process
        return f"callable {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


# Rope types whose values depend only on the checkpoint's config, never on the `max_position` vLLM
# passes (that only sizes the cos/sin cache). Any other type (longrope/su picks its long or short
# factors from max_model_len; dynamic NTK and YaRN derive their base or correction range from the
# max_position some models set to max_model_len) keys max_model_len too.
MAX_LEN_FREE_ROPE = (None, "default", "linear", "llama3")
# Architectures whose vLLM code reads max_model_len for what decides K and V: Llama 4's attention
# temperature tuning (on above 32k), MiniMax-M2's and PLaMo 3's rope length, Cohere's Compass
# rope length, DeepSeek-V3.2's sparse indexer (which tokens each layer attends to).
MAX_LEN_ARCHITECTURES = ("Llama4", "MiniMaxM2", "Plamo3", "CohereCompass", "DeepseekV32")


def rope_types(hf_dict: dict[str, Any]) -> set[str | None]:
    """Every rope type the model's config names (several where layer types have their own)."""
    found: set[str | None] = set()

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            if "rope_type" in value or "type" in value:
                found.add(str(value.get("rope_type") or value.get("type")))
            for inner in value.values():
                if isinstance(inner, dict):
                    visit(inner)

    for name in ("rope_scaling", "rope_parameters"):
        visit(hf_dict.get(name))
    return found


def keys_max_model_len(vllm_config: Any, hf_dict: dict[str, Any]) -> bool:
    """Whether vLLM's model code reads max_model_len to compute this model's K and V."""
    architectures = [str(a) for a in (hf_dict.get("architectures") or [])]
    if any(a.startswith(MAX_LEN_ARCHITECTURES) for a in architectures):
        return True
    return any(t not in MAX_LEN_FREE_ROPE for t in rope_types(hf_dict))


def config_facts(vllm_config: Any) -> dict[str, Any]:
    """What besides the model path decides the KV bytes: quantization, overrides, the model's
    config as loaded (rope settings, windows, sinks, the checkpoint's KV-scale scheme), skipped
    layers, multimodal processing options, and max_model_len where the model's code reads it."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    hf_dict = hf.to_dict() if hf is not None and callable(getattr(hf, "to_dict", None)) else {}
    hf_dict = {k: v for k, v in hf_dict.items() if k not in IGNORED_CONFIG_KEYS}
    full = getattr(model, "hf_config", None)
    full_dict = full.to_dict() if full is not None and callable(getattr(full, "to_dict", None)) else {}
    facts = {
        "quantization": getattr(model, "quantization", None),
        "hf_overrides": getattr(model, "hf_overrides", None),
        "hf_config": hf_dict,
        "kv_cache_dtype_skip_layers": sorted(getattr(cache, "kv_cache_dtype_skip_layers", None) or []),
    }
    mm_config = getattr(model, "multimodal_config", None)
    if mm_config is not None and getattr(mm_config, "mm_processor_kwargs", None):
        facts["mm_processor_kwargs"] = mm_config.mm_processor_kwargs
    if keys_max_model_len(vllm_config, {**full_dict, **hf_dict}):
        facts["max_model_len"] = int(getattr(model, "max_model_len", 0) or 0)
    return facts


def config_digest(vllm_config: Any) -> str:
    facts = json.dumps(_jsonable(config_facts(vllm_config)), sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(facts.encode())


def check_kv_scales(vllm_config: Any) -> None:
    """KV scales computed by each engine from its first batch make its quantized KV bytes its own:
    another engine would read them with other scales. Refused (vLLM 0.32 takes them from the
    checkpoint, which the config digest covers; versions with calculate_kv_scales compute them)."""
    cache = vllm_config.cache_config
    quantized = str(getattr(cache, "cache_dtype", "auto")) not in ("auto", "float16", "bfloat16", "float32")
    if quantized and bool(getattr(cache, "calculate_kv_scales", False) or
                          getattr(vllm_config.model_config, "calculate_kv_scales", False)):
        raise UnsupportedDeployment(
            "calculate_kv_scales computes each engine's KV scales from its own first batch, so its quantized KV "
            "cannot be shared: set calculate_kv_scales=False (scales from the checkpoint) or kv_cache_dtype=auto")


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
    revision = str(getattr(model, "revision", None) or "")
    return ModelFingerprint(
        model_id=str(model.model),
        revision=f"{revision}|config {config_digest(vllm_config)}",
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


def group_fingerprints(base: ModelFingerprint, groups: list[CacheGroup]) -> list[ModelFingerprint]:
    """One fingerprint per KV cache group: its index, kind and window in the layout name. A plain
    model (one full-attention group) keeps `base`."""
    if is_plain(groups):
        return [base]
    return [replace(base, kv_layout=f"{base.kv_layout}|{g.tag(len(groups))}") for g in groups]


def chain_fingerprint(base: ModelFingerprint, weights: str) -> ModelFingerprint:
    """The fingerprint block keys are chained from: the identity of the weights the engine runs
    (identity.weights_identity), so KV computed with other weights is never matched."""
    if not weights:
        raise ValueError("a key chain needs the identity of the weights it was computed with")
    return replace(base, cache_salt=f"{base.cache_salt}#weights {weights}")
