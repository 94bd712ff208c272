"""Typed errors of the Transfer Engine; native per-op status codes map onto them."""
from __future__ import annotations


class TransferError(Exception):
    """Base class of every Transfer Engine error."""


class UnknownRegion(TransferError, KeyError):
    """The region id is not registered (or not exported to peers) on the side that owns it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown region"


class OutOfBounds(TransferError, IndexError):
    """An op's (offset, length) does not fit inside its region."""


class ReadOnlyRegion(TransferError):
    """A write targeted a region registered read-only (or, from a peer, one that takes no remote writes)."""


class WriteNotGranted(TransferError, PermissionError):
    """A write into a region that takes remote writes only where granted, outside every range its
    owner granted this engine (never granted, revoked since, or granted to another peer)."""


class PeerUnreachable(TransferError, ConnectionError):
    """The peer cannot be connected to, or died or closed the connection mid-transfer."""


class TransferTimeout(TransferError, TimeoutError):
    """A peer stalled past the stall timeout, or a wait ran out of time."""


class AuthenticationFailed(TransferError, PermissionError):
    """The peer does not know the cluster secret (or we do not know its)."""


class EngineClosed(TransferError):
    """The engine (or the peer handle) was closed."""


class ProtocolError(TransferError):
    """The peer sent bytes that do not follow the wire protocol."""


class TransferIOError(TransferError, OSError):
    """A file-backed region failed to read or write."""


class UnsupportedBuffer(TransferError, TypeError):
    """The object cannot be registered (not contiguous, unsupported type, ...)."""


class InvalidOp(TransferError, ValueError):
    """The op itself is malformed (bad opcode, negative length, ...)."""


class MissingSecret(TransferError, ValueError):
    """A listening engine was given no cluster secret and was not explicitly made insecure."""


class PeerBusy(TransferError, TimeoutError):
    """The peer's bounce-buffer budget stayed full for the stall time: retry later."""


# Native status code -> exception class (codes from cpp/common.h).
STATUS_ERRORS: dict[int, type[TransferError]] = {
    2: UnknownRegion,
    3: OutOfBounds,
    4: ReadOnlyRegion,
    5: PeerUnreachable,
    6: TransferTimeout,
    7: TransferIOError,
    8: EngineClosed,
    9: ProtocolError,
    10: InvalidOp,
    11: PeerBusy,
    12: WriteNotGranted,
}

STATUS_NAMES: dict[int, str] = {
    0: "done",
    1: "pending",
    2: "unknown region",
    3: "out of bounds",
    4: "read-only region",
    5: "peer closed the connection",
    6: "peer stalled past the stall timeout",
    7: "file I/O error",
    8: "engine closed",
    9: "protocol error",
    10: "invalid op",
    11: "peer busy: its bounce-buffer budget is full",
    12: "write not granted: outside every range the owner granted this engine",
}
