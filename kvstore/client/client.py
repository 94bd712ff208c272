"""`kvstore.Client`: put and get KV blocks by (fingerprint, block hash) across the cluster.

The client is a thin face over its parts:
- `put_path.PutPipeline`: place -> reserve/lease -> write -> commit -> learn. Targets are picked
  same host first, then by DRAM use (counting this client's puts in flight and the use each node
  reported in its last reply); small rounds go in one control round trip with their bytes (same
  host: an authenticated unix socket, received straight into the node's DRAM arena; other hosts:
  the same wire over TCP, or TLS), large ones Reserve (or take leased slots) -> write with the Transfer Engine
  straight into the node's memory -> Commit. The node verifies the digest, seals and queues the
  index update; the putting client's own mirror learns the block at once (read-your-writes, unless
  a watch event about the block came first: see the docs), other clients when the node's next
  publish batch reaches etcd. `put_batch` says per key where it landed or why not.
- `read_path.ReadPipeline`: index-mirror lookup -> read with the engine (or, for a same-host node's
  NVMe tier, with O_DIRECT from the tier file's read-only fd) straight into the caller's buffer ->
  verify the digest (BLAKE3, kvstore.integrity) -> on a dead node or corrupt copy try the next
  replica, else report a miss.
- `links.NodeLinks`: the connections to nodes. Every remote step has a timeout.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
import uuid
from typing import Any, Callable, Collection, Iterable, Sequence

from transfer import Engine

from ..access import client_secret
from ..errors import (
    AccessDenied,
    AuthenticationFailed,
    BlockTooLarge,
    FingerprintMismatch,
    InvalidConfig,
    InvalidRequest,
    KVStoreError,
    NoStoreNodes,
    RemoveIncomplete,
    StoreClosed,
    WrongSize,
)
from ..index import IndexMirror, ShardedMirror, open_mirror
from ..index.host_mirror import HostIndexMirror
from ..codec import check_codec
from ..index.records import MAX_BLOCK_BYTES
from ..index.signatures import RecordVerifier
from ..keys import HASH_BYTES, ModelFingerprint, fingerprint_tenant
from .links import NodeLinks
from .put_path import PutBatch, PutPipeline, key_results
from .read_path import ReadPipeline, host_bytes
from .reads import VerifiedSlots
from .results import KeyPut, PutResult

log = logging.getLogger(__name__)
STRIPE_BYTES = 512 << 10  # a 1 MiB block goes out as two 512 KiB pieces in parallel

__all__ = ["AsyncClient", "Client", "KeyPut", "PutResult", "host_bytes"]


def _tls_context(path: str | None) -> ssl.SSLContext | None:
    """A TLS client context trusting the PEM roots `tls_ca` names; InvalidConfig when they cannot
    be read or are not PEM certificates."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return ssl.create_default_context(cadata=f.read().decode())
    except OSError as exc:
        raise InvalidConfig(f"tls_ca: cannot read {path}: {exc.strerror}") from None
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidConfig(f"tls_ca: {path} holds no PEM certificates ({exc})") from None


INDEX_MODES = ("own", "host", "auto")


def _open_index(index: str, metadata: str, cluster: str, timeout: float, transport: str,
                fingerprints: Iterable[ModelFingerprint | str] | None) -> IndexMirror | ShardedMirror | HostIndexMirror:
    """The started index view `index` names (see Client); the embedded store (memory://) and a
    client held to TCP keep their own."""
    if index == "host" and transport == "tcp":
        raise InvalidConfig("index='host' asks the host's daemon over the same-host socket, which transport='tcp' "
                            "does not use: pass index='own' (or 'auto')")
    if index != "own" and transport != "tcp" and not metadata.startswith("memory://"):
        try:
            return HostIndexMirror(metadata, cluster, timeout=timeout, fingerprints=fingerprints).start()
        except InvalidConfig:
            if index == "host":
                raise
    return open_mirror(metadata, cluster, timeout=timeout, fingerprints=fingerprints).start()


