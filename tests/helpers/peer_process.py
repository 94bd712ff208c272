"""A Transfer Engine in its own process for cross-process tests.

Exports three regions filled with a seeded pattern (shared memory, a numpy array, a file) and a
read-only one, prints one JSON line describing them, then answers JSON commands on stdin:
{"cmd": "sha", "region": NAME, "offset": O, "length": N} -> {"sha": HEX}, {"cmd": "exit"}.
"""
from __future__ import annotations

import argparse
import hashlib
import json
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
    args = parser.parse_args()

    engine = Engine("peer", secret=args.secret, stall_timeout=args.stall)
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
    regions = {"shm": shm, "numpy": arr, "file": file_region, "readonly": frozen, "private": private}
    views = {"shm": shm.buffer, "numpy": array, "readonly": frozen.buffer, "private": private.buffer}

    print(json.dumps({"descriptor": engine.export().to_json(),
                      "regions": {name: r.id for name, r in regions.items()}}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "sha":
            name, offset, length = cmd["region"], cmd["offset"], cmd["length"]
            if name == "file":
                with open(path, "rb") as f:
                    f.seek(offset)
                    blob = f.read(length)
            else:
                blob = bytes(memoryview(views[name]).cast("B")[offset : offset + length])
            print(json.dumps({"sha": hashlib.sha256(blob).hexdigest()}), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
