"""Running a benchmark as its users do (`python -m benchmarks.NAME ...`, a process of its own) and
finding every process it left behind.

The benchmark runs under reaper.py, a child subreaper: whatever the benchmark started (etcd,
`kvstore serve`, `vllm serve` and its engine core, routers, helpers) is reparented to it when its
parent ends, even in a group or session of its own or under another process title (vLLM renames
its engine core), so the reaper sees what outlived the benchmark, reports it and kills it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from tests_support import as_foreground

ROOT = Path(__file__).resolve().parents[2]
REAPER = Path(__file__).resolve().parent / "reaper.py"


@dataclass
class Run:
    code: int
    output: str
    seconds: float
    records: object | None  # the --json document, when the run wrote one
    left_behind: list[str]  # "pid: command line" of each process that outlived the benchmark (killed since)


class Started:
    """A benchmark running under the reaper."""

    def __init__(self, name: str, args: list[str], report: Path, timeout: float, env: dict | None = None) -> None:
        self.report, self.timeout = report, timeout
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # SIGINT as a terminal gives it, whatever this pytest inherited: an ignored SIGINT passes to
        # children through exec, and the Ctrl-C test would see the benchmark run on to its end.
        self.proc = subprocess.Popen(
            as_foreground([sys.executable, str(REAPER), "--report", str(report), "--timeout", str(timeout), "--",
                           sys.executable, "-m", f"benchmarks.{name}", *args]),
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def benchmark_pid(self, timeout: float = 30.0) -> int:
        """The benchmark's own pid (the reaper's one child at first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = children_of(self.proc.pid)
            if kids:
                return kids[0]
            time.sleep(0.05)
        raise AssertionError("the benchmark did not start")

    def signal(self, sig: int) -> None:
        """Like Ctrl-C or `kill` on the benchmark (the reaper passes it on)."""
        os.kill(self.proc.pid, sig)

    def finish(self) -> tuple[int, str, list[str]]:
        """(the benchmark's exit code, its output, what it left behind)."""
        try:
            output, _ = self.proc.communicate(timeout=self.timeout + 120)
        except subprocess.TimeoutExpired:  # the reaper itself hung: take the whole group down
            os.killpg(self.proc.pid, signal.SIGKILL)
            output, _ = self.proc.communicate()
            return -9, output + "\n[test: the reaper hung]", ["(unknown: the reaper hung)"]
        report = json.loads(self.report.read_text())
        if report["timed_out"]:
            output += f"\n[test: killed after {self.timeout:.0f} s]"
        return report["code"], output, report["left_behind"]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                pass
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid}: {command[:200]}"
    except OSError:
        return f"{pid}: (gone)"


def runner(tmp_path: Path) -> Callable[..., Run]:
    """run(name, *args, timeout=..., env=...) -> Run: `--json` (a file of tmp_path) is added, and
    Run.left_behind lists (and has killed) every process of the run still alive after it."""

    def run(name: str, *args: str, timeout: float = 240.0, env: dict | None = None) -> Run:
        out = tmp_path / f"{name}.json"
        started = time.monotonic()
        code, output, left = Started(name, [*args, "--json", str(out)], tmp_path / f"{name}.reaper.json",
                                     timeout, env).finish()
        seconds = time.monotonic() - started
        print(f"benchmarks.{name} {' '.join(args)}: {seconds:.1f} s, exit code {code}")
        records = json.loads(out.read_text()) if out.exists() else None
        return Run(code, output, seconds, records, left)

    return run
