"""Background tasks that fail while nobody waits on them any more leave no "never retrieved" log."""
from __future__ import annotations

import asyncio
import gc

from kvstore.aio import bounded, quiet


async def _fails_when_cancelled() -> None:
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise ConnectionError("etcd member went away") from None  # as a gRPC call failing under a cancel


def _unretrieved(waiter) -> list[dict]:
    seen: list[dict] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        loop.run_until_complete(waiter())
        gc.collect()  # asyncio says "never retrieved" when the task is collected
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    gc.collect()
    return seen


def test_a_cancelled_wait_retrieves_the_inner_failure():
    """Kills `asyncio.wait_for` around an etcd call (the index mirror's health check): when the
    mirror's tasks were reaped as etcd went away, the call failed under the cancel and asyncio logged
    "Task exception was never retrieved" with a traceback on the fault report's output."""
    async def cancel_while_waiting() -> None:
        outer = asyncio.ensure_future(bounded(_fails_when_cancelled(), 5))
        await asyncio.sleep(0.01)
        outer.cancel()
        try:
            await outer
        except asyncio.CancelledError:
            pass

    assert _unretrieved(cancel_while_waiting) == []



def test_a_quiet_background_task_that_fails_unawaited_is_not_logged():
    """Kills the index mirror's watch task left unretrieved: its watch ended ("watch ended") as the
    mirror was being stopped, after the reaping had looked, and asyncio logged the failure with a
    traceback on the fault report's output."""
    async def abandon() -> None:
        quiet(asyncio.ensure_future(_fails_when_cancelled())).cancel()  # fails as it is cancelled
        await asyncio.sleep(0.05)

    assert _unretrieved(abandon) == []
