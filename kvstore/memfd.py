"""Shared memory a daemon writes and its host's clients only read (the seal table, the host index's
shared table): a memfd mapped writable by its creator alone, sealed against growing, shrinking
and (where the kernel has F_SEAL_FUTURE_WRITE) any new writable mapping; clients get read-only
descriptors of it over the same-host socket, so none can change what the daemon wrote."""
from __future__ import annotations

import fcntl
import mmap
import os

_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def writer_memfd(name: str, size: int, lock: bool = False) -> tuple[int, mmap.mmap]:
    """A new memfd of `size` bytes and this process's writable mapping of it; with `lock`, an
    exclusive flock on it that lasts as long as this process keeps the descriptor open."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        try:  # after our own writable mapping: nobody gets another one
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | _F_SEAL_FUTURE_WRITE)
        except OSError:  # an older kernel: clients still get read-only descriptors only
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapped


def reader_fd(fd: int) -> int:
    """A new read-only descriptor (its own open file) of the memfd `fd`, for a client; the caller
    closes it."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
