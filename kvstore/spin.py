"""Whether waiting awake for a reply can pay now: a wait that polls (kvstore.wire's spins) meets a
reply due within microseconds without the tens of microseconds of waking a parked thread on an
idle CPU, but it only pays when a CPU would otherwise idle. On a host whose CPUs are all busy the
poll takes CPU from the very process it waits for: serial 64 KiB same-host puts on 2 busy vCPUs
(load average 8), alternating put by put, p50 1,041 us without the client's poll against 1,204 us
with it. So the polls run only while the host's recent load leaves a CPU to spare."""
from __future__ import annotations

import os
import time

CHECK_S = 1.0  # the load average is read at most this often (it moves over seconds anyway)
_cpus = max(1, len(os.sched_getaffinity(0)))
_checked = float("-inf")
_spare = True


def spare_cpu() -> bool:
    """Whether the last minute's load average leaves about one of this process's CPUs idle."""
    global _checked, _spare
    now = time.monotonic()
    if now - _checked >= CHECK_S:
        _checked = now
        try:
            _spare = os.getloadavg()[0] < _cpus - 0.5
        except OSError:
            _spare = True
    return _spare


def spin_for(seconds: float) -> float:
    """`seconds` of polling before parking when a CPU is to spare, else none."""
    return seconds if spare_cpu() else 0.0
