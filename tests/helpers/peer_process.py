"""A Transfer Engine in its own process for cross-process tests.

Exports three regions filled with a seeded pattern (shared memory, a numpy array, a file) and a
read-only one, prints one JSON line describing them, then answers JSON commands on stdin:
{"cmd": "sha", "region": NAME, "offset": O, "length": N} -> {"sha": HEX}, {"cmd": "exit"},
{"cmd": "limit_as", "extra_mib": N | null} -> {"ok": true} (caps the address space, for fault tests),
{"cmd": "grant" | "revoke" | "landing", "peer": ID, "region": NAME, "offset": O, "length": N} ->
{"ok": true} | {"quiet": bool} | {"landing": bool} | {"error": TYPE} (write grants of the region
"granted", which takes remote writes only where granted; "sealed" takes none).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile

import numpy as np

from transfer import Engine


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4 << 20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--stall", type=float, default=10.0)
    parser.add_argument("--handshake-timeout", type=float, default=5.0)
    parser.add_argument("--bounce-limit", type=int, default=None, help="the engine's own default without it")
    parser.add_argument("--wire", default=None)
    parser.add_argument("--spare-fds", type=int, default=None, help="cap open files at those in use plus this")
    args = parser.parse_args()

    engine = Engine("peer", secret=args.secret, insecure=args.secret is None, stall_timeout=args.stall,
                    handshake_timeout=args.handshake_timeout, wire=args.wire,
                    **({} if args.bounce_limit is None else {"bounce_limit": args.bounce_limit}))
    data = pattern(args.seed, args.size)
    shm = engine.allocate(args.size)
    np.frombuffer(shm.buffer, np.uint8)[:] = data
    array = data.copy()
    arr = engine.register(array)
    folder = tempfile.mkdtemp(prefix="kvt-peer-")
    path = f"{folder}/tier.bin"
    with open(path, "wb") as f:
        f.write(data.tobytes())
    file_region = engine.register_file(path, args.size)
    frozen = engine.register(bytes(data[:65536].tobytes()))
    private = engine.register(np.zeros(4096, np.uint8), remote_access=False)
    granted = engine.allocate(args.size, remote_writes="granted")
    np.frombuffer(granted.buffer, np.uint8)[:] = data
    sealed_path = f"{folder}/sealed.bin"
    with open(sealed_path, "wb") as f:
        f.write(data.tobytes())
    sealed = engine.register_file(sealed_path, args.size, remote_writes="none")
    regions = {"shm": shm, "numpy": arr, "file": file_region, "readonly": frozen, "private": private,
               "granted": granted, "sealed": sealed}
    views = {"shm": shm.buffer, "numpy": array, "readonly": frozen.buffer, "private": private.buffer,
             "granted": granted.buffer}
    files = {"file": path, "sealed": sealed_path}

    if args.spare_fds is not None:
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + args.spare_fds, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(json.dumps({"descriptor": engine.export().to_json(),
                      "regions": {name: r.id for name, r in regions.items()}}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "limit_as":  # address-space cap: VmSize now + extra_mib (None lifts it)
            extra = cmd.get("extra_mib")
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            if extra is None:
                resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            else:
                with open("/proc/self/status") as f:
                    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
                resource.setrlimit(resource.RLIMIT_AS, (vm + (extra << 20), hard))
            print(json.dumps({"ok": True}), flush=True)
        if cmd["cmd"] in ("grant", "revoke", "landing"):
            call = getattr(engine, cmd["cmd"])
            try:
                answer = call(cmd["peer"], regions[cmd["region"]], cmd["offset"], cmd["length"])
                reply = {"ok": True} if cmd["cmd"] == "grant" else {"quiet" if cmd["cmd"] == "revoke" else "landing": answer}
            except Exception as exc:  # noqa: BLE001 - the test reads which
                reply = {"error": type(exc).__name__}
            print(json.dumps(reply), flush=True)
        if cmd["cmd"] == "sha":
            name, offset, length = cmd["region"], cmd["offset"], cmd["length"]
            if name in files:
                with open(files[name], "rb") as f:
                    f.seek(offset)
                    blob = f.read(length)
            else:
                blob = bytes(memoryview(views[name]).cast("B")[offset : offset + length])
            print(json.dumps({"sha": hashlib.sha256(blob).hexdigest()}), flush=True)
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
