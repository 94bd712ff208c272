"""The GPU check (run by scripts/gpu-check.sh): builds the Transfer Engine's native module and runs
the checks and measurements that need a CUDA device, on a machine with only PyTorch (and numpy,
which PyTorch brings) and no network: no pip, no pytest, no vLLM. kvstore's own dependencies
(grpcio, blake3, xxhash, protobuf, prometheus-client) come as wheels when the machine lacks them
(GPU_CHECK_WHEELS=DIR, default scripts/gpu_check_wheels/; scripts/gpu-check-wheels.sh fetches them
on a machine with a network); without them the parts that need them are skipped, with the reason.

    python scripts/gpu_check.py --out gpu-check.json [--cpu-only]

1. build: cpp/*.cpp -> transfer/_native (pybind11 headers from pybind11 or from PyTorch, which
   ships them; OpenSSL's EVP declarations from the system or scripts/gpu_check_include), into a
   scratch package that also holds the Python modules the checks import (transfer, the connector's
   copy path: layout.py, kv_cache_io.py, kv_batch.py, writer.py; benchmarks/kv_copy.py), and a
   second tree with the whole kvstore package for the store parts (scripts/gpu_check_store.py,
   run in a process of its own).
2. checks: host regions through the Transfer Engine; CUDA regions; the connector's per-block copy
   path and its batched path (kv_batch.py) on CUDA tensors in each vLLM KV cache layout and kernel
   split, byte for byte against an independent read; the same on CPU tensors (what CPU-only mode
   can check).
3. measurements, written as `records`: the connector's batched save and load of a step of
   Llama-3-8B-shaped KV (32 layers, 8 KV heads of 128, bf16; blocks of 16 and 64 tokens; every
   layout and kernel split at 4k-token steps, BLNHC at 32k) beside a pinned torch copy of the same
   bytes (kind "kv_copy", benchmarks/kv_copy.py); the Transfer Engine's CUDA regions to and from
   host memory beside the same (kind "te_cuda"); each step through an embedded kvstore, byte for
   byte (kind "store"); a same-host batch get of 32 x 1 MiB with every block's digest verified
   against the same get unhashed and a memcpy, on the machine's CPUs (kind "verified_get"); BLAKE3
   block digests on 1..CPUs threads (kind "digest_rate": what bounds a save with digests); 1 GiB
   of KV handed from one set of device tensors to another through the
   store against the raw device->host->device copy (kind "handoff"); and the engine profile
   `h200-llama3-8b-measured` (scripts/gpu_check_profile.py, under `profiles`, which
   `benchmarks.fleet --profile` reads from the committed benchmarks/results/gpu-check.json).
4. bandwidth: device->host and host->device, torch copies (pageable and pinned) vs the Transfer
   Engine's CUDA regions vs the connector's per-block copies (the path before the batched one).

Writes one JSON (rewritten after every part, so a run cut short keeps what it measured): each
check passed/failed/skipped (with why), the build, the records, the machine. Exit code 1 if a
check failed. Without CUDA (or with --cpu-only) the CUDA parts are skipped, each with its reason,
and the CPU parts run small. GPU_CHECK_BUDGET_S (default 420) bounds the parts: one that would
start later is skipped, so the JSON is written inside the script's 8 minutes.
"""
from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM_INCLUDE = os.path.join(ROOT, "scripts", "gpu_check_include")
# vLLM's KV cache layouts (vllm/v1/kv_cache_layout.py): the physical order of logical [L, B, H, N, C].
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4)}
# The connector modules the device path needs; they import only torch, numpy, transfer and kvstore.errors.
CONNECTOR_MODULES = ("layout.py", "kv_cache_io.py", "kv_batch.py", "writer.py")
# kvstore modules the digests need (blake3, xxhash: skipped where missing) and the benchmark module.
CORE_MODULES = ("errors.py", "keys.py", "integrity.py")
BENCHMARK_MODULES = ("__init__.py", "kv_copy.py", "records.py")
WHEELS = os.environ.get("GPU_CHECK_WHEELS") or os.path.join(ROOT, "scripts", "gpu_check_wheels")
# GPU_CHECK_BARE=1: build as on a machine with only PyTorch (its pybind11 headers, the EVP
# declarations of scripts/gpu_check_include), even where the pybind11 package and OpenSSL's
# headers are installed: what CI checks of the bare-machine path.
BARE = os.environ.get("GPU_CHECK_BARE") == "1"


