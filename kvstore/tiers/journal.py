"""The NVMe tier's journal: what a restarted daemon (`kvstore serve --keep-disk`) needs to serve the
blocks its tier file holds again.

Two things on the disk, beside each other in --disk-dir:

- **The tier file's label**, its first 4 KiB (LABEL_BYTES; blocks start after it): magic
  `KVSTIER1`, a u32 length, a JSON object {version, cluster, node, size, tier_id} and a CRC-32 of it.
  `tier_id` is 16 random bytes chosen when the tier was (re)labelled: the tier's fingerprint.
- **The journal**, `<node>.journal`: a header (magic `KVSJRNL2`, u32 length, JSON {version,
  cluster, node, tier_size, tier_id}, a 16-byte MAC), then entries, each `u32 length, 16-byte MAC,
  payload`; a payload is ENTRY (op, codec, offset, size, stored, block hash, digest, fingerprint
  length) and the fingerprint. `put` says a block's bytes (its frame when coded) are at `offset`;
  `delete` that they no longer are.

**Authenticity.** The journal says which bytes a restarted node serves under which key, and the
digest each must hash to: whoever could write it could make the node serve bytes of their choosing
(the digest check at restart compares the disk with the journal's own digest). So the header and
every entry carry a MAC (keyed BLAKE3, 16 bytes) under a key derived from the cluster secret, the
cluster, the node and the tier id, a key that never touches --disk-dir; each entry's MAC also
covers the one before it (the header's for the first), so entries cannot be forged, altered,
reordered, replayed or removed from the middle. A header that fails its MAC refuses the journal;
the first entry that fails its MAC ends it (it and all after it are dropped and counted). What it
does not stop: a process with the daemon's uid can read the secret file too (docs/security.md), and
on an --insecure node (no secret) the key is public.

At start the label and the journal header must name this cluster, this node, this tier size and
one tier id; else the whole journal is refused (one log line, a metric per reason) and the tier
starts empty under a new tier id. Entries are read up to the first one torn (short) or damaged
(CRC): it and everything after it are dropped and counted. The entries left are replayed (a put of
a block replaces its earlier place, a delete removes it where it was) into the blocks to restore,
oldest first; an entry whose fields do not fit the tier, or whose extent overlaps a newer one's, is
dropped and counted. The journal is then rewritten with just those (a temporary file renamed over
it), and appended to from then on. Nothing here trusts a block: the daemon verifies each one's
digest over the bytes on disk before it publishes it (kvstore.daemon.tierwork).

**fsync policy.** Every entry is written (write(2), O_APPEND) when the tier changes, under the
store's lock, after the block's bytes were written: a crash of the process (kill -9) loses nothing
the journal said. Every SYNC_S (1 s) a background thread fdatasync()s the tier file, then the
journal, when either changed; a clean stop does the same, and a compaction's new journal is fsync'd
before it is renamed into place (and the folder after). A power loss therefore loses at most the
last second's entries, and an entry that survives may still point at bytes that did not: both are
caught by the digest check at restart, never served. The journal is compacted (rewritten from the
tier's blocks, appends meanwhile kept and replayed on top) once it holds more than twice the
entries of its last rewrite, and at least COMPACT_MIN of them.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import struct
import threading
import zlib

import blake3
from dataclasses import dataclass
from typing import Callable, Iterable

from ..index.records import MAX_BLOCK_BYTES, NAME
from .allocator import ALIGN, ExtentAllocator, align_up

log = logging.getLogger(__name__)
LABEL_BYTES = 4096
LABEL_MAGIC = b"KVSTIER1"
JOURNAL_MAGIC = b"KVSJRNL2"
FORMAT_VERSION = 2
ENTRY = struct.Struct("<BBQII16s32sB")  # op, codec, offset, size, stored, hash, digest, fingerprint length
MAC_BYTES = 16
FRAME = struct.Struct(f"<I{MAC_BYTES}s")  # payload length, MAC of (previous MAC, payload)
PUT, DELETE = 1, 2
KNOWN_CODECS = (0, 1, 2, 3)  # kvstore.codec: RAW, LZ4_W1, LZ4_W2, LZ4_W4
SYNC_S = 1.0
COMPACT_MIN = 65536  # entries appended before a compaction is considered
REASONS = ("format", "mac", "cluster", "node", "tier_id", "size", "label")  # why a journal is refused


@dataclass(frozen=True, slots=True)
class Entry:
    """A block the tier holds: its key, where its bytes are, and what they must hash to."""

    fingerprint: str
    block_hash: bytes
    offset: int
    size: int  # the block's raw bytes
    stored: int  # bytes at `offset` (== size when raw)
    codec: int
    digest: bytes


@dataclass
class Recovery:
    """What a start found on the disk."""

    entries: list[Entry]  # to restore, oldest first (not verified yet)
    refused: str = ""  # one of REASONS when the whole journal was refused
    detail: str = ""  # that reason in words
    dropped: int = 0  # entries dropped: fields that do not fit the tier, overlaps
    torn_bytes: int = 0  # bytes cut at the journal's end (a torn or damaged entry and all after it)


def _frame(magic: bytes, header: dict) -> bytes:
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return magic + struct.pack("<I", len(body)) + body + struct.pack("<I", zlib.crc32(body))


def _unframe(magic: bytes, raw: bytes) -> tuple[dict, int] | None:
    """(header, bytes it took) or None when `raw` does not start with a sound one."""
    if len(raw) < len(magic) + 8 or raw[: len(magic)] != magic:
        return None
    (length,) = struct.unpack_from("<I", raw, len(magic))
    start = len(magic) + 4
    if length > 65536 or start + length + 4 > len(raw):
        return None
    body = raw[start : start + length]
    (crc,) = struct.unpack_from("<I", raw, start + length)
    if zlib.crc32(body) != crc:
        return None
    try:
        header = json.loads(body)
    except ValueError:
        return None
    return (header, start + length + 4) if isinstance(header, dict) else None


def journal_key(secret: bytes, cluster: str, node: str, tier_id: bytes) -> bytes:
    """The MAC key of one tier's journal: from the cluster secret, never stored beside the tier."""
    context = b"kvstore tier journal v2\0" + cluster.encode() + b"\0" + node.encode() + b"\0" + tier_id
    return blake3.blake3(context, key=blake3.blake3(secret).digest()).digest()


