"""Small helpers shared by tests."""
from __future__ import annotations

import hashlib
import sys
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


def as_foreground(command: list[str], file_size_limit: int | None = None) -> list[str]:
    """`command` with SIGINT at its default, as a terminal's foreground job gets it (a suite run as a
    background job, `cmd &` in a script, starts with SIGINT ignored, which children inherit), and
    optionally a file-size limit (SIGXFSZ ignored: a write past it fails with EFBIG). A small Python
    sets these up and execs the command, instead of a Popen `preexec_fn`: that runs Python in a fork
    of this process, and with gRPC threads alive here gRPC's fork handlers started its poller in the
    child, which aborted it ("epoll_wait error: Bad file descriptor", exit -6, seen in a suite run)."""
    setup = "import os, resource, signal, sys\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    if file_size_limit is not None:
        setup += (f"signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                  f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, {file_size_limit}))\n")
    return [sys.executable, "-c", setup + "os.execvp(sys.argv[1], sys.argv[1:])", *command]
