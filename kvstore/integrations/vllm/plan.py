"""Per-request block bookkeeping of the connector, free of vLLM types: which blocks to load,
which newly computed prompt blocks to save, in every KV cache group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import xxhash

from ...keys import ModelFingerprint, chain_hashes
from ...prefix import loadable_tokens
from .groups import NULL_BLOCK

# (KV cache group, vLLM block id, store key): one block of one group to load or save.
GroupBlock = tuple[int, int, bytes]


def prompt_hashes(fingerprint: ModelFingerprint, prompt: list[int], cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the prompt's full blocks; a per-request cache salt starts its own chain."""
    parent = None
    if cache_salt:
        parent = xxhash.xxh3_128_digest(fingerprint.root_hash() + cache_salt.encode())
    return chain_hashes(fingerprint, prompt, parent=parent)


def common_prefix(a: list[int], b: list[int]) -> list[int]:
    """The longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def longest_servable(first: int, upper: int, servable: Callable[[int], bool]) -> int:
    """The largest block count k in (first, upper] whose load every group can serve
    (`servable(k)`), else `first` (nothing beyond what vLLM has)."""
    for k in range(upper, first, -1):
        if servable(k):
            return k
    return first


@dataclass
class RequestState:
    """What the scheduler-side connector remembers about one running request."""

    hashes: list[bytes]  # keys of the prompt's full blocks
    prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group, by block position
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

    def update_block_ids(self, ids: Sequence[Sequence[int]], replace: bool) -> None:
        """vLLM's block table per group: the whole table (`replace`), or blocks appended this step."""
        if replace or not self.block_ids:
            self.block_ids = [list(g) for g in ids]
        else:
            for table, new in zip(self.block_ids, ids):
                table.extend(new)

    def blocks_to_save(self, computed_tokens: int, block_size: int,
                       stored: Callable[[int, bytes], bool]) -> list[GroupBlock]:
        """(group, vLLM block id, key) of prompt blocks that became complete and are not in the
        store yet: full blocks as they fill, the partial last block once the whole prompt is
        computed. A group's null entries (blocks a sliding window dropped) have nothing to save."""
        keys = self.keys
        done = min(computed_tokens, self.prompt_tokens) // block_size
        if self.tail is not None and computed_tokens >= self.prompt_tokens:
            done += 1
        done = min(done, len(keys), min((len(t) for t in self.block_ids), default=0))
        out = [(group, table[i], keys[i]) for i in range(self.saved_blocks, done)
               for group, table in enumerate(self.block_ids)
               if table[i] != NULL_BLOCK and not stored(group, keys[i])]
        self.saved_blocks = max(self.saved_blocks, done)
        return out
