"""Store keys for chunks of vLLM's tiered CPU offloading (kvstore as a secondary tier).

vLLM names an offloaded chunk by an `OffloadKey`: a block hash (of the tokens and the request's
extra keys) and the KV cache group's index. Nothing in it says which weights, config or layout
computed the bytes, so two engines that differ there would agree on the key and disagree on the
bytes. A chunk's store key therefore pairs:
- a fingerprint: kvstore's own for this engine (`fingerprint_from_vllm`: model, config digest,
  dtype, KV layout, block size, layers, heads, parallelism, tenant, cache salt), chained from the
  identity of the weights loaded (`chain_fingerprint`), with the chunk's geometry in its layout
  name (bytes per chunk, blocks per chunk, tokens per block of each group, the groups' layers, the
  block-hash algorithm);
- a hash: xxh3-128 of the fingerprint's root and the OffloadKey.
Two engines share a chunk only when all of that is equal.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

import xxhash

from ...keys import ModelFingerprint

KEY_DOMAIN = b"vllm-offload-chunk v1\0"


@dataclass(frozen=True)
class ChunkGeometry:
    """What decides the size and arrangement of a chunk's bytes in vLLM's CPU tier."""

    chunk_bytes: int  # one row of the CPU tier: every KV tensor's pages of the chunk, padded to a page
    blocks_per_chunk: int
    tokens_per_block: tuple[int, ...]  # per offloaded KV cache group
    group_layers: tuple[tuple[str, ...], ...]  # each group's layer names, in vLLM's order
    worker_kv_bytes_per_block: int
    hash_algo: str  # vLLM's prefix-caching hash: the OffloadKey's block-hash half

    def name(self) -> str:
        layers = xxhash.xxh3_64_hexdigest(json.dumps(self.group_layers).encode())
        tokens = ",".join(str(t) for t in self.tokens_per_block)
        return (f"vllm-offload-chunk {self.chunk_bytes}B {self.blocks_per_chunk}x[{tokens}] "
                f"{self.worker_kv_bytes_per_block}B/block layers {layers} hash {self.hash_algo}")


def chunk_fingerprint(base: ModelFingerprint, weights: str, geometry: ChunkGeometry) -> ModelFingerprint:
    """The fingerprint a tier's chunks are stored under: `base` (the engine's), the weights'
    identity and the chunk geometry."""
    if not weights:
        raise ValueError("a chunk key needs the identity of the weights it was computed with")
    if geometry.chunk_bytes <= 0 or geometry.blocks_per_chunk <= 0:
        raise ValueError(f"a chunk of {geometry.chunk_bytes} bytes and {geometry.blocks_per_chunk} blocks")
    return replace(base, kv_layout=f"{base.kv_layout}|{geometry.name()}",
                   cache_salt=f"{base.cache_salt}#weights {weights}")


def chunk_hash(fingerprint: ModelFingerprint, offload_key: bytes) -> bytes:
    """The 16-byte store hash of vLLM's OffloadKey under `fingerprint`."""
    return xxhash.xxh3_128_digest(fingerprint.root_hash() + KEY_DOMAIN + bytes(offload_key))
