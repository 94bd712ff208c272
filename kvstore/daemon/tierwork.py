"""The NVMe tier's background work, on one thread per daemon:

1. **Restore.** A daemon restarted on a persistent tier (`--keep-disk`) holds the extents its
   journal lists but serves none of them yet: this thread reads each block's bytes back from the
   tier file, decodes them when coded, checks the digest, and only then seals the block and
   publishes it under the new lease, in journal order (oldest first), 64 blocks or 32 MiB at a time.
   A block that fails is dropped and counted (`kvstore_tier_restore_corrupt_blocks`), never listed.
   The daemon serves puts and gets meanwhile; `kvstore_tier_restore_pending` counts what is left.
2. **Coding** (`--disk-codec lz4`): blocks demoted raw (the eviction path stays as fast as before)
   are coded here, off the store's lock, oldest first, and swapped in where they gain at least 5 %.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .store import BlockStore, Update

log = logging.getLogger(__name__)
IDLE_S = 0.5


class TierWork:
    """See module docstring."""

    def __init__(self, store: BlockStore, publish: Callable[[list[Update], bool], None], node: str) -> None:
        self._store, self._publish, self._node = store, publish, node
        self._stop = threading.Event()
        self._restored = threading.Event()
        if not store.restoring:
            self._restored.set()
        self._thread = threading.Thread(target=self._run, name=f"kvs-tier-{node}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store, counters = self._store, self._store.counters
        total, started = store.restoring, time.monotonic()
        if total:
            log.info("%s: restoring %d blocks from its NVMe tier (each verified before it is served)", self._node,
                     total)
        while not self._stop.is_set():
            try:
                if store.restoring:
                    updates, left = store.verify_restored()
                    if updates:
                        self._publish(updates, False)
                    if not left:
                        self._restored.set()
                        log.info("%s: restored %d of %d blocks from its NVMe tier in %.1f s (%d failed their digest "
                                 "and were dropped, %d were put again meanwhile)", self._node,
                                 counters.get("restored_blocks", 0), total, time.monotonic() - started,
                                 counters.get("restore_corrupt_blocks", 0), counters.get("restore_superseded", 0))
                    continue
                self._restored.set()
                if store.uncoded:
                    updates, _ = store.code_some()
                    if updates:
                        self._publish(updates, False)
                    continue
                store.tier_work.wait(IDLE_S)
                store.tier_work.clear()
            except Exception:  # noqa: BLE001 - a failed batch is said and the next one tried
                log.exception("%s: NVMe tier background work failed", self._node)
                self._stop.wait(IDLE_S)

    def wait_restored(self, timeout: float) -> bool:
        """Wait until every restored block was verified (sealed or dropped); whether it was."""
        return self._restored.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._store.tier_work.set()
        self._thread.join(timeout=10)
