"""Block keys of a vLLM request: our deterministic token chain plus everything vLLM's own block
hash covers (LoRA adapter, multimodal inputs, prompt embeddings, cache salt).

vLLM's `request.block_hashes` cannot be used as store keys: its chain starts from a random seed
unless PYTHONHASHSEED is set, so two processes never agree. Instead the same per-block extra keys
vLLM computes are folded into our xxh3 chain, so two adapters or two images behind the same
placeholder tokens never share KV. Two of vLLM's extra keys name rather than identify, which is
enough inside one engine but not for a store every engine shares for as long as it keeps blocks:
a LoRA adapter's name and path (retrained in place, it keeps both), and a multimodal item's
identifier (a client's `multi_modal_uuids` entry, or a per-request name when vLLM's caches are
off). Here an adapter adds its weights' digest, and an item the digest of its processed inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ...keys import ModelFingerprint, chain_hashes, encode_extra_keys, tail_hash
from .identity import AdapterIdentities


@dataclass
class KeySources:
    """How a request's extras are bound to content: each LoRA adapter by its weights' digest, each
    multimodal item by a digest of its processed inputs. `trust_mm_identifiers` (the operator's
    opt-in) keys an item whose inputs the scheduler does not hold by vLLM's identifier, which may be
    a client's `multi_modal_uuids` entry or a per-request name: only safe where every identifier
    is known to name one content."""

    adapters: AdapterIdentities = field(default_factory=AdapterIdentities)
    trust_mm_identifiers: bool = False


_DEFAULT_SOURCES = KeySources()


def _digest_nested(hasher: Any, value: Any) -> bool:
    """Feed a processed multimodal input into `hasher`; False where part of it is missing."""
    import torch

    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return True
    if isinstance(value, (list, tuple)):
        hasher.update(f"L{len(value)}".encode())
        return all(_digest_nested(hasher, v) for v in value)
    hasher.update(encode_extra_keys(value if isinstance(value, (str, int, float, bytes, bool)) else repr(value)))
    return True


def mm_content_digest(feature: Any) -> str | None:
    """A digest of one multimodal item's processed inputs (what the model reads), or None where the
    scheduler does not hold them (vLLM's caches may leave them out of the request)."""
    import blake3

    data = getattr(feature, "data", None)
    if data is None:
        return None
    hasher = blake3.blake3()
    hasher.update(f"kvstore mm v1 {getattr(feature, 'modality', '')}\0".encode())
    for key in sorted(data):
        hasher.update(encode_extra_keys(str(key)))
        if not _digest_nested(hasher, getattr(data[key], "data", None)):
            return None
    return hasher.hexdigest()[:32]


def _mm_digests(request: Any, trusted: bool) -> dict[str, str | None]:
    """identifier -> the key part standing for it (None: the item cannot be keyed)."""
    out: dict[str, str | None] = {}
    for feature in getattr(request, "mm_features", None) or ():
        digest = mm_content_digest(feature)
        part = f"content {digest}" if digest else (f"id {feature.identifier}" if trusted else None)
        ident = feature.identifier
        # One identifier naming two contents (a reused uuid inside one request) keys neither.
        out[ident] = part if out.get(ident, part) == part else None
    return out


def _bind(keys: tuple, request: Any, sources: KeySources, mm: dict[str, str | None] | None) -> tuple | None:
    """vLLM's extra keys of one block with adapters and multimodal items bound to their content;
    None when one of them cannot be."""
    out = []
    for key in keys:
        if isinstance(key, tuple) and key and key[0] == "lora":
            digest = sources.adapters.identity(request.lora_request)
            if digest is None:
                return None
            key = (*key, f"weights {digest}")
        elif isinstance(key, tuple) and key and key[0] == "mm":
            part = (mm or {}).get(key[1])
            if part is None:
                return None
            key = ("mm", part, *key[2:])
        out.append(key)
    return tuple(out)


def block_extra_keys(request: Any, block_size: int, num_tokens: int,
                     sources: KeySources | None = None) -> list[bytes | None]:
    """Per block of the first `num_tokens` (the last one may be partial), the encoded extra keys
    vLLM hashes with it (None where there are none), adapters and multimodal items bound to their
    content. The list stops before the first block whose extras cannot be bound: that block and
    every later one have no key (they are neither saved nor loaded)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    sources = sources or _DEFAULT_SOURCES
    mm = _mm_digests(request, sources.trust_mm_identifiers) if getattr(request, "mm_features", None) else None
    out: list[bytes | None] = []
    mm_index = 0
    for start in range(0, num_tokens, block_size):
        keys, mm_index = generate_block_hash_extra_keys(request, start, min(start + block_size, num_tokens), mm_index)
        if keys:
            keys = _bind(tuple(keys), request, sources, mm)
            if keys is None:
                break
        out.append(encode_extra_keys(keys) if keys else None)
    return out


def request_hashes(fingerprint: ModelFingerprint, request: Any, tokens: Sequence[int] | None = None,
                   sources: KeySources | None = None) -> list[bytes]:
    """Store keys of the request's full prompt blocks (`tokens` defaults to its prompt)."""
    return request_keys(fingerprint, request, tokens, sources)[0]


def request_keys(fingerprint: ModelFingerprint, request: Any, tokens: Sequence[int] | None = None,
                 sources: KeySources | None = None) -> tuple[list[bytes], bytes | None]:
    """(keys of the full blocks, key of the trailing partial block or None) of `tokens`; blocks
    from the first whose extras cannot be bound to content on have no key."""
    tokens = list(request.prompt_token_ids or []) if tokens is None else list(tokens)
    size = fingerprint.block_size
    extras = block_extra_keys(request, size, len(tokens), sources)
    keyed = len(extras)  # blocks (the partial one included) whose extras could be bound
    full = chain_hashes(fingerprint, tokens[:min(keyed, len(tokens) // size) * size], extras=extras)
    if len(tokens) % size == 0 or keyed <= len(tokens) // size:
        return full, None
    return full, tail_hash(fingerprint, tokens[len(full) * size:], full[-1] if full else None, extras[-1])
