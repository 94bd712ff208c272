"""`kvstore demo` compares like with like: every engine first runs the same warm-up, the twin of every
prompt of the demo (same lengths, calls and shared-prefix structure, no prefix shared with them),
and each row says what its TTFT includes. (The demo itself runs real vLLM: `kvstore demo`.)"""
from __future__ import annotations

from kvstore.integrations.vllm.demo import BLOCK, ROUNDS, Row, demo_steps, rounds, warmup_twin


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_warmup_twins_match_the_measured_prompts_and_share_no_prefix_with_them():
    shared, handoff = demo_steps()
    steps = shared + handoff
    twins, measured = warmup_twin(steps), rounds(steps)
    assert len(measured) == ROUNDS * len(steps)
    assert [len(t.prompt) for t in twins] == [len(s.prompt) for s in steps]
    assert [t.remote_decode for t in twins] == [s.remote_decode for s in steps]
    for twin in twins:  # not even a first token in common: no block hash in common either
        assert all(shared_prefix(twin.prompt, s.prompt) == 0 for s in measured), twin.name
    for group in (twins, *(measured[k * len(steps):(k + 1) * len(steps)] for k in range(ROUNDS))):
        for i, a in enumerate(steps):  # each round and the twins share exactly what the demo's prompts share
            for j, b in enumerate(steps):
                assert shared_prefix(group[i].prompt, group[j].prompt) == shared_prefix(a.prompt, b.prompt)
    for a in measured:  # and no round shares anything with another
        assert all(shared_prefix(a.prompt, b.prompt) == 0 for b in measured if b.round != a.round)
    assert shared_prefix(shared[0].prompt, shared[1].prompt) == 3 * BLOCK  # a system prompt of 3 blocks


def test_each_row_says_what_its_ttft_includes():
    assert Row("q1", 389, 0, 20.0, True, 18.0, saved_blocks=4).includes() == \
        "first sight: computes 389 tokens (then saves 4 blocks)"
    assert Row("q2", 387, 384, 9.0, True, 18.0).includes() == "warm: loads 384 tokens from the store, computes 3"
    assert Row("decode", 316, 315, 30.0, True, 18.0, handoff_ms=12.5).includes() == \
        "hand-off: loads 315 tokens (12.5 ms), computes 1"
