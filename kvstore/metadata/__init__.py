"""Metadata service: one interface (`Metadata`), two backends with the same behaviour.

    open_metadata("etcd://127.0.0.1:2379")   # a real etcd
    open_metadata("memory://demo")           # in-process, shared by name (library mode, unit tests)
"""
from __future__ import annotations

from urllib.parse import urlparse

from .base import (MAX_TXN_OPS, Compare, Delete, KeyValue, Lease, Metadata, Put, TxnResult, Watch,
                   WatchEvent)
from .memory import MemoryMetadata


def open_metadata(url: str, *, timeout: float = 5.0) -> Metadata:
    """A Metadata handle for `etcd://host:port` or `memory://name`."""
    parsed = urlparse(url)
    if parsed.scheme == "memory":
        return MemoryMetadata(parsed.netloc or parsed.path.strip("/") or "default")
    if parsed.scheme == "etcd":
        from .etcd import EtcdMetadata

        if not parsed.hostname or not parsed.port:
            raise ValueError(f"etcd URL needs host and port: {url!r}")
        return EtcdMetadata(parsed.hostname, parsed.port, timeout)
    raise ValueError(f"unknown metadata URL {url!r}: use etcd://host:port or memory://name")


__all__ = ["MAX_TXN_OPS", "Compare", "Delete", "KeyValue", "Lease", "Metadata", "MemoryMetadata", "Put",
           "TxnResult", "Watch", "WatchEvent", "open_metadata"]
