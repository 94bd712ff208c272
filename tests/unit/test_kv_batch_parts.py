"""Parts of the connector's batched copy path that need no vLLM: a layer's runs as a grid one
tensor operation gathers (layout.block_grid), and the save writer handing staging back
(writer.SaveBatch.release) however a batch ends."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.errors import UnsupportedKVLayout
from kvstore.integrations.vllm.layout import LayerGeometry, block_grid
from kvstore.integrations.vllm.writer import SaveBatch, SaveWriter


def test_runs_become_the_grid_that_enumerates_them_in_physical_order():
    """LHBNC-like (one run per head), two levels, and a single run. Kills: every level given the
    innermost level's stride."""
    heads = LayerGeometry(0, 256, tuple((h * 4096, 256) for h in range(4)))
    grid = block_grid(heads, "LHBNC")
    assert (grid.offset, grid.shape, grid.strides, grid.run, grid.element) == (0, (4,), (4096,), 256, 8)
    two = LayerGeometry(0, 1 << 16, tuple((i * 1000 + j * 64, 32) for i in range(3) for j in range(2)))
    grid = block_grid(two, "X")
    assert (grid.shape, grid.strides) == ((3, 2), (1000, 64)) and grid.runs(2) == [(2 * (1 << 16) + o, 32) for o, _ in two.runs]
    one = block_grid(LayerGeometry(0, 96, ((12, 36),)), "BLNHC")
    assert (one.shape, one.run, one.element) == ((), 36, 4)


@pytest.mark.parametrize("runs", [((0, 8), (20, 16)), ((0, 4), (20, 4), (28, 4), (40, 4), (48, 4), (68, 4))])
def test_runs_no_grid_enumerates_are_refused_naming_the_layout(runs):
    """Unequal runs, and equal runs at uneven strides. Kills: a grid taken without checking it."""
    with pytest.raises(UnsupportedKVLayout, match="the ODD KV cache layout"):
        block_grid(LayerGeometry(0, 128, runs), "ODD")


def blocks(n: int) -> list[tuple[bytes, np.ndarray]]:
    return [(bytes([i]) * 16, np.zeros(64, np.uint8)) for i in range(n)]


def test_staging_is_released_once_whether_stored_failed_or_dropped():
    """A batch's staging goes back exactly once: after its put, after a failed put, and when the
    queue drops it; `ready` (a device copy landing) runs before the put reads the bytes. Kills: a
    dropped batch that never gives its slot back (every later step falls back block by block)."""
    gate, order, released = threading.Event(), [], []

    def put(batch):
        order.append(("put", batch.group))
        gate.wait(10)
        if batch.group == 2:
            raise OSError("store down")

    writer = SaveWriter(put, max_bytes=128, on_done=lambda *a: None)
    try:
        assert writer.submit(SaveBatch(blocks(1), False, 1, ready=lambda: order.append(("ready", 1)),
                                       release=lambda: released.append(1)))
        assert writer.submit(SaveBatch(blocks(1), False, 2, release=lambda: released.append(2)))
        assert not writer.submit(SaveBatch(blocks(1), False, 3, release=lambda: released.append(3)))  # no room
        gate.set()
        assert writer.flush(10)
    finally:
        gate.set()
        writer.close()
    assert order == [("ready", 1), ("put", 1), ("put", 2)]
    assert sorted(released) == [1, 2, 3]
