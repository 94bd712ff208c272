"""Accepts peer connections: authenticates them, then hands data connections to the native
server and answers control requests (region table, shared-memory descriptors) itself."""
from __future__ import annotations

import logging
import selectors
import socket
import threading
from typing import Any, Callable

from .auth import recv_frame, send_frame, server_handshake
from .errors import TransferError

log = logging.getLogger(__name__)
FDS_PER_MESSAGE = 200  # the kernel caps SCM_RIGHTS at 253 descriptors per message


class Listener:
    """TCP listener (data + control) and an abstract unix socket (same-host control)."""

    def __init__(self, host: str, port: int, unix_name: str | None, secret: bytes, name: str,
                 serve_data: Callable[[int], None], export_table: Callable[[], tuple[list[dict[str, Any]], list[int]]],
                 handshake_timeout: float) -> None:
        self._secret, self._name = secret, name
        self._serve_data, self._export_table = serve_data, export_table
        self._handshake_timeout = handshake_timeout
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
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvt-listen-{name}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._tcp, selectors.EVENT_READ)
        if self._unix is not None:
            selector.register(self._unix, selectors.EVENT_READ)
        while not self._closed.is_set():
            for key, _ in selector.select(timeout=0.2):
                try:
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                except OSError:
                    continue
                is_unix = key.fileobj is self._unix
                threading.Thread(target=self._handle, args=(conn, is_unix), daemon=True).start()
        selector.close()

    def _handle(self, conn: socket.socket, is_unix: bool) -> None:
        try:
            conn.settimeout(self._handshake_timeout)
            hello = server_handshake(conn, self._secret, self._name)
        except (OSError, TransferError, ValueError) as exc:
            log.info("refused connection: %s", exc)
            conn.close()
            return
        if hello["role"] == "data":
            if is_unix:
                conn.close()
                return
            conn.settimeout(None)
            self._serve_data(conn.detach())
            return
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._controls.add(conn)
        try:
            conn.settimeout(None)
            self._control_loop(conn, is_unix)
        except (OSError, TransferError, ValueError):
            pass
        finally:
            with self._lock:
                self._controls.discard(conn)
            conn.close()

    def _control_loop(self, conn: socket.socket, is_unix: bool) -> None:
        while True:
            request = recv_frame(conn)
            if request.get("op") == "regions":
                table, fds = self._export_table()
                if not is_unix:  # shared memory is only offered on the same host
                    table = [dict(entry, shm=False) for entry in table]
                    fds = []
                send_frame(conn, {"regions": table, "fds": len(fds)})
                for start in range(0, len(fds), FDS_PER_MESSAGE):
                    socket.send_fds(conn, [b"F"], fds[start : start + FDS_PER_MESSAGE])
            elif request.get("op") == "ping":
                send_frame(conn, {"pong": True})
            else:
                send_frame(conn, {"error": f"unknown control op {request.get('op')!r}"})

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
