"""The NVMe tier's file: where it goes, whether the disk can hold it, read descriptors for
same-host clients, and its removal.

A tier file the daemon creates lives as long as the daemon unless the user asks to keep it: it is
unlinked as soon as the engine holds it open, so neither a stop nor a crash leaves a preallocated
file of the tier's size behind. Same-host clients get a duplicate of a descriptor opened before the
unlink, never the path.

A kept tier (`keep`, `kvstore serve --keep-disk`) is a persistent one: the file and its journal
(kvstore.tiers.journal) stay, and the next daemon of that node serves the blocks again. A kept file
found at another size than asked for is cut or grown to the new size and its journal refused
(`resized` says so): blocks are never read from a tier that changed under them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ..errors import InvalidConfig

log = logging.getLogger(__name__)
WARN_FREE_SHARE = 0.5  # a tier taking more than this share of the disk's free space is worth a warning


def _free_bytes(folder: str) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def _allocated(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


@dataclass
class DiskTierFile:
    """The tier file of one node (see module docstring); `prepare` checks the place first."""

    path: str
    size: int
    created: bool  # the daemon made the file (it did not exist before)
    keep: bool  # the user asked to keep it after the daemon ends
    resized: str = ""  # a kept file found at another size (in words): its journal is refused
    _fds: dict[bool, int] = field(default_factory=dict)  # O_DIRECT or not -> a descriptor held open
    _removed: bool = False  # unlinked once: never again (the path may be another daemon's file by then)

    @classmethod
    def prepare(cls, folder: str, node: str, size: int, *, keep: bool = False) -> "DiskTierFile":
        """Check that `folder` is (or can be made as) a directory whose disk can hold `size` more
        bytes; only the last component is created, so a mistyped path fails instead of growing."""
        folder = os.path.abspath(folder)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise InvalidConfig(f"disk directory {folder} exists and is not a directory")
        if not os.path.isdir(folder):
            parent = os.path.dirname(folder)
            if not os.path.isdir(parent):
                raise InvalidConfig(f"disk directory {folder}: its parent {parent} does not exist (create it first)")
            try:
                os.mkdir(folder, 0o700)
            except OSError as exc:
                raise InvalidConfig(f"cannot create disk directory {folder}: {exc.strerror}") from None
        path = os.path.join(folder, f"{node}.tier")
        created = not os.path.exists(path)
        resized = ""
        if not created and keep and (found := os.path.getsize(path)) != size:
            resized = f"the tier file is {found} bytes where --disk-size asks for {size}"
            try:
                os.truncate(path, min(found, size))  # grown (and preallocated) by the engine
            except OSError as exc:
                raise InvalidConfig(f"cannot resize the disk tier {path}: {exc.strerror}") from None
        needed, free = size - _allocated(path), _free_bytes(folder)
        if needed > free:
            raise InvalidConfig(f"a {size >> 20} MiB disk tier does not fit in {folder}: {free >> 20} MiB free")
        if needed > WARN_FREE_SHARE * free:
            log.warning("the %d MiB disk tier in %s takes %.0f%% of the %d MiB free there", size >> 20, folder,
                        100 * needed / free, free >> 20)
        return cls(path, size, created, keep, resized)

    def hold(self) -> None:
        """Open the read descriptors same-host clients get (the engine has made the file by now),
        then unlink a file the daemon created unless it is to be kept."""
        try:
            self._fds[True] = os.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:  # a file system without O_DIRECT (tmpfs): page-cache reads still skip the network
            pass
        self._fds[False] = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        if self.created and not self.keep:
            self.remove()

    def reader(self) -> tuple[int, bool]:
        """A new descriptor for a same-host client (the caller sends and closes it): O_DIRECT
        when the file system has it, and whether it does."""
        direct = True in self._fds
        return os.dup(self._fds[direct]), direct

    def remove(self) -> None:
        """Unlink the file if the daemon created it (a failed allocation's leftover included)."""
        if self.created and not self._removed:
            self._removed = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if not self.keep:
            self.remove()