def mac(key: bytes, previous: bytes, payload: bytes) -> bytes:
    return blake3.blake3(previous + payload, key=key).digest(MAC_BYTES)


def header_mac(key: bytes, body: bytes) -> bytes:
    return mac(key, b"header", body)


def encode_entry(key: bytes, previous: bytes, op: int, fingerprint: str, block_hash: bytes, offset: int,
                 size: int = 0, stored: int = 0, codec: int = 0, digest: bytes = bytes(32)) -> tuple[bytes, bytes]:
    """(the entry's bytes, its MAC: the next entry's `previous`)."""
    name = fingerprint.encode()
    payload = ENTRY.pack(op, codec, offset, size, stored, block_hash, digest, len(name)) + name
    tag = mac(key, previous, payload)
    return FRAME.pack(len(payload), tag) + payload, tag


def frame_header(key: bytes, header: dict) -> tuple[bytes, bytes]:
    """(the journal header's bytes, its MAC)."""
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    tag = header_mac(key, body)
    return JOURNAL_MAGIC + struct.pack("<I", len(body)) + body + tag, tag


def unframe_header(key: bytes, raw: bytes) -> tuple[dict, int, bytes, bool] | None:
    """(header, bytes it took, its MAC, whether the MAC holds under `key`), or None when `raw` does
    not start with a header at all. The header's fields are read either way, to say whose a
    journal is; only an authentic one is trusted."""
    start = len(JOURNAL_MAGIC) + 4
    if len(raw) < start or raw[: len(JOURNAL_MAGIC)] != JOURNAL_MAGIC:
        return None
    (length,) = struct.unpack_from("<I", raw, len(JOURNAL_MAGIC))
    if length > 65536 or start + length + MAC_BYTES > len(raw):
        return None
    body, tag = raw[start : start + length], raw[start + length : start + length + MAC_BYTES]
    try:
        header = json.loads(body)
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    return header, start + length + MAC_BYTES, tag, hmac.compare_digest(tag, header_mac(key, body))


