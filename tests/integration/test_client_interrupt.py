"""Ctrl-C in a terminal while a client writes: SIGINT reaches the whole foreground group, the
client and a `kvstore serve` it started alike. The client must stop with KeyboardInterrupt at once,
not retry its put on other nodes until it ends with NoStoreNodes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests_support import as_foreground

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WRITER = r'''
import subprocess, sys, time
import numpy as np
from kvstore import Client
from kvstore.keys import ModelFingerprint, external_hashes

metadata = sys.argv[1]
daemon = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--node", "fg", "--insecure",
                           "--metadata", metadata, "--cluster", "ctrl-c", "--dram", "64MiB",
                           "--metrics-port", "0", "--lease-ttl", "3"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
daemon.stdout.readline()
fp = ModelFingerprint("m", "bfloat16", 16, 2, 2, 64, kv_layout="bytes")
client = Client(metadata, cluster="ctrl-c", fingerprint=fp, timeout=20)
client.mirror.wait_until(lambda m: len(m.nodes) == 1, 20)
hashes = external_hashes(range(1_000_000), fp)
data = np.ones(256 << 10, np.uint8)
print("writing", flush=True)
done = 0
try:
    while True:
        client.put_many([(h, data) for h in hashes[done : done + 32]])
        done += 32
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    raise
except BaseException as exc:
    print("ended by", type(exc).__name__, str(exc)[:300], flush=True)
    raise
'''


def test_ctrl_c_stops_a_writing_client_with_keyboard_interrupt(etcd_server):
    """Kills: a put loop that treats any exception, KeyboardInterrupt included, as a node's failure
    (the node is marked down and the put moves on): the script then ends with NoStoreNodes, as the
    daemon beside it stopped too, not with the user's interrupt."""
    proc = subprocess.Popen(as_foreground([sys.executable, "-c", WRITER, etcd_server.url]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        time.sleep(0.5)  # puts under way
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the client and its daemon
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert out.strip().splitlines()[-1] == "KeyboardInterrupt", out + err[-2000:]
    assert proc.returncode == -signal.SIGINT and took < 5, (proc.returncode, took)
