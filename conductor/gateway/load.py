"""The load ledger: what this gateway has in flight at each engine (Engine.inflight, inflight_tokens,
inflight_kv), taken when a request goes there and given back exactly once when it ends, however it
ends (answered, failed, timed out, cancelled). Routing reads these counts as the load it caused
since the last scrape, so a count never given back steers every later request away for good; this
is the only place that moves them."""
from __future__ import annotations

from types import TracebackType

from .pool import Engine


class Load:
    """`with Load(engine, queued_tokens=..., kv_tokens=...) as load:` around one request's call.
    `queued_tokens`: prompt tokens it makes the engine compute (its prefill queue), given back by
    `started()` once the first token is out or when the call ends; `kv_tokens`: KV it holds there
    until the call ends."""

    def __init__(self, engine: Engine, queued_tokens: int = 0, kv_tokens: int = 0) -> None:
        self.engine, self.queued_tokens, self.kv_tokens = engine, queued_tokens, kv_tokens
        self._queued = self._held = False

    def __enter__(self) -> Load:
        if self._held:
            raise RuntimeError("a Load is taken once")
        self.engine.inflight += 1
        self.engine.inflight_tokens += self.queued_tokens
        self.engine.inflight_kv += self.kv_tokens
        self._queued = self._held = True
        return self

    def started(self) -> None:
        """Its prefill is done (or will not happen): the queue it caused is gone; the KV stays."""
        if self._queued:
            self._queued = False
            self.engine.inflight_tokens -= self.queued_tokens

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.started()
        self.engine.inflight -= 1
        self.engine.inflight_kv -= self.kv_tokens
