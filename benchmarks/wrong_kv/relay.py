"""A TCP relay on the path between clients and a daemon's Transfer Engine port, holding no secret:
it passes every byte through, except when armed for one fault:

- `flip`: one bit of the daemon's reply stream, `at` bytes after arming, is flipped in flight;
- `kill`: the first reply bytes after arming (the daemon is serving a load) are held, `on_reply`
  runs (the benchmark kills the daemon there), and every connection through the relay is closed:
  the client sees the daemon die in the middle of its load.
"""
from __future__ import annotations

import socket
import threading
from typing import Callable

CHUNK = 1 << 16


class Relay:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = self._server.getsockname()[:2]
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._mode: str | None = None
        self._at = 0
        self._bit = 0
        self._seen = 0  # reply bytes since arming
        self._on_reply: Callable[[], None] | None = None
        self.fired = False
        self._closed = False
        threading.Thread(target=self._accept, name="wrong-kv-relay", daemon=True).start()

    # --- faults ---------------------------------------------------------------------------------
    def arm_flip(self, at: int, bit: int) -> None:
        with self._lock:
            self._mode, self._at, self._bit, self._seen, self.fired = "flip", at, bit, 0, False

    def arm_kill(self, on_reply: Callable[[], None]) -> None:
        with self._lock:
            self._mode, self._on_reply, self._seen, self.fired = "kill", on_reply, 0, False

    def disarm(self) -> bool:
        """Stop injecting; whether the armed fault happened."""
        with self._lock:
            self._mode, self._on_reply = None, None
            return self.fired

    # --- plumbing -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while True:
                chunk = src.recv(CHUNK)
                if not chunk:
                    break
                if reply:
                    chunk = self._tamper(chunk)
                    if chunk is None:
                        break
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _tamper(self, chunk: bytes) -> bytes | None:
        """The reply chunk to pass on (altered when a flip falls in it), or None to cut the
        connection (a kill)."""
        with self._lock:
            mode = self._mode
            if mode is None:
                return chunk
            if mode == "kill":
                on_reply, self._mode, self._on_reply = self._on_reply, None, None
                self.fired = True
            else:
                start, self._seen = self._seen, self._seen + len(chunk)
                if not start <= self._at < self._seen:
                    return chunk
                data = bytearray(chunk)
                data[self._at - start] ^= 1 << self._bit
                self._mode, self.fired = None, True
                return bytes(data)
        if on_reply is not None:
            on_reply()
        self.cut()
        return None

    def cut(self) -> None:
        """Close every connection through the relay (new ones are still accepted)."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._server.close()
        self.cut()
