"""Verifies, after the put was answered, the bytes of blocks committed with `verify=False`, then
publishes the good ones.

Why after the answer: the node's digest pass over a 32 MiB same-host put took a quarter of the
put's time, with the client waiting. The putting client holds the records from its answer
(read-your-writes) and checks every block it reads, so the pass may come later, as long as no one
else learns of a block before it: until then the block is only *written* (see BlockStore.commit),
never published, evicted or demoted. Puts that asked to wait for publication are verified before
their answer, as before.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from .store import BlockStore, Update

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often the thread looks at its stop flag while nothing waits


class Verifier:
    """One thread that seals what `store` has written and hands the updates to `publish`."""

    def __init__(self, store: BlockStore, publish: Callable[[list[Update], bool], None], node: str) -> None:
        self._store, self._publish = store, publish
        self._stopped = threading.Event()
        self._sealing = threading.Lock()  # a drain's seal waits for the thread's batch in flight
        self._thread = threading.Thread(target=self._run, name=f"kvs-verify-{node}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if self._store.wait_written(POLL_S):
                try:
                    self.seal()
                except Exception:  # noqa: BLE001 - that batch is dropped (freed, never published); go on
                    log.exception("verifying written blocks failed")

    def seal(self) -> None:
        """Verify and publish (queue) everything written so far; also what a drain does first."""
        with self._sealing:
            updates = self._store.seal_written()
        if updates:
            self._publish(updates, False)  # queued: never waits for the metadata service

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2.0)
