"""One kvstore client per process for the connector's scheduler and worker sides, opened from
`kv_connector_extra_config`:

    {"metadata": "embedded" | "memory://name" | "etcd://host:port", "cluster": "default",
     "dram": "2GiB", "disk": "/path", "disk_size": "16GiB", "secret": "...", "timeout": 5}

"embedded" (the default) and memory:// URLs start an in-process store daemon the first time a
process asks (library mode); etcd:// URLs connect to running `kvstore serve` daemons.
"""
from __future__ import annotations

import atexit
import threading
from typing import Any

from ...client import Client
from ...library import open as open_embedded

_clients: dict[tuple[str, str], Client] = {}
_lock = threading.Lock()


def store_for(config: dict[str, Any]) -> Client:
    url = str(config.get("metadata", "embedded"))
    if url == "embedded":
        url = "memory://vllm-embedded"
    cluster = str(config.get("cluster", "default"))
    with _lock:
        client = _clients.get((url, cluster))
        if client is None:
            timeout = float(config.get("timeout", 5.0))
            if url.startswith("memory://"):
                client = open_embedded(url, dram=config.get("dram", "1GiB"), disk=config.get("disk"),
                                       disk_size=config.get("disk_size", "4GiB"), secret=config.get("secret"),
                                       timeout=timeout)
            else:
                client = Client(url, cluster=cluster, secret=config.get("secret"), timeout=timeout)
            _clients[(url, cluster)] = client
        return client


@atexit.register
def _close_all() -> None:
    with _lock:
        for client in _clients.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - interpreter exit: best effort
                pass
        _clients.clear()
