"""How much of a prompt an engine may take from the store: all of it but the last token, which the
engine computes itself for the next token's logits. The connector plans its loads by this, and the
stand-in engines of the fleet, which schedule as vLLM does, by the same rule."""
from __future__ import annotations


def loadable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full blocks that may come from outside: vLLM must still compute at least one prompt token."""
    return max(0, (prompt_tokens - 1) // block_size)


def loadable_tokens(prompt_tokens: int) -> int:
    """Prompt tokens whose KV may come from outside: all but the last, which vLLM computes for logits."""
    return max(0, prompt_tokens - 1)
