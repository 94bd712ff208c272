"""The GPU check's store parts, in a process of their own (scripts/gpu_check.py runs it with the
whole kvstore package and its dependencies on the path): a step's KV saved and loaded through the
vLLM connector's batched path and an embedded kvstore (library mode), byte for byte against an
independent read; a same-host batch get of 32 x 1 MiB with every block's digest verified against
the same get unhashed and a memcpy, on the host's CPUs; and a same-host hand-off of KV from one set
of device tensors to another through the store against the raw device->host->device copy.

    python scripts/gpu_check_store.py --out PART.json --device cuda|cpu [--quick] [--budget S]

Writes {"checks": [...], "records": [...]} (records of kind "store", "verified_get" and "handoff").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np
import torch

if os.environ.get("GPU_CHECK_SITE"):  # wheels gpu_check.py unpacked: before this Python's own packages
    sys.path.insert(1, os.environ["GPU_CHECK_SITE"])  # (the versions the generated gRPC modules need)

from benchmarks import kv_copy  # noqa: E402
from kvstore.keys import ModelFingerprint  # noqa: E402

GIB = 1 << 30


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def physical(block: torch.Tensor) -> torch.Tensor:
    """A block's bytes in storage order, read without the connector's geometry code: its
    dimensions ordered by stride (outermost first), made contiguous, as bytes."""
    order = sorted(range(block.dim()), key=lambda d: -block.stride(d))
    return block.permute(order).contiguous().view(-1).view(torch.uint8)


def expected_blocks(setup: kv_copy.Setup, ratio: int) -> list[torch.Tensor]:
    names = list(setup.caches)
    return [torch.cat([physical(setup.caches[n][b * ratio:(b + 1) * ratio]) for n in names]) for b in setup.ids]


def fingerprint(model: kv_copy.Model, block_tokens: int, layout: str) -> ModelFingerprint:
    return ModelFingerprint(model_id="gpu-check/llama-3-8b-shape", dtype=model.dtype, block_size=block_tokens,
                            num_layers=model.layers, num_kv_heads=model.kv_heads, head_size=model.head_size,
                            kv_layout=f"gpu-check:{layout}")


def round_trip(store: Any, model: kv_copy.Model, shape: str, block_tokens: int, step_tokens: int,
               device: str) -> dict:
    """Save a step through the batched path into the store, read it back independently, zero the
    cache, load it through the batched path: every byte compared. Seconds of each side."""
    layout, ratio = kv_copy.SHAPES[shape]
    fp = fingerprint(model, block_tokens, shape)
    setup = kv_copy.Setup(store.engine, model, shape, block_tokens, step_tokens, device, save=True, load=True)
    try:
        want = expected_blocks(setup, ratio)
        sync()
        started = time.perf_counter()
        saved = setup.save_step()
        saved.ready and saved.ready()
        store.put_many(saved.blocks, fingerprint=fp)
        saved.release()
        save_s = time.perf_counter() - started
        size = setup.io.block_bytes[0]
        buffers = [np.empty(size, np.uint8) for _ in setup.ids]  # the independent read: plain buffers
        assert all(store.get_many(setup.hashes, buffers, fingerprint=fp)), "a saved block is not in the store"
        for b, buf, expected in zip(setup.ids, buffers, want):
            if not torch.equal(torch.from_numpy(buf).to(expected.device), expected):
                raise AssertionError(f"{shape} block {b}: stored bytes differ from the cache's")
        first = next(iter(setup.caches.values()))
        torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage()).zero_()
        sync()
        started = time.perf_counter()
        found = setup.batch.load(0, setup.ids, lambda s, e, targets: store.get_many(setup.hashes[s:e], targets,
                                                                                    fingerprint=fp), timeout=60)
        sync()
        load_s = time.perf_counter() - started
        assert all(found), "a block did not load"
        names = list(setup.caches)
        for b, expected in zip(setup.ids, want):
            got = torch.cat([physical(setup.caches[n][b * ratio:(b + 1) * ratio]) for n in names])
            if not torch.equal(got, expected):
                raise AssertionError(f"{shape} block {b}: loaded bytes differ from the saved ones")
        store.remove(setup.hashes, fingerprint=fp)
        return {"kind": "store", "device": "cuda" if setup.cuda else "cpu", "block_tokens": block_tokens,
                "layout": shape, "step_tokens": step_tokens, "step_bytes": setup.step_bytes, "blocks": len(setup.ids),
                "save_seconds": round(save_s, 4), "load_seconds": round(load_s, 4),
                "save_gbps": round(setup.step_bytes / save_s / 1e9, 3), "load_gbps": round(setup.step_bytes / load_s / 1e9, 3),
                "wrong_bytes": 0}
    finally:
        setup.close(store.engine)


def handoff(store: Any, model: kv_copy.Model, nbytes: int, device: str, repeats: int = 3) -> dict:
    """`nbytes` of KV (BLNHC, 16-token blocks) from one set of device tensors to another through the
    store (batched save, put, get, batched load), against a pinned device->host->device copy.
    `repeats` hand-offs, each of fresh keys (a real put, not a block already there); the figures
    are the median one's, with its phases (`save`: device to the pinned slot, `put`, `get_load`:
    the store's read into the load slot and the scatter into the other cache). The first pays for
    what a first use starts (thread pools, the first copies into each buffer), as an engine's first
    hand-off does."""
    block_tokens = 16
    tokens = max(block_tokens, nbytes // model.token_bytes())
    fp = fingerprint(model, block_tokens, "handoff")
    source = kv_copy.Setup(store.engine, model, "BLNHC", block_tokens, tokens, device, save=True, load=False)
    target = kv_copy.Setup(store.engine, model, "BLNHC", block_tokens, tokens, device, save=False, load=True)
    try:
        target.ids = list(source.ids)
        first = next(iter(target.caches.values()))
        runs = []
        for _ in range(repeats):
            source.hashes = [os.urandom(16) for _ in source.ids]
            torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage()).zero_()
            sync()
            marks = [time.perf_counter()]
            saved = source.save_step()
            saved.ready and saved.ready()
            marks.append(time.perf_counter())
            store.put_many(saved.blocks, fingerprint=fp)
            saved.release()
            marks.append(time.perf_counter())
            found = target.batch.load(0, target.ids,
                                      lambda s, e, t: store.get_many(source.hashes[s:e], t, fingerprint=fp),
                                      timeout=120)
            sync()
            marks.append(time.perf_counter())
            assert all(found), "a handed-off block did not load"
            names = list(source.caches)
            for b in source.ids:
                for n in names:
                    # (as bytes: random bits hold NaNs, which equal nothing)
                    if not torch.equal(physical(source.caches[n][b]), physical(target.caches[n][b])):
                        raise AssertionError(f"hand-off block {b} {n}: bytes differ")
            store.remove(source.hashes, fingerprint=fp)
            runs.append([b - a for a, b in zip(marks, marks[1:])])
        raw = raw_copy(source.step_bytes, device)
        runs_total = [sum(r) for r in runs]
        median = sorted(range(len(runs)), key=lambda i: runs_total[i])[len(runs) // 2]
        seconds = runs_total[median]
        return {"kind": "handoff", "device": "cuda" if source.cuda else "cpu", "bytes": source.step_bytes,
                "seconds": round(seconds, 4), "raw_seconds": round(raw, 4), "ratio": round(seconds / raw, 3),
                "phases": dict(zip(("save", "put", "get_load"), (round(x, 4) for x in runs[median]))),
                "runs_seconds": [round(x, 4) for x in runs_total], "wrong_bytes": 0}
    finally:
        source.close(store.engine)
        target.close(store.engine)


def raw_copy(nbytes: int, device: str) -> float:
    """Median seconds of the same bytes device -> pinned host -> another device buffer."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    times = []
    for _ in range(4):
        sync()
        started = time.perf_counter()
        host.copy_(src, non_blocking=True)
        sync()
        dst.copy_(host, non_blocking=True)
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def verified_get(store: Any, blocks: int, block_bytes: int, rounds: int) -> dict:
    """A same-host batch get of `blocks` blocks with every block's digest verified (the default)
    against the same get with no digest taken and a one-thread memcpy of the same bytes, taking
    turns (who goes first rotating) for `rounds` rounds of 3 timed calls each; ratios are the
    medians of the per-round ratios. What the host's CPUs give the verification: the digests of a
    wave are taken on a thread per CPU (up to 16, `integrity.digest_threads()`) while the next wave
    is copied."""
    from kvstore.client.reads import VerifiedSlots
    from kvstore.keys import external_hashes

    fp = ModelFingerprint("gpu-check/verified-get", "uint8", 16, 1, 1, 64, kv_layout="bytes")
    hashes = external_hashes(range(blocks), fp)
    data = [np.random.default_rng(i).integers(0, 256, block_bytes, dtype=np.uint8) for i in range(blocks)]
    outs = [np.empty(block_bytes, np.uint8) for _ in range(blocks)]
    store.put_many(list(zip(hashes, data)), fingerprint=fp)
    unhashed = VerifiedSlots(mode="once")
    unhashed.trusted = lambda view, record, number: True  # every slot taken as verified: no digest
    nodes = store.reads.nodes

    def get(verified: Any) -> None:
        mine, nodes.verified = nodes.verified, verified
        try:
            if not all(store.get_many(hashes, outs, fingerprint=fp)):
                raise AssertionError("a stored block was not found")
        finally:
            nodes.verified = mine

    paths = {"verified": lambda: get(nodes.verified), "unhashed": lambda: get(unhashed),
             "memcpy": lambda: [np.copyto(o, d) for o, d in zip(outs, data)]}
    for fn in paths.values():
        fn()  # warm: pages touched, the digest pool started
    per_round: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        names = list(paths)[r % 3:] + list(paths)[:r % 3]
        for name in names:
            times = []
            for _ in range(3):
                started = time.perf_counter()
                paths[name]()
                times.append(time.perf_counter() - started)
            per_round[name].append(statistics.median(times))
    if not all(np.array_equal(o, d) for o, d in zip(outs, data)):
        raise AssertionError("a get returned other bytes")
    store.remove(hashes, fingerprint=fp)
    total = blocks * block_bytes

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(y / x for x, y in zip(per_round[a], per_round[b])), 3)

    return {"kind": "verified_get", "cpus": len(os.sched_getaffinity(0)), "blocks": blocks,
            "block_bytes": block_bytes, "rounds": rounds,
            **{f"{name}_gbps": round(total / statistics.median(t) / 1e9, 3) for name, t in per_round.items()},
            "verified_over_unhashed": ratio("verified", "unhashed"),
            "verified_over_unhashed_rounds": [round(u / v, 3) for v, u in zip(per_round["verified"],
                                                                               per_round["unhashed"])],
            "verified_over_memcpy": ratio("verified", "memcpy")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check_store.py")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small steps (CPU-only mode)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds: parts that would start later are skipped")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget
    import kvstore

    checks, records = [], []
    if args.quick:
        model = kv_copy.Model(layers=2, kv_heads=2, head_size=64)
        cases = [(shape, bt, 128) for shape in kv_copy.SHAPES for bt in (16, 64)]
        dram, handoff_bytes = "256MiB", 16 << 20
    else:
        model = kv_copy.Model()
        cases = [(shape, bt, 4096) for shape in kv_copy.SHAPES for bt in (16, 64)]
        cases += [("BLNHC", bt, 32768) for bt in (16, 64)]
        dram, handoff_bytes = "20GiB", GIB

    def check(name: str, fn: Any) -> None:
        if time.monotonic() > deadline:
            checks.append({"name": name, "status": "skipped", "reason": "the check's time budget was spent"})
            return
        started = time.perf_counter()
        try:
            detail = fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
            checks.append({"name": name, "status": "failed", "seconds": round(time.perf_counter() - started, 3),
                           "reason": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
            return
        checks.append({"name": name, "status": "passed", "seconds": round(time.perf_counter() - started, 3),
                       **({"detail": detail} if detail is not None else {})})

    with kvstore.open("memory://gpu-check", dram=dram) as store:
        def steps() -> dict:
            done = []
            for shape, bt, tokens in cases:
                if time.monotonic() > deadline:
                    done.append(f"{shape}/{bt}/{tokens}: skipped (time budget)")
                    continue
                record = round_trip(store, model, shape, bt, tokens, args.device)
                records.append(record)
                done.append(f"{shape}/{bt}/{tokens}")
            return {"cases": done}

        # The hand-off and the verified get first: the steps' loop is the part the budget cuts short.
        name = "hand-off: KV device -> store -> other device tensors"
        if args.device.startswith("cuda"):
            check(name, lambda: records.append(handoff(store, model, handoff_bytes, args.device)) or
                  {"bytes": handoff_bytes})
        else:
            checks.append({"name": name, "status": "skipped", "reason": "needs a CUDA device: --cpu-only"})
        check("store: a same-host batch get, every block verified, against no digest and memcpy",
              lambda: records.append(verified_get(store, 32, 1 << 20, 3 if args.quick else 9)) or None)
        check(f"store: a step saved and loaded through the batched path, byte for byte ({args.device})", steps)
    with open(args.out, "w") as f:
        json.dump({"checks": checks, "records": records}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
