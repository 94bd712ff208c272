"""Child processes that never outlive the program that started them (benchmarks, demos, tests).

    proc = spawn([...])          # a process group of its own, registered here
    ...
    stop(proc)                   # SIGTERM to the group, SIGKILL after `grace`, reaped

    if __name__ == "__main__":
        sys.exit(run_main(main))  # SIGTERM/SIGHUP unwind like Ctrl-C; every child is killed on the way out

Each child runs in a process group of its own (`start_new_session`), so stopping it reaches what it
started too (vLLM's engine core, `ip netns exec`'s command). Every child still registered is
stopped, group and all, by `stop_all()`: `run_main` calls it in its `finally`, and it is registered
with `atexit`. `run_main` turns SIGTERM and SIGHUP into an exception (`Interrupted`), as Python
already does SIGINT, so the `finally` blocks of the program run and stop their children first; a
second signal while it cleans up stops every child at once and exits.

Only SIGKILL of the program itself escapes this: its children then live on in their own groups.

Test hook: with KVSTORE_TESTING_FAIL_AFTER_SPAWNS=N in the environment, the Nth `spawn` raises
`InjectedFailure` once its child is running (tests use it to crash a benchmark with children up).
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from kvstore.errors import KVStoreError
from transfer.errors import TransferError

FAIL_AFTER_ENV = "KVSTORE_TESTING_FAIL_AFTER_SPAWNS"

_lock = threading.Lock()
_live: dict[int, subprocess.Popen] = {}
_spawned = 0


class InjectedFailure(RuntimeError):
    """Raised by `spawn` when KVSTORE_TESTING_FAIL_AFTER_SPAWNS says so (tests only)."""


class Interrupted(SystemExit):
    """SIGTERM or SIGHUP arrived (see `run_main`); the exit code is 128 + the signal number."""


def spawn(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(cmd, ...)` in a new process group, registered for `stop_all`."""
    global _spawned
    popen_kwargs.setdefault("start_new_session", True)
    proc = subprocess.Popen(list(cmd), **popen_kwargs)
    with _lock:
        _live[proc.pid] = proc
        _spawned += 1
        count = _spawned
    fail_after = os.environ.get(FAIL_AFTER_ENV)
    if fail_after and count == int(fail_after):
        raise InjectedFailure(f"{FAIL_AFTER_ENV}={fail_after}: failing after starting {cmd[0]} (pid {proc.pid})")
    return proc


def register(proc: subprocess.Popen) -> subprocess.Popen:
    """Have `stop_all` stop a process started elsewhere (best in a group of its own)."""
    with _lock:
        _live[proc.pid] = proc
    return proc


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        if proc.returncode is None:  # not a group leader (started without a session of its own)
            try:
                proc.send_signal(sig)
            except (ProcessLookupError, OSError):
                pass


def exited(proc: subprocess.Popen) -> bool:
    """Whether the process ended, without reaping it: while it is a zombie its group id stays taken,
    so a SIGKILL to the group (`stop`) cannot reach an unrelated process. Use it instead of poll()."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def stop(proc: subprocess.Popen, grace: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """Stop `proc` and its group: `sig` (after SIGCONT, in case it was stopped), SIGKILL after `grace`
    seconds, then reaped. Returns its exit code. Safe to call twice, or on a process that ended."""
    if not exited(proc):
        _signal_group(proc, signal.SIGCONT)
        _signal_group(proc, sig)
        deadline = time.monotonic() + grace
        while not exited(proc) and time.monotonic() < deadline:
            time.sleep(0.02)
    _signal_group(proc, signal.SIGKILL)  # the leader if it is still up, and stragglers of its group
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it registered for stop_all
        return None
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
    with _lock:
        _live.pop(proc.pid, None)
    return proc.returncode


def kill(proc: subprocess.Popen) -> int | None:
    """SIGKILL `proc`'s group at once (a crash), and reap it."""
    return stop(proc, grace=0.0, sig=signal.SIGKILL)


def live() -> list[subprocess.Popen]:
    """Registered children not stopped yet."""
    with _lock:
        return list(_live.values())


def stop_all(grace: float = 3.0) -> None:
    """Stop every registered child and its group: SIGTERM to all at once, SIGKILL after `grace`."""
    stop_together(live(), grace)


def stop_together(procs: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """Stop `procs` and their groups at once: SIGTERM to all, SIGKILL to any still up after `grace`
    (one grace for all of them, not one each: engines that ignore SIGTERM while they load cost it
    once)."""
    for proc in procs:
        if not exited(proc):
            _signal_group(proc, signal.SIGCONT)
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        while not exited(proc) and time.monotonic() < deadline:
            time.sleep(0.02)
    for proc in procs:
        stop(proc, grace=0.0, sig=signal.SIGKILL)


atexit.register(stop_all)


def _interrupt(signum: int, frame) -> None:
    # Further signals while the program unwinds: stop every child now and leave.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _exit_now)
    raise Interrupted(128 + signum)


def _exit_now(signum: int, frame) -> None:
    stop_all(grace=0.0)
    os._exit(128 + signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise `Interrupted` in the main thread (SIGINT raises KeyboardInterrupt)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a program's `main(argv)` so that none of its children outlive it, whatever happens:
    signals unwind it (`install_signal_handlers`), and every child still registered is stopped
    when it returns or raises. An interruption ends with one line and exit code 128 + signal; a
    typed store or transfer error (etcd timing out, a node refusing) with one line and exit code 1."""
    if threading.current_thread() is threading.main_thread():
        install_signal_handlers()
    prog = prog or os.path.basename(sys.argv[0])
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Interrupted as exc:
        print(f"{prog}: interrupted (signal {int(exc.code) - 128})", file=sys.stderr)
        return int(exc.code)
    except (KVStoreError, TransferError) as exc:  # the store or etcd failed it (a timeout, a refusal): one line
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all()


def release(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Tell a child waiting on its stdin to finish (a newline), then stop it within `grace`."""
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
    except OSError:
        pass
    stop(proc, grace=grace)


def start_store_daemon(args: Sequence[str], **popen_kwargs) -> tuple[subprocess.Popen, dict]:
    """`kvstore serve ARGS` as a registered child; returns it and the JSON line it prints once it
    serves (`control`, `metrics_port`, `engine`). Raises RuntimeError, the daemon stopped, if it
    exits before that line."""
    popen_kwargs.setdefault("cwd", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = spawn([sys.executable, "-m", "kvstore.cli", "serve", *args], stdout=subprocess.PIPE, text=True,
                 **popen_kwargs)
    try:
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise RuntimeError(f"kvstore serve {' '.join(args)} exited with {proc.returncode} before serving")
        import json

        return proc, json.loads(line)
    except BaseException:
        stop(proc)
        raise