def read_label(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, LABEL_BYTES, 0)
    except OSError:
        return None
    found = _unframe(LABEL_MAGIC, raw)
    return None if found is None else found[0]


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replay(raw: bytes, tier_size: int, start: int, key: bytes, previous: bytes) -> tuple[list[Entry], int, int]:
    """The entries of a journal body from `start` (`previous`: the header's MAC): (live entries,
    oldest first; entries dropped; bytes cut at a torn, damaged or forged entry)."""
    live: dict[tuple[str, bytes], tuple[int, Entry]] = {}
    dropped, at, seq = 0, start, 0
    capacity = tier_size // ALIGN * ALIGN
    while at < len(raw):
        if at + FRAME.size > len(raw):
            break
        length, tag = FRAME.unpack_from(raw, at)
        payload = raw[at + FRAME.size : at + FRAME.size + length]
        if length < ENTRY.size or len(payload) != length or not hmac.compare_digest(tag, mac(key, previous, payload)):
            break
        previous = tag
        at += FRAME.size + length
        seq += 1
        op, codec, offset, size, stored, block_hash, digest, name_len = ENTRY.unpack_from(payload)
        try:
            fingerprint = payload[ENTRY.size :].decode("ascii")
        except UnicodeDecodeError:
            fingerprint = ""
        if name_len != len(payload) - ENTRY.size or not NAME.fullmatch(fingerprint) or op not in (PUT, DELETE):
            dropped += 1
            continue
        block = (fingerprint, block_hash)
        if op == DELETE:
            if block in live and live[block][1].offset == offset:
                del live[block]
            continue
        if (codec not in KNOWN_CODECS or not 0 < size <= MAX_BLOCK_BYTES or not 0 < stored <= MAX_BLOCK_BYTES
                or (codec == 0 and stored != size) or offset < LABEL_BYTES or offset % ALIGN
                or offset + align_up(stored) > capacity):
            dropped += 1
            live.pop(block, None)  # where it was before is not where it is
            continue
        live[block] = (seq, Entry(fingerprint, block_hash, offset, size, stored, codec, digest))
    torn = len(raw) - at
    # Extents that overlap (a journal damaged in a way its CRCs did not catch): the newest entry wins.
    space = ExtentAllocator(capacity)
    space.take(0, LABEL_BYTES)
    kept = []
    for seq, entry in sorted(live.values(), key=lambda item: -item[0]):
        if space.take(entry.offset, entry.stored):
            kept.append((seq, entry))
        else:
            dropped += 1
    kept.sort(key=lambda item: item[0])
    return [entry for _, entry in kept], dropped, torn


