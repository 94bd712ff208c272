"""Generated traces: Mooncake's format, the shapes their parameters ask for, presets near the
traces Mooncake published."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from conductor.sim.shapes import PRESETS, Shape, describe, generate, shape_from

# Mooncake's published traces (FAST '25): mean input, mean output, infinite-cache hit ratio.
PUBLISHED = {"conversation": (12035, 343, 0.374), "toolagent": (8596, 182, 0.59), "synthetic": (15325, 149, 0.651)}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_resemble_the_published_traces(preset):
    """Kills: a preset (or a generator) off the published trace's lengths or prefix reuse by more
    than a quarter (lengths) or 0.06 (hit ratio)."""
    stats = describe(generate(PRESETS[preset]))
    mean_in, mean_out, hit = PUBLISHED[preset]
    assert abs(stats["mean_input"] / mean_in - 1) < 0.25, stats
    assert abs(stats["mean_output"] / mean_out - 1) < 0.25, stats
    assert abs(stats["infinite_cache_hit_ratio"] - hit) < 0.06, stats


def test_parameters_move_what_they_name():
    """Kills: parameters that do not reach the generator (sharing depth, fan-out, sessions,
    lengths, burstiness), and rows out of order or not in Mooncake's format."""
    base = Shape(requests=1500, roots=4, root_blocks=4, session_turns=1.0, history=False, new_tokens=1000,
                 new_sigma=0.3, output_tokens=50, output_sigma=0.2, seed=3)
    rows = generate(base)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    hit = describe(rows)["infinite_cache_hit_ratio"]
    assert describe(generate(replace(base, root_blocks=16)))["infinite_cache_hit_ratio"] > hit + 0.2  # deeper
    assert describe(generate(replace(base, roots=1000)))["infinite_cache_hit_ratio"] < hit - 0.2  # less fan-out
    assert describe(generate(replace(base, session_turns=4.0, history=True)))["infinite_cache_hit_ratio"] > hit
    assert describe(generate(replace(base, new_tokens=4000)))["mean_input"] > 2 * describe(rows)["mean_input"]
    assert describe(generate(replace(base, output_tokens=400)))["mean_output"] > 5 * describe(rows)["mean_output"]

    def gap_cv(shape):
        times = [r["timestamp"] for r in generate(shape)]
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert gap_cv(replace(base, burstiness=3.0)) > 2 * gap_cv(base)
    assert generate(base) == rows  # the same seed, the same trace


def test_the_command_writes_a_trace_the_fleet_reads_and_refuses_bad_input(tmp_path):
    from benchmarks.fleet import read_trace

    out = tmp_path / "t.jsonl"
    done = subprocess.run([sys.executable, "-m", "conductor.sim.shapes", "toolagent", "--requests", "200", "--out",
                           str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 200 and len(read_trace(str(out))) == 200
    bad = subprocess.run([sys.executable, "-m", "conductor.sim.shapes", "chat", "--out", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "unknown preset" in bad.stderr
    with pytest.raises(ValueError):
        shape_from("toolagent", {"rate_rps": 0.0})
