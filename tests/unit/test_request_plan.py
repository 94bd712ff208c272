"""The connector's per-request plan (no vLLM): which prompt blocks load and save, the partial one
included, in every KV cache group (a sliding-window group's dropped blocks are null)."""
from __future__ import annotations

from kvstore.integrations.vllm.groups import NULL_BLOCK, SLIDING, CacheGroup
from kvstore.integrations.vllm.plan import RequestState, longest_servable

B = 16


def state(prompt_tokens: int, tail: bool, groups: int = 1) -> RequestState:
    full = prompt_tokens // B
    return RequestState([bytes([i]) * 16 for i in range(full)], prompt_tokens,
                        block_ids=[list(range(100 * (g + 1), 100 * (g + 1) + full + 1)) for g in range(groups)],
                        tail=b"T" * 16 if tail else None)


def never(group: int, h: bytes) -> bool:
    return False


def test_loadable_blocks_cover_every_prompt_token_but_the_last():
    assert state(2 * B + 5, tail=True).load_blocks(B) == 3  # 2 full + the partial: 36 of 37 tokens
    assert state(2 * B + 5, tail=False).load_blocks(B) == 2  # no partial key: the full blocks only
    assert state(2 * B, tail=False).load_blocks(B) == 2  # the last full block gives its first 15 tokens
    assert state(2 * B + 1, tail=False).load_blocks(B) == 2  # a 1-token tail would give nothing
    assert state(3, tail=True).load_blocks(B) == 1


def test_the_partial_block_is_saved_only_once_the_whole_prompt_is_computed():
    s = state(2 * B + 5, tail=True)
    assert s.blocks_to_save(B, B, never) == [(0, 100, s.hashes[0])]
    assert s.blocks_to_save(2 * B + 4, B, never) == [(0, 101, s.hashes[1])]  # 4 of the 5 tail tokens: not yet
    assert s.blocks_to_save(2 * B + 5, B, never) == [(0, 102, b"T" * 16)]
    assert s.blocks_to_save(2 * B + 9, B, never) == []  # decode tokens never re-save it


def test_blocks_already_stored_are_not_saved_again():
    s = state(2 * B + 5, tail=True)
    stored = {s.hashes[0], b"T" * 16}
    assert s.blocks_to_save(2 * B + 5, B, lambda g, h: h in stored) == [(0, 101, s.hashes[1])]


def test_every_group_saves_its_own_blocks_but_never_a_null_one():
    s = state(3 * B, tail=False, groups=2)
    s.block_ids[1][0] = NULL_BLOCK  # the sliding-window group dropped its first block
    saves = s.blocks_to_save(3 * B, B, never)
    assert saves == [(0, 100, s.hashes[0]), (0, 101, s.hashes[1]), (1, 201, s.hashes[1]),
                     (0, 102, s.hashes[2]), (1, 202, s.hashes[2])]
    s.update_block_ids([[103], [203]], replace=False)  # a step appends blocks per group
    assert s.block_ids[0][-1] == 103 and s.block_ids[1][-1] == 203


def test_a_sliding_window_group_keeps_only_the_blocks_the_next_token_attends():
    window = CacheGroup(1, SLIDING, ("l1",), B, window=2 * B)
    # 5 blocks computed: the next token (80) attends 49..80, so blocks 3 and 4 stay, 0..2 are null.
    assert window.first_kept_block(5 * B) == 3
    assert window.first_kept_block(B) == 0
    assert CacheGroup(1, SLIDING, ("l1",), B, window=2 * B, retained=B).first_kept_block(5 * B) == 2


def test_the_longest_prefix_every_group_serves():
    assert longest_servable(0, 6, lambda k: k <= 4) == 4
    assert longest_servable(2, 6, lambda k: False) == 2  # nothing beyond what vLLM has
