"""The store daemon (`kvstore serve`): tiers, control service, metrics, node session."""
from .server import Daemon, DaemonConfig
from .store import AllocationFailed, BlockStore, WrongSize

__all__ = ["AllocationFailed", "BlockStore", "Daemon", "DaemonConfig", "WrongSize"]
