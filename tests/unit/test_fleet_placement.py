"""benchmarks.fleet's placement figure: how far behind other prefills each request was placed,
read from the requests' own outcomes (arrival, engine, uncached prompt tokens, TTFT)."""
from __future__ import annotations

from benchmarks.fleet import BEHIND_TOKENS, REQUEST_FIELDS, placement


def row(at: float, prompt: int, engine: int, ttft_ms: float, cached: int = 0) -> list:
    values = {"at_s": at, "prompt_tokens": prompt, "output_tokens": 16, "engine": engine, "cached_tokens": cached,
              "credited_tokens": 0, "ttft_ms": ttft_ms, "tpot_ms": 10.0, "error": None}
    return [values[f] for f in REQUEST_FIELDS]


def test_a_request_placed_behind_a_long_prefill_while_another_engine_is_empty_counts():
    """Kills: a backlog that counts the request itself, cached tokens as work, requests whose first
    token is already out, or failed requests (no TTFT) as work."""
    failed = row(0.0, 90_000, 1, 0.0)
    failed[REQUEST_FIELDS.index("ttft_ms")] = None
    rows = [row(0.0, 20_000, 0, 3000.0),  # engine 0 computes 20k tokens until 3 s
            row(0.0, 30_000, 1, 1500.0, cached=29_000),  # engine 1: 1k tokens to compute until 1.5 s
            row(0.0, 50_000, 1, 200.0),  # engine 1: first token out at 0.2 s, no work left at 1 s
            failed,  # no outcome: no work counted
            row(1.0, 2_000, 0, 2500.0),  # behind 20k on engine 0 while engine 1 has 1k
            row(1.0, 2_000, 1, 100.0)]  # engine 1: the least backlog
    out = placement(rows)
    assert 20_000 - 1_000 >= BEHIND_TOKENS
    assert out["behind_share"] == 1 / 5
    assert out["excess_backlog_mean_tokens"] == (0 + 0 + 0 + 19_000 + 0) / 5


def test_one_engine_gives_no_figure():
    assert placement([row(0.0, 100, 0, 10.0)]) == {"behind_share": None, "excess_backlog_mean_tokens": None}


def test_the_goodput_ceiling_counts_what_an_idle_engine_could_meet():
    """Kills: a ceiling that counts prompts no engine computes within the TTFT SLO (it would let a
    target above what any router can reach look reachable), or one that ignores what earlier
    requests left cached (a repeated long prompt is a hit, within the SLO)."""
    from benchmarks.fleet import TRACE_BLOCK, Row, goodput_ceiling_rps
    from conductor.sim.engine.profile import get_profile

    profile = get_profile("h100-llama3-8b")
    long_ids = tuple(range(120))  # 61,440 tokens: seconds of prefill even on an idle engine
    assert profile.prefill_ms(len(long_ids) * TRACE_BLOCK, len(long_ids) * TRACE_BLOCK) > 2000
    slice_ = [(0.0, Row(0.0, 2048, 16, (1000, 1001, 1002, 1003))),
              (1.0, Row(0.0, len(long_ids) * TRACE_BLOCK, 16, long_ids)),  # misses under any router
              (2.0, Row(0.0, len(long_ids) * TRACE_BLOCK + 100, 16, long_ids + (500,)))]  # its prefix cached
    assert goodput_ceiling_rps(profile, slice_, 2000.0, 10.0) == 0.2
