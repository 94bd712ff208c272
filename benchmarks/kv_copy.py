"""A step's KV through the vLLM connector's batched copy path, against a plain copy of the same
bytes in the same run: the part of a save or a load that the connector itself does, between the
paged KV cache and the registered host staging the store reads from and writes into.

    python -m benchmarks.kv_copy [--quick] [--json PATH] [--device cpu|cuda] [--step-tokens N ...]

Caches are shaped like Llama-3-8B's (32 layers, 8 KV heads of 128, bf16; K and V side by side in
each head's channels, as vLLM 0.32 allocates them) and laid out as vLLM lays them out in each
layout (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC) and with kernel-block splits (LBHNC/2, LBNHC/2); a
step's blocks sit at scattered block ids in a cache twice the step's size. Per block size, layout
and step:

- save: the step's blocks gathered layer by layer (`SaveStep.gather_layer`: one `index_select` over
  the block ids per layer) into a registered staging slot (CUDA: into device staging, then one
  copy into the pinned slot, waited for); with digests on, each block's BLAKE3 digest (what the
  store's put computes first, `kvstore.integrity.block_digests`) is taken on host threads while the
  next step is gathered into the other slot, over `--reps` steps: the save's throughput with
  digests is the rate of the whole pipeline;
- load: the slot's rows scattered into the cache (`BatchedKV.load`: CUDA one host-to-device copy,
  then one `index_copy_` per layer; CPU one row-wise numpy assignment per layer);
- the limit, measured beside each: a plain torch copy of the same number of bytes between
  contiguous buffers (CUDA: pinned, device to host for saves and host to device for loads, the
  slot's own memory; CPU: with the same torch threads as the path, `--threads`, default 1: on a
  small VM shared with other work torch's parallel copies stall whenever another process holds a
  core), and on CPU glibc's memcpy of them too.

Records: `device`, `direction` (save/load), `block_tokens`, `layout`, `digests` (on/off),
`step_tokens`, `step_bytes`, `gbps`, `limit_gbps`, `ratio` (gbps / limit_gbps: the median of the
per-repetition ratios, each path timed right beside its limit), `ratio_min`, `ratio_max`, on CPU
`memcpy_gbps` and `memcpy_ratio` (against glibc's memcpy, see `Setup.limits`), and `path`
("batched"; with `--per-block` also "per-block": the connector's fallback, in the same run).
`--quick` (the test suite's run): 4 layers, 512-token steps, 3 repetitions.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

from transfer import Engine

from kvstore.integrations.vllm.kv_batch import BatchedKV
from kvstore.integrations.vllm.kv_cache_io import KVCacheIO
from kvstore.integrations.vllm.writer import SaveBatch

# vLLM's KV cache layouts (vllm/v1/kv_cache_layout.py): the physical order of logical [L, B, H, N, C].
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4)}
SHAPES = {name: (name, 1) for name in LAYOUTS} | {"LBHNC/2": ("LBHNC", 2), "LBNHC/2": ("LBNHC", 2)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Record:
    device: str
    direction: str  # save | load
    block_tokens: int
    layout: str
    digests: str  # on | off
    step_tokens: int
    step_bytes: int
    gbps: float
    limit_gbps: float
    ratio: float
    ratio_min: float
    ratio_max: float
    memcpy_gbps: float | None  # CPU: glibc's memcpy of the same bytes (streaming stores), beside the path
    memcpy_ratio: float | None
    path: str = "batched"  # or "per-block" (--per-block: the connector's fallback, for comparison)


@dataclass(frozen=True)
class Model:
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"

    def token_bytes(self) -> int:
        return self.layers * self.kv_heads * 2 * self.head_size * torch.empty(0, dtype=DTYPES[self.dtype]).element_size()


def kv_caches(layout: str, layers: int, blocks: int, heads: int, tokens: int, channels: int, device: str,
              dtype: torch.dtype = torch.bfloat16, kernel_ratio: int = 1) -> dict[str, torch.Tensor]:
    """One `[kernel blocks, heads, tokens, channels]` view per layer over one allocation whose
    physical order is `layout`, as vllm.v1.kv_cache_interface.create_kv_cache_views makes them."""
    logical = (layers, blocks * kernel_ratio, heads, tokens // kernel_ratio, channels)
    order = LAYOUTS[layout]
    physical = torch.empty([logical[d] for d in order], dtype=dtype, device=device)
    view = physical.permute([order.index(d) for d in range(5)])
    return {f"model.layers.{layer}.self_attn.attn": view[layer] for layer in range(layers)}


def fill_random(caches: dict[str, torch.Tensor]) -> None:
    first = next(iter(caches.values()))
    storage = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
    storage.view(torch.int32).random_() if storage.numel() % 4 == 0 else storage.random_(0, 256)


class Setup:
    """One cache in one layout, a step's scattered block ids and the batched path over it."""

    def __init__(self, engine: Engine, model: Model, shape: str, block_tokens: int, step_tokens: int, device: str,
                 save: bool, load: bool) -> None:
        layout, ratio = SHAPES[shape]
        self.step_blocks = max(1, step_tokens // block_tokens)
        num_blocks = 2 * self.step_blocks
        self.caches = kv_caches(layout, model.layers, num_blocks, model.kv_heads, block_tokens, 2 * model.head_size,
                                device, DTYPES[model.dtype], ratio)
        fill_random(self.caches)
        names = list(self.caches)
        self.io = KVCacheIO(engine, self.caches, num_blocks, [names], {n: ratio for n in names}, staged=True)
        self.batch = BatchedKV(self.io, engine, self.step_blocks, layout, save=save, load=load, layer_loads=False)
        generator = torch.Generator().manual_seed(block_tokens * 31 + len(shape))
        self.ids = torch.randperm(num_blocks, generator=generator)[:self.step_blocks].tolist()
        self.step_bytes = self.step_blocks * self.io.block_bytes[0]
        self.hashes = [os.urandom(16) for _ in self.ids]
        self.cuda = device.startswith("cuda")

    def close(self, engine: Engine) -> None:
        self.batch.close(engine)
        self.io.close()

    # --- the connector's path ------------------------------------------------------------------
    def save_step(self) -> SaveBatch:
        """Gather the step into a slot: the writer's batch (views of the slot), as the connector makes it."""
        step, overflow = self.batch.begin_save([(0, b, h, False) for b, h in zip(self.ids, self.hashes)])
        assert step is not None and not overflow
        for layer in range(len(self.io.names)):
            step.gather_layer(layer)
        (saved,) = step.finish()
        return saved

    def save(self) -> None:
        saved = self.save_step()
        if saved.ready is not None:
            saved.ready()  # (CUDA: the copy into the pinned slot has landed)
        saved.release()

    def save_with_digests(self, steps: int, pool: ThreadPoolExecutor) -> None:
        """`steps` saves, each step's digests taken on host threads while the next is gathered."""
        from kvstore.integrity import block_digests

        pending = []
        for _ in range(steps):
            if len(pending) == 2:  # both slots in use: wait for the older step's digests
                pending.pop(0).result()
            saved = self.save_step()

            def digest(saved: SaveBatch = saved) -> None:  # what the writer's put does first
                if saved.ready is not None:
                    saved.ready()
                block_digests([h for h, _ in saved.blocks], [b for _, b in saved.blocks])
                saved.release()

            pending.append(pool.submit(digest))
        for future in pending:
            future.result()

    def load(self) -> None:
        found = self.batch.load(0, self.ids, lambda start, end, targets: [True] * (end - start), timeout=30)
        assert all(found)

    # --- the per-block fallback, for comparison --------------------------------------------------
    def save_per_block(self) -> None:
        """What the connector does without staging: each block's layers into a fresh buffer."""
        for block_id in self.ids:
            out = np.empty(self.io.block_bytes[0], np.uint8)
            for layer in range(len(self.io.names)):
                self.io.stage_layer(layer, block_id, out)

    def load_per_block(self) -> None:
        rows = self.batch.load_pool.slots()[0].host
        size = self.io.block_bytes[0]
        for j, block_id in enumerate(self.ids):
            self.io.write_block(0, block_id, rows[j * size:(j + 1) * size])

    # --- the limit: a plain copy of the same bytes --------------------------------------------
    def limits(self, direction: str) -> Callable[[], tuple[float, float | None]]:
        """What times the plain copies beside each repetition: (the limit's seconds, memcpy's
        seconds or None). CUDA: a pinned torch copy of the step's bytes between the slot and the
        device staging. CPU: torch's copy of the same bytes between contiguous buffers, with the
        path's threads (the copy primitive its gathers and scatters are made of), and glibc's
        memcpy (numpy.copyto), whose streaming stores a copy of 64 KiB rows cannot use."""
        n = self.step_bytes
        if self.cuda:
            slot = (self.batch.save_pool or self.batch.load_pool).slots()[0]
            device = self.batch._save_device if direction == "save" else self.batch._load_device
            if direction == "save":
                copy = lambda: slot.tensor[:n].copy_(device[:n], non_blocking=True)  # noqa: E731
            else:
                copy = lambda: device[:n].copy_(slot.tensor[:n], non_blocking=True)  # noqa: E731
            return lambda: (timed(copy), None)
        source = torch.empty(n, dtype=torch.uint8)
        source.random_(0, 256)
        target = torch.zeros(n, dtype=torch.uint8)
        copies = [lambda: target.copy_(source)]
        if n % 8 == 0:
            copies.append(lambda: target.view(torch.int64).copy_(source.view(torch.int64)))

        def plain() -> tuple[float, float]:
            return min(timed(copy) for copy in copies), timed(lambda: np.copyto(target.numpy(), source.numpy()))

        return plain


def timed(fn: Callable[[], Any]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def paired(path: Callable[[], Any], limits: Callable[[], tuple[float, float | None]], reps: int
           ) -> tuple[list[float], list[float], list[float]]:
    """Seconds per repetition of the path, its limit and memcpy (empty on CUDA), each timed right
    beside the path."""
    path(), limits()  # warm: first-touch faults and allocator caches out of the figures
    ours, plain, memcpy = [], [], []
    for _ in range(reps):
        limit, copied = limits()
        plain.append(limit)
        if copied is not None:
            memcpy.append(copied)
        ours.append(timed(path))
    return ours, plain, memcpy


def measure(engine: Engine, model: Model, shape: str, block_tokens: int, step_tokens: int, device: str, reps: int,
            digests: bool, out: list[Record], report: Callable[[Record], None], per_block: bool = False) -> None:
    kind = "cuda" if device.startswith("cuda") else "cpu"
    for direction in ("save", "load"):
        setup = Setup(engine, model, shape, block_tokens, step_tokens, device, save=direction == "save",
                      load=direction == "load")
        try:
            limits = setup.limits(direction)
            runs = [("off", setup.save if direction == "save" else setup.load, 1)]
            if per_block:
                runs.append(("per-block", setup.save_per_block if direction == "save" else setup.load_per_block, 1))
            pool = None
            if direction == "save" and digests:
                pool = ThreadPoolExecutor(1, thread_name_prefix="kv-copy-digest")
                steps = max(2, reps)
                runs.append(("on", lambda: setup.save_with_digests(steps, pool), steps))
            for label, path, steps in runs:
                ours, plain, memcpy = paired(path, limits, reps if steps == 1 else 3)
                gbps = setup.step_bytes * steps / statistics.median(ours) / 1e9
                ratios = [p * steps / o for o, p in zip(ours, plain)]
                memcpy_gbps = setup.step_bytes / statistics.median(memcpy) / 1e9 if memcpy else None
                record = Record(kind, direction, block_tokens, shape, "off" if label == "per-block" else label,
                                step_tokens, setup.step_bytes,
                                round(gbps, 3), round(setup.step_bytes / statistics.median(plain) / 1e9, 3),
                                round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3),
                                round(memcpy_gbps, 3) if memcpy_gbps else None,
                                round(statistics.median([m * steps / o for o, m in zip(ours, memcpy)]), 3)
                                if memcpy else None, "per-block" if label == "per-block" else "batched")
                out.append(record)
                report(record)
            if pool is not None:
                pool.shutdown()
        finally:
            setup.close(engine)


def run(args: argparse.Namespace, report: Callable[[Record], None] = lambda r: None) -> list[Record]:
    model = Model(layers=args.layers, kv_heads=args.kv_heads, head_size=args.head_size, dtype=args.dtype)
    records: list[Record] = []
    with Engine("kv-copy", listen=None) as engine:
        for step_tokens in args.step_tokens:
            for block_tokens in args.block_tokens:
                for shape in args.layouts:
                    if SHAPES[shape][1] > 1 and block_tokens % SHAPES[shape][1]:
                        continue
                    measure(engine, model, shape, block_tokens, step_tokens, args.device, args.reps,
                            args.digests, records, report, args.per_block)
    return records


def print_record(r: Record) -> None:
    print(f"  {r.device:<5}{r.direction:<6}{r.block_tokens:>6} {r.layout:<9}"
          f"{r.digests if r.path == 'batched' else 'pblk':<5}{r.step_tokens:>7}"
          f"{r.step_bytes / 2**20:>9.0f}{r.gbps:>9.2f}{r.limit_gbps:>9.2f}{r.ratio:>7.2f}  {r.ratio_min:.2f}-{r.ratio_max:.2f}"
          + (f"{r.memcpy_gbps:>9.2f}{r.memcpy_ratio:>7.2f}" if r.memcpy_gbps else ""), flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_copy", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--quick", action="store_true", help="the test suite's run: 4 layers, 512-token steps, 3 repetitions")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    p.add_argument("--block-tokens", type=int, nargs="+", default=[16, 64])
    p.add_argument("--step-tokens", type=int, nargs="+", default=None, help="tokens a step saves or loads (default 2048)")
    p.add_argument("--layouts", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--reps", type=int, default=7, help="repetitions, each beside its plain copy (median ratio)")
    p.add_argument("--no-digests", dest="digests", action="store_false", help="skip the saves with digests")
    p.add_argument("--per-block", action="store_true", help="also the per-block fallback (records with path per-block)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (the path's and the limit's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("kv_copy: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if args.quick:
        args.layers, args.reps = min(args.layers, 4), min(args.reps, 3)
        args.step_tokens = args.step_tokens or [512]
    args.step_tokens = args.step_tokens or [2048]
    if not args.device.startswith("cuda"):
        torch.set_num_threads(max(1, args.threads))
    if min(args.block_tokens + args.step_tokens) < 1 or args.reps < 1 or args.layers < 1:
        print("kv_copy: --block-tokens, --step-tokens, --reps and --layers must be at least 1", file=sys.stderr)
        return 2
    print(f"  {'dev':<5}{'dir':<6}{'block':>6} {'layout':<9}{'dig':<5}{'tokens':>7}{'MiB':>9}{'GB/s':>9}{'limit':>9}"
          f"{'ratio':>7}  spread   memcpy  ratio")
    records = run(args, print_record)
    if args.json:
        from benchmarks.records import write_json

        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
                "torch": torch.__version__, "device": args.device, "reps": args.reps, "layers": args.layers,
                "kv_heads": args.kv_heads, "head_size": args.head_size, "dtype": args.dtype,
                "step_tokens": args.step_tokens, "quick": args.quick, "threads": torch.get_num_threads()}
        write_json(args.json, {"meta": meta, "records": [asdict(r) for r in records]})
    return 0


if __name__ == "__main__":
    from kvstore_testing import processes

    sys.exit(processes.run_main(main, prog="python -m benchmarks.kv_copy"))
