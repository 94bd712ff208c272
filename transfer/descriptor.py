"""What an engine publishes so that peers can reach it (no addresses of memory, ever)."""
from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def host_id() -> str:
    """Stable id of this host's boot: same value in every process on the host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EngineDescriptor:
    """Serialisable address card of an engine: TCP endpoint, plus a same-host control socket."""

    name: str
    host: str
    port: int
    host_id: str
    unix: str | None = None  # abstract unix socket name for same-host control (shm)
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
