"""kvstore: a KV-cache store for disaggregated LLM serving.

    store = kvstore.open("memory://", dram="2GiB", disk="/mnt/nvme/kv", fingerprint=fp)
    store.put(block_hash, tensor); store.get(block_hash, out)
"""
from .client import AsyncClient, Client
from .keys import ModelFingerprint, chain_hashes, external_hashes
from .library import open
from .sizes import parse_size

__all__ = ["AsyncClient", "Client", "ModelFingerprint", "chain_hashes", "external_hashes", "open", "parse_size"]
