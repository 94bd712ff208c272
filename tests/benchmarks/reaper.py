"""Runs a command and reports every process it left behind: this process becomes a child
subreaper (PR_SET_CHILD_SUBREAPER), so whatever the command started is reparented here when its
parent ends, whatever group, session or process title it took. Once the command exits (or is
killed at --timeout), processes still alive after --settle seconds are listed, killed and reaped.

    python reaper.py --report PATH [--timeout S] [--settle S] -- COMMAND...

SIGTERM, SIGINT and SIGHUP are passed on to the command. The report (JSON): {"code": the command's
exit code (negative: killed by that signal), "timed_out": bool, "left_behind": ["pid: cmdline", ...]}.
This process exits with 0 (the report says the rest)."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def children() -> list[int]:
    """Live (not zombie) processes whose parent is this one."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = "(gone)"
    return f"{pid}: {command[:200]}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    proc = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    timed_out = False
    try:
        code = proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        code = proc.wait()
    left: list[str] = []
    seen: set[int] = set()
    deadline = time.monotonic() + args.settle
    while True:
        reap()
        alive = children()
        if not alive:
            break
        if time.monotonic() < deadline:
            time.sleep(0.1)
            continue
        for pid in alive:  # what outlived the command: listed, then killed (its own children come next)
            if pid not in seen:
                seen.add(pid)
                left.append(describe(pid))
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                except (ProcessLookupError, PermissionError):
                    pass
        time.sleep(0.1)
    with open(args.report, "w") as f:
        json.dump({"code": code, "timed_out": timed_out, "left_behind": left}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
