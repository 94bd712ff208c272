"""What an engine publishes so that peers can reach it (no addresses of memory, ever)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any


# Containers on one host that share no network namespace (Kubernetes pods) cannot reach each other's
# abstract unix sockets, and each has a host name of its own. Given the same KVSTORE_HOST_ID (the
# node's name) and a directory mounted at the same KVSTORE_SOCKET_DIR path in each, they find each
# other as processes on one host do: same-host sockets are files there, published by path.
HOST_ID_ENV = "KVSTORE_HOST_ID"
SOCKET_DIR_ENV = "KVSTORE_SOCKET_DIR"


@lru_cache(maxsize=1)
def host_id() -> str:
    """Stable id of this host's boot: same value in every process on the host (the host name, or
    $KVSTORE_HOST_ID where containers on one host have names of their own, and the boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    name = os.environ.get(HOST_ID_ENV) or socket.gethostname()
    return hashlib.sha256(f"{name}/{boot}".encode()).hexdigest()[:16]


def unix_socket_name(name: str) -> str:
    """The published name of a same-host socket called `name`: `name` itself (the abstract
    namespace: only this network namespace reaches it), or its path in $KVSTORE_SOCKET_DIR."""
    folder = os.environ.get(SOCKET_DIR_ENV)
    return os.path.join(os.path.abspath(folder), name) if folder else name


def unix_address(name: str) -> str:
    """The address to bind or connect to for a published same-host socket name: a path as it is,
    an abstract name behind a NUL byte."""
    return name if name.startswith("/") else "\0" + name


def unlink_unix(name: str | None) -> None:
    """Remove a same-host socket's file when it has one (abstract names leave nothing behind)."""
    if name and name.startswith("/"):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class EngineDescriptor:
    """Serialisable address card of an engine: TCP endpoint, plus a same-host control socket."""

    name: str
    host: str
    port: int
    host_id: str
    unix: str | None = None  # same-host control socket (shm): an abstract name, or a path (unix_socket_name)
    version: int = 1
    ucx_tls: tuple[str, ...] = ()  # UCX transports the engine offers (empty: no ucx route)
    ucx_address: str | None = None  # its UCX worker address (hex); rkeys only go to authenticated peers
    ucx_scratch: str | None = None  # "address:rkey" of 8 bytes new endpoints put one byte into

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "EngineDescriptor":
        return cls.parse(json.loads(text))

    @classmethod
    def parse(cls, value: "EngineDescriptor | dict[str, Any] | str") -> "EngineDescriptor":
        """Accept a descriptor, its dict form or its JSON text."""
        if isinstance(value, EngineDescriptor):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        if not isinstance(value, dict):
            raise TypeError(f"not an engine descriptor: {type(value).__name__}")
        try:
            return cls(name=str(value["name"]), host=str(value["host"]), port=int(value["port"]),
                       host_id=str(value["host_id"]), unix=value.get("unix"), version=int(value.get("version", 1)),
                       ucx_tls=tuple(str(t) for t in value.get("ucx_tls") or ()), ucx_address=value.get("ucx_address"),
                       ucx_scratch=value.get("ucx_scratch"))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"malformed engine descriptor: {exc}") from exc
