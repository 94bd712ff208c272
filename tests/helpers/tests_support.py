"""Small helpers shared by tests."""
from __future__ import annotations

import hashlib
import time
from typing import Callable

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


def until(condition: Callable[[], bool], timeout: float = 10.0, every: float = 0.01) -> bool:
    """Poll `condition()` until it holds or `timeout` s pass; whether it held. For what another
    thread or process does meanwhile: on a loaded machine it can take seconds, not a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
