"""Metadata service: one interface (`Metadata`), two backends with the same behaviour.

    open_metadata("etcd://127.0.0.1:2379")   # a real etcd
    open_metadata("memory://demo")           # in-process, shared by name (library mode, unit tests)
"""
from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlparse

from .base import (MAX_TXN_OPS, Compare, Delete, KeyValue, Lease, Metadata, Page, Put, TxnResult, Watch,
                   WatchEvent, prefix_end)
from .memory import MemoryMetadata


def open_metadata(url: str, *, timeout: float = 5.0) -> Metadata:
    """A Metadata handle for `etcd://host:port`, `etcd+tls://host:port?ca=PEM&cert=PEM&key=PEM`
    (either with `user@` and the password in KVSTORE_ETCD_PASSWORD or `?password_file=PATH`) or
    `memory://name`."""
    parsed = urlparse(url)
    if parsed.scheme == "memory":
        return MemoryMetadata(parsed.netloc or parsed.path.strip("/") or "default")
    if parsed.scheme in ("etcd", "etcd+tls"):
        from .etcd import EtcdMetadata, EtcdTls

        if not parsed.hostname or not parsed.port:
            raise ValueError(f"etcd URL needs host and port: {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        unknown = set(query) - {"ca", "cert", "key", "password_file"}
        if unknown:
            raise ValueError(f"unknown etcd URL parameters {sorted(unknown)} in {url!r}")
        tls = None
        if parsed.scheme == "etcd+tls":
            tls = EtcdTls(query.get("ca"), query.get("cert"), query.get("key"))
        elif {"ca", "cert", "key"} & set(query):
            raise ValueError(f"TLS files need an etcd+tls:// URL, not {url!r}")
        password = parsed.password  # allowed, but it ends up in logs and process lists: prefer the others
        if "password_file" in query:
            with open(query["password_file"]) as f:
                password = f.read().strip()
        if parsed.username and password is None:
            password = os.environ.get("KVSTORE_ETCD_PASSWORD")
            if password is None:
                raise ValueError(f"etcd user {parsed.username!r} needs a password: set KVSTORE_ETCD_PASSWORD "
                                 "or add ?password_file=PATH")
        return EtcdMetadata(parsed.hostname, parsed.port, timeout, tls=tls,
                            username=unquote(parsed.username) if parsed.username else None, password=password)
    raise ValueError(f"unknown metadata URL {url!r}: use etcd://host:port, etcd+tls://host:port or memory://name")


__all__ = ["MAX_TXN_OPS", "Compare", "Delete", "KeyValue", "Lease", "Metadata", "MemoryMetadata", "Page", "Put",
           "TxnResult", "Watch", "WatchEvent", "open_metadata", "prefix_end"]
