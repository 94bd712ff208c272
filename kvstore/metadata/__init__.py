"""Metadata service: one interface (`Metadata`), two backends with the same behaviour.

    open_metadata("etcd://127.0.0.1:2379")   # a real etcd
    open_metadata("memory://demo")           # in-process, shared by name (library mode, unit tests)
"""
from __future__ import annotations

import ipaddress
import logging
import os
import threading
from urllib.parse import parse_qs, unquote, urlparse

from .base import (MAX_TXN_OPS, Compare, Delete, KeyValue, Lease, Metadata, Page, Put, TxnResult, Watch,
                   WatchEvent, prefix_end)
from .memory import MemoryMetadata

log = logging.getLogger(__name__)
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_plaintext_etcd(url: str) -> bool:
    """Log, once per process and address, that a plaintext etcd:// URL off loopback lets anyone who
    reaches that etcd read and rewrite the cluster's index (whether it warned)."""
    try:
        parsed = urlparse(url)
        host = parsed.hostname or ""
    except ValueError:
        return False
    if parsed.scheme != "etcd" or not host:
        return False
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    where = f"[{host}]:{parsed.port}" if ":" in host else f"{host}:{parsed.port}"  # never the user or password
    with _warned_lock:
        if loopback or where in _warned:
            return False
        _warned.add(where)
    log.warning("metadata etcd://%s is plaintext etcd off this host: anyone who reaches it can read the block "
                "index (nodes, fingerprints, block hashes) and rewrite it (register fake nodes, point clients at "
                "other memory, drop blocks); use etcd+tls://%s?ca=CA.pem&cert=CERT.pem&key=KEY.pem with etcd's "
                "client-certificate auth", where, where)
    return True


def _parse(url: str):
    """(parsed URL, its query parameters): the URL's form checked, nothing opened or read."""
    try:
        parsed = urlparse(url)
        if parsed.scheme in ("etcd", "etcd+tls"):
            parsed.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"bad metadata URL {url!r}: {exc}") from None
    if parsed.scheme == "memory":
        return parsed, {}
    if parsed.scheme not in ("etcd", "etcd+tls"):
        raise ValueError(f"unknown metadata URL {url!r}: use etcd://host:port, etcd+tls://host:port or memory://name")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"etcd URL needs host and port: {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    unknown = set(query) - {"ca", "cert", "key", "password_file"}
    if unknown:
        raise ValueError(f"unknown etcd URL parameters {sorted(unknown)} in {url!r}")
    if parsed.scheme == "etcd" and {"ca", "cert", "key"} & set(query):
        raise ValueError(f"TLS files need an etcd+tls:// URL, not {url!r}")
    if parsed.username and parsed.password is None and "password_file" not in query \
            and os.environ.get("KVSTORE_ETCD_PASSWORD") is None:
        raise ValueError(f"etcd user {parsed.username!r} needs a password: set KVSTORE_ETCD_PASSWORD "
                         "or add ?password_file=PATH")
    return parsed, query


def check_metadata_url(url: str) -> None:
    """ValueError (the same message open_metadata would give) when `url` is not a metadata URL
    this package can open; connects to nothing, so a typo fails at once instead of after a timeout."""
    _parse(url)


def open_metadata(url: str, *, timeout: float = 5.0) -> Metadata:
    """A Metadata handle for `etcd://host:port`, `etcd+tls://host:port?ca=PEM&cert=PEM&key=PEM`
    (either with `user@` and the password in KVSTORE_ETCD_PASSWORD or `?password_file=PATH`) or
    `memory://name`."""
    parsed, query = _parse(url)
    if parsed.scheme == "memory":
        return MemoryMetadata(parsed.netloc or parsed.path.strip("/") or "default")
    warn_plaintext_etcd(url)
    from .etcd import EtcdMetadata, EtcdTls

    tls = EtcdTls(query.get("ca"), query.get("cert"), query.get("key")) if parsed.scheme == "etcd+tls" else None
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


__all__ = ["MAX_TXN_OPS", "Compare", "Delete", "KeyValue", "Lease", "Metadata", "MemoryMetadata", "Page", "Put",
           "TxnResult", "Watch", "WatchEvent", "check_metadata_url", "open_metadata", "prefix_end",
           "warn_plaintext_etcd"]
