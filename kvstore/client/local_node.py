"""A store daemon's framed control wire, as its clients reach it: pooled authenticated connections
(`kvstore.wire`; its unix socket on this host, TCP from elsewhere) for control requests and
inline puts, and, on this host, the NVMe tier file's read-only fd, read with O_DIRECT straight
into the caller's buffer, and the DRAM arena's seal table (kvstore.seals), mapped read-only."""
from __future__ import annotations

import mmap
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from transfer import Region, _native

from ..codec import CodecError, decode
from ..errors import AccessDenied, AllocationFailed, AuthenticationFailed, ConnectionsExhausted, NodeRefused, WrongSize
from ..index.records import MAX_BLOCK_BYTES, BlockRecord
from ..seals import SealView
from ..spin import spin_for
from ..wire import REPLY_SPIN_S, TCP_SCHEME, Frames, connect

LOCAL_CONNECTIONS = 32  # idle same-host connections kept per node (one per concurrent caller)
POOLED_IDLE_S = 60.0  # a pooled connection idle longer is dropped: the node closes them after 120 s
# A node that admits no more of this client's connections (its share, or all, open): a control call
# waits, within its timeout, for one of ours to come back to the pool or for the node to admit it.
BUSY_PAUSES_S = (0.005, 0.02, 0.05, 0.1, 0.2)
DIRECT_ALIGN = 4096


@dataclass
class TierFile:
    """A same-host node's NVMe tier file, opened read-only by the node for this client."""

    region: int
    size: int
    fd: int
    direct: bool


