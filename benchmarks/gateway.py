"""The gateway's own cost, against stand-in engines that answer at once: short requests alone and
beside a stream of long prompts (about 22k tokens each), with long prompts tokenized on worker
threads (the default) and on the event loop (`tokenize_threads: 0`), side by side in one run.

    python -m benchmarks.gateway [--json PATH] [--requests N] [--quick]

The gateway runs in its own process (`conductor serve --config`), a fresh one per measurement; the
stand-in prefill and decode engines (the gateway tests' `FakeEngine`) and the clients share this
process. Figures: each short request's latency at the client, and the gateway's overhead p50 (its
time minus upstream time, from its own /metrics). Each scenario and tokenizing mode is measured
twice, who goes first alternating; `--quick` (the test suite's run): once each, 20 short requests.
JSON `records`: one per measurement, with `scenario` (alone, beside long prompts), `tokenize`
(threads, event loop), `short_p50_ms`, `short_p90_ms`, `gateway_overhead_p50_ms`, `long_prompts`,
`long_p50_ms` (null alone); `ratio_beside_long_threads_vs_loop`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
from benchmarks.records import write_json
from kvstore_testing.fake_engines import MODEL, FakeEngine, start_fakes
from kvstore.integrations.vllm.tiny_model import SENTENCES, build_tokenizer
from kvstore_testing import processes
from kvstore_testing.ports import free_port

SHORT_WORDS = 400  # about 2,400 characters (500 tokens): short prompts stay under the thread cut-off
LONG_REPEAT = 400  # SENTENCES x 400: about 109k characters, 22k tokens


def start_gateway(config: dict, workdir: str, k: int = 0,
                  started: list[subprocess.Popen] | None = None) -> tuple[subprocess.Popen, str]:
    """A `conductor serve --config` process, once it serves (it is added to `started` at once)."""
    path = os.path.join(workdir, f"gateway-{k}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    port = free_port()
    proc = processes.spawn([sys.executable, "-m", "conductor.cli", "serve", "--config", path,
                            "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, cwd=str(ROOT))
    if started is not None:
        started.append(proc)
    try:
        if not proc.stdout.readline():  # {"listen": ...} once it serves
            proc.wait(10)
            raise RuntimeError(f"the gateway did not start (exit code {proc.returncode})")
    except BaseException:
        processes.stop(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


async def overhead_p50_ms(http: aiohttp.ClientSession, url: str) -> float:
    text = await (await http.get(url + "/metrics")).text()
    match = re.search(r"^conductor_gateway_overhead_p50_seconds ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) * 1e3 if match else float("nan")


async def measure(url: str, requests: int, beside_long: bool) -> dict:
    words = " ".join(SENTENCES).split()
    shorts = [f"{i} " + " ".join(words[(i + k) % len(words)] for k in range(SHORT_WORDS)) for i in range(requests)]
    long = " ".join(SENTENCES * LONG_REPEAT)
    async with aiohttp.ClientSession() as http:
        async def one(prompt: str) -> float:
            started = time.perf_counter()
            async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                                "stream": True}) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"gateway answered {resp.status}")
            return time.perf_counter() - started

        for prompt in shorts[:10]:
            await one(prompt)
        stop = asyncio.Event()
        long_latencies: list[float] = []

        async def long_stream() -> None:
            while not stop.is_set():
                long_latencies.append(await one(f"{len(long_latencies)} {long}"))

        streamer = asyncio.create_task(long_stream()) if beside_long else None
        latencies = [await one(prompt) for prompt in shorts]
        stop.set()
        if streamer is not None:
            await streamer
        overhead = await overhead_p50_ms(http, url)
    latencies.sort()
    long_latencies.sort()
    return {"short_p50_ms": latencies[len(latencies) // 2] * 1e3,
            "short_p90_ms": latencies[len(latencies) * 9 // 10] * 1e3, "gateway_overhead_p50_ms": overhead,
            "long_prompts": len(long_latencies),
            "long_p50_ms": long_latencies[len(long_latencies) // 2] * 1e3 if long_latencies else None,
            "requests": requests}


async def run(args: argparse.Namespace) -> list[dict]:
    workdir = tempfile.mkdtemp(prefix="kvstore-gateway-bench-")
    model_dir = build_tokenizer(os.path.join(workdir, "model"))
    prefill, decode = FakeEngine("p0"), FakeEngine("d0")  # they answer at once
    runners = await start_fakes(prefill, decode)
    # Twice each, who goes first alternating; a fresh gateway per measurement, all started at once
    # before the first (a start is seconds of imports; an idle gateway only checks health every 5 s).
    plan = [(scenario, threads) for scenario in ("alone", "beside long prompts")
            for threads in ((2, 0) if args.quick else (2, 0, 0, 2))]
    procs: list[subprocess.Popen] = []
    records = []
    try:
        starts = [asyncio.ensure_future(asyncio.to_thread(
            start_gateway, {"prefill": [prefill.url], "decode": [decode.url], "model_dir": model_dir,
                            "block_tokens": 128, "local_prefill_tokens": 0, "tokenize_threads": threads,
                            "health_interval_s": 5.0}, workdir, k, procs)) for k, (_, threads) in enumerate(plan)]
        done, _ = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        # The first start to fail says why; the others then fail because they are stopped here.
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is not None:
            for proc in list(procs):
                await asyncio.to_thread(processes.stop, proc)
            await asyncio.gather(*starts, return_exceptions=True)
            raise failed
        gateways = [t.result() for t in starts]
        for (scenario, threads), (proc, url) in zip(plan, gateways):
            try:
                result = await measure(url, args.requests, scenario != "alone")
            finally:
                await asyncio.to_thread(processes.stop, proc)
            records.append({"scenario": scenario, "tokenize": "threads" if threads else "event loop",
                            "tokenize_threads": threads, **result})
    finally:
        for proc in procs:
            await asyncio.to_thread(processes.stop, proc)
        for runner in runners:
            await runner.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--requests", type=int, default=200, help="short requests per measurement")
    parser.add_argument("--quick", action="store_true", help="20 short requests, each measurement once")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 20
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    records = asyncio.run(run(args))
    print(f"\n  {'scenario':22} {'tokenize on':12} {'short p50 ms':>13} {'short p90 ms':>13} {'overhead p50 ms':>16} "
          f"{'long prompts':>13} {'long p50 ms':>12}")
    for r in records:
        long_p50 = "-" if r["long_p50_ms"] is None else f"{r['long_p50_ms']:.1f}"
        print(f"  {r['scenario']:22} {r['tokenize']:12} {r['short_p50_ms']:13.2f} {r['short_p90_ms']:13.2f} "
              f"{r['gateway_overhead_p50_ms']:16.2f} {r['long_prompts']:13d} {long_p50:>12}")

    def short_p50(threads: int) -> float:
        return statistics.median(r["short_p50_ms"] for r in records
                                 if r["scenario"] == "beside long prompts" and r["tokenize_threads"] == threads)

    ratio = short_p50(2) / short_p50(0)
    runs = "one run each" if args.quick else "median of two runs each"
    print(f"\n  beside long prompts, short p50 with threads / on the event loop ({runs}): {ratio:.2f}")
    if args.json:
        write_json(args.json, {"meta": {"machine": platform.node(), "cpus": os.cpu_count(), "requests": args.requests,
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                               "records": records, "ratio_beside_long_threads_vs_loop": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.gateway"))
