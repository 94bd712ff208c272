"""The connector's background save writer: back-pressure drops offload saves, hand-off saves wait."""
from __future__ import annotations

import threading
import time

import numpy as np

from kvstore.integrations.vllm.writer import SaveBatch, SaveWriter


def blocks(n: int, size: int = 1024) -> list[tuple[bytes, np.ndarray]]:
    return [(bytes([i]) * 16, np.zeros(size, np.uint8)) for i in range(n)]


def test_full_queue_drops_offload_saves_and_keeps_handoffs():
    gate, stored, done = threading.Event(), [], []
    writer = SaveWriter(lambda b: (gate.wait(10), stored.extend(b.blocks)), max_bytes=4096,  # staging being written counts too
                        on_done=lambda batch, s, err: done.append(err), handoff_wait_s=5)
    try:
        assert writer.submit(SaveBatch(blocks(2), handoff=False))  # taken by the thread, which blocks
        time.sleep(0.1)
        assert writer.submit(SaveBatch(blocks(2), handoff=False))  # queued: 4 KiB staged in all, the limit
        assert not writer.submit(SaveBatch(blocks(1), handoff=False))  # no room: dropped, nothing stalls
        assert writer.dropped_blocks == 1
        started = time.monotonic()  # before the timer starts: the gate opens 0.3 s after this at the earliest
        threading.Timer(0.3, gate.set).start()
        assert writer.submit(SaveBatch(blocks(1), handoff=True))  # a decode waits for it: wait for room
        assert time.monotonic() - started >= 0.2
        assert writer.flush(10)
        assert len(stored) == 5 and done == [None, None, None]
    finally:
        gate.set()
        writer.close()


def test_failed_put_is_reported_not_raised():
    errors = []

    def put(_):
        raise OSError("store down")

    writer = SaveWriter(put, max_bytes=1 << 20, on_done=lambda batch, s, err: errors.append(err))
    assert writer.submit(SaveBatch(blocks(1), handoff=False))
    assert writer.flush(5)
    writer.close()
    assert len(errors) == 1 and isinstance(errors[0], OSError)