class LocalNode:
    """A node's framed wire: pooled authenticated connections (unix on this host, or `tcp://`) and,
    on this host, its NVMe tier fd."""

    def __init__(self, name: str, address: str, secret: bytes, client: str, timeout: float,
                 secret_source: str = "", tenant: str = "", tls: ssl.SSLContext | None = None) -> None:
        self.name, self.address, self._secret, self._client, self.timeout = name, address, secret, client, timeout
        self._tls = tls  # over TCP: TLS, the node's certificate checked against these roots
        self._tenant = tenant  # authenticates as this tenant (`secret` is its own) when set
        self._secret_source = secret_source  # where the secret came from, in words, for a refusal's message
        self._idle: list[tuple[Frames, float]] = []  # (connection, when it was last used)
        self._lock = threading.Lock()
        self._tier: TierFile | None = None
        self._tier_checked = float("-inf")  # monotonic time starts at boot: 0.0 is 'just now' for a minute
        self._seals: SealView | None = None
        self._seals_checked = float("-inf")
        self.closed = False

    def call(self, message: dict, attachments: Sequence = (), want_fd: bool = False,
             timeout: float | None = None, wait: bool = True) -> tuple[dict, int | None]:
        """One request and its reply (and fd) within `timeout` (default: this node's). Raises the
        typed error a refusal maps to. A node with no connection for us is waited for within this
        node's timeout (not a sync put's longer answer time); not at all without `wait` (best-effort
        calls: hit reports, slots given back)."""
        waited = min(timeout or self.timeout, self.timeout) if wait else 0.0
        frames = self._pooled() or self._connect_waiting(time.monotonic() + waited)
        fd = None
        try:
            frames.send(message, attachments)  # each send bounded by the socket's timeout
            reply = frames.recv(timeout or self.timeout, exact=want_fd, spin=spin_for(REPLY_SPIN_S))
            if want_fd and reply.get("ok"):
                _, fds, _, _ = socket.recv_fds(frames.sock, 1, 1)
                if len(fds) != 1:
                    for extra in fds:
                        os.close(extra)
                    raise ConnectionError("node announced a descriptor but sent none")
                fd = fds[0]
        except BaseException:
            frames.sock.close()
            raise
        self._pool(frames, keep=bool(reply.get("ok")))  # a refused put may have left its bytes unread
        if not reply.get("ok"):
            raise self.refusal(reply)
        return reply, fd

    def _pooled(self) -> Frames | None:
        """An idle pooled connection, or None (those idle too long are closed on the way)."""
        frames, stale = None, []
        with self._lock:
            old_enough = time.monotonic() - POOLED_IDLE_S
            while self._idle and self._idle[0][1] < old_enough:  # oldest first: free their fds too
                stale.append(self._idle.pop(0)[0])
            if self._idle:
                frames = self._idle.pop()[0]
        for old in stale:
            old.sock.close()
        return frames

    def _connect_waiting(self, deadline: float) -> Frames:
        """A new connection; while the node admits none, one of ours back in the pool, until
        `deadline` (then what the last attempt raised). Not admitted: refused after the handshake
        (ConnectionsExhausted), or closed during it, where a TCP wire's handshake slots are all
        taken (a stalled one gives its slot to a newcomer after transfer.listener.STALE_HANDSHAKE_S).
        A same-host socket that closes during the handshake refused this user: not tried again."""
        pauses, tcp = iter(BUSY_PAUSES_S), self.address.startswith(TCP_SCHEME)
        while True:
            try:
                return self._connect(max(0.05, deadline - time.monotonic()))
            except ConnectionRefusedError:
                raise  # nothing listens there: the node is down
            except (ConnectionsExhausted, ConnectionError) as exc:
                pause = next(pauses, BUSY_PAUSES_S[-1])
                if time.monotonic() + pause > deadline or not (tcp or isinstance(exc, ConnectionsExhausted)):
                    raise
            time.sleep(pause)  # a backoff bounded by the caller's deadline, not a wait for a signal
            if (frames := self._pooled()) is not None:
                return frames

    def refusal(self, reply: dict) -> Exception:
        """The typed error a refusing reply maps to."""
        code, error = reply.get("code"), str(reply.get("error", ""))[:500]
        if code == "invalid":
            return WrongSize(error)
        if code == "exhausted":
            return AllocationFailed(error)
        if code == "denied":
            return AccessDenied(f"{self.name}: {error}")
        return NodeRefused(f"{self.name}: {error}")

    def read(self, message: dict, timeout: float | None = None) -> tuple[dict, list[bytearray]]:
        """A `read` request: its reply and the bytes sent after it, one buffer per record that is
        not null (as long as the record's span). Raises as `call` does."""
        with self._lock:
            frames = self._idle.pop()[0] if self._idle else None
        if frames is None:
            frames = self._connect(None)
        deadline = time.monotonic() + (timeout or self.timeout)
        try:
            frames.send(message)
            reply = frames.recv(timeout or self.timeout, spin=spin_for(REPLY_SPIN_S))
            parts: list[bytearray] = []
            if reply.get("ok"):
                records = reply.get("records")
                if not isinstance(records, list):
                    raise ValueError(f"{self.name} answered a malformed read")
                for raw in records:
                    if raw is None:
                        continue
                    if not isinstance(raw, str):
                        raise ValueError(f"{self.name} answered a malformed read")
                    span = BlockRecord.decode(bytes.fromhex(raw)).span
                    if not 0 < span <= MAX_BLOCK_BYTES:
                        raise ValueError(f"{self.name} announced a block of {span} bytes")
                    part = bytearray(span)
                    frames.recv_into(memoryview(part), deadline)
                    parts.append(part)
                if parts:
                    frames.attachments_end(deadline)  # sealed (TCP): bytes altered in flight are refused
        except BaseException:
            frames.sock.close()
            raise
        self._pool(frames)
        if not reply.get("ok"):
            raise self.refusal(reply)
        return reply, parts

    def _connect(self, connect_timeout: float | None) -> Frames:
        try:
            frames = connect(self.address, self._secret, self._client, self.timeout, connect_timeout=connect_timeout,
                             tenant=self._tenant, tls=self._tls)
        except ssl.SSLCertVerificationError as exc:
            raise AuthenticationFailed(f"node {self.name}'s TLS certificate does not verify against this client's "
                                       f"roots (tls_ca): {exc.verify_message}") from None
        except AuthenticationFailed as exc:
            whose = f"tenant {self._tenant!r}'s secret" if self._tenant else "cluster secret"
            raise AuthenticationFailed(f"node {self.name} refused this client's {whose} "
                                       f"(from {self._secret_source or 'the caller'}): {exc}") from None
        return frames

    def _pool(self, frames: Frames, keep: bool = True) -> None:
        """Keep a connection for the next call, or close it (not `keep`, closed, pool full)."""
        with self._lock:
            if self.closed or len(self._idle) >= LOCAL_CONNECTIONS or not keep:
                frames.sock.close()
            else:
                self._idle.append((frames, time.monotonic()))

    def tier(self) -> TierFile | None:
        """The node's NVMe tier fd (asked for once; again a minute after a refusal)."""
        if self._tier is not None or time.monotonic() - self._tier_checked < 60:
            return self._tier
        self._tier_checked = time.monotonic()
        try:
            reply, fd = self.call({"op": "tier"}, want_fd=True)
        except NodeRefused:
            return None
        tier = TierFile(int(reply["region"]), int(reply["size"]), fd, bool(reply.get("direct")))
        with self._lock:
            if self.closed or self._tier is not None:
                os.close(fd)
            else:
                self._tier = tier
        return self._tier

    def seals(self) -> SealView | None:
        """The node's seal table, mapped read-only (asked for once; again a minute after a refusal:
        an older node has none)."""
        if self._seals is not None or time.monotonic() - self._seals_checked < 60:
            return self._seals
        self._seals_checked = time.monotonic()
        try:
            reply, fd = self.call({"op": "seals"}, want_fd=True)
        except (NodeRefused, WrongSize):
            return None
        try:
            view = SealView(fd, int(reply["region"]), int(reply["size"]))
        except (ValueError, OSError, KeyError):
            return None
        finally:
            os.close(fd)
        with self._lock:
            if self.closed or self._seals is not None:
                view.close()
            else:
                self._seals = view
        return self._seals

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            tier, self._tier = self._tier, None
            self._seals = None  # unmapped once no read still holds it
        for frames, _ in idle:
            frames.sock.close()
        if tier is not None:
            os.close(tier.fd)


