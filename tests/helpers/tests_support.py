"""Small helpers shared by tests."""
from __future__ import annotations

import hashlib
import time

import numpy as np


def sha(data: bytes | memoryview | np.ndarray) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def wait_until_stopped(pid: int, timeout: float = 5.0) -> None:
    """After SIGSTOP: wait until the process really is stopped (the signal is only queued)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")
