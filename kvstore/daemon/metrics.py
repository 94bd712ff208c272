"""Prometheus metrics of one daemon, in a registry of its own (several daemons may share a
process in library mode and tests). Names are documented in the README."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ..tiers.journal import REASONS as JOURNAL_REASONS

class DaemonMetrics:
    """Counters live in the BlockStore's dict; this turns them (and tier and engine state) into
    Prometheus families at scrape time."""

    def __init__(self, node: str, store_counters: dict[str, float], tiers: Callable[[], list],
                 engine_stats: Callable[[], dict[str, int]],
                 tenant_usage: Callable[[], list[tuple[str, str, int, int | None]]] = lambda: []) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        self.latency = Histogram("kvstore_op_latency_seconds", "Store operation latency on the control wire", ["op"], registry=self.registry,
                                 buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0))
        self.publish_delay = Histogram("kvstore_publish_delay_seconds",
                                       "From a sealed block's update being queued to its batch being in etcd",
                                       registry=self.registry,
                                       buckets=(5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0))
        self.publish_pending: Callable[[], int] = lambda: 0  # set by the daemon once its publisher runs
        self._counters, self._tiers, self._engine_stats = store_counters, tiers, engine_stats
        self._tenant_usage = tenant_usage
        self.registry.register(self)

    def collect(self):
        c = self._counters
        tiers = self._tiers()
        hits = CounterMetricFamily("kvstore_hits", "Blocks clients read from this node, per tier", labels=["tier"])
        evictions = CounterMetricFamily("kvstore_evictions", "Blocks evicted, per tier", labels=["tier"])
        failures = CounterMetricFamily("kvstore_allocation_failures", "Reservations refused for lack of room",
                                       labels=["tier"])
        corrupt = CounterMetricFamily("kvstore_corrupt_blocks", "Blocks found corrupt and dropped", labels=["tier"])
        capacity = GaugeMetricFamily("kvstore_capacity_bytes", "Tier capacity", labels=["tier"])
        used = GaugeMetricFamily("kvstore_used_bytes", "Tier bytes in use", labels=["tier"])
        blocks = GaugeMetricFamily("kvstore_blocks", "Sealed blocks held, per tier", labels=["tier"])
        for tier in tiers:
            hits.add_metric([tier.name], c.get(f"hits_{tier.name}", 0))
            evictions.add_metric([tier.name], c.get(f"evictions_{tier.name}", 0))
            failures.add_metric([tier.name], c.get(f"allocation_failures_{tier.name}", 0))
            corrupt.add_metric([tier.name], c.get(f"corrupt_blocks_{tier.name}", 0))
            capacity.add_metric([tier.name], tier.capacity)
            used.add_metric([tier.name], tier.used)
            blocks.add_metric([tier.name], len(tier.sealed))
        yield from (hits, evictions, failures, corrupt, capacity, used, blocks)
        held = GaugeMetricFamily("kvstore_tenant_bytes", "Bytes a tenant's blocks take, per tier", labels=["tenant", "tier"])
        share = GaugeMetricFamily("kvstore_tenant_share_bytes",
                                  "A tenant's capacity share, per tier (its blocks are not evicted for another's "
                                  "while they take no more)", labels=["tenant", "tier"])
        for tenant, tier, taken, quota in self._tenant_usage():
            held.add_metric([tenant, tier], taken)
            if quota is not None:
                share.add_metric([tenant, tier], quota)
        yield from (held, share)
        misses = CounterMetricFamily("kvstore_misses", "Reads that found no usable copy here (reported by clients)")
        misses.add_metric([], c.get("client_reported_corrupt", 0))
        yield misses
        under = GaugeMetricFamily("kvstore_under_replicated_blocks",
                                  "Blocks this node must re-replicate (fewer live replicas than --replicas)")
        under.add_metric([], c.get("under_replicated_blocks", 0))
        yield under
        pending = GaugeMetricFamily("kvstore_publish_pending", "Index updates queued and not yet published")
        pending.add_metric([], self.publish_pending())
        yield pending
        for name, help_text in (("publish_batches", "Index update batches published"),
                                ("publish_failures", "Index update batches that failed (and were retried)")):
            family = CounterMetricFamily(f"kvstore_{name}", help_text)
            family.add_metric([], c.get(name, 0))
            yield family
        for name, help_text in (("demotions", "Blocks moved DRAM -> NVMe on eviction"),
                                ("promotions", "Blocks moved NVMe -> DRAM on a hit"),
                                ("corrupt_writes", "Commits refused because the bytes did not match"),
                                ("replicas_repaired", "Block copies this node made to restore the replica count")):
            family = CounterMetricFamily(f"kvstore_{name}", help_text)
            family.add_metric([], c.get(name, 0))
            yield family
        wire = CounterMetricFamily("kvstore_control_connections_refused",
                                   "Control-wire connections refused after their handshake: every slot of the "
                                   "socket taken (full), or the client's tenant's share of them (tenant)",
                                   labels=["reason"])
        for reason in ("full", "tenant"):
            wire.add_metric([reason], c.get(f"wire_connections_refused_{reason}", 0))
        yield wire
        refused = CounterMetricFamily("kvstore_tier_journal_refused",
                                      "Persistent NVMe tier journals refused at start (the tier started empty)",
                                      labels=["reason"])
        for reason in JOURNAL_REASONS:
            refused.add_metric([reason], c.get(f"journal_refused_{reason}", 0))
        yield refused
        for name, key, help_text in (
                ("tier_journal_dropped_entries", "journal_dropped_entries",
                 "Journal entries dropped at start (bad fields, overlaps)"),
                ("tier_journal_torn_bytes", "journal_torn_bytes", "Journal bytes cut at start at a torn or damaged entry"),
                ("tier_journal_write_failures", "journal_write_failures",
                 "Journal appends that failed (no more until the next start)"),
                ("tier_journal_compactions", "journal_compactions", "Journal rewrites from the tier's blocks"),
                ("tier_restored_blocks", "restored_blocks", "NVMe blocks served again after a restart, each verified first"),
                ("tier_restore_corrupt_blocks", "restore_corrupt_blocks",
                 "NVMe blocks a restart found failing their digest (dropped, never served)"),
                ("tier_restore_superseded", "restore_superseded", "NVMe blocks a restart dropped as put again meanwhile"),
                ("persisted_blocks", "persisted_blocks", "DRAM blocks moved to NVMe on a graceful stop (--persist-on-stop)"),
                ("disk_codec_coded_blocks", "disk_codec_coded_blocks", "NVMe blocks coded (--disk-codec)"),
                ("disk_codec_raw_blocks", "disk_codec_raw_blocks", "NVMe blocks left raw: coding gained under 5%"),
                ("disk_codec_saved_bytes", "disk_codec_saved_bytes", "NVMe bytes saved by coding (4 KiB extents)"),
                ("wire_read_blocks", "wire_read_blocks", "Blocks sent by the wire's read (a client's wire codec)"),
                ("wire_read_sent_bytes", "wire_read_sent_bytes", "Bytes the wire's read sent (coded where that gained)"),
                ("wire_read_raw_bytes", "wire_read_raw_bytes", "Raw bytes of the blocks the wire's read sent"),
                ("sole_copies_evicted", "sole_copies_evicted",
                 "Blocks no other live node held, evicted (nothing else made room)"),
                ("repair_copies_refused", "repair_copies_refused",
                 "Repair copies refused: no room without evicting a block no other node holds")):
            family = CounterMetricFamily(f"kvstore_{name}", help_text)
            family.add_metric([], c.get(key, 0))
            yield family
        pending = GaugeMetricFamily("kvstore_tier_restore_pending",
                                    "NVMe blocks a restart holds and has not verified yet (not served until then)")
        pending.add_metric([], c.get("restore_pending", 0))
        yield pending
        moved = CounterMetricFamily("kvstore_transfer_bytes", "Bytes moved by this node's engine", labels=["transport"])
        stats = self._engine_stats()
        moved.add_metric(["tcp_out"], stats.get("tcp_tx_bytes", 0))
        moved.add_metric(["tcp_in"], stats.get("tcp_rx_bytes", 0))
        moved.add_metric(["shm"], stats.get("local_bytes", 0))
        moved.add_metric(["file"], stats.get("file_bytes", 0))
        yield moved

    def describe(self):
        return []

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        server = getattr(self, "_http", None)
        if server is not None:
            server.shutdown()
