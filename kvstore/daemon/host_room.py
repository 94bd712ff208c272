"""The memory the host can give a daemon's DRAM tier, checked before anything is allocated.

A DRAM tier is one shared-memory arena whose pages are filled at start: asked for more than the
machine (or the cgroup the daemon runs in) has, the daemon would fill pages until the kernel's OOM
killer took it, or a neighbour. It is refused at start, in one line that says what there is. (The
NVMe tier's file is checked against its filesystem's free space where it is prepared:
kvstore.tiers.disk.)
"""
from __future__ import annotations

from ..errors import InvalidConfig

CGROUP_V2 = "/sys/fs/cgroup/memory.max"
CGROUP_V1 = "/sys/fs/cgroup/memory/memory.limit_in_bytes"


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit() -> int | None:
    for path in (CGROUP_V2, CGROUP_V1):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:  # "max", or v1's "no limit" (a huge number)
            return int(raw)
    return None


def memory_limit() -> tuple[int | None, str]:
    """(bytes of memory this process may use at most, what sets it), (None, "") when unknown."""
    total, cgroup = _meminfo("MemTotal"), _cgroup_limit()
    if cgroup is not None and (total is None or cgroup < total):
        return cgroup, "the memory limit of this daemon's cgroup"
    return total, "this machine's memory"


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


def check_dram(dram_bytes: int) -> None:
    """Refuse a DRAM tier larger than the memory this daemon may use."""
    limit, what = memory_limit()
    if limit is not None and dram_bytes > limit:
        raise InvalidConfig(f"a {_gib(dram_bytes)} DRAM tier is more than {what} ({_gib(limit)}): give it less "
                            "(--dram)")
