"""Block keys of a vLLM request: our deterministic token chain plus everything vLLM's own block
hash covers (LoRA adapter, multimodal inputs, prompt embeddings, cache salt).

vLLM's `request.block_hashes` cannot be used as store keys: its chain starts from a random seed
unless PYTHONHASHSEED is set, so two processes never agree. Instead the same per-block extra keys
vLLM computes are folded into our xxh3 chain, so two adapters or two images behind the same
placeholder tokens never share KV.
"""
from __future__ import annotations

from typing import Any, Sequence

from ...keys import ModelFingerprint, chain_hashes, tail_hash


def encode_extra_keys(keys: Any) -> bytes:
    """Deterministic bytes for one block's extra keys (nested tuples of str/bytes/int/None)."""
    if keys is None:
        return b"N"
    if isinstance(keys, bool):
        return b"T" if keys else b"F"
    if isinstance(keys, int):
        return b"I" + str(keys).encode() + b";"
    if isinstance(keys, str):
        raw = keys.encode()
        return b"S" + len(raw).to_bytes(4, "little") + raw
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
        return b"B" + len(raw).to_bytes(4, "little") + raw
    if isinstance(keys, (tuple, list)):
        return b"(" + b"".join(encode_extra_keys(k) for k in keys) + b")"
    if isinstance(keys, float):
        return b"D" + repr(keys).encode() + b";"
    raise TypeError(f"cannot encode a block extra key of type {type(keys).__name__}")


def block_extra_keys(request: Any, block_size: int, num_tokens: int) -> list[bytes | None]:
    """Per block of the first `num_tokens` (the last one may be partial), the encoded extra keys
    vLLM hashes with it (None where there are none)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    out: list[bytes | None] = []
    mm_index = 0
    for start in range(0, num_tokens, block_size):
        keys, mm_index = generate_block_hash_extra_keys(request, start, min(start + block_size, num_tokens), mm_index)
        out.append(encode_extra_keys(keys) if keys else None)
    return out


def request_hashes(fingerprint: ModelFingerprint, request: Any, tokens: Sequence[int] | None = None) -> list[bytes]:
    """Store keys of the request's full prompt blocks (`tokens` defaults to its prompt)."""
    return request_keys(fingerprint, request, tokens)[0]


def request_keys(fingerprint: ModelFingerprint, request: Any,
                 tokens: Sequence[int] | None = None) -> tuple[list[bytes], bytes | None]:
    """(keys of the full blocks, key of the trailing partial block or None) of `tokens`."""
    tokens = list(request.prompt_token_ids or []) if tokens is None else list(tokens)
    size = fingerprint.block_size
    extras = block_extra_keys(request, size, len(tokens))
    full = chain_hashes(fingerprint, tokens, extras=extras)
    if len(tokens) % size == 0:
        return full, None
    return full, tail_hash(fingerprint, tokens[len(full) * size:], full[-1] if full else None, extras[-1])
