"""One background asyncio loop per process for everything that speaks async (the etcd client,
index mirrors, node sessions). gRPC's asyncio layer keeps process-wide state tied to the loops
that use it, so sharing one long-lived loop keeps it away from loops that come and go."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Coroutine, TypeVar

T = TypeVar("T")

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


async def bounded(awaitable: Awaitable[T], timeout: float) -> T:
    """`asyncio.wait_for` whose inner task's failure is always retrieved: when the wait is cancelled
    or times out while the inner call fails (an etcd call failing as its member goes away), asyncio
    would otherwise log "Task exception was never retrieved" with a traceback."""
    return await asyncio.wait_for(quiet(asyncio.ensure_future(awaitable)), timeout)


def quiet(task: asyncio.Future) -> asyncio.Future:
    """`task`, whose failure counts as seen once it ends: for background tasks a caller may stop
    waiting on (cancelled, shut down) while they fail, which asyncio would otherwise log as "Task
    exception was never retrieved" with a traceback. Whoever awaits it still gets the exception."""
    task.add_done_callback(_retrieve)
    return task


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
