"""vLLM's KV cache groups as the connector stores them (pure: no vLLM import).

With vLLM's hybrid KV cache manager (HMA) a model's layers fall into groups, one block table
each: full attention, sliding-window attention (gpt-oss, Gemma 3), MLA. A store block is one
vLLM block of one group (its layers on this rank), so each group is its own key namespace.
A sliding-window group keeps only the blocks inside the window of the next token: vLLM puts
the null block (id 0) in the block table for the ones it dropped, and a load restores only the
kept ones. Everything else (Mamba/SSM state, chunked-local attention, sinks, cross-attention)
is refused at start-up: the connector cannot prove a restored state exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedDeployment

# vLLM's block pool reserves block 0 as the null block: table entries a group does not hold.
NULL_BLOCK = 0

FULL, MLA, SLIDING = "full_attention", "mla_attention", "sliding_window"
SUPPORTED = (FULL, MLA, SLIDING)

# What a user sets when a group kind cannot be stored: said at start-up, never a silent wrong load.
REMEDY = {
    "mamba": "kvstore cannot save or restore Mamba/SSM/linear-attention state exactly (vLLM keeps it only at "
             "chosen positions, in a layout of its own): serve this model without the kvstore connector (drop "
             "--kv-transfer-config)",
    "chunked_local_attention": "start vLLM with --disable-hybrid-kv-cache-manager: chunked-local layers then keep "
                               "every token, which kvstore stores exactly",
    "sliding_window_mla": "start vLLM with --disable-hybrid-kv-cache-manager (sliding-window MLA is not supported)",
}
DEFAULT_REMEDY = ("start vLLM with --disable-hybrid-kv-cache-manager if the model runs without it, or serve it "
                  "without the kvstore connector")


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group: its index, kind (vLLM's KVCacheSpecKind value) and geometry."""

    index: int
    kind: str
    layers: tuple[str, ...]
    block_size: int
    window: int | None = None  # sliding window in tokens
    retained: int = 0  # tokens vLLM keeps below the window (multi-token prediction)

    def first_kept_block(self, tokens: int) -> int:
        """The first block vLLM keeps once `tokens` tokens are computed (the next token attends
        tokens[tokens - window + 1:]); the ones before are null in the block table."""
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1 - self.retained) // self.block_size

    def tag(self, count: int) -> str:
        """What names this group in a fingerprint: position, kind, window, block size."""
        window = f" window {self.window}" if self.window is not None else ""
        return f"group {self.index}/{count} {self.kind}{window} block {self.block_size}"


def check_groups(groups: list[CacheGroup], unsupported: dict[int, str], block_size: int) -> None:
    """Refuse what the connector cannot store exactly; `unsupported` maps group index -> vLLM kind."""
    for index, kind in sorted(unsupported.items()):
        raise UnsupportedDeployment(
            f"KV cache group {index} is {kind}, which kvstore does not store (it stores full, sliding-window and "
            f"MLA attention): {REMEDY.get(kind, DEFAULT_REMEDY)}")
    sizes = {g.block_size for g in groups}
    if sizes and sizes != {block_size}:
        raise UnsupportedDeployment(
            f"the KV cache groups use block sizes {sorted(sizes)}, not the one block size {block_size} kvstore keys "
            "blocks by: start vLLM with --disable-hybrid-kv-cache-manager")


def is_plain(groups: list[CacheGroup]) -> bool:
    """One full-attention (or MLA) group: the layout every engine had before hybrid groups, whose
    fingerprints stay as they were."""
    return len(groups) == 1 and groups[0].kind in (FULL, MLA)
