"""`kvstore demo transfer`: two processes move 64 MiB both ways over shm and TCP and verify it."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time

import numpy as np

from .engine import Engine
from .ops import Read, Write

SIZE = 64 << 20
BLOCK = 1 << 20


def _serve() -> None:
    engine = Engine("demo-target", secret=os.environ["KVT_DEMO_SECRET"])
    region = engine.allocate(SIZE)
    print(json.dumps({"descriptor": engine.export().to_json(), "region": region.id}), flush=True)
    for line in sys.stdin:
        if line.strip() == "sha":
            print(hashlib.sha256(region.buffer).hexdigest(), flush=True)
        else:
            break
    engine.close()


def run() -> int:
    """Run the demo and print a table; returns a process exit code."""
    secret = secrets.token_hex(16)  # both processes, nobody else
    child = subprocess.Popen([sys.executable, "-m", "transfer.demo", "--serve"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, KVT_DEMO_SECRET=secret))
    try:
        hello = json.loads(child.stdout.readline())
        data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
        expected = hashlib.sha256(data).hexdigest()
        print(f"{'transport':<10}{'op':<7}{'MiB':>6}{'GB/s':>8}  verified")
        ok = True
        with Engine("demo-initiator", listen=None, secret=secret) as engine:
            local = engine.register(data)
            back = engine.allocate(SIZE)
            for transport in ("shm", "tcp"):
                peer = engine.connect(hello["descriptor"], transport=transport)
                remote = peer.region(hello["region"])
                for name, op in (("write", Write), ("read", Read)):
                    target = local if op is Write else back
                    ops = [op(target, o, remote, o, BLOCK) for o in range(0, SIZE, BLOCK)]
                    started = time.perf_counter()
                    engine.transfer(ops)
                    seconds = time.perf_counter() - started
                    if op is Write:
                        child.stdin.write("sha\n")
                        child.stdin.flush()
                        good = child.stdout.readline().strip() == expected
                    else:
                        good = hashlib.sha256(back.buffer).hexdigest() == expected
                        np.frombuffer(back.buffer, np.uint8)[:] = 0
                    ok &= good
                    label = "tcp+aead" if transport == "tcp" and peer.wire == "aead" else transport  # encrypted
                    print(f"{label:<10}{name:<7}{SIZE >> 20:>6}{SIZE / seconds / 1e9:>8.2f}  {'yes' if good else 'NO'}")
                peer.close()
        return 0 if ok else 1
    finally:
        child.stdin.close()
        child.wait(10)


if __name__ == "__main__":
    if "--serve" in sys.argv:
        _serve()
    else:
        sys.exit(run())
