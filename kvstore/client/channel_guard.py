"""A gRPC channel closed only once no call is on it, which refuses calls after it is retired.
grpc-python crashes the process on a call racing its channel's close, and on a call started on a
closed channel behind an interceptor (seen with grpc 1.85): a client that replaces its connection to
a failed node may still have a hit report or another thread's put on the old one."""
from __future__ import annotations

import threading

import grpc

from ..errors import ConnectionReplaced


class ChannelGuard(grpc.UnaryUnaryClientInterceptor):
    """Counts the unary calls on `raw`; `channel` is `raw` behind this guard."""

    def __init__(self, raw: grpc.Channel, name: str) -> None:
        self.raw, self.name = raw, name
        self.channel = grpc.intercept_channel(raw, self)
        self._lock = threading.Lock()
        self._calls = 0
        self._retired = False

    def intercept_unary_unary(self, continuation, details, request):
        with self._lock:
            if self._retired:
                raise ConnectionReplaced(f"the connection to {self.name} was replaced; call again")
            self._calls += 1
        try:
            outcome = continuation(details, request)
        except BaseException:
            self._done()
            raise
        outcome.add_done_callback(lambda _: self._done())  # at once for a blocking call: it has ended
        return outcome

    def retire(self) -> None:
        """No new calls; close the channel when the last call on it ends (now, when none is on it)."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            idle = self._calls == 0
        if idle:
            self.raw.close()

    def _done(self) -> None:
        with self._lock:
            self._calls -= 1
            last = self._retired and self._calls == 0
        if last:
            self.raw.close()
