"""Transfer ops and their per-op results."""
from __future__ import annotations

from dataclasses import dataclass

from .regions import Region, RemoteRegion

READ, WRITE = 1, 2


@dataclass(frozen=True, slots=True)
class Write:
    """Copy `length` bytes from `local` at `local_offset` to `remote` at `remote_offset`."""

    local: Region
    local_offset: int
    remote: RemoteRegion | Region
    remote_offset: int
    length: int
    opcode = WRITE


@dataclass(frozen=True, slots=True)
class Read:
    """Copy `length` bytes from `remote` at `remote_offset` into `local` at `local_offset`."""

    local: Region
    local_offset: int
    remote: RemoteRegion | Region
    remote_offset: int
    length: int
    opcode = READ


Op = Read | Write


@dataclass(frozen=True, slots=True)
class OpResult:
    """Outcome of one op: `ok`, bytes moved, and the error when it failed."""

    ok: bool
    bytes: int
    error: str | None = None
    status: int = 0
