"""Accepts peer connections: authenticates them, then hands data connections to the native
server (with the peer identity their handshake named, whose write grants apply) and answers
control requests (region table, shared-memory descriptors) itself.

Work done before a peer authenticates is bounded: at most `max_handshakes` at once (and a share of
them per source address), one deadline for each whole handshake, a pause when out of descriptors,
and the same-host socket admits only processes of our own user (SO_PEERCRED).
"""
from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable

from .auth import Channel, server_handshake

log = logging.getLogger(__name__)
FDS_PER_MESSAGE = 200  # the kernel caps SCM_RIGHTS at 253 descriptors per message
MAX_HANDSHAKES = 128
MAX_HANDSHAKES_PER_SOURCE = 16  # one address cannot take every slot from the others
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket."""
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return uid


class Listener:
    """TCP listener (data + control) and an abstract unix socket (same-host control)."""

    def __init__(self, host: str, port: int, unix_name: str | None, secret: bytes, name: str,
                 serve_data: Callable[[int, bytes, bytes, str], None],
                 export_table: Callable[[], tuple[list[dict[str, Any]], list[int]]],
                 handshake_timeout: float, wire: str = "aead", max_handshakes: int = MAX_HANDSHAKES,
                 max_per_source: int = MAX_HANDSHAKES_PER_SOURCE) -> None:
        self._secret, self._name, self._wire = secret, name, wire
        self._serve_data, self._export_table = serve_data, export_table
        self._handshake_timeout = handshake_timeout
        self._max_handshakes, self._max_per_source = max_handshakes, max_per_source
        self._pending: dict[str, int] = {}  # handshakes in progress per source
        self._allowed_uids = {os.geteuid(), 0}
        self._tcp = socket.create_server((host, port), backlog=128)
        self.host, self.port = self._tcp.getsockname()[:2]
        self._unix: socket.socket | None = None
        if unix_name is not None:
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind("\0" + unix_name)
            self._unix.listen(128)
        self._closed = threading.Event()
        self._controls: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.refused = 0  # connections dropped before authenticating (slots full, wrong user, failed)
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvt-listen-{name}", daemon=True)
        self._thread.start()

    @property
    def handshakes(self) -> int:
        """Handshakes in progress now."""
        with self._lock:
            return sum(self._pending.values())

    def _admit(self, source: str) -> bool:
        with self._lock:
            if sum(self._pending.values()) >= self._max_handshakes or \
                    self._pending.get(source, 0) >= self._max_per_source:
                self.refused += 1
                return False
            self._pending[source] = self._pending.get(source, 0) + 1
            return True

    def _release(self, source: str) -> None:
        with self._lock:
            left = self._pending[source] - 1
            if left:
                self._pending[source] = left
            else:
                del self._pending[source]

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
                    self.refused += 1
                conn.close()
                return
            source = f"uid:{uid}"
        else:
            source = str(addr[0])
        if not self._admit(source):
            conn.close()
            return
        try:
            threading.Thread(target=self._handle, args=(conn, is_unix, source), daemon=True).start()
        except RuntimeError:  # no thread to spare: refuse rather than fail the loop
            self._release(source)
            conn.close()

    def _handle(self, conn: socket.socket, is_unix: bool, source: str) -> None:
        try:
            session = server_handshake(conn, self._secret, self._name, wire=self._wire,
                                       timeout=self._handshake_timeout)
        except Exception as exc:  # whatever a stranger sends, only this connection ends
            log.info("refused connection from %s: %s: %s", source, type(exc).__name__, exc)
            with self._lock:
                self.refused += 1
            conn.close()
            return
        finally:
            self._release(source)
        if session.hello["role"] == "data":
            if is_unix:
                conn.close()
                return
            conn.settimeout(None)
            tx, rx = session.native_keys
            self._serve_data(conn.detach(), tx, rx, session.peer)
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
        with self._lock:
            for conn in self._controls:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
