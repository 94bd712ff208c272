"""Two daemons told to listen on the same port: the second fails at start in one line. Real
processes, real sockets."""
from __future__ import annotations

import os
import subprocess
import sys

from kvstore_testing.ports import free_port


def serve(node: str, port: int) -> list[str]:
    return [sys.executable, "-m", "kvstore.cli", "serve", "--node", node, "--insecure", "--dram", "16MiB",
            "--listen", f"127.0.0.1:{port}", "--log-level", "warning"]


def test_a_second_daemon_on_a_taken_port_fails_instead_of_sharing_it():
    """Kills: gRPC's default SO_REUSEPORT (the second daemon bound the same port and the kernel
    split the first one's callers between them), and a bind failure as a traceback."""
    port = free_port()
    first = subprocess.Popen(serve("first", port), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert first.stdout.readline().startswith("{")  # serving
        done = subprocess.run(serve("second", port), capture_output=True, text=True, timeout=60,
                              env={**os.environ, "GRPC_VERBOSITY": "NONE"})
        assert done.returncode == 1, done.stdout
        lines = [line for line in done.stderr.splitlines() if "kvstore serve" in line]
        assert lines == [f"kvstore serve: cannot start second: OSError: cannot listen on 127.0.0.1:{port} "
                         "(--listen): the address is in use or not this host's"], done.stderr
    finally:
        first.terminate()
        first.wait(20)
