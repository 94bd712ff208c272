"""How far a layer-by-layer load has got: the forward pass waits for each layer's KV just before
that layer's attention, so loading the next layers overlaps computing the first ones.

A load that misses its deadline is cancelled: the forward has read KV that never landed, so the
step's blocks are reported failed, and the loading thread may no longer write into the cache
(vLLM recomputes into those blocks, or gives them to another request). Every write into the
cache goes through `write`, under the same lock `cancel` takes: once `cancel` returns, no write
is running and none will start.
"""
from __future__ import annotations

import threading
import time
from typing import Callable


class LayerProgress:
    """Layers landed so far, whether the load has ended, and whether it was cancelled."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._landed: set[int] = set()
        self._ended = False
        self._cancelled = False
        self._cond = threading.Condition()
        self._fence = threading.Lock()  # held by each write into the cache, and by cancel

    def landed(self, layer: int) -> None:
        with self._cond:
            self._landed.add(layer)
            self._cond.notify_all()

    def end(self) -> None:
        """The load is over (done or failed): nobody waits any longer."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    @property
    def cancelled(self) -> bool:
        with self._fence:
            return self._cancelled

    def cancel(self) -> None:
        """No write into the cache after this returns (one in progress finishes first)."""
        with self._fence:
            self._cancelled = True
        self.end()

    def write(self, copy: Callable[[], None]) -> bool:
        """Run `copy` (a write into the KV cache) unless the load was cancelled; whether it ran."""
        with self._fence:
            if self._cancelled:
                return False
            copy()
            return True

    def wait(self, layer: int) -> tuple[bool, float]:
        """Block until `layer` has landed, the load ended, or `timeout` passed:
        (whether the layer's KV is in the cache, seconds waited)."""
        started = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: layer in self._landed or self._ended, self.timeout)
            ok = layer in self._landed
        return ok and not self.cancelled, time.perf_counter() - started