class TierJournal:
    """The journal of one tier file (see module docstring): open() recovers, put/delete append."""

    def __init__(self, folder: str, node: str, cluster: str, tier_path: str, tier_size: int,
                 counters: dict[str, float], secret: bytes, sync_s: float = SYNC_S) -> None:
        self.folder, self.node, self.cluster = folder, node, cluster
        self._secret = secret
        self._key = b""  # journal_key(...) once the tier id is known
        self._last = b""  # the MAC of the last entry written (the next one's `previous`)
        self.path = os.path.join(folder, f"{node}.journal")
        self.tier_path, self.tier_size = tier_path, tier_size
        self.counters = counters
        self.sync_s = sync_s
        self.tier_id = b""
        self._lock = threading.Lock()
        self._fd = -1
        self._tier_fd = -1
        self._dirty = False
        self._broken = False
        self._appended = 0  # entries written since the last rewrite
        self._base = 0  # entries the last rewrite held
        self._capture: list[tuple] | None = None  # entries written while a compaction runs
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.snapshot: Callable[[], list[Entry]] | None = None  # the tier's blocks now (set by the store)

    def _count(self, name: str, by: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    # --- start ------------------------------------------------------------------------------
    def open(self, resized: str = "") -> Recovery:
        """Read the label and the journal, decide what to restore, rewrite the journal (and the
        label when the tier starts over); `resized`: the tier file had another size (in words)."""
        self._tier_fd = os.open(self.tier_path, os.O_RDWR | os.O_CLOEXEC)
        label = read_label(self._tier_fd)
        recovery = self._recover(label, resized)
        if recovery.refused:
            self._count(f"journal_refused_{recovery.refused}")
            log.warning("NVMe tier %s: its journal is refused (%s): the tier starts empty", self.tier_path,
                        recovery.detail)
        if recovery.dropped or recovery.torn_bytes:
            self._count("journal_dropped_entries", recovery.dropped)
            self._count("journal_torn_bytes", recovery.torn_bytes)
            log.warning("NVMe tier %s: journal damaged: %d entries dropped (bad fields or overlaps), %d bytes cut "
                        "at a torn or damaged entry", self.tier_path, recovery.dropped, recovery.torn_bytes)
        if recovery.refused or label is None or label.get("tier_id") is None:
            self.tier_id = secrets.token_bytes(16)
            self._write_label()
        else:
            self.tier_id = bytes.fromhex(label["tier_id"])
        self._key = journal_key(self._secret, self.cluster, self.node, self.tier_id)
        self._install(*self._write_temporary(recovery.entries), [])
        self._thread = threading.Thread(target=self._run, name=f"kvs-journal-{self.node}", daemon=True)
        self._thread.start()
        return recovery

    def _recover(self, label: dict | None, resized: str) -> Recovery:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raw = None
        if raw is None:  # nothing to restore (a new tier, or a label without its journal)
            detail = "" if label is None else "no journal beside a labelled tier file"
            return Recovery([], "label" if label is not None else "", detail)
        if resized:
            return Recovery([], "size", resized)
        if label is None:
            return Recovery([], "label", "the tier file carries no label (made by another program, an older "
                                         "release, or a daemon without --keep-disk)")
        try:
            key = journal_key(self._secret, self.cluster, self.node, bytes.fromhex(str(label.get("tier_id"))))
        except ValueError:
            return Recovery([], "label", "the tier file's label names no tier id")
        found = unframe_header(key, raw)
        if found is None or found[0].get("version") != FORMAT_VERSION or label.get("version") != FORMAT_VERSION:
            return Recovery([], "format", "not a journal of this release (bad magic or version)")
        header, start, previous, authentic = found
        for reason, theirs, ours in (("cluster", header.get("cluster"), self.cluster),
                                     ("cluster", label.get("cluster"), self.cluster),
                                     ("node", header.get("node"), self.node),
                                     ("node", label.get("node"), self.node),
                                     ("size", header.get("tier_size"), self.tier_size),
                                     ("size", label.get("size"), self.tier_size),
                                     ("tier_id", header.get("tier_id"), label.get("tier_id"))):
            if theirs != ours:
                what = {"cluster": "cluster", "node": "node", "size": "tier size",
                        "tier_id": "tier id (the journal belongs to another tier file)"}[reason]
                return Recovery([], reason, f"{what} {theirs!r} where this is {ours!r}")
        if not authentic:
            return Recovery([], "mac", "its header fails its MAC: written without this cluster's secret, or damaged")
        entries, dropped, torn = replay(raw, self.tier_size, start, key, previous)
        return Recovery(entries, "", "", dropped, torn)

    def _write_label(self) -> None:
        label = _frame(LABEL_MAGIC, {"version": FORMAT_VERSION, "cluster": self.cluster, "node": self.node,
                                     "size": self.tier_size, "tier_id": self.tier_id.hex()})
        os.pwrite(self._tier_fd, label.ljust(LABEL_BYTES, b"\0"), 0)
        os.fdatasync(self._tier_fd)

    def _write_temporary(self, entries: Iterable[Entry]) -> tuple[int, int, bytes]:
        """A new journal of `entries` in a temporary file, synced: (its fd, entries written, the
        last MAC written)."""
        fd = os.open(self.path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            header, last = frame_header(self._key, {"version": FORMAT_VERSION, "cluster": self.cluster,
                                                    "node": self.node, "tier_size": self.tier_size,
                                                    "tier_id": self.tier_id.hex()})
            parts, count = [header], 0
            for e in entries:
                entry, last = encode_entry(self._key, last, PUT, e.fingerprint, e.block_hash, e.offset, e.size,
                                           e.stored, e.codec, e.digest)
                parts.append(entry)
                count += 1
                if len(parts) >= 4096:
                    _write_all(fd, b"".join(parts))
                    parts = []
            _write_all(fd, b"".join(parts))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd, count, last

    def _install(self, fd: int, count: int, last: bytes, tail: list[Entry]) -> None:
        """Append `tail` (entries appended meanwhile, re-chained behind `last`) to the temporary
        journal, sync it, rename it over the journal and append to it from then on (the lock held,
        or nothing appending yet)."""
        try:
            if tail:
                parts = []
                for op, *fields in tail:
                    entry, last = encode_entry(self._key, last, op, *fields)
                    parts.append(entry)
                _write_all(fd, b"".join(parts))
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(self.path + ".tmp", self.path)
        _fsync_folder(self.folder)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        if old >= 0:
            os.close(old)
        self._base, self._appended, self._last = count + len(tail), 0, last

    # --- appends (under the store's lock) -----------------------------------------------------------
    def put(self, fingerprint: str, block_hash: bytes, offset: int, size: int, stored: int, codec: int,
            digest: bytes) -> None:
        self._append((PUT, fingerprint, block_hash, offset, size, stored, codec, digest))

    def delete(self, fingerprint: str, block_hash: bytes, offset: int) -> None:
        self._append((DELETE, fingerprint, block_hash, offset, 0, 0, 0, bytes(32)))

    def _append(self, fields: tuple) -> None:
        with self._lock:
            if self._broken or self._fd < 0:
                return
            entry, last = encode_entry(self._key, self._last, *fields)
            try:
                _write_all(self._fd, entry)
            except OSError as exc:
                # From here on the journal says less than the tier holds: a restart restores fewer
                # blocks (an entry left stale points at bytes that fail their digest), never wrong ones.
                self._broken = True
                self._count("journal_write_failures")
                log.error("NVMe tier journal %s: cannot append (%s): no more entries until the next start",
                          self.path, exc)
                return
            self._last = last
            self._dirty = True
            self._appended += 1
            if self._capture is not None:
                self._capture.append(fields)

    # --- background: sync and compaction -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.sync_s):
            try:
                self.sync()
                if self._appended > max(COMPACT_MIN, 2 * self._base) and self.snapshot is not None:
                    self.compact()
            except Exception:  # noqa: BLE001 - said; tried again next round
                log.exception("NVMe tier journal %s: sync or compaction failed", self.path)

    def sync(self) -> None:
        """fdatasync the tier file, then the journal, if anything was appended since the last sync."""
        with self._lock:
            if not self._dirty or self._fd < 0:
                return
            self._dirty = False
            fd = self._fd
            os.fdatasync(self._tier_fd)  # the bytes entries point at, before the entries
            os.fdatasync(fd)

    def compact(self) -> None:
        """Rewrite the journal from the tier's blocks now (`snapshot`), keeping appends made meanwhile."""
        with self._lock:
            if self._broken:
                return
            self._capture = []
        try:
            # Taken under the store's lock: every entry appended before it is in it, every one after
            # it is captured (some may be in both: replaying a put or delete twice changes nothing).
            fd, count, last = self._write_temporary(self.snapshot())
            with self._lock:
                captured, self._capture = self._capture or [], None
                self._install(fd, count, last, captured)
            self._count("journal_compactions")
        finally:
            with self._lock:
                self._capture = None

    def close(self) -> None:
        """A clean stop: sync, stop the thread, close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            try:
                if self._fd >= 0 and not self._broken:
                    os.fdatasync(self._tier_fd)
                    os.fdatasync(self._fd)
            except OSError as exc:
                log.warning("NVMe tier journal %s: final sync failed: %s", self.path, exc)
            for fd in (self._fd, self._tier_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._tier_fd = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def remove_stale(folder: str, node: str) -> bool:
    """Delete a journal a tier that is not kept would leave wrong (its file is reused without it)."""
    try:
        os.unlink(os.path.join(folder, f"{node}.journal"))
    except FileNotFoundError:
        return False
    return True

