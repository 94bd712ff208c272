"""The block codec (lz4 over byte planes, `--disk-codec lz4`, `Client(wire_codec="lz4")`): what it
buys and what it costs, per kind of KV bytes.

Sources: synthetic bf16 and fp16 KV (normal values; bf16 truncated from float32), and with `--vllm`
real KV blocks that vLLM (CPU) saved through our connector while serving prompts on the demo's
tiny model (randomly initialised weights, bf16 and fp16 engines, run one after another in child
processes).

Per source:
- `ratio`: raw bytes over stored bytes (blocks that gain under 5 % count as raw), the share kept
  raw, and the per-core speeds: compress (choose and code) and decompress, raw GB/s on one thread;
- `tier`: the same NVMe tier size with the codec off and on: blocks it holds once full (the
  ratio is the capacity the codec buys, after 4 KiB extents), and gets served from it on the same
  host (the tier fd, decoded in the client; no promotion), raw GB/s effective;
- `wire` (synthetic bf16 and, with --vllm, the bf16 engine's KV): a daemon in another network
  namespace behind a veth pair with a `tbf` qdisc at --link (1 Gbit/s) each way, read over TCP by a
  client with and without the wire codec: raw GB/s delivered. Needs root, `ip` and `tc`; recorded
  as n/a (with the reason) where they are not there.

`python -m benchmarks.codec [--quick] [--vllm] [--json PATH]`; `--quick` runs the synthetic sources
on small sizes (the test suite runs it).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from benchmarks.records import write_json
from kvstore.codec import MIN_GAIN, NAMES, Chooser, decode
from kvstore.keys import ModelFingerprint, external_hashes
from kvstore_testing import processes
from kvstore.tiers.allocator import align_up

KIB, MIB = 1024, 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 512 * KIB  # a vLLM CPU block of the demo model: 128 tokens x 4 layers x K,V x 4 heads x 64 x 2 bytes
NET_NS = "kvsbench-codec"
VETH_HOST, VETH_NS = "kvsbc0", "kvsbc1"
HOST_IP, NS_IP = "10.213.71.1", "10.213.71.2"


# --- sources ---------------------------------------------------------------------------------------
def synthetic(dtype: str, count: int, size: int = BLOCK, seed: int = 0) -> list[bytes]:
    """KV-like blocks: normal values (sigma 1) in bf16 (float32's high half) or fp16."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.standard_normal(size // 2).astype(np.float32)
        if dtype == "bfloat16":
            out.append((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        else:
            out.append(x.astype(np.float16).tobytes())
    return out


def dump_vllm(folder: str, dtype: str, prompts: int) -> int:
    """(In a child process) serve `prompts` prompts on the demo's tiny model with the connector in
    `dtype`, then write every block the embedded store holds to folder/kv-DTYPE-N.bin."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvstore.integrations.vllm import store as vllm_store
    from kvstore.integrations.vllm.local_engine import engine
    from kvstore.integrations.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(os.path.join(os.path.expanduser("~"), ".cache", "kvstore", "tiny-llama-demo"),
                             layers=4, hidden=256, heads=4)
    extra = {"metadata": f"memory://codec-{os.getpid()}", "dram": "1GiB", "process_local": True}
    llm = engine(model, {"role": "kv_both", "extra": extra}, dtype=dtype)
    from vllm import SamplingParams

    rng = np.random.default_rng(7)
    batch = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, 1024)]} for _ in range(prompts)]
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    written = 0
    for client in list(vllm_store._clients.values()):
        store = client.daemon.store
        for key, _ in store.keys():
            data = store.read_block(key)
            if data is not None:
                with open(os.path.join(folder, f"kv-{dtype}-{written:05d}.bin"), "wb") as f:
                    f.write(data)
                written += 1
    print(json.dumps({"blocks": written}), flush=True)
    os._exit(0)  # vLLM's engine teardown on CPU takes longer than the dump: the files are written


def vllm_blocks(dtype: str, prompts: int, timeout: float = 600) -> tuple[list[bytes], str]:
    """Real KV blocks saved by vLLM in `dtype` (a child process); ([], reason) when that fails."""
    folder = tempfile.mkdtemp(prefix="kvstore-bench-codec-vllm-")
    try:
        proc = processes.spawn([sys.executable, "-m", "benchmarks.codec", "--dump-vllm", folder, "--dtype", dtype,
                                "--prompts", str(prompts)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            processes.stop(proc)
            return [], f"vLLM ({dtype}) did not finish in {timeout:.0f} s"
        files = sorted(glob.glob(os.path.join(folder, f"kv-{dtype}-*.bin")))
        if proc.returncode != 0 or not files:
            return [], f"vLLM ({dtype}) failed: {(err or out).strip().splitlines()[-1:] or ['no output']}"
        blocks = []
        for path in files:
            with open(path, "rb") as f:
                blocks.append(f.read())
        return blocks, ""
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- ratio and speed -------------------------------------------------------------------------------
def measure_ratio(blocks: list[bytes], repeats: int) -> dict:
    """Raw/stored ratio, the share kept raw, the codec chosen, per-core compress/decompress GB/s."""
    chooser = Chooser()
    frames = [chooser.encode("fp", b) for b in blocks]
    raw = sum(len(b) for b in blocks)
    stored = sum(len(f) if f is not None else len(b) for (c, f), b in zip(frames, blocks))
    extents_raw = sum(align_up(len(b)) for b in blocks)
    extents = sum(align_up(len(f) if f is not None else len(b)) for (c, f), b in zip(frames, blocks))
    started = time.perf_counter()
    for _ in range(repeats):
        fresh = Chooser()  # the first block of each pass probes every width, as a new daemon does
        for b in blocks:
            fresh.encode("fp", b)
    compress = repeats * raw / (time.perf_counter() - started) / 1e9
    coded = [(c, f, len(b)) for (c, f), b in zip(frames, blocks) if f is not None]
    decompress = None
    if coded:
        started = time.perf_counter()
        for _ in range(repeats):
            for c, f, size in coded:
                decode(f, c, size)
        decompress = repeats * sum(s for _, _, s in coded) / (time.perf_counter() - started) / 1e9
    chosen = sorted({NAMES[c] for c, f in frames if f is not None}) or ["raw"]
    return {"blocks": len(blocks), "block_bytes": len(blocks[0]), "ratio": raw / stored,
            "ratio_4k_extents": extents_raw / extents, "raw_share": sum(f is None for _, f in frames) / len(blocks),
            "codec": ",".join(chosen), "compress_gbps_per_core": compress, "decompress_gbps_per_core": decompress}


# --- the NVMe tier: capacity and reads ---------------------------------------------------------------
def open_store(folder: str, disk: str, codec: str | None):
    """An embedded store whose NVMe blocks stay there when read (no promotion)."""
    import secrets

    from kvstore.daemon import Daemon, DaemonConfig
    from kvstore.library import EmbeddedStore

    secret = secrets.token_urlsafe(32)
    config = DaemonConfig(node="bench", metadata=f"memory://codec-{uuid.uuid4().hex[:8]}", dram_bytes=4 * MIB,
                          disk_dir=folder, disk_bytes=int(disk[:-3]) * MIB, disk_codec=codec, promote=False,
                          secret=secret, engine_listen="127.0.0.1:0")
    daemon = Daemon(config)
    daemon.start()
    daemon.serve()
    return EmbeddedStore(daemon, secret=secret)


def fill_tier(store, fp: ModelFingerprint, blocks: list[bytes], coded: bool) -> tuple[list[bytes], float]:
    """Put twice what the tier holds raw, the coder keeping up (a steady put rate); returns (the
    hashes put, blocks the NVMe tier held on average over the second half, once full)."""
    nvme = store.daemon.store
    per_block = len(blocks[0])
    want = 2 * nvme.nvme.capacity // per_block + 8
    hashes = external_hashes(range(want), fp)
    counts = []
    for start in range(0, want, 4):
        chunk = [(h, blocks[i % len(blocks)]) for i, h in enumerate(hashes[start : start + 4], start)]
        store.put_many(chunk, fingerprint=fp)
        if coded:
            deadline = time.monotonic() + 10
            while nvme.uncoded and time.monotonic() < deadline:
                time.sleep(0.005)
        if start >= want // 2:  # it cycles between the low and high watermarks: the mean of a cycle
            with nvme.lock:
                counts.append(len(nvme.nvme.sealed))
    return hashes, sum(counts) / len(counts)


def bench_tier(name: str, blocks: list[bytes], disk: str, passes: int) -> dict:
    """Blocks a tier of `disk` holds with the codec off and on, and same-host NVMe get GB/s (the two
    stores side by side, read in turns, who goes first alternating; the median of the per-pass ratios)."""
    per_block = len(blocks[0])
    fp = ModelFingerprint(f"bench-codec-{name}", "bfloat16", 128, 4, 4, 64, kv_layout="bytes")
    folders = [tempfile.mkdtemp(prefix="kvstore-bench-codec-") for _ in range(2)]
    out: dict = {}
    try:
        with open_store(folders[0], disk, None) as raw, open_store(folders[1], disk, "lz4") as lz4:
            samples: dict[str, list[float]] = {"raw": [], "lz4": []}
            readers = {}
            for key, store in (("raw", raw), ("lz4", lz4)):
                hashes, held = fill_tier(store, fp, blocks, key == "lz4")
                nvme = store.daemon.store
                with nvme.lock:
                    on_nvme = list(nvme.nvme.sealed)
                    out[f"{key}_coded_blocks"] = sum(1 for s in nvme.nvme.sealed.values() if s.codec)
                out[f"{key}_blocks_held"] = held
                sample = [k[1] for k in on_nvme[-16:]]
                outs = [np.empty(per_block, np.uint8) for _ in sample]
                expect = [blocks[hashes.index(h) % len(blocks)] for h in sample]
                store.get_many(sample, outs, fingerprint=fp)  # warm: the tier fd, its bounce buffers
                if any(bytes(o) != e for o, e in zip(outs, expect)):
                    raise RuntimeError("wrong bytes from the NVMe tier")
                readers[key] = (store, sample, outs)
            for turn in range(passes):
                for key in ("raw", "lz4") if turn % 2 == 0 else ("lz4", "raw"):
                    store, sample, outs = readers[key]
                    started = time.perf_counter()
                    for _ in range(3):
                        if not all(store.get_many(sample, outs, fingerprint=fp)):
                            raise RuntimeError("an NVMe get missed")
                    samples[key].append(3 * len(sample) * per_block / (time.perf_counter() - started) / 1e9)
            capacity = raw.daemon.store.nvme.capacity
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    for key in ("raw", "lz4"):
        out[f"{key}_read_gbps"] = statistics.median(samples[key])
    out["held_ratio"] = out["lz4_blocks_held"] / max(out["raw_blocks_held"], 1)
    out["read_ratio"] = statistics.median(b / a for a, b in zip(samples["raw"], samples["lz4"]))
    out["tier_bytes"] = capacity
    return out


# --- a throttled cross-host link -------------------------------------------------------------------
def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


def link_missing() -> str:
    """Why the throttled link cannot be built here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    for tool in ("ip", "tc", "etcd"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return ""


def link_up(rate: str) -> None:
    link_down()
    _sh("ip", "netns", "add", NET_NS)
    _sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
    _sh("ip", "link", "set", VETH_NS, "netns", NET_NS)
    _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", VETH_HOST)
    _sh("ip", "link", "set", VETH_HOST, "up")
    _sh("ip", "netns", "exec", NET_NS, "ip", "addr", "add", f"{NS_IP}/24", "dev", VETH_NS)
    _sh("ip", "netns", "exec", NET_NS, "ip", "link", "set", VETH_NS, "up")
    _sh("ip", "netns", "exec", NET_NS, "ip", "link", "set", "lo", "up")
    # tbf each way: what a 1 Gbit/s link between hosts gives (burst 256 KB, queue up to 50 ms).
    _sh("tc", "qdisc", "add", "dev", VETH_HOST, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
    _sh("ip", "netns", "exec", NET_NS, "tc", "qdisc", "add", "dev", VETH_NS, "root", "tbf", "rate", rate, "burst",
        "256kb", "latency", "50ms")


def link_down() -> None:
    subprocess.run(["ip", "link", "del", VETH_HOST], capture_output=True, timeout=20)
    subprocess.run(["ip", "netns", "del", NET_NS], capture_output=True, timeout=20)


def bench_wire(sources: dict[str, list[bytes]], rate: str, rounds: int) -> dict:
    """Raw GB/s a client reads from a daemon across the throttled link, with and without the wire codec."""
    from kvstore import Client
    from kvstore_testing.ports import free_port

    missing = link_missing()
    if missing:
        return {"available": False, "reason": missing}
    out: dict = {"available": True, "rate": rate}
    folder = tempfile.mkdtemp(prefix="kvstore-bench-codec-etcd-")
    etcd = daemon = None
    try:
        link_up(rate)
        port, peer = free_port(), free_port()
        client_url, peer_url = f"http://{HOST_IP}:{port}", f"http://127.0.0.1:{peer}"
        etcd = processes.spawn(["etcd", "--name", "codec", "--data-dir", folder, "--listen-client-urls", client_url,
                                "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url,
                                "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"codec={peer_url}",
                                "--log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metadata = f"etcd://{HOST_IP}:{port}"
        cluster = f"codec-{uuid.uuid4().hex[:6]}"
        # The daemon runs in the namespace: everything it sends crosses the throttled link.
        daemon = processes.spawn(["ip", "netns", "exec", NET_NS, sys.executable, "-m", "kvstore.cli", "serve",
                                  "--node", "far", "--metadata", metadata, "--cluster", cluster, "--dram", "1GiB",
                                  "--insecure", "--listen", f"{NS_IP}:0", "--engine-listen", f"{NS_IP}:0",
                                  "--lease-ttl", "30"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        if not daemon.stdout.readline():
            raise RuntimeError("the daemon in the network namespace did not start")
        for name, blocks in sources.items():
            fp = ModelFingerprint(f"bench-wire-{name}", "bfloat16", 128, 4, 4, 64, kv_layout="bytes")
            hashes = external_hashes(range(len(blocks)), fp)
            with Client(metadata, cluster=cluster, fingerprint=fp, transport="tcp", timeout=30) as writer:
                writer.mirror.wait_until(lambda m: "far" in m.nodes, 20)
                for start in range(0, len(blocks), 4):
                    writer.put_many(list(zip(hashes[start : start + 4], blocks[start : start + 4])))
            row: dict = {"blocks": len(blocks), "block_bytes": len(blocks[0])}
            for codec in (None, "lz4", None, "lz4")[: 2 * rounds]:
                with Client(metadata, cluster=cluster, fingerprint=fp, transport="tcp", timeout=30,
                            wire_codec=codec) as reader:
                    reader.mirror.wait_until(lambda m: all(m.lookup(fp, h) for h in hashes), 20)
                    outs = [np.empty(len(b), np.uint8) for b in blocks]
                    started = time.perf_counter()
                    for start in range(0, len(blocks), 32):  # a long prompt's blocks: one get
                        if not all(reader.get_many(hashes[start : start + 32], outs[start : start + 32])):
                            raise RuntimeError("a get across the link missed")
                    gbps = sum(map(len, blocks)) / (time.perf_counter() - started) / 1e9
                    if any(bytes(o) != b for o, b in zip(outs, blocks)):
                        raise RuntimeError("wrong bytes across the link")
                    key = codec or "raw"
                    row.setdefault(f"{key}_gbps_runs", []).append(gbps)
                    if codec:
                        row["sent_ratio"] = reader.stats["wire_read_raw_bytes"] / max(reader.stats["wire_read_bytes"], 1)
            for key in ("raw", "lz4"):
                row[f"{key}_gbps"] = max(row[f"{key}_gbps_runs"])
            row["speedup"] = row["lz4_gbps"] / row["raw_gbps"]
            out[name] = row
    except (subprocess.SubprocessError, OSError, RuntimeError) as exc:
        out = {"available": False, "reason": f"{type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        if daemon is not None:
            processes.stop(daemon, grace=10)
        if etcd is not None:
            processes.stop(etcd, grace=5)
        link_down()
        shutil.rmtree(folder, ignore_errors=True)
    return out


# --- report ----------------------------------------------------------------------------------------
def show(doc: dict) -> None:
    print(f"\n  {'source':<16}{'codec':<14}{'ratio':>7}{'4K ext':>8}{'raw %':>7}{'comp GB/s':>11}{'decomp GB/s':>13}")
    for name, r in doc["ratio"].items():
        dec = f"{r['decompress_gbps_per_core']:.2f}" if r["decompress_gbps_per_core"] else "-"
        print(f"  {name:<16}{r['codec']:<14}{r['ratio']:>7.3f}{r['ratio_4k_extents']:>8.3f}{100 * r['raw_share']:>7.0f}"
              f"{r['compress_gbps_per_core']:>11.2f}{dec:>13}")
    print(f"\n  {'source':<16}{'held raw':>9}{'held lz4':>9}{'x':>7}{'read raw GB/s':>15}{'read lz4 GB/s':>15}{'x':>7}")
    for name, t in doc["tier"].items():
        print(f"  {name:<16}{t['raw_blocks_held']:>9.1f}{t['lz4_blocks_held']:>9.1f}{t['held_ratio']:>7.3f}"
              f"{t['raw_read_gbps']:>15.2f}{t['lz4_read_gbps']:>15.2f}{t['read_ratio']:>7.2f}")
    wire = doc["wire"]
    if not wire.get("available"):
        print(f"\n  throttled link: n/a ({wire.get('reason')})")
        return
    print(f"\n  across a {wire['rate']} link (tbf, veth into a network namespace), raw GB/s delivered:")
    print(f"  {'source':<16}{'no codec':>10}{'lz4':>8}{'x':>7}{'sent ratio':>12}")
    for name, w in wire.items():
        if isinstance(w, dict):
            print(f"  {name:<16}{w['raw_gbps']:>10.3f}{w['lz4_gbps']:>8.3f}{w['speedup']:>7.2f}{w['sent_ratio']:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codec", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--quick", action="store_true", help="synthetic sources, small sizes")
    parser.add_argument("--vllm", action="store_true", help="also real KV saved by vLLM (CPU; a few minutes)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of 1024 tokens each vLLM engine serves")
    parser.add_argument("--link", default="1gbit", help="the throttled link's rate (tc's syntax)")
    parser.add_argument("--no-link", action="store_true", help="skip the throttled link")
    parser.add_argument("--dump-vllm", metavar="DIR", help=argparse.SUPPRESS)  # the child process's job
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dump_vllm:
        return dump_vllm(args.dump_vllm, args.dtype, args.prompts)
    count = 24 if args.quick else 96
    sources = {"synthetic-bf16": synthetic("bfloat16", count), "synthetic-fp16": synthetic("float16", count, seed=1)}
    notes = {}
    if args.vllm:
        for dtype, short in (("bfloat16", "bf16"), ("float16", "fp16")):
            blocks, why = vllm_blocks(dtype, args.prompts)
            if blocks:
                sources[f"vllm-{short}"] = blocks
                print(f"  vLLM ({dtype}) saved {len(blocks)} blocks of {len(blocks[0])} bytes", flush=True)
            else:
                notes[f"vllm-{short}"] = why
                print(f"  vLLM ({dtype}): {why}", flush=True)
    doc: dict = {"machine": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime()),
                 "load": os.getloadavg()[0], "min_gain": MIN_GAIN, "notes": notes, "ratio": {}, "tier": {}}
    started = time.monotonic()
    for name, blocks in sources.items():
        doc["ratio"][name] = measure_ratio(blocks, 1 if args.quick else 3)
    print(f"  ratio and speed: {time.monotonic() - started:.0f} s", flush=True)
    for name, blocks in sources.items():
        doc["tier"][name] = bench_tier(name, blocks, "16MiB" if args.quick else "64MiB", 4 if args.quick else 20)
    print(f"  + NVMe tier: {time.monotonic() - started:.0f} s", flush=True)
    wire_sources = {n: b[: 12 if args.quick else count] for n, b in sources.items()
                    if n in ("synthetic-bf16", "vllm-bf16")}
    doc["wire"] = {"available": False, "reason": "--no-link"} if args.no_link else \
        bench_wire(wire_sources, args.link, 1 if args.quick else 2)
    print(f"  + throttled link: {time.monotonic() - started:.0f} s", flush=True)
    show(doc)
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(processes.run_main(main))
