"""Metadata service: one interface (`Metadata`), two backends with the same behaviour.

    open_metadata("etcd://127.0.0.1:2379")   # a real etcd
    open_metadata("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379")   # an etcd cluster: fails over
    open_metadata("memory://demo")           # in-process, shared by name (library mode, unit tests)
"""
from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from .base import (MAX_TXN_OPS, Compare, Delete, KeyValue, Lease, Metadata, Page, Put, TxnResult, Watch,
                   WatchEvent, prefix_end)
from .memory import MemoryMetadata

log = logging.getLogger(__name__)
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_plaintext_etcd(url: str) -> bool:
    """Log, once per process and address, that a plaintext etcd:// URL off loopback lets anyone who
    reaches that etcd read and rewrite the cluster's index (whether it warned). Every endpoint of a
    multi-endpoint URL is looked at."""
    try:
        target = _parse(url)
    except ValueError:
        return False
    if target.scheme != "etcd":
        return False
    warned = False
    for host, port in target.endpoints:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # never the user or password
        with _warned_lock:
            if loopback or where in _warned:
                continue
            _warned.add(where)
        log.warning("metadata etcd://%s is plaintext etcd off this host: anyone who reaches it can read the block "
                    "index (nodes, fingerprints, block hashes) and rewrite it (register fake nodes, point clients "
                    "at other memory, drop blocks); use etcd+tls://%s?ca=CA.pem&cert=CERT.pem&key=KEY.pem with "
                    "etcd's client-certificate auth", where, where)
        warned = True
    return warned


@dataclass(frozen=True)
class _Target:
    """A metadata URL taken apart: scheme, etcd endpoints (host, port) in the order given, the user and
    inline password (etcd URLs), the query parameters, and memory://'s name."""

    scheme: str
    endpoints: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = None
    query: dict = field(default_factory=dict)
    name: str = ""


def _endpoint(url: str, text: str, number: int, count: int) -> tuple[str, int]:
    """One `host:port` (or `[v6]:port`) of an etcd URL's comma-separated list."""
    which = f"endpoint {number} of {count}" if count > 1 else "endpoint"
    if not text:
        raise ValueError(f"bad metadata URL {url!r}: {which} is empty (give host:port,host:port,...)")
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise ValueError(f"bad metadata URL {url!r}: {which} {text!r} is not [IPv6]:port")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
        if ":" in host:
            raise ValueError(f"bad metadata URL {url!r}: {which} {text!r}: write an IPv6 address as [addr]:port")
    if not host or any(c.isspace() or c in "/?#@" for c in host):
        raise ValueError(f"bad metadata URL {url!r}: {which} {text!r} has no usable host")
    if not port_text:
        if count == 1:
            raise ValueError(f"etcd URL needs host and port: {url!r}")
        raise ValueError(f"bad metadata URL {url!r}: {which} {text!r} needs a port (host:port)")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad metadata URL {url!r}: {which} {text!r} has a port that is not a number "
                         "in 1-65535")
    return host.lower() if not text.startswith("[") else host, int(port_text)


def _parse(url: str) -> _Target:
    """The URL taken apart and its form checked, nothing opened or read. etcd URLs take one endpoint
    or several, comma-separated (`etcd://h1:2379,h2:2379,h3:2379`): the members of one etcd cluster."""
    try:
        parsed = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"bad metadata URL {url!r}: {exc}") from None
    if parsed.scheme == "memory":
        return _Target("memory", name=parsed.netloc or parsed.path.strip("/") or "default")
    if parsed.scheme not in ("etcd", "etcd+tls"):
        raise ValueError(f"unknown metadata URL {url!r}: use etcd://host:port, etcd+tls://host:port or memory://name")
    if parsed.path not in ("", "/") or parsed.fragment:
        raise ValueError(f"bad metadata URL {url!r}: nothing may follow the endpoints but ?parameters")
    userinfo, at, hosts = parsed.netloc.rpartition("@")
    if not hosts:
        raise ValueError(f"etcd URL needs host and port: {url!r}")
    parts = hosts.split(",")
    endpoints = tuple(_endpoint(url, part, i + 1, len(parts)) for i, part in enumerate(parts))
    seen: set[tuple[str, int]] = set()
    for endpoint in endpoints:
        if endpoint in seen:
            raise ValueError(f"bad metadata URL {url!r}: endpoint {endpoint[0]}:{endpoint[1]} is listed twice")
        seen.add(endpoint)
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(secret) if colon else None)
        if username is None:
            raise ValueError(f"bad metadata URL {url!r}: an empty user name before '@'")
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    unknown = set(query) - {"ca", "cert", "key", "password_file"}
    if unknown:
        raise ValueError(f"unknown etcd URL parameters {sorted(unknown)} in {url!r}")
    if parsed.scheme == "etcd" and {"ca", "cert", "key"} & set(query):
        raise ValueError(f"TLS files need an etcd+tls:// URL, not {url!r}")
    if username and password is None and "password_file" not in query \
            and os.environ.get("KVSTORE_ETCD_PASSWORD") is None:
        raise ValueError(f"etcd user {username!r} needs a password: set KVSTORE_ETCD_PASSWORD "
                         "or add ?password_file=PATH")
    return _Target(parsed.scheme, endpoints, username, password, query)


