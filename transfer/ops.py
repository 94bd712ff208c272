"""Transfer ops and their per-op results."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .peer import RemoteRegion
from .regions import Region

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


class OpResult(NamedTuple):  # a tuple: built per op on every batch, where a dataclass costs ~1 us
    """Outcome of one op: `ok`, bytes moved, and the error when it failed."""

    ok: bool
    bytes: int
    error: str | None = None
    status: int = 0
