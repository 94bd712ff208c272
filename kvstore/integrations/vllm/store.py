"""One kvstore client per process for the connector's scheduler and worker sides, opened from
`kv_connector_extra_config`:

    {"metadata": "embedded" | "memory://name" | "etcd://host:port", "cluster": "default",
     "dram": "2GiB", "disk": "/path", "disk_size": "16GiB", "secret": "...", "timeout": 5,
     "tenant": "acme", "tenant_secret": "...", "tls_ca": "/path/roots.pem", "index": "own"}

"tenant" alone namespaces the fingerprint (digests 'acme:...'); with "tenant_secret" (that tenant's
own secret from the daemons' --tenants file, instead of "secret") the engine also authenticates as
the tenant, and the daemons let it write and look up only that tenant's fingerprints. "tls_ca":
the roots that signed the daemons' certificates, where they run with --tls-cert. "index": "host"
(or "auto": where a daemon of the cluster runs on this host) asks the host's daemon about blocks
instead of keeping a mirror of the index in this process: one copy per host, not one per worker.

"embedded" (the default) and memory:// URLs start an in-process store daemon the first time a
process asks (library mode); etcd:// URLs connect to running `kvstore serve` daemons. A
process-local store cannot serve engines split over processes (TP/PP workers) or a P/D pair in two
processes: such deployments are refused at start-up instead of silently never hitting.
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Iterable

from ...client import Client
from ...errors import UnsupportedDeployment
from ...library import open as open_embedded

# (url, cluster, mirror scope): the scope is the fingerprints a cluster client mirrors (None: all of
# them; a process-local store always None, its one in-process store serving every model).
_clients: dict[tuple[str, str, frozenset[str] | None], Client] = {}
_lock = threading.Lock()


def is_private(config: dict[str, Any]) -> bool:
    """Whether the store is private to this process (embedded or memory://)."""
    url = str(config.get("metadata", "embedded"))
    return url == "embedded" or url.startswith("memory://")


def check_deployment(config: dict[str, Any], world_size: int, kv_role: str) -> None:
    """Refuse a process-local store where the parties that must share it live in other processes."""
    url = str(config.get("metadata", "embedded"))
    if not is_private(config):
        return
    if world_size > 1:
        raise UnsupportedDeployment(
            f"kv_connector_extra_config.metadata={url!r} is a store private to one process, but this engine's "
            f"{world_size} TP/PP workers run in separate processes: set metadata to etcd://HOST:PORT and run "
            "`kvstore serve` daemons")
    if kv_role in ("kv_producer", "kv_consumer") and not config.get("process_local"):
        raise UnsupportedDeployment(
            f"kv_role={kv_role} hands KV to another engine, but metadata={url!r} is private to this process: "
            "set metadata to etcd://HOST:PORT (with `kvstore serve` daemons), or process_local: true when the "
            "prefill and decode engines share this process")


def store_for(config: dict[str, Any], mirror_fingerprints: Iterable[str] | None = None) -> Client:
    """This process's client of the store `config` names. `mirror_fingerprints`: the model
    fingerprints (digests) the caller looks up; a cluster client then mirrors those models' blocks
    only, not every model's in the cluster (engines of other models in this process get a client
    of their own)."""
    url = str(config.get("metadata", "embedded"))
    if url == "embedded":
        url = "memory://vllm-embedded"
    cluster = str(config.get("cluster", "default"))
    scope = None if url.startswith("memory://") or mirror_fingerprints is None else frozenset(mirror_fingerprints)
    with _lock:
        client = _clients.get((url, cluster, scope))
        if client is None:
            timeout = float(config.get("timeout", 5.0))
            if url.startswith("memory://"):
                client = open_embedded(url, dram=config.get("dram", "1GiB"), disk=config.get("disk"),
                                       disk_size=config.get("disk_size", "4GiB"), secret=config.get("secret"),
                                       timeout=timeout)
            else:
                # With tenant_secret, the engine authenticates as its fingerprint's tenant (daemons given
                # --tenants then let it use that tenant's fingerprints only); else with the cluster secret.
                tenant = str(config["tenant"]) if config.get("tenant_secret") and config.get("tenant") else None
                secret = config.get("tenant_secret") if tenant else config.get("secret")
                client = Client(url, cluster=cluster, secret=secret, timeout=timeout, tenant=tenant,
                                tls_ca=config.get("tls_ca"), mirror_fingerprints=scope,
                                index=str(config.get("index", "own")))
            _clients[(url, cluster, scope)] = client
        return client


def close_store(url: str, cluster: str = "default") -> None:
    """Close this process's store clients for `url` (an embedded store's daemon with it); the next
    store_for of that URL opens a new one."""
    with _lock:
        closing = [_clients.pop(key) for key in list(_clients) if key[:2] == (url, cluster)]
    for client in closing:
        client.close()


@atexit.register
def _close_all() -> None:
    with _lock:
        for client in _clients.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - interpreter exit: best effort
                pass
        _clients.clear()
