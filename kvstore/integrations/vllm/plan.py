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


def loadable_tokens(prompt_tokens: int) -> int:
    """Prompt tokens whose KV may come from outside: all but the last, which vLLM computes for logits."""
    return max(0, prompt_tokens - 1)


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

    hashes: list[bytes]  # keys of the prompt's full blocks
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # prompt blocks (the partial one included) before this index are saved or stored
    tokens: list[int] = field(default_factory=list)  # the prompt (P/D parameters and KV events carry it)
    handoff: bool = False  # a prefill whose KV a remote decode instance will load
    tail: bytes | None = None  # key of the prompt's trailing partial block (saved once the prompt is computed)

    @property
    def keys(self) -> list[bytes]:
        """One key per prompt block: the full blocks', then the partial block's when there is one."""
        return self.hashes + [self.tail] if self.tail is not None else self.hashes

    def load_blocks(self, block_size: int) -> int:
        """Blocks that hold the loadable tokens: the partial last one counts when it has a key."""
        keys = len(self.keys)
        return min(-(-loadable_tokens(self.prompt_tokens) // block_size), keys)

    def blocks_to_save(self, computed_tokens: int, block_size: int, stored) -> list[tuple[int, bytes]]:
        """(vLLM block id, key) of prompt blocks that became complete and are not in the store yet:
        full blocks as they fill, the partial last block once the whole prompt is computed."""
        keys = self.keys
        done = min(computed_tokens, self.prompt_tokens) // block_size
        if self.tail is not None and computed_tokens >= self.prompt_tokens:
            done += 1
        done = min(done, len(keys), len(self.block_ids))
        out = [(self.block_ids[i], keys[i]) for i in range(self.saved_blocks, done) if not stored(keys[i])]
        self.saved_blocks = max(self.saved_blocks, done)
        return out