class Client:
    """Synchronous client; `AsyncClient` wraps it for asyncio callers."""

    def __init__(self, metadata: str = "memory://default", *, cluster: str = "default",
                 fingerprint: ModelFingerprint | None = None, secret: str | None = None, timeout: float = 5.0,
                 replicas: int | None = None, mirror: IndexMirror | None = None, transport: str = "auto",
                 tls_ca: str | None = None, publish: str = "async", tenant: str | None = None,
                 repair: bool = False, wire_codec: str | None = None,
                 mirror_fingerprints: Iterable[ModelFingerprint | str] | None = None, index: str = "own") -> None:
        self.fingerprint, self.timeout = fingerprint, timeout
        if index not in INDEX_MODES:
            raise InvalidConfig(f"index must be one of {', '.join(INDEX_MODES)}, not {str(index)[:40]!r}")
        # Same-host DRAM slots this client verified (KVSTORE_VERIFY=once: re-reads skip the hash);
        # first, so that a bad setting fails before anything is started.
        verified = VerifiedSlots()
        tls = _tls_context(tls_ca)
        # "lz4": gets from nodes on other hosts (or over forced TCP) go over the framed wire with the
        # blocks coded by the node where that gains (kvstore.codec), decoded and checked here. For
        # slow links; on a fast one the node's coding costs more than the bytes it saves.
        self.wire_codec = check_codec(wire_codec)
        # Puts are repair copies (a daemon's repairer): a node takes them only into room it can make
        # without evicting a block no other live node holds; one that cannot is skipped for the next.
        self.repair = repair
        # A tenant client (`tenant=` with that tenant's own `secret=`) may use only its fingerprints.
        self.tenant = tenant or ""
        if self.tenant:
            from transfer.auth import TENANT_NAME, TENANT_RULE

            if not TENANT_NAME.fullmatch(self.tenant):
                raise InvalidConfig(f"tenant must be {TENANT_RULE}, not {self.tenant[:80]!r}")
            if not secret:
                raise InvalidConfig(f"tenant {self.tenant!r} needs its own secret: pass secret= (the tenant's, "
                                    "from the daemons' --tenants file)")
            if fingerprint is not None and fingerprint.tenant != self.tenant:
                raise InvalidConfig(f"this client is tenant {self.tenant!r} but its fingerprint's tenant is "
                                    f"{fingerprint.tenant!r}: a tenant stores only fingerprints with tenant="
                                    f"{self.tenant!r}")
        # None: the cluster's count, as its daemons were started with (`kvstore serve --replicas`).
        self.replicas = None if replicas is None else max(1, replicas)
        self._warned_replicas = False
        self.transport = transport  # "auto" (shared memory on the same host, else TCP) or "tcp"
        if publish not in ("async", "sync"):
            raise ValueError(f"publish must be 'async' or 'sync', not {publish!r}")
        # "async": a put returns once sealed (this client's mirror knows it at once, others after the
        # node's next publish batch); "sync": once the node has published it to the metadata service.
        self.publish = publish
        self._own_mirror = mirror is None
        # `mirror_fingerprints`: this client's own mirror keeps those models' blocks only (its
        # memory and load time follow them, not the cluster); others raise NotMirrored.
        # index="host": the host's daemon keeps the one mirror every process here asks (this one
        # keeps the nodes only); "auto": that where a daemon of the cluster runs on this host.
        self.mirror = mirror or _open_index(index, metadata, cluster, timeout, transport, mirror_fingerprints)
        # Given, else KVSTORE_SECRET, else what `kvstore serve` generated for this cluster (same user).
        secret, self.secret_source = client_secret(cluster, secret)
        self.engine = Engine(f"client-{os.getpid()}-{uuid.uuid4().hex[:6]}", listen=None, secret=secret,
                             stall_timeout=timeout, stripe_bytes=STRIPE_BYTES, tenant=self.tenant)
        self._secret = secret.encode() if secret else b""
        # Records are used to read bytes only once their seal is their node's (the cluster secret's
        # MAC, or this tenant's): a record written into the index by anyone else is a miss.
        self._records = RecordVerifier(self._secret, cluster, self.tenant)
        self.stats: dict[str, int] = {"control_calls": 0, "local_puts": 0, "wire_puts": 0, "nvme_fd_reads": 0,
                                      "nvme_fd_bytes": 0, "already_held": 0, "wire_reads": 0,
                                      "wire_read_bytes": 0, "wire_read_raw_bytes": 0, "coded_reads": 0,
                                      "reads_unhashed": 0, "refused_records": 0, "control_fallbacks": 0}
        self.links = NodeLinks(self.engine, self.mirror, timeout=timeout, transport=transport, secret=self._secret,
                               secret_source=self.secret_source, tenant=self.tenant,
                               tls=tls, stats=self.stats)
        if isinstance(self.mirror, HostIndexMirror):
            self.mirror.attach(lambda node, message, attachments, timeout:
                               self.links.control(node).call(message, attachments, timeout=timeout)[0],
                               lambda node: self.links.control(node).call({"op": "index", "q": "table", "count": 0},
                                                                          want_fd=True))
        self.puts = PutPipeline(self.links, publish=publish, repair=repair)
        self.reads = ReadPipeline(self.links, self._records, verified, wire_codec=self.wire_codec)
        self.closed = False
        try:
            self.links.check_secrets()  # a node expecting another kind of secret fails here, in one line
        except BaseException:
            self.close()
            raise

    # --- fingerprints and nodes ------------------------------------------------------------------
    def _fp(self, fingerprint: ModelFingerprint | str | None) -> str:
        if self.closed:
            raise StoreClosed("this client is closed")
        if fingerprint is None:
            if self.fingerprint is None:
                raise FingerprintMismatch("no fingerprint given and the client has none")
            return self.fingerprint.digest
        if self.fingerprint is not None:
            if isinstance(fingerprint, ModelFingerprint):
                self.fingerprint.check_compatible(fingerprint)
            elif fingerprint != self.fingerprint.digest:
                raise FingerprintMismatch(f"fingerprint {fingerprint} is not this client's {self.fingerprint.digest}")
        name = fingerprint.digest if isinstance(fingerprint, ModelFingerprint) else fingerprint
        if self.tenant and isinstance(name, str) and fingerprint_tenant(name) != self.tenant:
            raise AccessDenied(f"this client is tenant {self.tenant!r}: it may only use fingerprints of its own "
                               f"(tenant={self.tenant!r}, digests '{self.tenant}:...'), not {name[:80]!r}")
        return name

    def _geometry(self, fingerprint: ModelFingerprint | str | None) -> ModelFingerprint | None:
        """The fingerprint whose fields give a block's size, when one is known (after `_fp`)."""
        return fingerprint if isinstance(fingerprint, ModelFingerprint) else self.fingerprint

    def _check_block_sizes(self, fingerprint: ModelFingerprint | None, sizes: Iterable[int]) -> None:
        """Refuse blocks no node can hold, or of another size than the fingerprint's geometry:
        stored, they would be matched as cached and then fail every read."""
        expected = fingerprint.block_bytes if fingerprint is not None else None
        largest = max((n.tiers.get("dram", 0) for n in self.mirror.nodes.values()), default=0)
        for size in sizes:
            if size == 0:
                raise WrongSize("cannot store an empty block")
            if expected is not None and size != expected:
                f = fingerprint
                raise WrongSize(f"a block of {f.model_id} is {expected} bytes (key and value x {f.num_layers} layers "
                                f"x {f.block_size} tokens x {f.num_kv_heads} heads x {f.head_size} x {f.dtype}), "
                                f"got {size}: check the fingerprint, or use kv_layout='bytes' for free-form blocks")
            if size > MAX_BLOCK_BYTES:
                raise WrongSize(f"a block of {size} bytes is over the {MAX_BLOCK_BYTES >> 20} MiB a node takes")
            if largest and size > largest:
                raise BlockTooLarge(f"a block of {size} bytes is larger than every store node's DRAM tier "
                                f"(the largest holds {largest})")

    def cluster_replicas(self) -> int:
        """The cluster's replica count: the largest `--replicas` a live node was started with."""
        return max((n.replicas for n in self.mirror.nodes.values()), default=1)

    def _replicas_wanted(self) -> int:
        cluster = self.cluster_replicas()
        if self.replicas is None:
            return cluster
        if self.replicas > cluster and not self._warned_replicas:
            self._warned_replicas = True  # nodes repair up to the cluster's count only: say so once
            log.warning("this client writes %d copies of each block, but the cluster's nodes keep %d after a node "
                        "dies: start them with `kvstore serve --replicas %d`", self.replicas, cluster, self.replicas)
        return self.replicas

    def check_secrets(self) -> None:
        """Raise AuthenticationFailed, in one line that says where this client's secret came from,
        if a registered node expects another kind of secret (none, or one) than this client has."""
        self.links.check_secrets()

    # --- put ---------------------------------------------------------------------------------
    def put(self, block_hash: bytes, data: Any, fingerprint: ModelFingerprint | str | None = None) -> PutResult:
        """Store one block; returns how many nodes newly stored it (a PutResult: `.already_held`
        says on how many it was held already)."""
        return self.put_many([(block_hash, data)], fingerprint)

    def put_many(self, items: Iterable[tuple[bytes, Any]], fingerprint: ModelFingerprint | str | None = None,
                 replicas: int | None = None, exclude: Collection[str] = ()) -> PutResult:
        """Store blocks on `replicas` distinct nodes each (none of them in `exclude`); returns blocks
        newly stored (all nodes), as a PutResult: an int whose `already_held` counts the blocks a
        node held already (stored earlier by this client or another: their bytes stand, these are
        not written). `items` is any iterable of (hash, block), a `zip` included. When it
        returns, every block's bytes are on each node counted (the node verifies them before it
        publishes them; sync: before it answers), and this client's mirror lists it there; see the
        docs for what others see. Any failure raises for the whole call (`put_batch` answers per key)."""
        fp = self._fp(fingerprint)
        items = list(items)  # walked more than once below: a zip or a generator would be empty the second time
        if not items:
            return PutResult(0)
        hashes = [bytes(h) for h, _ in items]
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise WrongSize(f"block hashes are {HASH_BYTES} bytes, got {len(h)}")
        views = [host_bytes(d) for _, d in items]
        self._check_block_sizes(self._geometry(fingerprint), (v.nbytes for v in views))
        want = replicas or self._replicas_wanted()
        batch = PutBatch(fp, hashes, views)
        holders, refusals, result = self.puts.run(batch, list(range(len(hashes))), want, exclude, strict=True)
        errors = list(dict.fromkeys(f"{name}: {exc}" for tries in refusals for name, exc in tries))
        if not errors:  # every node that could be asked took them: say why there were not more
            errors.append(self._no_other_node(exclude))
        if not all(holders):
            raise NoStoreNodes(f"no store node took the blocks: {'; '.join(errors)}")
        placed = min(len(nodes) for nodes in holders)
        if placed < want:
            log.warning("stored %d of %d replicas: %s", placed, want, "; ".join(errors))
        self.stats["already_held"] += result.already_held
        return result

    def put_batch(self, items: Iterable[tuple[bytes, Any]], fingerprint: ModelFingerprint | str | None = None,
                  replicas: int | None = None, exclude: Collection[str] = ()) -> list[KeyPut]:
        """Store blocks as `put_many` does, answering one `KeyPut` per item, in order (as Mooncake's
        BatchPut): the nodes that hold the block, or why none does (typed, with each node's reason).
        A key one node refuses, or that a node failing mid-batch did not take, is tried on the next
        node; a block of a size no node takes is refused alone, never sent. Retry exactly the keys
        whose result is not `ok`. Configuration errors (a wrong secret, another tenant's fingerprint,
        a closed client) still raise."""
        fp = self._fp(fingerprint)
        items = list(items)
        if not items:
            return []
        hashes = [bytes(h) for h, _ in items]
        never_sent: dict[int, BaseException] = {}
        views: list[memoryview] = []
        geometry = self._geometry(fingerprint)
        for i, (h, (_, data)) in enumerate(zip(hashes, items)):
            try:
                if len(h) != HASH_BYTES:
                    raise WrongSize(f"block hashes are {HASH_BYTES} bytes, got {len(h)}")
                view = host_bytes(data)
                self._check_block_sizes(geometry, [view.nbytes])
            except WrongSize as exc:
                never_sent[i] = exc
                view = memoryview(b"")
            views.append(view)
        want = replicas or self._replicas_wanted()
        keys = [i for i in range(len(hashes)) if i not in never_sent]
        holders: list[list[str]] = [[] for _ in hashes]
        refusals: list[list[tuple[str, BaseException]]] = [[] for _ in hashes]
        if keys:
            holders, refusals, result = self.puts.run(PutBatch(fp, hashes, views), keys, want, exclude, strict=False)
            self.stats["already_held"] += result.already_held
        results = key_results(hashes, holders, refusals, never_sent, self._no_other_node(exclude))
        short = sum(1 for r in results if r.ok and len(r.nodes) < want)
        if short:
            log.warning("%d of %d blocks stored on fewer than %d replicas", short, len(results), want)
        return results

    def _no_other_node(self, exclude: Collection[str]) -> str:
        live = len(self.mirror.nodes)
        return (f"no other node could take them (the cluster has {live} live node{'s' if live != 1 else ''}"
                + (f", {len(exclude)} excluded)" if exclude else ")"))

    # --- get ---------------------------------------------------------------------------------
    def get(self, block_hash: bytes, out: Any, fingerprint: ModelFingerprint | str | None = None) -> bool:
        """Read one block into `out`; False on a miss. `out` must be the block's size: a smaller block
        would fill it only partly, which for KV is garbage (`get_into` reads values of any size)."""
        return self.get_many([block_hash], [out], fingerprint)[0]

    def get_into(self, block_hash: bytes, out: Any, fingerprint: ModelFingerprint | str | None = None) -> int:
        """Read one block into the start of `out`, which may be larger than the block (blocks of any
        size: a fingerprint without geometry); the bytes it filled, 0 on a miss."""
        fp = self._fp(fingerprint)
        filled: list[int] = []
        expected = getattr(self._geometry(fingerprint), "block_bytes", None)
        self.reads.run(fp, [bytes(block_hash)], [out], expected, None, None, filled)
        return filled[0]

    def get_many(self, hashes: Iterable[bytes], outs: Iterable[Any],
                 fingerprint: ModelFingerprint | str | None = None, *, stages: Sequence[int] | None = None,
                 on_stage: Callable[[int], None] | None = None) -> list[bool]:
        """Read blocks into caller buffers (zero extra copies on the shared-memory path).

        With `stages` (the stage of each segment of a block's segment list, e.g. its layer) and
        `on_stage`, segments are read stage by stage and `on_stage(s)` says when every block's stage-s
        bytes have landed, so a consumer can start on them (and change them: each block's digest is taken
        as its stages land; a block that fails is a miss). Each block is read from its first replica only.

        Buffers pair with hashes in order; extra buffers are left alone (`get_many(hashes[:n], outs)`
        after `match_prefix` reads the n cached blocks into the first n buffers)."""
        fp = self._fp(fingerprint)
        hashes, outs = list(hashes), list(outs)
        if len(outs) < len(hashes):
            raise WrongSize(f"{len(hashes)} hashes but only {len(outs)} buffers")
        expected = getattr(self._geometry(fingerprint), "block_bytes", None)
        return self.reads.run(fp, hashes, outs[: len(hashes)], expected, stages, on_stage)

    # --- queries -------------------------------------------------------------------------------
    def contains(self, block_hash: bytes, fingerprint: ModelFingerprint | str | None = None) -> bool:
        return self.mirror.contains(self._fp(fingerprint), bytes(block_hash))

    def match_prefix(self, hashes: Sequence[bytes], fingerprint: ModelFingerprint | str | None = None) -> int:
        """How many leading blocks of a prompt the cluster holds."""
        return self.mirror.match(self._fp(fingerprint), hashes).length

    def remove(self, hashes: Sequence[bytes], fingerprint: ModelFingerprint | str | None = None) -> int:
        """Remove blocks from every node holding them; returns copies removed, once they are gone
        from etcd and from this client's mirror (up to `timeout`). Every node is asked, even after
        one fails: then `RemoveIncomplete` says how many went and which nodes kept theirs (a denial
        or a bad setting is the caller's and raises at once)."""
        fp = self._fp(fingerprint)
        by_node: dict[str, list[bytes]] = {}
        for h in hashes:
            for name in self.mirror.lookup(fp, bytes(h)):
                by_node.setdefault(name, []).append(bytes(h))
        removed, failed, revision = 0, {}, 0
        for name, hs in by_node.items():
            with self.mirror.asking(fp, name, hs) as since:
                try:
                    reply, _ = self.links.control(name).call({"op": "remove", "fp": fp,
                                                              "hashes": [h.hex() for h in hs]})
                except (AccessDenied, AuthenticationFailed, InvalidConfig, InvalidRequest, StoreClosed):
                    raise  # the caller's (a secret, a setting, a request the node calls invalid): every node alike
                except (OSError, KVStoreError) as exc:
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                # This client's own next lookup, put or get no longer finds them (as the put path
                # learns its blocks from the reply): the watch's delete events come later.
                self.mirror.forget_many(fp, name, hs, since)
            removed += int(reply.get("removed", 0))
            revision = max(revision, int(reply.get("revision", 0)))
        # Events older than the deletions (the blocks' own put events among them) may still be on
        # their way and would list them again: return once the mirror has applied the deletions.
        if revision and not self.mirror.wait_for_revision(revision, self.timeout):
            log.info("the index mirror had not applied revision %d %.0f s after a remove: this client may "
                     "list the removed blocks until it does", revision, self.timeout)
        if failed:
            raise RemoveIncomplete(removed, failed)
        return removed

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.reads.close_reports()  # before the connections its reports go over
        self.links.close()
        self.puts.close()
        self.reads.close()
        self.engine.close()
        if self._own_mirror:
            self.mirror.stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio form of Client: the same methods, awaitable (the work runs off the event loop)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sync = Client(*args, **kwargs)

    def __getattr__(self, name: str):
        method = getattr(self.sync, name)

        async def call(*args: Any, **kwargs: Any):
            return await asyncio.to_thread(method, *args, **kwargs)

        return call
