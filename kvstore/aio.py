"""One background asyncio loop per process for everything that speaks async (the etcd client,
index mirrors, node sessions). gRPC's asyncio layer keeps process-wide state tied to the loops
that use it, so sharing one long-lived loop keeps it away from loops that come and go."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's background loop, started on first use (a daemon thread)."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="kvstore-aio", daemon=True).start()
        return _loop


def run(coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
    """Run `coro` on the shared loop and wait (at most `timeout` seconds) for its result."""
    future = asyncio.run_coroutine_threadsafe(coro, shared_loop())
    try:
        return future.result(timeout)
    except TimeoutError:
        future.cancel()
        raise