# ------------------------------------------------------------------ build
def pybind11_include() -> str:
    try:
        if BARE:
            raise ImportError("GPU_CHECK_BARE")
        import pybind11

        return pybind11.get_include()
    except ImportError:  # PyTorch wheels ship pybind11's headers
        import torch

        include = os.path.join(os.path.dirname(torch.__file__), "include")
        if os.path.exists(os.path.join(include, "pybind11", "pybind11.h")):
            return include
    raise RuntimeError("no pybind11 headers: neither the pybind11 package nor PyTorch's include/pybind11")


def has_header(compiler: str, header: str) -> bool:
    probe = subprocess.run([compiler, "-x", "c++", "-E", "-"], input=f"#include <{header}>\n", text=True,
                           capture_output=True)
    return probe.returncode == 0


def crypto_link_args() -> list[str]:
    """-lcrypto, or the versioned library itself when its development symlink is absent."""
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                      "/usr/local/lib"):
        if os.path.exists(os.path.join(directory, "libcrypto.so")):
            return ["-lcrypto"]
    name = ctypes.util.find_library("crypto")
    if name is None:
        raise RuntimeError("no libcrypto (OpenSSL) on this machine: the native module needs it")
    return [f"-l:{name}"]


def build_native(package: str) -> dict[str, Any]:
    """Compile cpp/*.cpp into package/transfer/_native<suffix>; what was used and how long it took."""
    started = time.perf_counter()
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    includes = [sysconfig.get_paths()["include"], pybind11_include()]
    openssl = "system"
    if BARE or not has_header(compiler, "openssl/evp.h"):
        includes.append(SHIM_INCLUDE)
        openssl = "declarations from scripts/gpu_check_include"
    flags = ["-O2", "-fPIC", "-std=c++17", "-pthread", "-fvisibility=hidden"] + [f"-I{i}" for i in includes]
    sources = sorted(os.path.join(ROOT, "cpp", f) for f in os.listdir(os.path.join(ROOT, "cpp")) if f.endswith(".cpp"))
    objects_dir = os.path.join(package, "obj")
    os.makedirs(objects_dir, exist_ok=True)

    def compile_one(source: str) -> str:
        obj = os.path.join(objects_dir, os.path.basename(source) + ".o")
        done = subprocess.run([compiler, *flags, "-c", source, "-o", obj], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {os.path.basename(source)} failed:\n{done.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        objects = list(pool.map(compile_one, sources))
    target = os.path.join(package, "transfer", "_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    link = [compiler, "-shared", "-pthread", *objects, "-o", target, *crypto_link_args()]
    done = subprocess.run(link, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"linking the native module failed:\n{done.stderr[-4000:]}")
    return {"compiler": compiler, "pybind11": includes[1], "openssl": openssl, "sources": len(sources),
            "seconds": round(time.perf_counter() - started, 1)}


def scratch_package(package: str) -> None:
    """A package tree the checks import from: transfer, kvstore.errors, the digests and the
    connector's copy path, without kvstore/__init__.py (which imports the client and its
    dependencies), and benchmarks.kv_copy."""
    shutil.copytree(os.path.join(ROOT, "transfer"), os.path.join(package, "transfer"),
                    ignore=shutil.ignore_patterns("_native*", "__pycache__"))
    vllm_dir = os.path.join(package, "kvstore", "integrations", "vllm")
    os.makedirs(vllm_dir)
    for init in ("kvstore", "kvstore/integrations", "kvstore/integrations/vllm"):
        open(os.path.join(package, init, "__init__.py"), "w").close()
    for name in CORE_MODULES:
        shutil.copy(os.path.join(ROOT, "kvstore", name), os.path.join(package, "kvstore", name))
    for name in CONNECTOR_MODULES:
        shutil.copy(os.path.join(ROOT, "kvstore", "integrations", "vllm", name), os.path.join(vllm_dir, name))
    os.makedirs(os.path.join(package, "benchmarks"))
    for name in BENCHMARK_MODULES:
        shutil.copy(os.path.join(ROOT, "benchmarks", name), os.path.join(package, "benchmarks", name))


def full_tree(package: str, full: str) -> None:
    """The whole kvstore package (its generated gRPC modules included, where the checkout has them)
    beside the built transfer package and benchmarks.kv_copy: what the store parts import."""
    shutil.copytree(os.path.join(ROOT, "kvstore"), os.path.join(full, "kvstore"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(package, "transfer"), os.path.join(full, "transfer"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(package, "benchmarks"), os.path.join(full, "benchmarks"),
                    ignore=shutil.ignore_patterns("__pycache__"))


def wheel_fits(name: str) -> bool:
    """Whether wheel file `name` installs on this Python: pure (py3), this CPython's own (cpXY), or
    the stable ABI of this or an older one (cpXY-abi3). The platform tag is not checked: the
    wheels are fetched for Linux x86_64 and the machines that run this are."""
    parts = name[:-len(".whl")].split("-")
    if len(parts) < 5:
        return False
    python, abi = parts[-3], parts[-2]
    here = sys.version_info
    for tag in python.split("."):
        if tag.startswith("py3") or tag == "py2.py3":
            return True
        if tag.startswith("cp") and tag[2:].isdigit():
            minor = int(tag[3:]) if tag[2] == "3" else -1
            if minor == here.minor or (abi == "abi3" and 0 <= minor <= here.minor):
                return True
    return False


def unpack_wheels(site: str) -> list[str]:
    """Wheels in WHEELS that fit this Python (`wheel_fits`) unpacked into `site` (a wheel is a zip
    of its installed files); those for another Python are left out, so a checkout that carries
    one machine's wheels still runs its checks on another."""
    import zipfile

    if not os.path.isdir(WHEELS):
        return []
    names = sorted(f for f in os.listdir(WHEELS) if f.endswith(".whl") and wheel_fits(f))
    for name in names:
        with zipfile.ZipFile(os.path.join(WHEELS, name)) as wheel:
            wheel.extractall(site)
    return names


def missing_modules(names: tuple[str, ...], path: list[str], site: str) -> list[str]:
    """Which of `names` a Python with `path` and the unpacked wheels (`site`) in front of its own
    packages cannot import (probed in a child process), each with why: `name (Error: message)`."""
    probe = "import importlib, sys\nsys.path.insert(1, sys.argv[1])\nfor n in sys.argv[2:]:\n" \
            "    try: importlib.import_module(n)\n" \
            "    except Exception as e: print(f'{n} ({type(e).__name__}: {e})'.replace(chr(10), ' '))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    # cwd: `-c` puts the working directory first on the path, and a checkout's own transfer/ (its
    # native module built for another Python, or none) would shadow the one built here.
    done = subprocess.run([sys.executable, "-c", probe, site, *names], env=env, capture_output=True, text=True,
                          timeout=120, cwd=site)
    return done.stdout.splitlines()


# ------------------------------------------------------------------ layouts (as vLLM allocates them)
def kv_views(layout: str, layers: int, blocks: int, heads: int, tokens: int, channels: int, device: str,
             kernel_ratio: int = 1) -> list[Any]:
    """One `[kernel blocks, heads, tokens, channels]` view per layer over one allocation whose
    physical order is `layout`, as vllm.v1.kv_cache_interface.create_kv_cache_views makes them."""
    import torch

    logical = (layers, blocks * kernel_ratio, heads, tokens // kernel_ratio, channels)
    order = LAYOUTS[layout]
    physical = torch.zeros([logical[d] for d in order], dtype=torch.float16, device=device)
    view = physical.permute([order.index(d) for d in range(5)])
    return [view[layer] for layer in range(layers)]


def physical_bytes(view: Any) -> Any:
    """A view's bytes in storage order (independent of the connector's geometry code), on the CPU."""
    import torch

    element = view.element_size()
    storage = torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())
    index = torch.arange(storage.numel() // element)
    offsets = torch.as_strided(index, view.shape, view.stride(), view.storage_offset()).reshape(-1).sort().values
    byte_offsets = (offsets[:, None] * element + torch.arange(element)).reshape(-1)
    return storage[byte_offsets.to(view.device)].cpu()


# ------------------------------------------------------------------ checks
class Checks:
    def __init__(self, cuda: bool, why_no_cuda: str, deadline: float = float("inf"),
                 on_result: Callable[[], None] = lambda: None) -> None:
        self.cuda, self.why_no_cuda, self.deadline, self.on_result = cuda, why_no_cuda, deadline, on_result
        self.results: list[dict[str, Any]] = []

    def skip(self, name: str, reason: str) -> None:
        self.results.append({"name": name, "status": "skipped", "reason": reason})
        self.on_result()

    def run(self, name: str, fn: Callable[[], Any], needs_cuda: bool = False) -> Any:
        if needs_cuda and not self.cuda:
            self.skip(name, self.why_no_cuda)
            return None
        if time.monotonic() > self.deadline:
            self.skip(name, "GPU_CHECK_BUDGET_S was spent before it could start")
            return None
        try:
            return self._run(name, fn)
        finally:
            self.on_result()

    def _run(self, name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            detail = fn()
        except Exception as exc:  # noqa: BLE001 - a failed check is recorded, the others still run
            self.results.append({"name": name, "status": "failed", "seconds": round(time.perf_counter() - started, 3),
                                 "reason": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
            return None
        self.results.append({"name": name, "status": "passed", "seconds": round(time.perf_counter() - started, 3),
                             **({"detail": detail} if detail is not None else {})})
        return detail


def check_host_regions() -> dict:
    import numpy as np
    from transfer import Engine, Read, Write

    with Engine("gpu-check-host", listen=None) as engine:
        source = np.arange(1 << 20, dtype=np.uint8)
        target = np.zeros(1 << 20, np.uint8)
        a, b = engine.register(source, remote_access=False), engine.register(target, remote_access=False)
        engine.transfer([Write(a, 0, b, 0, source.nbytes)])
        assert np.array_equal(source, target)
        target[:] = 0
        engine.transfer([Read(b, 0, a, 0, source.nbytes)])
        assert np.array_equal(source, target)
    return {"bytes": source.nbytes}


def check_cuda_regions() -> dict:
    import torch
    from transfer import Engine, Read, Write

    with Engine("gpu-check-cuda", listen=None) as engine:
        device_tensor = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
        region = engine.register(device_tensor)
        assert region.kind == "cuda", region.kind
        host = engine.allocate(device_tensor.numel())
        engine.transfer([Write(region, 0, host, 0, device_tensor.numel())])
        assert bytes(host.buffer) == device_tensor.cpu().numpy().tobytes()
        import numpy as np

        np.frombuffer(host.buffer, np.uint8)[:] = 7
        engine.transfer([Read(region, 0, host, 0, device_tensor.numel())])
        torch.cuda.synchronize()
        assert int((device_tensor == 7).sum().item()) == device_tensor.numel()
    return {"bytes": device_tensor.numel()}


def check_device_copy_path(device: str) -> dict:
    """The connector's staged copy path (KVCacheIO) in every layout and with kernel-block splitting:
    a block written lands exactly where an independent read finds it, neighbours untouched, and a
    staged read gives back the same bytes."""
    import numpy as np
    from transfer import Engine

    from kvstore.integrations.vllm.kv_cache_io import KVCacheIO

    cases = [(layout, 1) for layout in LAYOUTS] + [("LBHNC", 2), ("LBNHC", 2)]
    rng = np.random.default_rng(0)
    done = []
    with Engine("gpu-check-io", listen=None) as engine:
        for layout, ratio in cases:
            names = [f"layer{i}" for i in range(3)]
            views = kv_views(layout, len(names), 6, 2, 16, 128, device, ratio)
            caches = dict(zip(names, views))
            io = KVCacheIO(engine, caches, 6, [names], {n: ratio for n in names}, staged=True)
            assert not io.on_host
            data = rng.integers(0, 255, io.block_bytes[0], dtype=np.uint8)
            io.write_block(0, 4, data)
            per_layer = io.block_bytes[0] // len(names)
            for layer, name in enumerate(names):
                block = caches[name][4 * ratio:5 * ratio]
                landed = physical_bytes(block).numpy()
                assert np.array_equal(landed, data[layer * per_layer:(layer + 1) * per_layer]), (layout, ratio, name)
                for other in (3, 5):
                    neighbour = caches[name][other * ratio:(other + 1) * ratio]
                    assert not physical_bytes(neighbour).numpy().any(), (layout, ratio, "neighbour", other)
            staged = np.zeros(io.block_bytes[0], np.uint8)
            for layer in range(len(names)):
                io.stage_layer(layer, 4, staged)
            assert np.array_equal(staged, data), (layout, ratio, "staged read")
            io.close()
            done.append(f"{layout}{'/kernel x' + str(ratio) if ratio > 1 else ''}")
    return {"layouts": done}


def block_physical(block: Any) -> Any:
    """A block's bytes in storage order, read without the connector's geometry code: its dimensions
    ordered by stride (outermost first), made contiguous, as bytes (on the block's device)."""
    import torch

    order = sorted(range(block.dim()), key=lambda d: -block.stride(d))
    return block.permute(order).contiguous().view(-1).view(torch.uint8)


def check_batched_path(device: str) -> dict:
    """The batched path (kv_batch.BatchedKV) in every layout and kernel split: a step's blocks (out
    of order, the cache's first and last among them, more than a slot holds) gathered into
    registered staging, the rows compared with an independent read of the cache, then scattered
    into the zeroed cache (one block missing from the store: never written), every block compared."""
    import numpy as np
    import torch
    from transfer import Engine

    from benchmarks.kv_copy import SHAPES, fill_random, kv_caches
    from kvstore.integrations.vllm.kv_batch import BatchedKV
    from kvstore.integrations.vllm.kv_cache_io import KVCacheIO

    done = []
    with Engine("gpu-check-batched", listen=None) as engine:
        for shape, (layout, ratio) in SHAPES.items():
            for block_tokens in (16, 64):
                caches = kv_caches(layout, 3, 12, 2, block_tokens, 128, device, torch.bfloat16, ratio)
                fill_random(caches)
                names = list(caches)

                def stored(b: int) -> Any:
                    return torch.cat([block_physical(caches[n][b * ratio:(b + 1) * ratio]) for n in names]).cpu()

                want = {b: stored(b) for b in range(12)}
                io = KVCacheIO(engine, caches, 12, [names], {n: ratio for n in names}, staged=True)
                batch = BatchedKV(io, engine, 4, layout)
                chosen, missing = [11, 0, 5, 3, 7], 3
                step, overflow = batch.begin_save([(0, b, bytes([b]) * 16, False) for b in chosen])
                assert [b for _, b, _, _ in overflow] == [7], overflow
                for layer in range(len(names)):
                    step.gather_layer(layer)
                (saved,) = step.finish()
                saved.ready and saved.ready()
                for (_, row), b in zip(saved.blocks, chosen):
                    assert np.array_equal(row, want[b].numpy()), (shape, block_tokens, "saved", b)
                saved.release()
                first = next(iter(caches.values()))
                torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage()).zero_()

                def read(start: int, end: int, targets: list) -> list[bool]:
                    found = []
                    for b, [(region, offset, length)] in zip(chosen[start:end], targets):
                        host = np.frombuffer(region.buffer, np.uint8)
                        host[offset:offset + length] = 0xAB if b == missing else want[b].numpy()
                        found.append(b != missing)
                    return found

                assert batch.load(0, chosen, read, timeout=30) == [b != missing for b in chosen]
                for b in range(12):
                    expected = want[b] if b in chosen and b != missing else torch.zeros_like(want[b])
                    assert torch.equal(stored(b), expected), (shape, block_tokens, "loaded", b)
                batch.close(engine)
                io.close()
                done.append(f"{shape}/{block_tokens}")
    return {"layouts": done}


def te_cuda_records(nbytes: int) -> list[dict]:
    """The Transfer Engine's CUDA region to and from a host region of this process (one direct
    device<->host copy, the host memory pinned on first use), byte for byte, beside a pinned torch
    copy of the same bytes (median of 5 after a warm-up)."""
    import numpy as np
    import torch
    from transfer import Engine, Read, Write

    out = []
    with Engine("gpu-check-te", listen=None) as engine:
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
        region = engine.register(device)
        host = engine.allocate(nbytes)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        cases = {"device_to_host": (lambda: engine.transfer([Write(region, 0, host, 0, nbytes)]),
                                    lambda: pinned.copy_(device, non_blocking=True)),
                 "host_to_device": (lambda: engine.transfer([Read(region, 0, host, 0, nbytes)]),
                                    lambda: device.copy_(pinned, non_blocking=True))}
        for direction, (ours, limit) in cases.items():
            ours_s, limit_s = [], []
            ours(), limit()
            for _ in range(5):
                limit_s.append(timed_once(limit))
                ours_s.append(timed_once(ours))
            if direction == "device_to_host":
                assert np.array_equal(np.frombuffer(host.buffer, np.uint8), device.cpu().numpy()), "d2h bytes differ"
            else:
                np.frombuffer(host.buffer, np.uint8)[:] = 7
                engine.transfer([Read(region, 0, host, 0, nbytes)])
                torch.cuda.synchronize()
                assert int((device == 7).sum().item()) == nbytes, "h2d bytes differ"
            g, lg = nbytes / sorted(ours_s)[2] / 1e9, nbytes / sorted(limit_s)[2] / 1e9
            out.append({"kind": "te_cuda", "direction": direction, "bytes": nbytes, "gbps": round(g, 3),
                        "limit_gbps": round(lg, 3), "ratio": round(g / lg, 3)})
    return out


def timed_once(fn: Callable[[], Any]) -> float:
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def kv_copy_records(cuda: bool, deadline: float, digests: bool) -> dict:
    """benchmarks.kv_copy's records (kind "kv_copy"): CUDA: Llama-3-8B-shaped steps of 4k tokens in
    every layout and kernel split, 32k in BLNHC, blocks of 16 and 64 tokens; CPU: small steps."""
    from transfer import Engine

    from benchmarks import kv_copy

    if cuda:
        model, reps = kv_copy.Model(), 5
        cases = [(shape, bt, 4096) for shape in kv_copy.SHAPES for bt in (16, 64)]
        cases += [("BLNHC", bt, 32768) for bt in (16, 64)]
    else:
        model, reps = kv_copy.Model(layers=2, kv_heads=2, head_size=64), 3
        cases = [(shape, bt, 256) for shape in kv_copy.SHAPES for bt in (16, 64)]
    records: list[Any] = []
    skipped = []
    with Engine("gpu-check-kv-copy", listen=None) as engine:
        for shape, block_tokens, tokens in cases:
            if time.monotonic() > deadline:
                skipped.append(f"{shape}/{block_tokens}/{tokens}")
                continue
            kv_copy.measure(engine, model, shape, block_tokens, tokens, "cuda" if cuda else "cpu", reps, digests,
                            records, lambda r: None)
    from dataclasses import asdict

    return {"records": [{"kind": "kv_copy", **asdict(r)} for r in records], "skipped": skipped}


def digest_rate_records(nbytes: int, block_bytes: int = 2 << 20) -> list[dict]:
    """BLAKE3 block digests (kvstore.integrity.block_digest) of `nbytes` in blocks of
    `block_bytes` on 1, 2, 4, ... threads up to the CPUs here (kind "digest_rate", best of 3):
    what bounds a save with digests, beside the thread count the store uses
    (`integrity.digest_threads()`)."""
    import numpy as np

    from kvstore import integrity

    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    blocks = [data[i:i + block_bytes] for i in range(0, nbytes - block_bytes + 1, block_bytes)]
    hashes = [bytes(16)] * len(blocks)
    cpus = len(os.sched_getaffinity(0))
    counts = sorted({1 << k for k in range(8) if 1 << k <= cpus} | {cpus})
    out = []
    for threads in counts:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(integrity.block_digest, hashes, blocks))
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                list(pool.map(integrity.block_digest, hashes, blocks))
                best = min(best, time.perf_counter() - started)
        out.append({"kind": "digest_rate", "threads": threads, "block_bytes": block_bytes,
                    "bytes": len(blocks) * block_bytes, "gbps": round(len(blocks) * block_bytes / best / 1e9, 3),
                    "store_threads": integrity.digest_threads()})
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def timed(fn: Callable[[], None], repeat: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def measure_bandwidth(size_mib: int) -> dict:
    """Device<->host GB/s (best of 5): torch copies (pageable, pinned) vs the Transfer Engine's CUDA
    regions vs the connector's per-block staged copies (2 MiB blocks)."""
    import numpy as np
    import torch
    from transfer import Engine, Read, Write

    from kvstore.integrations.vllm.kv_cache_io import KVCacheIO

    n = size_mib << 20
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out: dict[str, Any] = {"bytes": n}
    out["torch_d2h_pageable_gbps"] = gbps(n, timed(lambda: pageable.copy_(device)))
    out["torch_h2d_pageable_gbps"] = gbps(n, timed(lambda: device.copy_(pageable)))
    out["torch_d2h_pinned_gbps"] = gbps(n, timed(lambda: pinned.copy_(device, non_blocking=True)))
    out["torch_h2d_pinned_gbps"] = gbps(n, timed(lambda: device.copy_(pinned, non_blocking=True)))
    with Engine("gpu-check-bw", listen=None) as engine:
        region = engine.register(device)
        host = engine.allocate(n)
        out["engine_d2h_gbps"] = gbps(n, timed(lambda: engine.transfer([Write(region, 0, host, 0, n)])))
        out["engine_h2d_gbps"] = gbps(n, timed(lambda: engine.transfer([Read(region, 0, host, 0, n)])))
        block_tokens, heads, channels = 256, 8, 256  # 2 layers x 256 tokens x 8 heads x 256 x fp16 = 2 MiB a block
        blocks = max(1, n // (2 * block_tokens * heads * channels * 2))
        views = kv_views("BLNHC", 2, blocks, heads, block_tokens, channels, "cuda")
        io = KVCacheIO(engine, {"l0": views[0], "l1": views[1]}, blocks, [["l0", "l1"]], staged=True)
        buffers = [np.empty(io.block_bytes[0], np.uint8) for _ in range(blocks)]
        total = blocks * io.block_bytes[0]

        def save() -> None:
            for b, buf in enumerate(buffers):
                for layer in range(2):
                    io.stage_layer(layer, b, buf)

        def load() -> None:
            for b, buf in enumerate(buffers):
                io.write_block(0, b, buf)

        out["connector_save_d2h_gbps"] = gbps(total, timed(save, repeat=3))
        out["connector_load_h2d_gbps"] = gbps(total, timed(load, repeat=3))
        out["connector_block_bytes"] = io.block_bytes[0]
        io.close()
    return out


def machine(cuda: bool) -> dict:
    import torch

    info = {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpus": os.cpu_count(), "cuda_available": cuda}
    if cuda:
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / (1 << 30), 1))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "gpu-check.json"), help="where the JSON goes")
    parser.add_argument("--cpu-only", action="store_true", help="skip every CUDA part (CI)")
    parser.add_argument("--bandwidth-mib", type=int, default=512, help="bytes each bandwidth copy moves")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", "420"))
    deadline = time.monotonic() + budget
    # The parts after the step copies (the store, the profile, the bandwidth) keep up to 200 s,
    # at most half a short budget: a budget under 200 s still measures some steps.
    after_steps = min(200.0, budget / 2)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_only
    why = "--cpu-only" if args.cpu_only else "torch.cuda.is_available() is False (no CUDA device or driver)"
    document: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": "cuda" if cuda else "cpu-only",
                                "machine": machine(cuda), "records": []}

    def write() -> None:  # after every part: a run cut short keeps what it measured
        document["checks"] = checks.results
        document["seconds"] = round(time.perf_counter() - started, 1)
        document["ok"] = not any(c["status"] == "failed" for c in checks.results)
        with open(args.out, "w") as f:
            json.dump(document, f, indent=1)

    checks = Checks(cuda, f"needs a CUDA device: {why}", deadline, write)
    package = tempfile.mkdtemp(prefix="kvstore-gpu-check-")
    try:
        site = os.path.join(package, "site")
        os.makedirs(site)  # (the import probes run in it: it exists with no wheels too)
        document["wheels"] = unpack_wheels(site)
        scratch_package(package)
        build = checks.run("build native module", lambda: build_native(package))
        document["build"] = build
        if build is not None:
            sys.path.insert(0, package)
            # The wheels before this Python's own packages: the generated gRPC modules need the
            # grpcio and protobuf they were generated for (a machine's older ones refuse them).
            sys.path.insert(1, site)
            missing = missing_modules(("blake3", "xxhash"), [package], site)
            digests = not missing
            document["digests"] = "on and off" if digests else f"off only (no {', '.join(missing)} here)"
            checks.run("transfer engine: host regions", check_host_regions)
            checks.run("connector copy path: CPU tensors, every layout", lambda: check_device_copy_path("cpu"))
            checks.run("connector batched path: CPU tensors, every layout", lambda: check_batched_path("cpu"))
            checks.run("transfer engine: CUDA regions", check_cuda_regions, needs_cuda=True)
            checks.run("connector copy path: CUDA tensors, every layout", lambda: check_device_copy_path("cuda"),
                       needs_cuda=True)
            checks.run("connector batched path: CUDA tensors, every layout", lambda: check_batched_path("cuda"),
                       needs_cuda=True)
            kv = checks.run("kv_copy: a step through the connector's batched path beside a plain copy",
                            lambda: kv_copy_records(cuda, deadline - after_steps if cuda else deadline, digests))
            if kv is not None:
                document["records"] += kv.pop("records")
            if digests:
                rates = checks.run("digests: BLAKE3 of 2 MiB blocks on 1..CPUs threads",
                                   lambda: digest_rate_records((512 if cuda else 32) << 20))
                document["records"] += rates or []
            else:
                checks.skip("digests: BLAKE3 of 2 MiB blocks on 1..CPUs threads", document["digests"])
            te = checks.run("transfer engine: CUDA regions beside a pinned copy (1 GiB)",
                            lambda: te_cuda_records(1 << 30), needs_cuda=True)
            document["records"] += te or []
            run_store_parts(package, site, cuda, deadline, checks, document)
            profile = checks.run("profile: a Llama-3-8B-shaped layer stack (random weights)", measure_profile,
                                 needs_cuda=True)
            if profile is not None:
                document["profiles"] = [profile["profile"]]
                document["records"].append({"kind": "profile", "name": profile["profile"]["name"],
                                            "prefill_ms_per_token": profile["prefill_ms_per_token"],
                                            "decode_step_ms": profile["decode_step_ms"]})
            document["bandwidth"] = checks.run("bandwidth device<->host", lambda: measure_bandwidth(args.bandwidth_mib),
                                               needs_cuda=True)
    finally:
        shutil.rmtree(package, ignore_errors=True)
    write()
    for c in checks.results:
        print(f"  {c['status']:<8} {c['name']}" + (f": {c['reason']}" if c.get("reason") else ""))
    for r in document["records"]:
        if r["kind"] in ("kv_copy", "te_cuda", "handoff", "verified_get", "digest_rate"):
            print("  " + ", ".join(f"{k} {v}" for k, v in r.items()
                                   if k in ("kind", "device", "direction", "block_tokens", "layout", "digests",
                                            "step_tokens", "gbps", "limit_gbps", "ratio", "seconds", "raw_seconds",
                                            "cpus", "verified_gbps", "unhashed_gbps", "memcpy_gbps",
                                            "verified_over_unhashed", "threads", "store_threads")))
    if document.get("bandwidth"):
        print("  " + ", ".join(f"{k} {v}" for k, v in document["bandwidth"].items() if k.endswith("gbps")))
    print(f"  wrote {args.out} ({document['seconds']} s)")
    return 0 if document["ok"] else 1


def run_store_parts(package: str, site: str, cuda: bool, deadline: float, checks: Checks, document: dict) -> None:
    """scripts/gpu_check_store.py in a process of its own, over the whole kvstore package; its
    checks and records join this run's. Skipped, with what is missing, where kvstore's
    dependencies are not here (and no wheel brought them)."""
    name = "store: the whole kvstore package and its dependencies"
    full = os.path.join(package, "full")
    full_tree(package, full)
    missing = missing_modules(("grpc", "blake3", "xxhash", "google.protobuf", "prometheus_client",
                               "kvstore.library"), [full], site)
    if missing:
        checks.skip(name, f"cannot import {', '.join(missing)}: bring wheels in GPU_CHECK_WHEELS "
                          "(scripts/gpu-check-wheels.sh), and the generated kvstore/*/v1 modules")
        return
    left = deadline - time.monotonic() - (60 if cuda else 0)  # (the profile's minute)
    if left < 20:
        checks.skip(name, "GPU_CHECK_BUDGET_S was spent before it could start")
        return
    part = os.path.join(package, "store.json")
    command = [sys.executable, os.path.join(ROOT, "scripts", "gpu_check_store.py"), "--out", part,
               "--device", "cuda" if cuda else "cpu", "--budget", str(int(left - 15))] + ([] if cuda else ["--quick"])
    env = dict(os.environ, PYTHONPATH=full, GPU_CHECK_SITE=site)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=left, cwd=package)
    except subprocess.TimeoutExpired:
        checks.results.append({"name": name, "status": "failed", "reason": f"did not end within {left:.0f} s"})
        return
    if done.returncode != 0 or not os.path.exists(part):
        checks.results.append({"name": name, "status": "failed", "reason": f"exit code {done.returncode}",
                               "trace": (done.stdout + done.stderr)[-3000:]})
        return
    with open(part) as f:
        result = json.load(f)
    checks.results.extend(result["checks"])
    document["records"] += result["records"]
    checks.on_result()


def measure_profile() -> dict:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_check_profile

    return gpu_check_profile.measure("cuda")


if __name__ == "__main__":
    sys.exit(main())
