"""The store daemon (`kvstore serve`): tiers, control service, metrics, node session."""
from ..errors import AllocationFailed, WrongSize
from .server import Daemon, DaemonConfig
from .store import BlockStore

__all__ = ["AllocationFailed", "BlockStore", "Daemon", "DaemonConfig", "WrongSize"]
