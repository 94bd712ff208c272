"""Library mode: `kvstore.open(...)` runs a store daemon inside this process and returns a client
of it — the embedded default for the quick start and a single vLLM instance offloading to
DRAM/NVMe. Same client API as a cluster."""
from __future__ import annotations

import os
import secrets
import uuid
from typing import Any

from .access import ensure_private_file
from .client import Client
from .client.local_node import InProcessNode
from .daemon import Daemon, DaemonConfig
from .keys import ModelFingerprint
from .sizes import parse_size

class EmbeddedStore(Client):
    """A Client whose store daemon runs in this process; closing it stops the daemon."""

    def __init__(self, daemon: Daemon, **client_args: Any) -> None:
        self.daemon = daemon
        super().__init__(daemon.config.metadata, cluster=daemon.config.cluster, **client_args)
        # Control calls to its own daemon go straight to the daemon's handler, not its unix socket.
        node = daemon.config.node
        self.links.in_process[node] = InProcessNode(node, daemon.local.in_process, self.links.timeout)

    def close(self) -> None:
        super().close()
        self.daemon.stop()


def open(url: str = "memory://", *, dram: int | str = "1GiB", disk: str | None = None, disk_size: int | str = "4GiB",
         keep_disk: bool = False, fingerprint: ModelFingerprint | None = None, node: str = "local",
         eviction: str = "lru", secret: str | None = None, metrics_port: int | None = None,
         timeout: float = 5.0, persist_on_stop: bool = False, disk_codec: str | None = None) -> EmbeddedStore:
    """Start an in-process daemon on `url` ("memory://" = a private in-process index) and connect.

    `disk` is a directory for the NVMe tier (its parent must exist), `disk_size` the tier's size;
    the tier file goes when the store closes (or the process dies) unless `keep_disk`: then it is a
    persistent tier, whose blocks a store opened again on the same `disk` (and `node`, `disk_size`)
    serves again once each is verified. `persist_on_stop`: close() first moves DRAM blocks to the
    NVMe tier (up to 10 s). `disk_codec="lz4"` codes NVMe blocks (kvstore.codec). A persistent
    tier without an explicit `secret` uses this user's ~/.kvstore/library-NODE.secret (made 0600
    the first time): the tier's journal is authenticated under it."""
    if url.rstrip("/") == "memory:":
        url = f"memory://embedded-{uuid.uuid4().hex[:8]}"
    if secret is None and keep_disk and disk:
        # A persistent tier's journal is keyed by the secret (never kept beside the tier): the same
        # per-user secret each time, or a reopened store could not trust (and serve) what it kept.
        secret, _ = ensure_private_file(os.path.join(os.path.expanduser("~"), ".kvstore", f"library-{node}.secret"),
                                        "the persistent tier's secret", "it keys the tier's journal", announce=None)
    if secret is None:  # a private secret: only this process (and whom it tells) can reach the daemon
        secret = secrets.token_urlsafe(32)
    config = DaemonConfig(node=node, metadata=url, dram_bytes=parse_size(dram), disk_dir=disk,
                          disk_bytes=parse_size(disk_size) if disk else 0, keep_disk=keep_disk, eviction=eviction,
                          persist_on_stop=persist_on_stop, disk_codec=disk_codec,
                          secret=secret,
                          metrics_port=metrics_port, timeout=timeout, engine_listen="127.0.0.1:0")
    daemon = Daemon(config)
    try:
        daemon.start()
    except BaseException:
        daemon.stop()  # what it opened before the failure (the tier file among them)
        raise
    daemon.serve()
    try:
        return EmbeddedStore(daemon, fingerprint=fingerprint, secret=secret, timeout=timeout)
    except BaseException:
        daemon.stop()
        raise
