"""Block keys, both kinds an engine deals in.

vLLM's own prefix-cache hashes (what its KV events carry): with the default
`--prefix-caching-hash-algo sha256`, each full block's hash is sha256 of the pickled
`(parent hash, block token ids, extra keys)`, the first block's parent being `NONE_HASH` =
sha256 of the pickled seed (`PYTHONHASHSEED` when set, else "vllm-none-hash"); events publish
the low 64 bits of the big-endian digest as an int (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the
default). Extra keys are tagged, e.g. `(("cache_salt", salt),)` on a salted prompt's first block.

The store's keys are the kvstore connector's: our xxh3 chain over the same blocks under the
engine's fingerprint (`kvstore.keys.chain_hashes`), the same extra keys folded in, and a tail
key for the prompt's trailing partial block (`kvstore.keys.tail_hash`)."""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Sequence

from kvstore.keys import ModelFingerprint, chain_hashes, encode_extra_keys, tail_hash

DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The parent of every chain's first block."""
    return _sha256(seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED))


def salt_keys(cache_salt: str | None) -> tuple | None:
    """The extra keys vLLM hashes with a salted prompt's first block."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def vllm_block_hashes(tokens: Sequence[int], block_size: int, parent: bytes | None, first_block: int,
                      root: bytes, cache_salt: str | None = None) -> list[bytes]:
    """vLLM's hashes of the full blocks of `tokens`, which start at block index `first_block`
    behind `parent` (None: the chain's start)."""
    out = []
    previous = parent if parent is not None else root
    for i, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        extra = salt_keys(cache_salt) if first_block + i == 0 else None
        previous = _sha256((previous, tuple(tokens[start:start + block_size]), extra))
        out.append(previous)
    return out


def external(block_hash: bytes) -> int:
    """A hash as KV events publish it (`maybe_convert_block_hash`)."""
    return int.from_bytes(block_hash, "big") & _MASK64


def event_extra_keys(cache_salt: str | None) -> tuple | None:
    """The first block's extra keys as events publish them (untagged: the bare salt)."""
    return (cache_salt,) if cache_salt else None


def store_keys(fingerprint: ModelFingerprint, tokens: Sequence[int], cache_salt: str | None = None,
               partial: bool = True) -> tuple[list[bytes], bytes | None]:
    """(keys of the full blocks, key of the trailing partial block) as the connector makes them;
    the partial block gets a key only when it holds at least 2 tokens (`partial_blocks`)."""
    extras = [encode_extra_keys(salt_keys(cache_salt))] if cache_salt else None
    full = chain_hashes(fingerprint, tokens, extras=extras)
    size = fingerprint.block_size
    rest = len(tokens) % size
    if not partial or rest < 2:
        return full, None
    extra = extras[0] if extras and not full else None
    return full, tail_hash(fingerprint, tokens[len(full) * size:], full[-1] if full else None, extra)
