"""Engine runs forked from one process that has imported vLLM already (tests and benchmarks, not
the product).

A Python process that runs a vLLM engine (`python -m kvstore_testing.engine_run SPEC`, a
benchmark's engine script) spends about half of its life importing vLLM: 8-16 s of the suite's 2
vCPUs, for each of the few dozen engines the suite starts. `EngineForks` starts one server process
that imports vLLM (and only vLLM and what it pulls in: nothing of kvstore, whose modules may read
the environment as they load), then forks a child per run. The child takes the run's environment,
working directory and argv and runs it as `python -m MODULE ...` or `python -c CODE ...` would,
with stdout and stderr in files of its own; the caller gets the CompletedProcess a subprocess.run
of the same command gives. Only the import is shared: the server has run nothing of vLLM's when it
forks, so each child builds its engine from scratch. The server is a `processes.spawn` child (a
group of its own, which its forks stay in: stopping it stops a run in flight too, when the program
ends or is interrupted). Where it cannot start (or KVSTORE_TEST_ENGINE_FORKS=0), runs are plain
processes.

    python -m kvstore_testing.engine_fork    # the server: one JSON request per line on stdin
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

READY = "ready"
RESULT = "RESULT "  # the line an engine run prints its JSON result on (engine_run, tier_engine, benchmark scripts)
START_TIMEOUT_S = 300.0  # importing vLLM on a loaded 2-vCPU machine


class EngineForks:
    """A client of one fork server, started at the first run (see module docstring)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._broken = os.environ.get("KVSTORE_TEST_ENGINE_FORKS", "1") == "0"
        self._lock = threading.Lock()

    def run(self, spec: dict, *, env: dict | None = None, cwd: str | None = None,
            timeout: float = 300.0) -> subprocess.CompletedProcess:
        """What `subprocess.run([python, -m, kvstore_testing.engine_run, SPEC], capture_output=True,
        text=True, env=env, cwd=cwd, timeout=timeout)` returns, from a forked child."""
        return self.python(["-m", "kvstore_testing.engine_run", json.dumps(spec)], env=env, cwd=cwd, timeout=timeout)

    def python(self, argv: list[str], *, env: dict | None = None, cwd: str | None = None,
               timeout: float = 300.0) -> subprocess.CompletedProcess:
        """What `subprocess.run([python, *argv], capture_output=True, text=True, env=env, cwd=cwd,
        timeout=timeout)` returns, from a forked child; `argv` is `-m MODULE ARGS...` or `-c CODE ARGS...`."""
        if len(argv) < 2 or argv[0] not in ("-m", "-c"):
            raise ValueError(f"argv must start with -m MODULE or -c CODE, not {argv[:1]}")
        args = [sys.executable, *argv]
        with self._lock:
            if not self._broken and self._proc is None:
                self._start()
            if self._broken:
                return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
            return self._forked(args, dict(os.environ if env is None else env), cwd or os.getcwd(), timeout)

    def close(self) -> None:
        from kvstore_testing import processes  # the client's side only: the server imports nothing of kvstore

        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:  # not reaped yet (processes.stop_all may have)
            processes.stop(proc, grace=10.0)  # its group: a run still going goes with it

    def _start(self) -> None:
        from kvstore_testing import processes

        try:
            self._proc = processes.spawn([sys.executable, "-m", "kvstore_testing.engine_fork"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            if self._line(time.monotonic() + START_TIMEOUT_S) != {"state": READY}:
                raise RuntimeError("the engine fork server did not say it was ready")
            atexit.register(self.close)
        except processes.InjectedFailure:  # a test crashing the caller with the server up
            raise
        except (OSError, RuntimeError, ValueError):
            self.close()
            self._broken = True  # plain processes from now on

    def _forked(self, args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="kvstore-engine-fork-") as scratch:
            out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
            request = {"argv": args[1:], "env": env, "cwd": cwd, "stdout": out, "stderr": err}
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            deadline = time.monotonic() + timeout
            pid = self._line(deadline)["pid"]
            try:
                code = self._line(deadline)["rc"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._line(time.monotonic() + 30)  # the server reaps it and says so
                raise subprocess.TimeoutExpired(args, timeout, output=_read(out), stderr=_read(err)) from None
            return subprocess.CompletedProcess(args, code, _read(out), _read(err))

    def _line(self, deadline: float) -> dict:
        """The server's next JSON line; TimeoutError past `deadline`, RuntimeError if it ended."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the engine fork server did not answer in time")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._broken = True
                    raise RuntimeError("the engine fork server ended")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)


class EngineRunFailed(RuntimeError):
    """An engine run printed no RESULT line (it failed or was killed); the message ends with its stderr."""


def result_of(done: subprocess.CompletedProcess, what: str = "the engine run") -> dict:
    """The JSON an engine run printed on its RESULT line; EngineRunFailed, with its exit code and
    the tail of its stderr, where it printed none."""
    line = next((line for line in done.stdout.splitlines() if line.startswith(RESULT)), None)
    if line is None:
        raise EngineRunFailed(f"{what} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line[len(RESULT):])


_shared: EngineForks | None = None


def engine_forks() -> EngineForks:
    """This process's one EngineForks (its server starts at the first run)."""
    global _shared
    if _shared is None:
        _shared = EngineForks()
    return _shared


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _child(request: dict) -> None:
    """In the forked child: the run's files, environment and folder, then its module or code as
    `__main__`, as `python -m MODULE` or `python -c CODE` started in that folder would run it."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # where `python -m` or `-c` run there would look first
        flag, target, *rest = request["argv"]
        if flag == "-m":
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child's failure is its stderr and exit code
        traceback.print_exc()
    finally:
        try:  # what the run registered to happen at exit (a file to remove, say), as a normal exit does
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """The server: import vLLM, then fork one child per request line, answering its pid and, once
    it ended, its exit code."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what imports print must not reach the answers
    import vllm  # noqa: F401 - the point: children inherit it imported
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.v1.engine import llm_engine  # noqa: F401

    answers.write(json.dumps({"state": READY}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(request)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
