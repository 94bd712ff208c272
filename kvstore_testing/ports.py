"""Free ports for servers that tests, benchmarks and shell examples start on a port chosen first.

Ports come from below the kernel's ephemeral range, so no outgoing connection can take one between
the choice and the server's bind: a port the kernel hands out for `bind(0)` or `connect` (etcd's
own clients, vLLM's, the other test worker's) was, on a busy machine, sometimes taken by then.
Each is checked with a bind on every address, one process never hands out the same port twice,
and each pytest-xdist worker chooses from its own share of the pool, so two workers never pick
the same one either."""
from __future__ import annotations

import errno
import os
import random
import re
import socket
import sys
import threading

SPAN = 12_000  # ports below the ephemeral range to choose from
LOWEST = 10_000  # never below: well-known services, the usual dev servers, Ray's worker ports
HIGHEST = 30_000  # never from here on: Kubernetes NodePorts (30000-32767) answer on 127.0.0.1 unbound

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


def candidates(ephemeral: tuple[int, int] | None, span: int = SPAN, lowest: int = LOWEST,
               highest: int = HIGHEST) -> range | None:
    """Where to choose from: up to `span` ports below both the ephemeral range and `highest`, none
    below `lowest`; None when that leaves nothing (an ephemeral range starting low), and the
    kernel should choose."""
    if ephemeral is None:
        return None
    top = min(ephemeral[0], highest)
    low = max(lowest, top - span)
    return range(low, top) if low < top else None


def worker_share(pool: range, worker: str | None, workers: str | None) -> range:
    """This pytest-xdist worker's slice of `pool` (gw0 every n-th port from the first, gw1 from the
    second, ...): two workers' servers never get the same port. The whole pool outside xdist."""
    match = re.fullmatch(r"gw(\d+)", worker or "")
    try:
        count = int(workers or "")
    except ValueError:
        return pool
    if match is None or count < 1:
        return pool
    return pool[int(match.group(1)) % count::count]


def _binds(port: int) -> bool:
    """Whether a server could bind `port` on any address: 0.0.0.0 conflicts with a socket bound to
    any IPv4 address, :: (v6 only) with one on any IPv6 address."""
    families = [(socket.AF_INET, "0.0.0.0")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
    for family, address in families:
        try:
            with socket.socket(family) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((address, port))
        except OSError as exc:
            no_ipv6_here = family == socket.AF_INET6 and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)
            if not no_ipv6_here:  # (without IPv6, IPv4's answer decides)
                return False
    return True


def _kernel_choice() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A port nothing is bound to now, below the kernel's ephemeral range where it can, from this
    test worker's share, and not one this process handed out before."""
    pool = candidates(ephemeral_range())
    if pool is not None:
        pool = worker_share(pool, os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
    with _lock:
        if pool is not None and len(_handed_out) > len(pool) // 2:  # long bound or given up: choose again
            _handed_out.clear()
        for _ in range(200):
            port = _random.choice(pool) if pool is not None else _kernel_choice()
            if port not in _handed_out and _binds(port):
                _handed_out.add(port)
                return port
    raise OSError(f"no free port found (process {os.getpid()})")


def main(argv: list[str]) -> int:
    """`python -m kvstore_testing.ports NAME [NAME ...]`: `NAME=port` lines for a shell's `eval`
    (chosen in one process: never the same port twice); `... ports [COUNT]`: COUNT ports, one per line."""
    if len(argv) == 1 and argv[0].isdigit():
        print("\n".join(str(free_port()) for _ in range(int(argv[0]))))
        return 0
    bad = [name for name in argv if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)]
    if bad:
        print(f"usage: python -m kvstore_testing.ports [COUNT | NAME ...]; not a count or a shell name: {bad[0]!r}",
              file=sys.stderr)
        return 2
    print("\n".join(f"{name}={free_port()}" for name in argv) if argv else free_port())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
