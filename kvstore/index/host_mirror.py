"""The block index as the host's daemon holds it (`Client(index="host")`): this process keeps only
the cluster's nodes and segments (an IndexMirror of no fingerprint: a few records) and asks the
host's one mirror (kvstore.daemon.host_index) about blocks over the same-host control wire, so
the host holds one copy of the index however many processes read it.

Answers carry the host mirror's `stale`, never hidden. Records come back as their nodes sealed
them and are checked here, with this client's secret, as its own mirror's would be. A put's or a
remove's answer is told to the host index at once (every process on the host then sees it, not
only this one). When the host's daemon cannot answer, this client says so in one line and keeps a
mirror of its own from then on: slower to start, never a silent stale view.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from transfer.descriptor import host_id

from ..errors import InvalidConfig, KVStoreError, NotMirrored
from ..keys import ModelFingerprint
from .mirror import IndexMirror, fingerprint_id
from .records import BlockRecord, NodeRecord
from .signatures import RecordVerifier

log = logging.getLogger(__name__)
STATUS_EVERY_S = 0.5  # how long the host's `stale` is taken as known


@dataclass(frozen=True)
class HostMatch:
    """Leading blocks of a prompt found by the host index (IndexMirror.Match's length and flags)."""

    length: int
    stale: bool
    loading: bool = False


def host_daemon(nodes: dict[str, NodeRecord], here: str | None = None) -> str | None:
    """The daemon of this host whose index every client here asks: the first by name, not draining."""
    here = here or host_id()
    names = sorted(n for n, r in nodes.items() if r.host == here and not r.draining)
    return names[0] if names else None


class HostIndexMirror:
    """IndexMirror's questions answered by the host's daemon (see module docstring). `attach(ask)`
    before the first block question: `ask(node, message, attachments)` sends one control message
    (and the bytes that follow it) to a node of this host and returns its reply (raising what the
    wire raises)."""

    def __init__(self, metadata_url: str, cluster: str = "default", *, timeout: float = 5.0,
                 verifier: RecordVerifier | None = None,
                 fingerprints: Iterable[ModelFingerprint | str] | None = None) -> None:
        self.members = IndexMirror(metadata_url, cluster, timeout=timeout, fingerprints=())
        self.url, self.layout, self.timeout = metadata_url, self.members.layout, timeout
        self.scope: frozenset[str] | None = None if fingerprints is None else \
            frozenset(fingerprint_id(f) for f in fingerprints)
        self.verifier = verifier
        self.refused_records = 0
        self.host: str | None = None  # the daemon asked
        self._ask: Callable[[str, dict, Sequence[bytes]], dict] | None = None
        self._own: IndexMirror | None = None  # after the host failed: a mirror of this process's own
        self._lock = threading.Lock()
        self._host_stale, self._status_at = False, float("-inf")

    # --- lifetime -------------------------------------------------------------------------------
    def start(self, wait: float | None = None) -> "HostIndexMirror":
        self.members.start(wait)
        self.host = host_daemon(self.members.nodes)
        if self.host is None:
            self.members.stop()
            raise InvalidConfig(f"index='host': no kvstore serve daemon of cluster {self.layout.cluster!r} runs on "
                                "this host (start one, or use index='own')")
        return self

    def attach(self, ask: Callable[[str, dict, Sequence[bytes]], dict]) -> None:
        self._ask = ask

    def stop(self) -> None:
        self.members.stop()
        if self._own is not None:
            self._own.stop()

    @property
    def own(self) -> IndexMirror | None:
        """The mirror this process fell back to (None while the host index answers)."""
        return self._own

    def _question(self, message: dict, hashes: Sequence[bytes] = ()) -> dict | None:
        """The host index's reply, or None once this client keeps its own mirror. The hashes go
        raw after the frame (hex in JSON cost milliseconds for a long prompt)."""
        if self._own is not None:
            return None
        if self._ask is None or self.host is None:
            raise InvalidConfig("a host index mirror was asked before attach()")
        try:
            reply = self._ask(self.host, {"op": "index", **message, "count": len(hashes)},
                              [b"".join(hashes)] if hashes else [])
        except (KVStoreError, OSError) as exc:
            if isinstance(exc, InvalidConfig):
                raise
            self._fall_back(exc)
            return None
        if "stale" in reply:  # the host's word on its view, as fresh as this answer
            self._host_stale, self._status_at = bool(reply["stale"]), time.monotonic()
        return reply

    def _fall_back(self, why: Exception) -> None:
        with self._lock:
            if self._own is not None:
                return
            log.warning("the host index of %s did not answer (%s: %s): this process keeps a mirror of its own from now "
                        "on (answers say stale until it has loaded)", self.host, type(why).__name__, why)
            self._own = IndexMirror(self.url, self.layout.cluster, timeout=self.timeout, verifier=self.verifier,
                                    fingerprints=self.scope)
            try:  # served as soon as it began loading (answers say loading and stale until then)
                self._own.start(self.timeout)
            except KVStoreError as exc:  # etcd gone too: every answer says stale
                log.warning("the mirror replacing the host index could not start: %s", exc)

    def _mirrored(self, fingerprint: ModelFingerprint | str) -> str:
        fp = fingerprint_id(fingerprint)
        if self.scope is not None and fp not in self.scope:
            raise NotMirrored(f"this client's index holds {len(self.scope)} fingerprint(s) only "
                              f"(fingerprints=...), not {fp[:80]!r}")
        return fp

    # --- what this process keeps itself ---------------------------------------------------------
    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.members.nodes

    @property
    def segments(self) -> dict[str, str]:
        return self.members.segments

    @property
    def revision(self) -> int:
        return self.members.revision

    @property
    def resyncs(self) -> int:
        return self.members.resyncs

    @property
    def malformed(self) -> int:
        return self.members.malformed

    @property
    def loading(self) -> bool:
        return self.members.loading or (self._own is not None and self._own.loading)

    @property
    def stale(self) -> bool:
        """True while this process's or the host's view cannot be confirmed current."""
        if self.members.stale:
            return True
        if self._own is not None:
            return self._own.stale
        if time.monotonic() - self._status_at > STATUS_EVERY_S:
            self.status()
        return self._host_stale if self._own is None else self._own.stale

    def status(self) -> dict:
        reply = self._question({"q": "status"})
        if reply is None:
            return {"revision": self._own.revision, "stale": self._own.stale, "loading": self._own.loading,
                    "blocks": self._own.block_count}
        return reply

    @property
    def block_count(self) -> int:
        return int(self.status().get("blocks", 0))

    # --- block questions ------------------------------------------------------------------------
    def match(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]):
        fp = self._mirrored(fingerprint)
        reply = self._question({"q": "match", "fp": fp}, hashes)
        if reply is None:
            return self._own.match(fp, hashes)
        return HostMatch(int(reply["length"]), bool(reply.get("stale")) or self.members.stale,
                         bool(reply.get("loading")))

    def node_prefix_lengths(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes]) -> dict[str, int]:
        fp = self._mirrored(fingerprint)
        reply = self._question({"q": "prefix", "fp": fp}, hashes)
        if reply is None:
            return self._own.node_prefix_lengths(fp, hashes)
        return {str(n): int(k) for n, k in reply["lengths"].items()}

    def contains(self, fingerprint: ModelFingerprint | str, block_hash: bytes) -> bool:
        return self.match(fingerprint, [block_hash]).length == 1

    def lookup(self, fingerprint: ModelFingerprint | str, block_hash: bytes,
               verifier: RecordVerifier | None = None) -> dict[str, BlockRecord]:
        return self.lookup_many(fingerprint, [block_hash], verifier)[0]

    def lookup_many(self, fingerprint: ModelFingerprint | str, hashes: Sequence[bytes],
                    verifier: RecordVerifier | None = None) -> list[dict[str, BlockRecord]]:
        """Every replica of each block, those whose seal is not their node's dropped and counted."""
        fp = self._mirrored(fingerprint)
        if not hashes:
            return []
        reply = self._question({"q": "lookup", "fp": fp}, hashes)
        if reply is None:
            return self._own.lookup_many(fp, hashes, verifier)
        verifier = verifier or self.verifier
        found: list[dict[str, BlockRecord]] = []
        for h, replicas in zip(hashes, reply["records"]):
            kept = {}
            for node, hexed in replicas.items():
                raw = bytes.fromhex(hexed)
                if verifier is None or verifier.check(fp, bytes(h), node, raw):
                    kept[node] = BlockRecord.decode(raw)
                else:
                    self.refused_records += 1
            found.append(kept)
        return found

    # --- what a put or a remove learned ---------------------------------------------------------
    @contextlib.contextmanager
    def asking(self, fingerprint: ModelFingerprint | str, node: str, hashes: Sequence[bytes]) -> Iterator[int]:
        """IndexMirror.asking's face: the host index has no guard for a question out here (a record
        learned after a newer event costs a reader a miss, then the read path forgets it)."""
        if self._own is not None:
            with self._own.asking(fingerprint, node, hashes) as since:
                yield since
        else:
            yield 0

    def remember_many(self, fingerprint: ModelFingerprint | str, node: str,
                      blocks: Sequence[tuple[bytes, BlockRecord | bytes]], since: int | None = None) -> None:
        fp = fingerprint_id(fingerprint)
        if (self.scope is not None and fp not in self.scope) or not blocks:
            return
        records = [(r.encode() if isinstance(r, BlockRecord) else bytes(r)).hex() for _, r in blocks]
        reply = self._question({"q": "learn", "fp": fp, "node": node, "kind": "put", "records": records},
                               [h for h, _ in blocks])
        if reply is None:
            self._own.remember_many(fp, node, blocks, since)

    def remember(self, fingerprint: ModelFingerprint | str, block_hash: bytes, node: str,
                 record: BlockRecord | bytes) -> None:
        self.remember_many(fingerprint, node, [(block_hash, record)])

    def forget_many(self, fingerprint: ModelFingerprint | str, node: str, hashes: Sequence[bytes],
                    since: int | None = None) -> None:
        fp = fingerprint_id(fingerprint)
        if (self.scope is not None and fp not in self.scope) or not hashes:
            return
        reply = self._question({"q": "learn", "fp": fp, "node": node, "kind": "delete"}, hashes)
        if reply is None:
            self._own.forget_many(fp, node, hashes, since)

    # --- waiting --------------------------------------------------------------------------------
    def wait_for_revision(self, revision: int, timeout: float = 5.0) -> bool:
        """Whether the host's mirror (and this process's view of the nodes) applied `revision` in time."""
        deadline = time.monotonic() + timeout
        reply = self._question({"q": "wait", "revision": int(revision), "timeout": timeout})
        reached = self._own.wait_for_revision(revision, timeout) if reply is None else bool(reply.get("reached"))
        return reached and self.members.wait_for_revision(revision, max(0.0, deadline - time.monotonic()))

    def wait_until(self, predicate: Callable[["HostIndexMirror"], bool], timeout: float = 5.0) -> bool:
        """Poll `predicate(self)` until it holds or the timeout passes (its questions go to the host)."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def wait_loaded(self, timeout: float) -> bool:
        return self.members.wait_loaded(timeout)

    def wake(self) -> None:
        self.members.wake()

    def on_replica_removed(self, listener: Callable[[str, bytes, str], None]) -> None:
        raise InvalidConfig("a host index reports no removals to a client: a daemon's repairer keeps its own mirror")
