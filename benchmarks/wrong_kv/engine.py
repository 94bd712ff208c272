"""The benchmark's handle on an engine worker process (worker.py): commands in, answers out, each
within a bound. A request that does not finish within its bound is a hung request: the engine is
killed and started again."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from kvstore_testing import processes

from .worker import PREFIX

ROOT = Path(__file__).resolve().parents[2]
START_S = 600.0  # an engine start on a loaded 2-core machine


class Hung(Exception):
    """The engine did not answer within the bound."""


class EngineDied(RuntimeError):
    """The engine process ended (its log's tail says why)."""


class Engine:
    """One vLLM engine with the kvstore connector, in a process of its own; started by the
    constructor, ready after `wait_ready()`."""

    def __init__(self, model: str, extra: dict, engine: dict, log_path: str, secret: str) -> None:
        self.log_path = log_path
        spec = {"model": model, "extra": extra, "engine": engine}
        env = dict(os.environ, KVSTORE_SECRET=secret, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        with open(log_path, "a") as log:
            self.proc = processes.spawn([sys.executable, "-m", "benchmarks.wrong_kv.worker", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                        cwd=ROOT, env=env)
        self._answers: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict = {}

    def wait_ready(self) -> "Engine":
        """Block until the engine has started (it loads its weights at the start, from its path)."""
        if not self.info:
            self.info = self._answer(START_S)
            if not self.info.get("ready"):
                raise EngineDied(f"the engine did not start: {self.info}")
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._answers.put(json.loads(line[len(PREFIX):]))
        self._answers.put(None)  # the process ended

    def _answer(self, timeout: float) -> dict:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise Hung(f"no answer within {timeout:.0f} s") from None
        if answer is None:
            raise EngineDied(f"the engine process ended: {self.log_tail()}")
        return answer

    def call(self, op: str, timeout: float = 120.0, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        if "error" in answer:
            raise RuntimeError(f"engine {op}: {answer['error']}")
        return answer

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        processes.stop(self.proc, grace=10)
