"""Accepts peer connections: authenticates them, then hands data connections to the native
server (with the peer identity their handshake named, scoped by the tenant it authenticated as,
whose write grants apply) and answers
control requests (region table, shared-memory descriptors) itself.

Work done before a peer authenticates is bounded (HandshakeBudget): the TCP socket and the
same-host socket each have a budget of their own, so a flood of one never shuts out the other.
Over TCP a source is an IPv4 /24 or an IPv6 /64 (one host can use many addresses of its prefix),
and one source holds at most a sixteenth of the budget; at a cap, a handshake pending longer than
a legitimate one ever takes (STALE_HANDSHAKE_S) gives its slot to the newcomer. One deadline
covers each whole handshake, accept pauses when out of descriptors, and the same-host socket
admits only processes of our own user (SO_PEERCRED).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from itertools import count
from typing import Any, Callable, Mapping

from .auth import Channel, server_handshake
from .descriptor import unix_address, unlink_unix

log = logging.getLogger(__name__)
FDS_PER_MESSAGE = 200  # the kernel caps SCM_RIGHTS at 253 descriptors per message
MAX_HANDSHAKES = 256  # TCP connections still in their handshake, all sources
MAX_HANDSHAKES_PER_SOURCE = 16  # ... from one IPv4 /24 or IPv6 /64: a sixteenth of them
MAX_UNIX_HANDSHAKES = 64  # the same-host socket's own budget (processes of our user only)
# A handshake on a LAN takes milliseconds; one pending this long when its source (or the whole
# budget) is at its cap is a staller, and a newcomer takes its slot. A flood must then open fresh
# connections faster than cap / STALE_HANDSHAKE_S per second to keep others out.
STALE_HANDSHAKE_S = 0.5
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket."""
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return uid


def source_of(address: str) -> str:
    """The source a handshake budget counts a TCP peer as: its IPv4 /24 or IPv6 /64 (an
    IPv4-mapped IPv6 address as its IPv4), so the addresses one host or subnet can use are one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False))


class HandshakeBudget:
    """Connections that have not authenticated yet: at most `total` at once and `per_source` from
    one source. A newcomer over either cap takes the slot of the oldest handshake pending for
    `stale_after` seconds or more (of its own source when that source is at its cap, else of the
    source holding the most), which is shut down; with none that old it is refused."""

    def __init__(self, total: int, per_source: int, stale_after: float = STALE_HANDSHAKE_S) -> None:
        self.total, self.per_source, self.stale_after = total, per_source, stale_after
        self._pending: dict[str, OrderedDict[int, tuple[float, socket.socket]]] = {}  # oldest first
        self._held = 0
        self._tickets = count(1)
        self._lock = threading.Lock()
        self.refused = 0
        self.evicted = 0

    @property
    def pending(self) -> int:
        with self._lock:
            return self._held

    def by_source(self) -> dict[str, int]:
        with self._lock:
            return {source: len(held) for source, held in self._pending.items()}

    def admit(self, source: str, conn: socket.socket) -> int | None:
        """A ticket for `conn` (release it when its handshake ends), or None: refused."""
        now = time.monotonic()
        with self._lock:
            mine = self._pending.get(source)
            victim = None
            if mine is not None and len(mine) >= self.per_source:
                victim = self._evict(source, now)
            elif self._held >= self.total:
                for other in sorted(self._pending, key=lambda s: len(self._pending[s]), reverse=True):
                    victim = self._evict(other, now)
                    if victim is not None:
                        break
            if victim is None and (self._held >= self.total or (mine is not None and len(mine) >= self.per_source)):
                self.refused += 1
                return None
            ticket = next(self._tickets)
            self._pending.setdefault(source, OrderedDict())[ticket] = (now, conn)
            self._held += 1
        if victim is not None:
            try:
                victim.shutdown(socket.SHUT_RDWR)  # its handler sees the end and lets go of the socket
            except OSError:
                pass  # it finished (or failed) meanwhile
        return ticket

    def _evict(self, source: str, now: float) -> socket.socket | None:
        """Take `source`'s oldest handshake out of the budget if it is stale (lock held)."""
        held = self._pending[source]
        ticket, (started, conn) = next(iter(held.items()))
        if now - started < self.stale_after:
            return None
        del held[ticket]
        if not held:
            del self._pending[source]
        self._held -= 1
        self.evicted += 1
        return conn

    def release(self, source: str, ticket: int) -> None:
        with self._lock:
            held = self._pending.get(source)
            if held is None or held.pop(ticket, None) is None:
                return  # evicted: its slot went to a newcomer already
            self._held -= 1
            if not held:
                del self._pending[source]