class InProcessNode(LocalNode):
    """A node whose daemon runs in this very process (library mode): each control call goes
    straight to the daemon's handler (`answer`: LocalControl.in_process) with the requests,
    replies and errors of the same-host wire, and no socket, framing or session in between. Block
    bytes still move through the Transfer Engine's shared memory, as on the wire."""

    def __init__(self, name: str, answer: Callable[[dict, Sequence], tuple[dict, int | None, list]],
                 timeout: float) -> None:
        super().__init__(name, f"in-process:{name}", b"", "", timeout)
        self._answer = answer

    def call(self, message: dict, attachments: Sequence = (), want_fd: bool = False,
             timeout: float | None = None, wait: bool = True) -> tuple[dict, int | None]:
        reply, fd, _ = self._answer(message, attachments)
        if fd is not None and not (want_fd and reply.get("ok")):
            os.close(fd)
            fd = None
        if not reply.get("ok"):
            raise self.refusal(reply)
        return reply, fd

    def read(self, message: dict, timeout: float | None = None) -> tuple[dict, list[bytearray]]:
        reply, fd, parts = self._answer(message, ())
        if fd is not None:
            os.close(fd)
        if not reply.get("ok"):
            raise self.refusal(reply)
        return reply, [bytearray(p) for p in parts]  # copies: a slot may be reused once this returns


def read_block(tier: TierFile, record: BlockRecord, segments: list[tuple[Region, int, int]]) -> bool:
    """One block from the tier fd into its destination segments, bounds-checked against the
    record and the tier; O_DIRECT straight into the caller's buffer when it is aligned, else
    through an aligned bounce buffer. False when the record does not fit or the read came short."""
    if record.codec:
        return _read_coded(tier, record, segments)
    size, offset = record.size, record.offset
    span = _align_up(size) if tier.direct else size
    if size <= 0 or offset < 0 or offset + span > tier.size or sum(n for _, _, n in segments) != size:
        return False  # a record that does not fit the tier (or the buffer) is never read
    if tier.direct and offset % DIRECT_ALIGN:
        return False
    views = [(region, off, region.host_view()[off : off + n]) for region, off, n in segments]
    if len(views) == 1 and (not tier.direct or (size == span and
                                                _native.buffer_address(views[0][2])[0] % DIRECT_ALIGN == 0)):
        got = os.preadv(tier.fd, [views[0][2]], offset)
    else:
        bounce = _bounce_buffer(span)
        got = min(os.preadv(tier.fd, [memoryview(bounce)[:span]], offset), size)
        done = 0
        for _, _, view in views:
            view[:] = memoryview(bounce)[done : done + view.nbytes]
            done += view.nbytes
    if got < size:
        return False
    for region, off, view in views:
        if region._cuda_tensor is not None:
            region.sync_to_device(off, view.nbytes)
    return True


def _read_coded(tier: TierFile, record: BlockRecord, segments: list[tuple[Region, int, int]]) -> bool:
    """A coded block (kvstore.codec): its frame from the tier fd, decoded here, in the client, into
    the destination segments. False when the frame does not fit, comes short or does not decode
    (the caller's digest check then has nothing to pass)."""
    stored, offset = record.stored, record.offset
    span = _align_up(stored) if tier.direct else stored
    if stored <= 0 or offset < 0 or offset + span > tier.size or sum(n for _, _, n in segments) != record.size:
        return False
    if tier.direct and offset % DIRECT_ALIGN:
        return False
    bounce = _bounce_buffer(span)
    if os.preadv(tier.fd, [memoryview(bounce)[:span]], offset) < stored:
        return False
    try:
        fill_segments(decode(memoryview(bounce)[:stored], record.codec, record.size), segments)
    except CodecError:
        return False
    return True


def fill_segments(data, segments: list[tuple[Region, int, int]]) -> None:
    """Copy a block's bytes into its destination segments, in order (and on to a GPU region's device)."""
    done = 0
    for region, off, n in segments:
        region.host_view()[off : off + n] = memoryview(data)[done : done + n]
        if region._cuda_tensor is not None:
            region.sync_to_device(off, n)
        done += n


_bounce = threading.local()


def _bounce_buffer(size: int) -> mmap.mmap:
    """A page-aligned scratch buffer of at least `size` bytes for this thread (O_DIRECT reads)."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < size:
        if buf is not None:
            buf.close()
        buf = _bounce.buf = mmap.mmap(-1, max(size, 1 << 20))
    return buf


def _align_up(n: int) -> int:
    return (n + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN
