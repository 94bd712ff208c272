"""Connection admission for the gateway's listening socket: what outside traffic may hold.

- A cap on open client connections, in all and per source network (an IPv4 /24 or an IPv6 /64
  counts as one source: one host with many addresses still gets one share). A connection over a
  cap gets a canned 503 with Retry-After and is closed at once: no parser, no task, no timer.
  At a cap, room is made first: an idle keep-alive connection is closed (the oldest; of that source
  for the per-source cap), as nginx reuses keep-alive connections when it runs out; failing that,
  the connection whose request headers have been arriving the longest (a slowloris) is shed with a
  408, once it has had `shed_after_s` to send them. Requests being answered are never shed.
- A deadline for each request's headers (from the connection's start, or from the first byte of
  the next request on a kept-alive connection): past it, a 408 and the connection is closed. The
  header bytes of one request are bounded too (431).
- Requests the app marks (`request[CLOSE] = True`: no valid API key, a body that timed out) close
  their connection as soon as the answer is written: no keep-alive, no lingering read of a body.

The protocol is aiohttp's own RequestHandler; this subclass only decides whether it starts, and
when it stops."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .errors import ApiError

log = logging.getLogger("conductor.gateway")
# A request key: close the connection once the answer is out (aiohttp >= 3.13 wants typed keys).
CLOSE: Any = web.RequestKey("conductor_gateway_close", bool) if hasattr(web, "RequestKey") \
    else "conductor_gateway_close"
MAX_HEADER_BYTES = 64 << 10  # one request's line and headers (aiohttp's own: 8 KiB a line, 128 lines)
FD_RESERVE = 128  # descriptors kept for everything but client connections (logs, etcd, ZMQ, files)
FDS_PER_CONNECTION = 2  # a client connection and its request's engine connection


def source_of(peername: Any) -> tuple[int, int] | None:
    """The network a peer counts under: (4, its /24) or (6, its /64); IPv4-mapped IPv6 as IPv4."""
    if not isinstance(peername, tuple) or not peername:
        return None
    try:
        addr = ipaddress.ip_address(str(peername[0]).split("%", 1)[0])
    except ValueError:
        return None
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return (4, int(addr) >> 8) if addr.version == 4 else (6, int(addr) >> 64)


def describe(source: tuple[int, int] | None) -> str:
    if source is None:
        return "unknown"
    if source[0] == 4:
        return f"{ipaddress.IPv4Address(source[1] << 8)}/24"
    return f"{ipaddress.IPv6Address(source[1] << 64)}/64"


def canned(status: int, reason: str, message: str, code: str, headers: str = "") -> bytes:
    """A whole HTTP/1.1 answer with the OpenAI error object, written straight to the socket."""
    body = json.dumps(ApiError(status, message, code=code).body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{headers}Connection: close\r\n\r\n").encode() + body


def descriptor_room() -> int | None:
    """How many client connections the descriptor limit (ulimit -n) leaves room for; None: no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(1, (soft - FD_RESERVE) // FDS_PER_CONNECTION)


def raise_descriptor_limit(target: int = 65536) -> int:
    """Raise the soft descriptor limit towards `target` (never past the hard one), as vLLM's own
    server does at start; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            pass
    return soft


class Oldest:
    """Connections in one state, oldest first, in all and by source network."""

    def __init__(self) -> None:
        self.all: OrderedDict[GuardedHandler, float] = OrderedDict()  # -> when it entered the state
        self.by_source: dict[Any, OrderedDict[GuardedHandler, float]] = {}

    def add(self, handler: GuardedHandler, now: float) -> None:
        self.all[handler] = now
        self.by_source.setdefault(handler.source, OrderedDict())[handler] = now

    def discard(self, handler: GuardedHandler) -> None:
        if handler in self.all:
            del self.all[handler]
            mine = self.by_source[handler.source]
            del mine[handler]
            if not mine:
                del self.by_source[handler.source]

    def oldest(self, source: Any = None, *, whole: bool = True) -> tuple[GuardedHandler, float] | None:
        """The oldest of all (`whole`) or of one source; None when there is none."""
        group = self.all if whole else self.by_source.get(source)
        return next(iter(group.items()), None) if group else None

    def __contains__(self, handler: GuardedHandler) -> bool:
        return handler in self.all

    def __len__(self) -> int:
        return len(self.all)


class ConnectionGuard:
    """The counts behind the caps; one per listening gateway."""

    def __init__(self, max_connections: int, per_source: int, header_timeout_s: float, metrics=None,
                 shed_after_s: float = 1.0) -> None:
        self.header_timeout_s = header_timeout_s
        self.shed_after_s = shed_after_s
        self.metrics = metrics
        self.open = 0
        self.by_source: dict[Any, int] = {}
        self.idle = Oldest()  # between requests on a kept-alive connection
        self.waiting = Oldest()  # a request's line and headers on their way
        self.resize(max_connections, per_source)

    def resize(self, max_connections: int, per_source: int) -> None:
        self.max_connections, self.per_source = max_connections, per_source
        self._refusal = {
            reason: canned(503, "Service Unavailable", message, "too_many_connections", "Retry-After: 1\r\n")
            for reason, message in (
                ("total", f"the gateway holds its maximum of {max_connections} connections; retry shortly"),
                ("source", (f"too many connections from your network (at most {per_source} per IPv4 /24 or "
                            "IPv6 /64); close some or retry shortly")))}

    def admit(self, handler: GuardedHandler) -> str | None:
        """None: admitted (and counted); else why not ("source", "total")."""
        source = handler.source
        if self.per_source and source is not None and self.by_source.get(source, 0) >= self.per_source \
                and not self._make_room(source, whole=False):
            return self._refused("source")
        if self.open >= self.max_connections and not self._make_room(source, whole=True):
            return self._refused("total")
        self.open += 1
        self.by_source[source] = self.by_source.get(source, 0) + 1
        handler.counted = True
        return None

    def refusal(self, reason: str) -> bytes:
        return self._refusal[reason]

    def release(self, handler: GuardedHandler) -> None:
        if not handler.counted:
            return
        handler.counted = False
        self.idle.discard(handler)
        self.waiting.discard(handler)
        self.open -= 1
        left = self.by_source[handler.source] - 1
        if left:
            self.by_source[handler.source] = left
        else:
            del self.by_source[handler.source]

    def set_idle(self, handler: GuardedHandler, idle: bool) -> None:
        """Idle: between requests on a kept-alive connection, nothing of the next one received."""
        if idle and handler.counted:
            self.idle.add(handler, time.monotonic())
        else:
            self.idle.discard(handler)

    def set_waiting(self, handler: GuardedHandler, waiting: bool) -> None:
        """Waiting: a request's line and headers are on their way (since the connection opened, or
        since the first byte of the next request on a kept-alive one)."""
        if waiting and handler.counted:
            self.waiting.add(handler, time.monotonic())
        else:
            self.waiting.discard(handler)

    def _make_room(self, source: Any, whole: bool) -> bool:
        """Close one connection to admit another: the oldest idle one, else the oldest whose headers
        have been arriving for `shed_after_s` or more (a fresh one may be a client still sending)."""
        idle = self.idle.oldest(source, whole=whole)
        if idle is not None:
            handler = idle[0]
            self.release(handler)
            handler.force_close()
            if self.metrics is not None:
                self.metrics.connections_evicted.inc()
            return True
        waiting = self.waiting.oldest(source, whole=whole)
        if waiting is None or time.monotonic() - waiting[1] < self.shed_after_s:
            return False
        handler = waiting[0]
        self.release(handler)
        handler.shed()
        if self.metrics is not None:
            self.metrics.connections_shed.inc()
        return True

    def _refused(self, reason: str) -> str:
        if self.metrics is not None:
            self.metrics.connections_refused.labels(reason).inc()
        return reason


class GuardedHandler(RequestHandler):
    """aiohttp's HTTP/1.1 protocol, admitted by a ConnectionGuard and bound by its deadlines."""

    def __init__(self, manager, guard: ConnectionGuard, *, loop: asyncio.AbstractEventLoop, **kwargs) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self.guard = guard
        self.source: tuple[int, int] | None = None
        self.counted = False  # holds a slot of the guard
        self.refused = False
        self.phase = "headers"  # headers (of a request), request (being handled), idle, draining (its body)
        self.header_timer: asyncio.TimerHandle | None = None
        self.header_bytes = 0
        self.parsed = 0  # requests parsed when the header deadline was set
        self.draining: Any = None  # the payload aiohttp reads to its end after an answer

    # ------------------------------------------------------------ admission
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.source = source_of(transport.get_extra_info("peername"))
        reason = self.guard.admit(self)
        if reason is not None:  # refused: nothing started, nothing to undo
            self.refused = True
            transport.write(self.guard.refusal(reason))  # type: ignore[attr-defined]
            transport.close()
            return
        super().connection_made(transport)
        self._arm()
        self.guard.set_waiting(self, True)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        self._disarm()
        self.guard.release(self)
        super().connection_lost(exc)

    def eof_received(self) -> None:
        if not self.refused:
            super().eof_received()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None):  # type: ignore[override]
        """A request aiohttp cannot parse (bad request line, header, length): the OpenAI error object,
        not aiohttp's text, and one debug line, not a logged traceback per stranger's bad bytes."""
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        log.debug("malformed HTTP request from %s: %s", request.remote, message or exc)
        resp = ApiError(status, f"malformed HTTP request: {message or exc or 'unreadable'}",
                        code="malformed_http").response()
        resp.force_close()
        return resp

    # ------------------------------------------------------------ deadlines
    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.phase == "draining" and (self.draining is None or self.draining.is_eof()):
            self.phase, self.draining = "idle", None
        if self.phase == "idle" and data:  # the next request begins: its headers are on the clock
            self.guard.set_idle(self, False)
            self.phase = "headers"
            self._arm()
            self.guard.set_waiting(self, True)
        super().data_received(data)
        if self.phase != "headers":
            return
        if self._request_count != self.parsed:  # a whole request line and headers arrived
            self.phase = "request"
            self._disarm()
            self.guard.set_waiting(self, False)
            return
        self.header_bytes += len(data)
        if self.header_bytes > MAX_HEADER_BYTES and self.transport is not None:
            self._disarm()
            self.transport.write(canned(431, "Request Header Fields Too Large",
                                        f"request line and headers over {MAX_HEADER_BYTES} bytes", "headers_too_large"))
            self.force_close()

    async def _handle_request(self, request, start_time, request_handler):  # type: ignore[override]
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            if request.get(CLOSE):
                self.force_close()  # after the answer was written: no keep-alive, no lingering read
            elif self._messages:
                self.phase = "request"  # a pipelined one is parsed already
            elif request.content.is_eof():
                self.phase = "idle"
                self.guard.set_idle(self, True)
            else:  # aiohttp reads the rest of an unread body (at most its lingering time)
                self.phase, self.draining = "draining", request.content

    def shed(self) -> None:
        """Closed to make room at a cap while its headers were still arriving (already released)."""
        self._disarm()
        if self.transport is not None:
            self.transport.write(canned(408, "Request Timeout",
                                        "request headers not received in time while the gateway is at its connection "
                                        "cap: connection shed", "connection_shed"))
        self.force_close()

    def _arm(self) -> None:
        self._disarm()
        self.parsed, self.header_bytes = self._request_count, 0
        self.header_timer = self._loop.call_later(self.guard.header_timeout_s, self._header_timeout)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.phase != "headers" or self._request_count != self.parsed or self.transport is None:
            return
        if self.guard.metrics is not None:
            self.guard.metrics.header_timeouts.inc()
        self.transport.write(canned(408, "Request Timeout",
                                    f"request headers not received within {self.guard.header_timeout_s:g} s",
                                    "header_timeout"))
        self.force_close()