SHARD_SEPARATOR = ";"


def shard_urls(url: str) -> list[str]:
    """The metadata URL of each shard of a block index spread over several etcd clusters
    (`etcd://a:2379;etcd://b:2379,c:2379`: two shards, the second a cluster of two members), in
    order; [url] for one. ValueError for a shard URL that does not parse or is listed twice."""
    parts = [part.strip() for part in url.split(SHARD_SEPARATOR)]
    if len(parts) == 1:
        return [url]
    seen: list[_Target] = []
    for i, part in enumerate(parts):
        if not part:
            raise ValueError(f"bad metadata URL {url!r}: shard {i + 1} is empty (shards are separated by "
                             f"'{SHARD_SEPARATOR}')")
        target = _parse(part)
        if seen and (target.scheme == "memory") != (seen[0].scheme == "memory"):
            raise ValueError(f"bad metadata URL {url!r}: shards are all etcd or all memory://")
        for j, other in enumerate(seen):
            if (target.scheme == "memory" and target.name == other.name) or set(target.endpoints) & set(other.endpoints):
                raise ValueError(f"bad metadata URL {url!r}: shard {i + 1} ({part}) names an etcd (or memory "
                                 f"store) that shard {j + 1} names too")
        seen.append(target)
    return parts


def check_metadata_url(url: str) -> None:
    """ValueError (the same message open_metadata would give) when `url` is not a metadata URL
    this package can open (one etcd cluster, several shards, or memory://); connects to nothing,
    so a typo fails at once instead of after a timeout."""
    for part in shard_urls(url):
        _parse(part)


def metadata_endpoints(url: str) -> list[tuple[str, int]]:
    """The (host, port) endpoints an etcd URL names, in order ([] for memory://); ValueError as
    check_metadata_url."""
    return list(_parse(url).endpoints)


def open_metadata(url: str, *, timeout: float = 5.0) -> Metadata:
    """A Metadata handle for `etcd://host:port[,host:port...]`,
    `etcd+tls://host:port[,host:port...]?ca=PEM&cert=PEM&key=PEM` (either with `user@` and the
    password in KVSTORE_ETCD_PASSWORD or `?password_file=PATH`) or `memory://name`. Several etcd
    endpoints are members of one etcd cluster: the handle uses one at a time and moves to the next
    when it fails (etcd.py)."""
    if len(shard_urls(url)) > 1:
        raise ValueError(f"{url!r} names {len(shard_urls(url))} index shards: open each shard's URL "
                         "(kvstore.metadata.shard_urls) or a sharded mirror (kvstore.index.open_mirror)")
    target = _parse(url)
    if target.scheme == "memory":
        return MemoryMetadata(target.name)
    warn_plaintext_etcd(url)
    from .etcd import EtcdMetadata, EtcdTls

    query = target.query
    tls = EtcdTls(query.get("ca"), query.get("cert"), query.get("key")) if target.scheme == "etcd+tls" else None
    password = target.password  # allowed, but it ends up in logs and process lists: prefer the others
    if "password_file" in query:
        with open(query["password_file"]) as f:
            password = f.read().strip()
    if target.username and password is None:
        password = os.environ.get("KVSTORE_ETCD_PASSWORD")
        if password is None:
            raise ValueError(f"etcd user {target.username!r} needs a password: set KVSTORE_ETCD_PASSWORD "
                             "or add ?password_file=PATH")
    return EtcdMetadata(list(target.endpoints), timeout=timeout, tls=tls, username=target.username,
                        password=password)


__all__ = ["MAX_TXN_OPS", "Compare", "Delete", "KeyValue", "Lease", "Metadata", "MemoryMetadata", "Page", "Put",
           "TxnResult", "Watch", "WatchEvent", "check_metadata_url", "metadata_endpoints", "open_metadata", "prefix_end",
           "shard_urls", "warn_plaintext_etcd"]
