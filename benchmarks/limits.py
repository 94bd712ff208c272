"""The physical limits of moving one batch on this machine, timed per call the way the store's
batch calls are: a memcpy of the blocks (what a same-host put or get cannot beat) and the blocks
through loopback TCP over persistent connections, one sender and one receiver thread per stream
(what a put or get over TCP cannot beat)."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

STALL_S = 30.0  # a dead loopback peer fails the call instead of hanging the benchmark


def memcpy_batch(blocks: list[np.ndarray], threads: int) -> Callable[[int], None]:
    """A call copying every block into a destination of its own, the blocks split over `threads`
    threads (numpy copies without the GIL), as the engine splits a local batch over its workers."""
    outs = [np.empty_like(b) for b in blocks]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def copy_part(k: int) -> None:
        for dst, src in zip(outs[k::threads], blocks[k::threads]):
            np.copyto(dst, src)

    def copy(rep: int) -> None:
        if pool is None:
            copy_part(0)
        else:
            for job in [pool.submit(copy_part, k) for k in range(threads)]:
                job.result()
    return copy


class LoopbackBatch:
    """`streams` connected loopback socket pairs; calling it sends every block once, the blocks
    dealt round-robin over the streams, and returns when the receivers hold all the bytes."""

    def __init__(self, blocks: list[np.ndarray], streams: int) -> None:
        self.blocks = [memoryview(b).cast("B") for b in blocks]
        self.streams = streams
        listener = socket.create_server(("127.0.0.1", 0))
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        for _ in range(streams):
            sender = socket.create_connection(listener.getsockname())
            self.pairs.append((sender, listener.accept()[0]))
        listener.close()
        for pair in self.pairs:
            for conn in pair:
                conn.settimeout(STALL_S)
        # Each stream lands in memory of its own, as blocks land in distinct slots.
        self.sinks = [bytearray(sum(b.nbytes for b in self.blocks[k::streams])) for k in range(streams)]
        self.pool = ThreadPoolExecutor(2 * streams)  # workers started once, as an engine's are

    def _send(self, k: int) -> None:
        for block in self.blocks[k :: self.streams]:
            self.pairs[k][0].sendall(block)

    def _receive(self, k: int) -> None:
        sink, done = memoryview(self.sinks[k]), 0
        while done < len(sink):
            got = self.pairs[k][1].recv_into(sink[done:])
            if not got:
                raise ConnectionError("loopback peer closed")
            done += got

    def __call__(self, rep: int) -> None:
        jobs = [self.pool.submit(self._receive, k) for k in range(self.streams)]
        jobs += [self.pool.submit(self._send, k) for k in range(self.streams)]
        for job in jobs:
            job.result()

    def close(self) -> None:
        for sender, receiver in self.pairs:  # first: a worker stuck in a call returns at once
            sender.close()
            receiver.close()
        self.pool.shutdown()
