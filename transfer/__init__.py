"""kvstore's Transfer Engine: move bytes between registered regions over shm, TCP and files.

    engine = Engine("a", secret="s3cret")
    src = engine.register(numpy_array)
    peer = engine.connect(other_descriptor)
    engine.transfer([Write(src, 0, peer.region(1), 0, 4096)])
"""
from .batch import Batch
from .descriptor import EngineDescriptor
from .engine import Engine
from .errors import (
                     AuthenticationFailed,
                     EngineClosed,
                     InvalidOp,
                     MissingSecret,
                     OutOfBounds,
                     PeerBusy,
                     PeerUnreachable,
                     ProtocolError,
                     ReadOnlyRegion,
                     TransferError,
                     TransferIOError,
                     TransferTimeout,
                     UnknownRegion,
                     UnsupportedBuffer,
                     WriteNotGranted,
)
from .ops import OpResult, Read, Write
from .peer import Peer, RemoteRegion
from .regions import Region

__all__ = [
    "AuthenticationFailed", "Batch", "Engine", "EngineClosed", "EngineDescriptor", "InvalidOp",
    "MissingSecret", "OpResult", "OutOfBounds", "Peer", "PeerBusy", "PeerUnreachable", "ProtocolError", "Read", "ReadOnlyRegion",
    "Region", "RemoteRegion", "TransferError", "TransferIOError", "TransferTimeout", "UnknownRegion",
    "UnsupportedBuffer", "Write", "WriteNotGranted",
]
