"""A submitted batch: wait on it (blocking or `await`), then read per-op results."""
from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from . import _native
from .errors import STATUS_ERRORS, STATUS_NAMES, TransferError, TransferTimeout
from .ops import Op, OpResult


class Batch:
    """Handle on a batch of ops moving in the background."""

    __slots__ = ("_native", "_ops", "_on_done", "_default_timeout", "_on_failure", "_direct")

    def __init__(self, native: _native.Batch, ops: Sequence[Op], on_done: Callable[[], None] | None = None,
                 default_timeout: float = 30.0, on_failure: Callable[[_native.Batch], None] | None = None,
                 direct: Sequence[int] = ()) -> None:
        self._native = native
        self._ops = ops
        self._on_done = on_done
        self._on_failure = on_failure  # runs before a failed batch's results are handed out
        self._default_timeout = default_timeout
        self._direct = frozenset(direct)  # indexes of ops done before submission (cuda_direct), not in `native`

    def __len__(self) -> int:
        return len(self._ops)

    def done(self) -> bool:
        if not self._native.done():
            return False
        if self._on_failure is not None and self._native.failures():
            self._failed()
        return True

    def results(self) -> list[OpResult]:
        """Per-op outcome so far (`status` 1 = still pending)."""
        statuses, counts = self._native.statuses(), self._native.byte_counts()
        if self._on_failure is not None and any(s not in (0, 1) for s in statuses):
            self._failed()
        native = iter([OpResult(s == 0, n, None if s in (0, 1) else STATUS_NAMES.get(s, f"status {s}"), s)
                       for s, n in zip(statuses, counts)])
        if not self._direct:
            return list(native)
        return [OpResult(True, op.length) if i in self._direct else next(native) for i, op in enumerate(self._ops)]

    def _failed(self) -> None:
        """Once, whoever sees a failure first: the engine retires what failed (ucx endpoints)."""
        on_failure, self._on_failure = self._on_failure, None
        if on_failure is not None:
            on_failure(self._native)

    def give_up(self) -> None:
        """The caller stops waiting (a timeout): ops still in flight on the ucx route fail as
        stalled and their endpoints are retired, so none of their bytes lands later."""
        if self._on_failure is not None:
            self._native.abandon()
            self._failed()

    def timed_out(self, timeout: float) -> TransferTimeout:
        """Give the batch up after waiting `timeout` seconds in vain; the error to raise."""
        self.give_up()
        return TransferTimeout(f"batch of {len(self)} ops not done after {timeout:.3f}s")

    def wait(self, timeout: float | None = None, *, raise_on_error: bool = True) -> list[OpResult]:
        """Block (without the GIL) until every op finished; raise the first op's typed error.
        A timeout gives the batch up (ucx ops still in flight fail, see `give_up`): to wait again
        later, poll `done()` instead."""
        timeout = self._default_timeout if timeout is None else timeout
        failures = self._native.wait_failures(timeout)
        if failures < 0:
            raise self.timed_out(timeout)
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        if not failures:  # the common case, kept cheap: every op moved all its bytes
            return [OpResult(True, op.length) for op in self._ops]
        results = self.results()  # (runs the failure hook)
        if raise_on_error:
            for index, result in enumerate(results):
                if not result.ok:
                    error_type = STATUS_ERRORS.get(result.status, TransferError)
                    error = error_type(f"op {index} of {len(results)} failed: {result.error}")
                    error.results = results  # type: ignore[attr-defined]
                    raise error
        return results

    def __await__(self):
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.wait).__await__()
