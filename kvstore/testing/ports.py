"""Free loopback ports for servers that tests, benchmarks and demos start on a port chosen first.

Ports come from just below the kernel's ephemeral range, so no outgoing connection can take one
between the choice and the server's bind: a port the kernel hands out for `bind(0)` or `connect`
(etcd's own clients, vLLM's, the other test worker's) was, on a busy machine, sometimes taken by
then. Each is checked with a bind, and one process never hands out the same port twice."""
from __future__ import annotations

import os
import random
import socket
import threading

SPAN = 12_000  # ports just below the ephemeral range to choose from
LOWEST = 10_000  # never below: well-known services and the usual dev servers live down there

_lock = threading.Lock()
_handed_out: set[int] = set()
_random = random.Random()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """The kernel's range for automatically chosen ports (Linux), None where it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return None


def candidates(ephemeral: tuple[int, int] | None, span: int = SPAN, lowest: int = LOWEST) -> range | None:
    """Where to choose from: the `span` ports below the ephemeral range (not below `lowest`); None
    when that leaves nothing (an ephemeral range starting low), and the kernel should choose."""
    if ephemeral is None:
        return None
    low = max(lowest, ephemeral[0] - span)
    return range(low, ephemeral[0]) if low < ephemeral[0] else None


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _kernel_choice() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A loopback port nothing is bound to now, outside the kernel's ephemeral range where it can,
    and not one this process handed out before."""
    pool = candidates(ephemeral_range())
    with _lock:
        if len(_handed_out) > SPAN // 2:  # those were bound (or given up) long ago: room to choose again
            _handed_out.clear()
        for _ in range(200):
            port = _random.choice(pool) if pool is not None else _kernel_choice()
            if port not in _handed_out and _binds(port):
                _handed_out.add(port)
                return port
    raise OSError(f"no free loopback port found (process {os.getpid()})")


if __name__ == "__main__":  # `python -m kvstore.testing.ports [N]`: N free ports, one per line (shell examples)
    import sys

    try:
        count = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    except ValueError:
        sys.exit(f"usage: python -m kvstore.testing.ports [COUNT]; not a count: {sys.argv[1]!r}")
    print("\n".join(str(free_port()) for _ in range(count)))
