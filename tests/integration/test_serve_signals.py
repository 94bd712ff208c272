"""`kvstore serve` and Ctrl-C while it starts: a large DRAM tier fills its pages for seconds, and
the daemon must stop at once, in one line, with no traceback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvstore.daemon.host_room import memory_limit
from tests_support import as_foreground

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resident(pid: int) -> int:
    """Bytes of memory `pid` has filled (its resident set, shared pages included)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_ctrl_c_while_the_dram_tier_fills_stops_the_daemon_in_one_line(etcd_server, tmp_path):
    """Kills: filling the whole arena in one MAP_POPULATE (the kernel ignores Ctrl-C for its whole
    length; the interrupt then surfaces as a KeyboardInterrupt traceback once it returns), and a
    start-up interrupted with a traceback instead of one line and exit 130."""
    limit, _ = memory_limit()
    dram = min(4 << 30, (limit or 8 << 30) // 4)
    proc = subprocess.Popen(as_foreground([sys.executable, "-m", "kvstore.cli", "serve", "--node", "ctrl-c", "--insecure",
                                           "--metadata", etcd_server.url, "--dram", str(dram), "--metrics-port", "0"]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while resident(proc.pid) < 256 << 20:  # the arena is filling
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        filled = resident(proc.pid)
        while proc.poll() is None and time.monotonic() < deadline:  # how far the filling goes on after it
            filled = max(filled, resident(proc.pid))
            time.sleep(0.02)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert lines == ["kvstore serve: ctrl-c interrupted while starting"], err
    assert not out.strip()  # it never said it was ready
    assert filled < dram // 2, f"the arena kept filling after Ctrl-C: {filled >> 20} of {dram >> 20} MiB"
