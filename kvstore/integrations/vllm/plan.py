"""Per-request block bookkeeping of the connector, free of vLLM types: which blocks to load,
which newly computed prompt blocks to save."""
from __future__ import annotations

import xxhash
from dataclasses import dataclass, field

from ...keys import ModelFingerprint, chain_hashes


def prompt_hashes(fingerprint: ModelFingerprint, prompt: list[int], cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the prompt's full blocks; a per-request cache salt starts its own chain."""
    parent = None
    if cache_salt:
        parent = xxhash.xxh3_128_digest(fingerprint.root_hash() + cache_salt.encode())
    return chain_hashes(fingerprint, prompt, parent=parent)


def loadable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full blocks that may come from outside: vLLM must still compute at least one prompt token."""
    return max(0, (prompt_tokens - 1) // block_size)


def common_prefix(a: list[int], b: list[int]) -> list[int]:
    """The longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


@dataclass
class RequestState:
    """What the scheduler-side connector remembers about one running request."""

    hashes: list[bytes]
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # prompt blocks before this index are saved or known to be stored
    tokens: list[int] = field(default_factory=list)  # the prompt (P/D parameters and KV events carry it)
    handoff: bool = False  # a prefill whose KV a remote decode instance will load

    def blocks_to_save(self, computed_tokens: int, block_size: int, stored) -> list[tuple[int, bytes]]:
        """(vLLM block id, hash) of prompt blocks that became full and are not in the store yet."""
        done = min(computed_tokens, self.prompt_tokens) // block_size
        done = min(done, len(self.hashes), len(self.block_ids))
        out = [(self.block_ids[i], self.hashes[i]) for i in range(self.saved_blocks, done) if not stored(self.hashes[i])]
        self.saved_blocks = max(self.saved_blocks, done)
        return out
