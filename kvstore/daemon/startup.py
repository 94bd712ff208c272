"""The one line a daemon logs once it serves: what it serves, where, its tiers and sizes, and
whether clients must authenticate. Operators read it in `kubectl logs` first; it names no secret."""
from __future__ import annotations

from typing import Any


def size_text(n: int) -> str:
    """Bytes in binary units, as the flags take them (`64GiB`, `1.5GiB`)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def startup_line(config: Any, daemon: Any) -> str:
    """`config`: the DaemonConfig; `daemon`: the started Daemon."""
    tiers = [f"dram {size_text(config.dram_bytes)}"]
    if config.disk_dir:
        kept = "kept across restarts" if config.keep_disk else "emptied at start"
        codec = f", codec {config.disk_codec}" if config.disk_codec else ""
        tiers.append(f"nvme {size_text(config.disk_bytes)} at {config.disk_dir} ({kept}{codec})")
    wire = getattr(daemon.local, "tcp_address", None) or "same-host socket only"
    metrics = f"{config.metrics_listen}:{daemon.metrics_port}" if daemon.metrics_port else "off"
    auth = "off (--insecure)" if config.insecure else "cluster secret"
    if not config.insecure:
        auth += ", admin token" if config.admin_token else ""
        auth += ", TLS" if config.tls_cert and config.tls_key else ""
        auth += f", {len(config.tenants)} tenant(s)" if config.tenants else ""
    return (f"kvstore serve: node {config.node} of cluster {config.cluster!r} serving; control {daemon.address}, "
            f"wire {wire}, metrics {metrics}; tiers: {'; '.join(tiers)}; replicas {config.replicas}, "
            f"eviction {config.eviction}; metadata {redact(config.metadata)}; auth {auth}")


def redact(url: str) -> str:
    """A metadata URL without any user:password part (in each shard's URL, for a sharded index)."""
    def one(part: str) -> str:
        scheme, sep, rest = part.partition("://")
        if sep and "@" in rest.split("/", 1)[0]:
            rest = rest.split("@", 1)[1]
        return f"{scheme}{sep}{rest}"

    return ";".join(one(part) for part in url.split(";"))
