"""Conductor: the textbook table exactly, trace replay invariants, the planner, the policies."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conductor.cost import CostModel
from conductor.planner import Workload, batching_table, plan
from conductor.policies import InstanceView, RouteRequest, Slo, admit, make_policy
from conductor.sim.data import SCENARIOS, TRACES
from conductor.sim.scenario import Scenario, run_scenario
from conductor.sim.trace import Fleet, infinite_cache_hit_ratio, load_trace, simulate, tbt

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = SCENARIOS["textbook"]
TRACE = TRACES["mooncake-conversation"]


def test_scenario_reproduces_the_textbook_table_exactly(tmp_path):
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-m", "conductor.sim", "--scenario", SCENARIO, "--json", str(out)],
                   check=True, capture_output=True)
    result = json.loads(out.read_text())
    co, dis = result["colocated"], result["disaggregated"]
    assert (co["ttft_mean_ms"], co["ttft_max_ms"], co["tpot_p99_ms"]) == (602.0, 1064.0, 292.0)
    assert co["tpot_mean_ms"] == pytest.approx(24.05, abs=1e-9)
    assert (dis["ttft_mean_ms"], dis["ttft_max_ms"], dis["tpot_p99_ms"]) == (198.0, 252.0, 8.0)
    assert dis["tpot_mean_ms"] == pytest.approx(5.275, abs=1e-9)
    for design in (co, dis):
        assert set(design) >= {"ttft_mean_ms", "ttft_max_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms"}


def test_the_simulator_prints_a_table_from_any_directory_and_json_on_request(tmp_path):
    """Built-in inputs by name, from a directory that is not the repository. Kills: raw JSON as the
    only output, and inputs found only relative to the repository root."""
    run = lambda *args: subprocess.run([sys.executable, "-m", "conductor.sim", *args], capture_output=True,  # noqa: E731
                                       text=True, cwd=tmp_path, timeout=120)
    table = run("--scenario", "textbook")
    assert table.returncode == 0, table.stderr
    header, rule, colocated, disaggregated = table.stdout.splitlines()
    assert header.split()[:3] == ["deployment", "TTFT", "mean"] and set(rule) <= {"-", " "}
    assert colocated.split()[:2] == ["colocated", "602"] and disaggregated.split()[:2] == ["disaggregated", "198"]
    raw = run("--scenario", "textbook", "--json")
    assert json.loads(raw.stdout)["disaggregated"]["ttft_max_ms"] == 252.0
    replay = run("--trace", "mooncake-conversation", "--limit", "200", "--policy", "cache_global")
    assert replay.returncode == 0 and replay.stdout.splitlines()[2].split()[:2] == ["cache_global", "200"]
    missing = run("--trace", "no-such-trace.jsonl")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and len(missing.stderr.splitlines()) == 1


def test_scenario_model_follows_other_parameters():
    one = Scenario.from_dict({"requests": {"count": 1, "gap_ms": 5, "prompt_tokens": 100, "output_tokens": 3},
                              "cost": {"prefill_ms_per_token": 1.0, "decode_ms_per_step": 10.0, "kv_transfer_ms": 7.0},
                              "designs": {"c": {"workers": 1}, "d": {"prefill_workers": 1, "decode_workers": 1}}})
    result = run_scenario(one)
    assert result["c"]["ttft_mean_ms"] == 100.0 and result["c"]["tpot_mean_ms"] == 10.0
    assert result["d"]["ttft_mean_ms"] == 107.0 and result["d"]["tpot_p99_ms"] == 10.0
    with pytest.raises(ValueError):
        Scenario.from_dict({"requests": {"count": 1}})
    with pytest.raises(ValueError):
        Scenario.from_dict({**json.load(open(SCENARIO)), "decode_batching": True})


def test_tbt_is_the_mean_of_the_slowest_tenth():
    assert tbt({10.0: 18, 100.0: 2}) == 100.0
    assert tbt({10.0: 19, 100.0: 1}) == 55.0
    assert tbt({}) == 0.0


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE, limit=3000)


def test_trace_replay_orders_policies_sensibly(trace):
    cost = CostModel()
    ceiling = infinite_cache_hit_ratio(trace)
    fleet = Fleet(prefill=4, decode=2, local_cache_tokens=2_000_000, global_pool_tokens=8_000_000)
    results = {name: simulate(trace, fleet, make_policy(name, cost), cost, Slo())
               for name in ("round_robin", "least_loaded", "cache_local", "cache_global")}
    hits = {name: r["prefix_cache_hit_ratio"] for name, r in results.items()}
    assert all(0 <= h <= ceiling + 1e-9 for h in hits.values())
    assert hits["cache_global"] >= hits["cache_local"] >= hits["round_robin"]
    assert hits["cache_global"] >= 2 * hits["round_robin"]
    assert results["cache_global"]["prefill_gpu_seconds"] < results["least_loaded"]["prefill_gpu_seconds"]
    for r in results.values():
        assert r["requests"] == 3000 and 0 <= r["slo_attainment"] <= 1
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]


def test_tight_slos_reject_early_with_reasons(trace):
    cost = CostModel()
    fleet = Fleet(prefill=1, decode=1, local_cache_tokens=0, global_pool_tokens=0)
    result = simulate(trace[:500], fleet, make_policy("least_loaded", cost), cost, Slo(ttft_ms=2000, tbt_ms=200))
    assert result["rejected"] > 0 and result["ttft_p99_ms"] <= 2000 + 1e-6
    choice = make_policy("least_loaded", cost).choose(RouteRequest(100_000), [InstanceView("a", 0, 0)])
    assert "TTFT" in admit(choice, 10, Slo(ttft_ms=1000))
    assert "TBT" in admit(make_policy("least_loaded", cost).choose(RouteRequest(10), [InstanceView("a", 0, 0)]), 500, Slo())


def test_policies_trade_queue_against_cache():
    cost = CostModel()
    warm = InstanceView("warm", queue_ms=500, local_prefix_tokens=8000)
    cold = InstanceView("cold", queue_ms=0, local_prefix_tokens=0)
    request = RouteRequest(prompt_tokens=10_000, global_prefix_tokens=8000)
    assert make_policy("least_loaded", cost).choose(request, [warm, cold]).instance == "cold"
    assert make_policy("cache_local", cost).choose(request, [warm, cold]).instance == "warm"
    busy_warm = InstanceView("warm", queue_ms=60_000, local_prefix_tokens=8000)
    pick = make_policy("cache_global", cost).choose(request, [busy_warm, cold])
    assert pick.instance == "cold" and pick.loaded_tokens == 8000  # pulls the prefix from the pool
    sticky = make_policy("cache_local+sticky", cost)
    first = sticky.choose(RouteRequest(1000, session="s"), [cold, InstanceView("other", 0, 0)])
    assert sticky.choose(RouteRequest(1000, session="s"), [InstanceView("other", 0, 0), cold]).instance == first.instance
    with pytest.raises(ValueError):
        make_policy("random", cost)


def test_planner_gives_the_textbook_answer():
    cost = CostModel(prefill_ms_per_token=0.2, decode_ms_per_step=2.0, decode_ms_per_seq=0.05, decode_ms_per_kilotoken=0)
    p = plan(Workload(arrival_rate=40, prompt_tokens=1000, output_tokens=200), cost)
    assert p.prefill_gpu_seconds_per_second == pytest.approx(8.0)
    assert p.decode_gpu_seconds_per_second == pytest.approx(16.0)
    assert (p.prefill_instances, p.decode_instances, p.disaggregate) == (8, 16, True)
    table = batching_table(Workload(40, 1000, 200), cost)
    decode = [q.decode_gpu_seconds_per_second for q in table]
    assert decode == sorted(decode, reverse=True) and decode[-1] < 1.0
    assert plan(Workload(40, 100, 200), cost).disaggregate is False  # 20 ms prefills fit a 100 ms TBT
