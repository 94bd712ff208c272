"""Running a benchmark as its users do (`python -m benchmarks.NAME ...`, a process of its own) and
finding every process it left behind.

Each run gets a tag in its environment (KVSTORE_TEST_RUN_TAG); every descendant inherits it (etcd,
`kvstore serve`, `vllm serve` and its engine core, routers, helper processes), even one that moved
to a process group or session of its own, so /proc tells which processes of the run survive it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
TAG_ENV = "KVSTORE_TEST_RUN_TAG"


def tagged(tag: str) -> list[int]:
    """Pids of live processes (zombies aside) whose environment carries `tag`."""
    needle = f"{TAG_ENV}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or a kernel thread
            pass
    return pids


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid}: {command[:200]}"
    except OSError:
        return f"{pid}: (gone)"


def survivors(tag: str, settle: float = 5.0) -> list[str]:
    """What of the run is still alive after `settle` seconds (each killed, then reported)."""
    deadline = time.monotonic() + settle
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    found = [describe(pid) for pid in left]
    for pid in left:  # never leak into the rest of the test run
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


@dataclass
class Run:
    code: int
    output: str
    seconds: float
    records: object | None  # the --json document, when the run wrote one
    left_behind: list[str]


def start(name: str, args: list[str], tag: str, env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, TAG_ENV: tag, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[test: killed after {timeout:.0f} s]"
    return proc.returncode, output


def runner(tmp_path: Path) -> Callable[..., Run]:
    """run(name, *args, timeout=..., env=...) -> Run: `--json` (a file of tmp_path) is added, and
    Run.left_behind lists (and has killed) every process of the run still alive."""

    def run(name: str, *args: str, timeout: float = 240.0, env: dict | None = None) -> Run:
        out = tmp_path / f"{name}.json"
        tag = uuid.uuid4().hex
        started = time.monotonic()
        proc = start(name, [*args, "--json", str(out)], tag, env)
        code, output = finish(proc, timeout)
        seconds = time.monotonic() - started
        print(f"benchmarks.{name} {' '.join(args)}: {seconds:.1f} s, exit code {code}")
        records = json.loads(out.read_text()) if out.exists() else None
        return Run(code, output, seconds, records, survivors(tag))

    return run
