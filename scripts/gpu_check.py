"""The GPU check (run by scripts/gpu-check.sh): builds the Transfer Engine's native module and runs
the checks that need a CUDA device, on a machine with only PyTorch (and numpy, which PyTorch
brings) and no network: no pip, no pytest, no vLLM, nothing of kvstore's other dependencies.

    python scripts/gpu_check.py --out gpu-check.json [--cpu-only]

1. build: cpp/*.cpp -> transfer/_native (pybind11 headers from pybind11 or from PyTorch, which
   ships them; OpenSSL's EVP declarations from the system or scripts/gpu_check_include), into a
   scratch package that also holds the Python modules the checks import (transfer, and the
   connector's layout.py and kv_cache_io.py, which import nothing else of kvstore).
2. checks: host regions through the Transfer Engine (the build works); CUDA regions through the
   Transfer Engine; the connector's device copy path (KVCacheIO with host staging) on CUDA tensors
   in each vLLM KV cache layout and with kernel-block splitting, checked byte for byte against an
   independent read; the same on CPU tensors (what CPU-only mode can check).
3. bandwidth: device->host and host->device, torch copies (pageable and pinned) vs the Transfer
   Engine's CUDA regions vs the connector's per-block copies.

Writes one JSON: each check passed/failed/skipped (with why), the build, the bandwidths, the
machine. Exit code 1 if a check failed. Without CUDA (or with --cpu-only) the CUDA parts are
skipped, each with its reason.
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
CONNECTOR_MODULES = ("layout.py", "kv_cache_io.py")
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
    """A package tree the checks import from: transfer, kvstore.errors and the connector's copy
    path, without kvstore/__init__.py (which imports the client and its dependencies)."""
    shutil.copytree(os.path.join(ROOT, "transfer"), os.path.join(package, "transfer"),
                    ignore=shutil.ignore_patterns("_native*", "__pycache__"))
    vllm_dir = os.path.join(package, "kvstore", "integrations", "vllm")
    os.makedirs(vllm_dir)
    for init in ("kvstore", "kvstore/integrations", "kvstore/integrations/vllm"):
        open(os.path.join(package, init, "__init__.py"), "w").close()
    shutil.copy(os.path.join(ROOT, "kvstore", "errors.py"), os.path.join(package, "kvstore", "errors.py"))
    for name in CONNECTOR_MODULES:
        shutil.copy(os.path.join(ROOT, "kvstore", "integrations", "vllm", name), os.path.join(vllm_dir, name))


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
    def __init__(self, cuda: bool, why_no_cuda: str) -> None:
        self.cuda, self.why_no_cuda = cuda, why_no_cuda
        self.results: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], Any], needs_cuda: bool = False) -> Any:
        if needs_cuda and not self.cuda:
            self.results.append({"name": name, "status": "skipped", "reason": self.why_no_cuda})
            return None
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
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_only
    why = "--cpu-only" if args.cpu_only else "torch.cuda.is_available() is False (no CUDA device or driver)"
    checks = Checks(cuda, f"needs a CUDA device: {why}")
    document: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": "cuda" if cuda else "cpu-only",
                                "machine": machine(cuda)}
    package = tempfile.mkdtemp(prefix="kvstore-gpu-check-")
    try:
        scratch_package(package)
        build = checks.run("build native module", lambda: build_native(package))
        document["build"] = build
        if build is not None:
            sys.path.insert(0, package)
            checks.run("transfer engine: host regions", check_host_regions)
            checks.run("connector copy path: CPU tensors, every layout", lambda: check_device_copy_path("cpu"))
            checks.run("transfer engine: CUDA regions", check_cuda_regions, needs_cuda=True)
            checks.run("connector copy path: CUDA tensors, every layout", lambda: check_device_copy_path("cuda"),
                       needs_cuda=True)
            document["bandwidth"] = checks.run("bandwidth device<->host", lambda: measure_bandwidth(args.bandwidth_mib),
                                               needs_cuda=True)
    finally:
        shutil.rmtree(package, ignore_errors=True)
    document["checks"] = checks.results
    document["seconds"] = round(time.perf_counter() - started, 1)
    failed = [c["name"] for c in checks.results if c["status"] == "failed"]
    document["ok"] = not failed
    with open(args.out, "w") as f:
        json.dump(document, f, indent=1)
    for c in checks.results:
        print(f"  {c['status']:<8} {c['name']}" + (f": {c['reason']}" if c.get("reason") else ""))
    if document.get("bandwidth"):
        print("  " + ", ".join(f"{k} {v}" for k, v in document["bandwidth"].items() if k.endswith("gbps")))
    print(f"  wrote {args.out} ({document['seconds']} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
