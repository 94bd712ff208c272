"""Runs a local etcd (Debian's etcd-server) on free loopback ports with a temporary data dir:
for tests, benchmarks and trying a cluster on one machine."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Sequence

from kvstore.testing import processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member. `start()` waits until it reports healthy; `kill()`/`start()` restart it on
    the same ports and data, like a crashed and recovered server."""

    def __init__(self, data_dir: str | None = None, extra_args: Sequence[str] = ()) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd not found: install Debian's etcd-server (scripts/install-test-deps.sh)")
        self.binary = binary
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvstore-etcd-")
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.extra_args = list(extra_args)  # more etcd flags, e.g. a lower --max-txn-ops

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = processes.spawn(
            [self.binary, "--name", "kvstore-test", "--data-dir", self.data_dir,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvstore-test={peer}", "--logger", "zap", "--log-level", "error", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as reply:
                    if b'"health":"true"' in reply.read():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    def kill(self) -> None:
        if self.proc is not None:
            processes.kill(self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            processes.stop(self.proc, grace=10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


if __name__ == "__main__":  # a scratch etcd for manual runs
    with EtcdServer() as server:
        print(server.url, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    os._exit(0)
