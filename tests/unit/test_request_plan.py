"""The connector's per-request plan (no vLLM): which prompt blocks load and save, the partial one included."""
from __future__ import annotations

from kvstore.integrations.vllm.plan import RequestState

B = 16


def state(prompt_tokens: int, tail: bool) -> RequestState:
    full = prompt_tokens // B
    return RequestState([bytes([i]) * 16 for i in range(full)], prompt_tokens,
                        block_ids=list(range(100, 100 + full + 1)), tail=b"T" * 16 if tail else None)


def test_loadable_blocks_cover_every_prompt_token_but_the_last():
    assert state(2 * B + 5, tail=True).load_blocks(B) == 3  # 2 full + the partial: 36 of 37 tokens
    assert state(2 * B + 5, tail=False).load_blocks(B) == 2  # no partial key: the full blocks only
    assert state(2 * B, tail=False).load_blocks(B) == 2  # the last full block gives its first 15 tokens
    assert state(2 * B + 1, tail=False).load_blocks(B) == 2  # a 1-token tail would give nothing
    assert state(3, tail=True).load_blocks(B) == 1


def test_the_partial_block_is_saved_only_once_the_whole_prompt_is_computed():
    s = state(2 * B + 5, tail=True)
    never = lambda h: False  # noqa: E731
    assert s.blocks_to_save(B, B, never) == [(100, s.hashes[0])]
    assert s.blocks_to_save(2 * B + 4, B, never) == [(101, s.hashes[1])]  # 4 of the 5 tail tokens: not yet
    assert s.blocks_to_save(2 * B + 5, B, never) == [(102, b"T" * 16)]
    assert s.blocks_to_save(2 * B + 9, B, never) == []  # decode tokens never re-save it


def test_blocks_already_stored_are_not_saved_again():
    s = state(2 * B + 5, tail=True)
    stored = {s.hashes[0], b"T" * 16}
    assert s.blocks_to_save(2 * B + 5, B, stored.__contains__) == [(101, s.hashes[1])]
