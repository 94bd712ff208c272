"""`kvstore serve`: one store daemon — engine, tiers, control wire, admin API, metrics and node session.

Threads: the control wire's connection threads run the store operations on the BlockStore and hand
index updates to the process's shared asyncio loop, which runs the metadata session (lease
keep-alive, batched publishes); gRPC threads serve the admin API.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import ssl
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass
from typing import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from transfer import Engine, TransferError
from transfer.descriptor import host_id

from ..access import AccessRules, Tenants
from ..admin.service import AdminService
from ..admin.v1 import admin_pb2, admin_pb2_grpc
from ..aio import shared_loop
from ..errors import KVStoreError, MetadataError, MetadataTimeout, NoStoreNodes
from ..index.sharded_mirror import open_mirror
from ..index.records import Layout, NodeRecord, check_name
from ..index.signatures import RecordSigner, RecordVerifier
from ..metadata import open_metadata, shard_urls
from ..outage_log import OutageLog
from .host_index import HostIndex
from .host_room import check_dram
from .local import LocalControl
from .metrics import DaemonMetrics
from .oplog import EvictionLog, NeighbourWatch, Throttle
from .publisher import Publisher
from .repair import HAND_OFF_S, Repairer
from .operations import StoreOperations
from .session import NodeSession
from .shard_sessions import ShardedSession
from ..codec import check_codec
from ..tiers.disk import DiskTierFile
from ..tiers.journal import TierJournal, remove_stale
from .store import BlockStore, Update
from .tierwork import TierWork
from .verifier import Verifier

log = logging.getLogger(__name__)
DRAIN_BATCH = 32  # blocks moved per round of a drain
REGISTER_ATTEMPTS = 3  # a start-up registration that timed out is tried this many times in all


@dataclass
class DaemonConfig:
    node: str
    metadata: str = "memory://default"
    cluster: str = "default"
    listen: str = "127.0.0.1:0"  # admin API (gRPC); the TCP control wire listens on its host
    engine_listen: str = "127.0.0.1:0"  # Transfer Engine
    # The framed control wire over TCP, on the host of `listen`: this port (0: any free one; None:
    # none: only clients on this host can use the node). Inside TLS with tls_cert and tls_key.
    wire_port: int | None = 0
    dram_bytes: int = 1 << 30
    disk_dir: str | None = None
    disk_bytes: int = 0
    # A persistent NVMe tier: the tier file and its journal stay when the daemon ends (a stop or a
    # crash), and the next daemon of this node on the same disk_dir serves their blocks again, each
    # verified first (kvstore.tiers.journal). Else the file goes with the daemon, even after a crash.
    keep_disk: bool = False
    # On a graceful stop, demote DRAM blocks to the NVMe tier (most recently used first) for up to
    # persist_timeout seconds first, so that a persistent tier keeps them too.
    persist_on_stop: bool = False
    persist_timeout: float = 10.0
    disk_codec: str | None = None  # "lz4": NVMe blocks coded in the background (kvstore.codec)
    secret: str | None = None
    insecure: bool = False  # no secret on purpose: anyone who reaches the node may use its memory
    # Tenant name -> its own secret (`kvstore serve --tenants FILE`): clients that authenticate as a
    # tenant may write and look up only that tenant's fingerprints (kvstore.access). Needs a secret.
    # A kvstore.access.Tenants also carries each tenant's capacity share and connection share.
    tenants: dict[str, bytes] | None = None
    replicas: int = 1
    eviction: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    metrics_port: int | None = None  # None: no HTTP endpoint; 0: any free port
    metrics_listen: str = "127.0.0.1"  # the /metrics endpoint's address (no authentication: counters only)
    lease_ttl: int = 10
    # Index publish batches start at most this far apart (seconds) under a stream of puts, 2 ms
    # per update of the previous batch (publisher.py). Measured: 10 ms instead of a fixed 2 ms cut
    # etcd's CPU per put by about half and the daemon's by a fifth, time puts get back on a busy host.
    publish_window: float = 0.01
    timeout: float = 5.0
    promote: bool = True
    admin_token: str | None = None  # required by mutating admin calls when set
    tls_cert: str | None = None  # PEM files: serve gRPC and the TCP control wire over TLS when both are given
    tls_key: str | None = None
    tls_ca: str | None = None  # PEM roots this node trusts when it calls other nodes (drain moves)


class Daemon:
    """A running store node (see module docstring)."""

    def __init__(self, config: DaemonConfig) -> None:
        check_name("node", config.node)
        self.config = config
        self.layout = Layout(config.cluster)
        self.engine: Engine | None = None
        self.store: BlockStore | None = None
        self.session: NodeSession | None = None
        self.server: grpc.Server | None = None
        self.metrics: DaemonMetrics | None = None
        self.address = ""
        self.metrics_port: int | None = None
        self.draining = False
        self.drain_in_progress = False
        self._draining_lock = threading.Lock()  # a drain's last look against taking puts again
        self._loop = shared_loop()
        self._stopped = threading.Event()
        self._published_usage: dict[str, int] = {}
        self._usage_outage = OutageLog(log, "usage refresh failed", level=logging.INFO)
        self._evictions: EvictionLog | None = None  # evictions summed into one log line per 10 s
        self._neighbours = NeighbourWatch(config.node, self.registered_nodes)  # nodes joining and leaving
        self._reregister_said = Throttle(30.0)
        self.repairer: Repairer | None = None
        self.publisher: Publisher | None = None
        self.verifier: Verifier | None = None
        self.local: LocalControl | None = None
        self.disk: DiskTierFile | None = None  # the NVMe tier's file
        self.journal: TierJournal | None = None  # a persistent tier's journal
        self.tier_work: TierWork | None = None  # restores a persistent tier, codes blocks (--disk-codec)

    # --- start -----------------------------------------------------------------------------
    def start(self) -> "Daemon":
        c = self.config
        secret = (c.secret or "").encode()
        if c.tenants and not secret:
            raise ValueError("tenants need a cluster secret (on an --insecure node anyone is anyone)")
        check_dram(c.dram_bytes)  # before the arena's pages are filled: never an OOM kill
        self.engine = Engine(c.node, listen=c.engine_listen, secret=c.secret, insecure=c.insecure,
                             stall_timeout=c.timeout, tenants=c.tenants)
        # Remote peers write DRAM only into slots reserved or leased to them (BlockStore grants), and
        # never the NVMe tier (its writes are the daemon's own demotions); same-host clients map the
        # arena and write it directly: they are trusted by uid.
        dram = self.engine.allocate(c.dram_bytes, remote_writes="granted")
        nvme = None
        counters: dict[str, float] = {}
        entries = []
        check_codec(c.disk_codec)  # a typo fails before anything is made
        if c.disk_dir and c.disk_bytes > 0:
            self.disk = DiskTierFile.prepare(c.disk_dir, c.node, c.disk_bytes, keep=c.keep_disk)
            try:
                nvme = self.engine.register_file(self.disk.path, c.disk_bytes, remote_writes="none")
            except BaseException:
                self.disk.remove()  # a failed allocation leaves no file behind
                raise
            self.disk.hold()
            if c.keep_disk:  # persistent: what the last daemon of this node left is served again, once verified
                self.journal = TierJournal(os.path.dirname(self.disk.path), c.node, c.cluster, self.disk.path,
                                           c.disk_bytes, counters, secret)
                entries = self.journal.open(resized=self.disk.resized).entries
            elif remove_stale(os.path.dirname(self.disk.path), c.node):
                log.info("removed the journal of an earlier persistent tier in %s: this tier is not kept "
                         "(--keep-disk), its blocks will not be served again", c.disk_dir)
        shares = {name: c.tenants.capacity_share(name) for name in c.tenants} if isinstance(c.tenants, Tenants) else {}
        self.store = BlockStore(self.engine, dram, nvme, policy=c.eviction, high=c.high_watermark, low=c.low_watermark,
                                promote=c.promote, counters=counters, journal=self.journal, disk_codec=c.disk_codec,
                                shares=shares)
        self.store.restore(entries)
        # Every record this node publishes or hands out is sealed by it (kvstore.index.signatures).
        self.signer = RecordSigner(secret, c.cluster, c.node, c.tenants)
        self.metrics = DaemonMetrics(c.node, self.store.counters, lambda: self.store.tiers, self.engine.stats,
                                     self.store.tenant_usage)
        if c.metrics_port is not None:
            self.metrics_port = self.metrics.serve(c.metrics_port, c.metrics_listen)

        # The window never exceeds the timeout: no batch waits past a sync put's deadline.
        self.publisher = Publisher(self._loop, self._apply, c.timeout * 3, self.store.counters,
                                   self.metrics.publish_delay.observe, window=min(max(c.publish_window, 0.0), c.timeout))
        self.metrics.publish_pending = lambda: self.publisher.pending
        self.verifier = Verifier(self.store, self.publish, c.node)  # puts answered before their digest pass
        # The framed control wire, the one protocol of the store operations: puts in one round trip
        # and the NVMe tier's fd for same-host clients over an authenticated unix socket; over TCP
        # (TLS with --tls-cert) for others. gRPC below serves the admin API only.
        self.ops = StoreOperations(c.node, self.store, self.publish, lambda: not self.draining, self.signer)
        tls = None
        if c.tls_cert and c.tls_key:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.load_cert_chain(c.tls_cert, c.tls_key)
        self.local = LocalControl(f"kvstore-local-{uuid.uuid4().hex}", secret, self.ops,
                                  lambda op, s: self.metrics.latency.labels(op).observe(s),
                                  self.disk.reader if self.disk else None, c.timeout,
                                  tcp_host=None if c.wire_port is None else c.listen.rpartition(":")[0].strip("[]"),
                                  tcp_port=c.wire_port or 0, tenants=c.tenants, tls=tls)
        self.local.host_index = HostIndex(
            lambda: open_mirror(c.metadata, c.cluster, timeout=c.timeout), c.timeout,
            RecordVerifier(secret, c.cluster))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  interceptors=[AccessRules(c.admin_token)],
                                  # no SO_REUSEPORT: a second daemon on a taken port fails, not shares it
                                  options=[("grpc.so_reuseport", 0)])
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(self, self.config.node, self.config.cluster), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            if c.tls_cert and c.tls_key:
                with open(c.tls_key, "rb") as key, open(c.tls_cert, "rb") as cert:
                    credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                port = self.server.add_secure_port(c.listen, credentials)
            else:
                port = self.server.add_insecure_port(c.listen)
        except RuntimeError:  # grpc's "Failed to bind": the address is taken or not this host's
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {c.listen} (--listen): the address is in use or not this host's")
        self.address = f"{c.listen.rpartition(':')[0]}:{port}"
        # Each attempt is a lease grant and a write, each bounded by the timeout; a pause between.
        self._call(self._register(), timeout=c.timeout * (2 * REGISTER_ATTEMPTS + 1) + REGISTER_ATTEMPTS)
        return self

    def enable_reflection(self) -> None:
        """Let generic tools (grpcurl, grpc_cli) list and call the services."""
        names = [admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)

    def serve(self) -> None:
        """Start answering RPCs (after optional extra services were added)."""
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._usage_timer()
        if self.config.replicas > 1:  # keep blocks at the cluster's replica count when nodes die
            self.repairer = Repairer(self.config.node, self.store, self.store.counters, self._repair_client,
                                     self.config.replicas).start()
            self.store.replicated = self.repairer.held_elsewhere  # eviction spares the last copies
        if self.store.nvme is not None:  # a restarted persistent tier's blocks, verified and published
            self.tier_work = TierWork(self.store, self.publish, self.config.node)

    def _repair_client(self):
        from ..client import Client

        c = self.config
        # Its copies go where there is room without dropping a block no other node holds (repair=True).
        return Client(c.metadata, cluster=c.cluster, secret=c.secret or "", timeout=c.timeout, tls_ca=c.tls_ca,
                      publish="sync", repair=True)

    def node_record(self) -> NodeRecord:
        tiers = {t.name: t.capacity for t in self.store.tiers}
        used = {t.name: t.used for t in self.store.tiers}
        return NodeRecord(self.config.node, self.address, tiers, host=host_id(), used=used, draining=self.draining,
                          replicas=self.config.replicas, secured=not self.config.insecure)

    async def _register(self) -> None:
        shards = [open_metadata(url, timeout=self.config.timeout) for url in shard_urls(self.config.metadata)]
        segment = json.loads(self.engine.export().to_json())
        segment["kvstore_local"] = self.local.name  # same-host clients' fast path (EngineDescriptor ignores it)
        if self.local.tcp_address:
            segment["kvstore_wire"] = self.local.tcp_address  # the same wire over TCP, for other hosts
            segment["kvstore_wire_tls"] = self.local.tls is not None  # over TLS: a client without roots says so
        session = NodeSession if len(shards) == 1 else ShardedSession
        self.session = session(shards[0] if len(shards) == 1 else shards, self.layout, self.node_record(),
                               json.dumps(segment, separators=(",", ":")), ttl=self.config.lease_ttl,
                               on_lease_lost=self._lease_lost, signer=self.signer)
        # A loaded etcd can miss one deadline (seen when a machine starts many daemons at once): a
        # timed-out registration is tried again before the start fails. A refused connection or a
        # refusal is not: that etcd is not there, or says no, and one line says so at once.
        for attempt in range(1, REGISTER_ATTEMPTS + 1):
            try:
                await self.session.start()
                return
            except MetadataTimeout as exc:
                if attempt == REGISTER_ATTEMPTS:
                    raise
                log.warning("node %s: registering with the metadata service timed out (attempt %d of %d, "
                            "trying again): %s", self.config.node, attempt, REGISTER_ATTEMPTS, exc)
                await asyncio.sleep(min(1.0, self.config.timeout / 2))

    def _lease_lost(self) -> None:
        """Our lease expired (etcd unreachable too long): register again and republish every block."""
        async def again() -> None:
            try:
                await self.session.start()
                records = self.store.all_records()
                self.publisher.enqueue(records)  # behind nothing older: the last word wins
                log.warning("node %s re-registered and republished its %d blocks", self.config.node, len(records))
                self._reregister_said = Throttle(30.0)
            except KVStoreError as exc:  # etcd away, or a shard map it now refuses (InvalidConfig)
                if self._reregister_said():  # retried every second: said at most every 30 s
                    log.error("node %s could not re-register (retrying every second; clients do not see it "
                              "until it does): %s", self.config.node, exc)
                self._loop.call_later(1.0, self._lease_lost)

        asyncio.ensure_future(again(), loop=self._loop)

    # --- publishing --------------------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout or self.config.timeout * 3)

    def publish(self, updates: list[Update], wait: bool = True) -> int:
        """Queue index updates (put records, delete the None ones) for the background publisher;
        with `wait`, return once they are published (MetadataUnavailable if that takes too long),
        with a revision at or after them that every mirror of the cluster will apply."""
        return self.publisher.publish(updates, wait, self.config.timeout * 3)

    async def _apply(self, updates: list[Update]) -> int:
        latest: dict[tuple[str, bytes], object] = {}
        for fingerprint, block_hash, record in updates:  # the last word on a block wins
            latest[(fingerprint, block_hash)] = record
        by_fp_put: dict[str, list] = {}
        by_fp_del: dict[str, list] = {}
        for (fingerprint, block_hash), record in latest.items():
            if record is None:
                by_fp_del.setdefault(fingerprint, []).append(block_hash)
            else:
                by_fp_put.setdefault(fingerprint, []).append((block_hash, record))
        revision = 0
        for fingerprint, items in by_fp_put.items():
            revision = max(revision, await self.session.publish(fingerprint, items))
        for fingerprint, hashes in by_fp_del.items():
            revision = max(revision, await self.session.unpublish(fingerprint, hashes))
        return revision

    def _usage_timer(self) -> None:
        """Refresh the node record's usage every 2 s when it changed (clients place puts by it)."""
        if self._stopped.is_set():
            return
        record = self.node_record()
        if record.used != self._published_usage:
            try:
                self._call(self._put_node(record))
                self._published_usage = record.used
            except (MetadataError, TimeoutError) as exc:
                self._usage_outage.failed(exc)
            else:
                self._usage_outage.recovered()
        try:
            if self._evictions is None:
                self._evictions = EvictionLog(self.store.counters, lambda: [t.name for t in self.store.tiers])
            self._evictions.tick()
            self._neighbours.tick()
        except Exception as exc:  # noqa: BLE001 - never stops the timer (etcd down: said by the publisher)
            log.debug("looking at the cluster's nodes failed: %s", exc)
        timer = threading.Timer(2.0, self._usage_timer)
        timer.daemon = True
        timer.start()

    async def _put_node(self, record: NodeRecord) -> None:
        await self.session.put_node(record)

    def set_draining(self, draining: bool) -> None:
        with self._draining_lock:
            self.draining = draining
            if not draining:
                self.store.taking_blocks = True  # taking puts again, after (or instead of) a drain
        self._call(self._put_node(self.node_record()))

    def registered_nodes(self) -> list[str]:
        """Every node the metadata service lists for this cluster."""
        return self._call(self.session.node_names())

    def drain(self, move: bool, is_active=lambda: True) -> Iterator[admin_pb2.DrainProgress]:
        """Stop taking puts, then move (or drop) every block, yielding progress as it goes. Puts
        already under way when it began (reserved, or into leased slots) may still land: it looks
        again until a pass finds no block it has not handled, then refuses their commits and looks
        once more (a refused put goes to another node), so no put answered as stored is left here."""
        self.drain_in_progress = True
        if self.tier_work is not None:  # blocks still being restored are moved (or dropped) with the rest
            self.tier_work.wait_restored(self.config.timeout * 60)
        mover, looked = None, False  # the client that moves blocks (None: nowhere to go), made when first needed
        kept: set[tuple[str, bytes]] = set()  # blocks that could not be moved: they stay here, counted failed
        progress, ended = admin_pb2.DrainProgress(), "stopped: the caller went away (the node still takes no puts)"
        log.info("drain of %s started (%s): it takes no new puts", self.config.node,
                 "moving its blocks to other nodes" if move else "dropping its blocks")
        try:
            self.set_draining(True)
            quiet = False  # commits refused, and none was still sealing
            while True:
                self.verifier.seal()  # blocks written before now are sealed, so they move too
                # Every block handled is removed here: what is left landed since (a re-put included).
                blocks = [b for b in self.store.keys() if b[0] not in kept]
                if not blocks:
                    if quiet:
                        break
                    # Nothing new since the last look: from now on a put under way is refused (its
                    # client puts the blocks elsewhere), and one more look takes what landed before.
                    with self._draining_lock:
                        if not self.draining:
                            ended = "called off: the node takes puts again"
                            return
                        quiet = self.store.stop_taking(self.config.timeout)
                    continue
                progress.total += len(blocks)
                yield admin_pb2.DrainProgress(total=progress.total, moved=progress.moved, dropped=progress.dropped,
                                              failed=progress.failed)
                if move and not looked:
                    mover, looked = self._drain_client(), True
                    if mover is None:
                        log.warning("drain of %s: no other node to move blocks to, dropping them", self.config.node)
                for start in range(0, len(blocks), DRAIN_BATCH):
                    if not is_active():
                        return
                    self._drain_chunk(blocks[start : start + DRAIN_BATCH], mover, progress, kept)
                    yield admin_pb2.DrainProgress(total=progress.total, moved=progress.moved,
                                                  dropped=progress.dropped, failed=progress.failed)
            progress.done = True
            ended = "done"
            yield progress
        except Exception as exc:
            ended = f"failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.drain_in_progress = False
            if mover is not None:
                mover.close()
            (log.info if ended == "done" and not progress.failed else log.warning)(
                "drain of %s %s; moved %d, dropped %d, failed %d of %d blocks", self.config.node, ended,
                progress.moved, progress.dropped, progress.failed, progress.total)

    def _drain_client(self):
        """A client for moving blocks to the other nodes, or None when there is no other node."""
        from ..client import Client

        client = Client(self.config.metadata, cluster=self.config.cluster, secret=self.config.secret or "",
                        timeout=self.config.timeout, tls_ca=self.config.tls_ca, publish="sync")
        client.mirror.wait_until(lambda m: getattr(m.nodes.get(self.config.node), "draining", True), 10)
        if not [n for n in client.mirror.nodes.values() if not n.draining]:
            client.close()
            return None  # nowhere to move to: drop instead
        return client

    def _drain_chunk(self, chunk, client, progress, kept: set) -> None:
        # Blocks grouped by who else holds them: this node's copy moves to a node that lacks the
        # block, so a drain never lowers a block's replica count by landing on another holder. A
        # block that could not be moved (an error, or no node to take it that another does not
        # hold) stays here and joins `kept`: failed, never dropped (client None: dropping was asked).
        groups: dict[tuple[str, frozenset[str]], list[tuple[bytes, bytes]]] = {}
        for (fingerprint, block_hash), _ in chunk:
            data = self.store.read_block((fingerprint, block_hash)) if client is not None else None
            if data is not None:
                others = frozenset(client.mirror.lookup(fingerprint, block_hash)) - {self.config.node}
                groups.setdefault((fingerprint, others), []).append((block_hash, data))
        copied: set[tuple[str, bytes]] = set()
        for (fingerprint, others), items in groups.items():
            try:
                client.put_many(items, fingerprint=fingerprint, replicas=1,  # a move: this node's copy
                                exclude=others | {self.config.node})
                copied.update((fingerprint, h) for h, _ in items)
            except NoStoreNodes:
                if others:  # every node without it is gone or draining: the other holders keep it
                    copied.update((fingerprint, h) for h, _ in items)
                else:
                    log.warning("drain: nowhere to move %d blocks: they stay here", len(items))
                    kept.update((fingerprint, h) for h, _ in items)
            except (KVStoreError, TransferError) as exc:
                log.warning("drain: could not move %d blocks (they stay here): %s", len(items), exc)
                kept.update((fingerprint, h) for h, _ in items)
        if copied:  # readers see the new copy before the old one goes
            client.mirror.wait_until(lambda m: all(len(m.lookup(fp, h)) > 1 for fp, h in copied), 5)
        for (fingerprint, block_hash), _ in chunk:
            if (fingerprint, block_hash) in kept:
                progress.failed += 1
                continue
            _, updates = self.store.remove(fingerprint, [block_hash])
            if updates:
                self.publish(updates)
            if (fingerprint, block_hash) in copied:
                progress.moved += 1
            else:
                progress.dropped += 1

    # --- stop --------------------------------------------------------------------------------
    def stop(self, grace: float = 2.0) -> None:
        """Graceful: stop taking RPCs, hand off what would be left short of the cluster's replicas
        without this node, revoke the lease (every record goes at once), close."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.local is not None:
            self.local.close()
            if self.local.host_index is not None:
                self.local.host_index.close()
        if self.server is not None:
            self.health.enter_graceful_shutdown()
            self.server.stop(grace).wait(grace + 1)
        if self.verifier is not None:
            if self.repairer is not None or self.config.persist_on_stop:
                try:
                    self.verifier.seal()  # blocks written but not verified yet are handed off (or kept) too
                except Exception:  # noqa: BLE001 - those are dropped, as the verifier drops a failed batch
                    log.exception("verifying written blocks before stopping failed")
            self.verifier.stop()
        if self.tier_work is not None:
            self.tier_work.stop()
        if self.config.persist_on_stop and self.store is not None and self.store.nvme is not None:
            self._persist()
        if self.repairer is not None:  # no puts land now: its replicas go to other nodes before its lease
            self.repairer.stop(hand_off=HAND_OFF_S)
        if self.publisher is not None:
            self.publisher.stop()  # the lease revocation below removes whatever it published
        if self.session is not None:
            try:
                self._call(self.session.close(revoke=True), timeout=self.config.timeout * 4)  # two attempts
            except (MetadataError, TimeoutError) as exc:
                log.warning("could not revoke the lease of %s (it will expire): %s", self.config.node, exc)
        if self.metrics is not None:
            self.metrics.close()
        if self.session is not None:
            try:
                self._call(self.session.release())
            except (MetadataError, TimeoutError):
                pass
        if self.journal is not None:
            self.journal.close()  # synced: a clean stop loses no entry
        if self.engine is not None:
            self.engine.close()
        if self.disk is not None:
            self.disk.close()

    def _persist(self) -> None:
        """--persist-on-stop: DRAM blocks to the NVMe tier, most recently used first, within
        persist_timeout (never evicting an NVMe block no other live node holds, where that is known)."""
        started = time.monotonic()
        try:
            moved, left = self.store.persist(self.config.persist_timeout, keep_sole=self.store.replicated is not None)
        except Exception:  # noqa: BLE001 - stopping anyway: said, the rest is lost as without the flag
            log.exception("%s: persisting DRAM blocks to NVMe failed", self.config.node)
            return
        self.store.counters["persisted_blocks"] = self.store.counters.get("persisted_blocks", 0) + moved
        (log.warning if left else log.info)(
            "%s: persisted %d DRAM blocks to its NVMe tier in %.1f s%s", self.config.node, moved,
            time.monotonic() - started, f"; {left} left in DRAM (out of time or room: lost with this process)"
            if left else "" if self.journal is not None else " (the tier is not kept: they go with it)")

    def wait(self) -> None:
        """Block until SIGTERM/SIGINT, then stop gracefully."""
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        self.stop()
