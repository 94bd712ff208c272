"""How far a layer-by-layer load has got: the forward pass waits for each layer's KV just before
that layer's attention, so loading the next layers overlaps computing the first ones."""
from __future__ import annotations

import threading
import time


class LayerProgress:
    """Layers landed so far (they land in order) and whether the load has ended."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._landed = -1  # every layer up to this one has landed
        self._ended = False
        self._cond = threading.Condition()

    def landed(self, layer: int) -> None:
        with self._cond:
            self._landed = max(self._landed, layer)
            self._cond.notify_all()

    def end(self) -> None:
        """The load is over (done or failed): nobody waits any longer."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, layer: int) -> float:
        """Block until `layer` has landed or the load ended (at most `timeout`); seconds waited."""
        started = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._landed >= layer or self._ended, self.timeout)
        return time.perf_counter() - started