class Listener:
    """TCP listener (data + control) and an abstract unix socket (same-host control)."""

    def __init__(self, host: str, port: int, unix_name: str | None, secret: bytes, name: str,
                 serve_data: Callable[[int, bytes, bytes, str], None],
                 export_table: Callable[[], tuple[list[dict[str, Any]], list[int]]],
                 handshake_timeout: float, wire: str = "aead", max_handshakes: int = MAX_HANDSHAKES,
                 max_per_source: int = MAX_HANDSHAKES_PER_SOURCE, max_unix_handshakes: int = MAX_UNIX_HANDSHAKES,
                 stale_after: float | None = None, tenants: Mapping[str, bytes] | None = None) -> None:
        self._secret, self._name, self._wire = secret, name, wire
        self._tenants = tenants  # tenant -> its own secret: clients that name one prove it with that
        self._serve_data, self._export_table = serve_data, export_table
        self._handshake_timeout = handshake_timeout
        stale = min(STALE_HANDSHAKE_S, handshake_timeout / 2) if stale_after is None else stale_after
        self.tcp_budget = HandshakeBudget(max_handshakes, max_per_source, stale)
        self.unix_budget = HandshakeBudget(max_unix_handshakes, max_unix_handshakes, stale)
        self._allowed_uids = {os.geteuid(), 0}
        self._tcp = socket.create_server((host, port), backlog=128)
        self.host, self.port = self._tcp.getsockname()[:2]
        self._unix: socket.socket | None = None
        self._unix_name = unix_name
        if unix_name is not None:
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind(unix_address(unix_name))
            self._unix.listen(128)
        self._closed = threading.Event()
        self._controls: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._refused = 0  # wrong user, failed handshakes, no thread to spare
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvt-listen-{name}", daemon=True)
        self._thread.start()

    @property
    def handshakes(self) -> int:
        """Handshakes in progress now (both sockets)."""
        return self.tcp_budget.pending + self.unix_budget.pending

    @property
    def refused(self) -> int:
        """Connections dropped before authenticating (over a budget, wrong user, failed)."""
        with self._lock:
            return self._refused + self.tcp_budget.refused + self.unix_budget.refused

    def _accept_loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._tcp, selectors.EVENT_READ)
        if self._unix is not None:
            selector.register(self._unix, selectors.EVENT_READ)
        last_warning = 0.0
        while not self._closed.is_set():
            for key, _ in selector.select(timeout=0.2):
                try:
                    conn, addr = key.fileobj.accept()  # type: ignore[union-attr]
                except OSError as exc:
                    if exc.errno in _OUT_OF_FDS:
                        # The connection stays in the backlog; retrying at once would spin.
                        if time.monotonic() - last_warning > 10:
                            log.warning("%s: out of file descriptors, pausing accept: %s", self._name, exc)
                            last_warning = time.monotonic()
                        self._closed.wait(0.1)
                    continue
                self._admit_connection(conn, addr, key.fileobj is self._unix)
        selector.close()

    def _admit_connection(self, conn: socket.socket, addr: Any, is_unix: bool) -> None:
        if is_unix:
            try:
                uid = peer_uid(conn)
            except OSError:
                uid = -1
            if uid not in self._allowed_uids:
                log.warning("%s: refused same-host connection from uid %d", self._name, uid)
                with self._lock:
                    self._refused += 1
                conn.close()
                return
            source, budget = f"uid:{uid}", self.unix_budget
        else:
            source, budget = source_of(str(addr[0])), self.tcp_budget
        ticket = budget.admit(source, conn)
        if ticket is None:
            conn.close()
            return
        try:
            threading.Thread(target=self._handle, args=(conn, is_unix, source, budget, ticket), daemon=True).start()
        except RuntimeError:  # no thread to spare: refuse rather than fail the loop
            budget.release(source, ticket)
            with self._lock:
                self._refused += 1
            conn.close()

    def _handle(self, conn: socket.socket, is_unix: bool, source: str, budget: HandshakeBudget, ticket: int) -> None:
        try:
            session = server_handshake(conn, self._secret, self._name, wire=self._wire,
                                       timeout=self._handshake_timeout, tenants=self._tenants)
        except Exception as exc:  # whatever a stranger sends, only this connection ends
            log.info("refused connection from %s: %s: %s", source, type(exc).__name__, exc)
            with self._lock:
                self._refused += 1
            conn.close()
            return
        finally:
            budget.release(source, ticket)
        if session.hello["role"] == "data":
            if is_unix:
                conn.close()
                return
            conn.settimeout(None)
            tx, rx = session.native_keys
            self._serve_data(conn.detach(), tx, rx, session.identity)  # a tenant's grants are its own
            return
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._controls.add(conn)
        try:
            conn.settimeout(None)
            self._control_loop(Channel(conn, session), is_unix)
        except Exception as exc:  # the peer went away or broke the protocol
            log.debug("control connection from %s ended: %s", source, exc)
        finally:
            with self._lock:
                self._controls.discard(conn)
            conn.close()

    def _control_loop(self, channel: Channel, is_unix: bool) -> None:
        while True:
            request = channel.recv()
            if request.get("op") == "regions":
                table, fds = self._export_table()  # our own duplicates: closed below, never reused under us
                try:
                    if not is_unix:  # shared memory is only offered on the same host
                        table = [dict(entry, shm=False) for entry in table]
                    channel.send({"regions": table, "fds": len(fds) if is_unix else 0})
                    if is_unix:
                        for start in range(0, len(fds), FDS_PER_MESSAGE):
                            socket.send_fds(channel.sock, [b"F"], fds[start : start + FDS_PER_MESSAGE])
                finally:
                    for fd in fds:
                        os.close(fd)
            elif request.get("op") == "ping":
                channel.send({"pong": True})
            else:
                channel.send({"error": f"unknown control op {str(request.get('op'))[:64]!r}"})

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)
        self._tcp.close()
        if self._unix is not None:
            self._unix.close()
            unlink_unix(self._unix_name)
        with self._lock:
            for conn in self._controls:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
