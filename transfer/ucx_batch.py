"""Ops on the UCX route: each Read/Write becomes one ucp_get_nbx/ucp_put_nbx, polled to completion and
reported with the native engine's status codes, so `Batch`, `OpResult` and the typed errors stay the same.

A put completes *locally* (its source may be reused) before its bytes are at the peer, so every endpoint
a batch writes to is flushed (`ucp_ep_flush_nbx`) and its writes are reported done only once the flush
completes: a write reported done has landed."""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from . import ucx_api as U
from .errors import InvalidOp, UnknownRegion
from .ops import Op, Write
from .regions import RemoteRegion

if TYPE_CHECKING:
    from .ucx import UcxEndpoint, UcxNode

DONE, PENDING, OUT_OF_BOUNDS, READ_ONLY, PEER_GONE, STALLED = 0, 1, 3, 4, 5, 6
SPIN_SECONDS = 0.002  # a waiter polls this long after UCX last did work before it starts sleeping


@dataclass
class UcxItem:
    """One op, resolved: a status when it is refused before it starts, else what put/get needs."""

    length: int
    status: int = PENDING
    write: bool = False
    endpoint: "UcxEndpoint | None" = None
    local: int = 0
    memh: int = 0
    remote: int = 0
    rkey: int = 0
    cuda: bool = False


def plan(op: Op, regions: dict[int, Any]) -> UcxItem | None:
    """The UCX form of `op`, or None when it takes another route (no endpoint, file regions, ours)."""
    remote, local = op.remote, op.local
    if not isinstance(remote, RemoteRegion) or getattr(remote.peer, "_ucx", None) is None:
        return None
    if getattr(local, "_ucx", None) is None:
        return None  # file regions (and memory UCX would not map) use the peer's TCP streams
    endpoint = remote.peer._ucx
    memory = endpoint.rkey(remote.id)
    if memory is None:
        return None  # no rkey (a file region) or the endpoint was retired: the peer's TCP streams
    if regions.get(local.id) is not local:
        raise UnknownRegion(f"local side of {op!r} is not registered")
    offsets = (op.local_offset, op.remote_offset, op.length)
    if not all(isinstance(v, int) and 0 <= v < 1 << 64 for v in offsets):
        raise InvalidOp(f"offsets and lengths must be non-negative 64-bit integers: {op!r}")
    write = isinstance(op, Write)
    item = UcxItem(op.length, write=write)
    if op.local_offset + op.length > local.size or op.remote_offset + op.length > min(remote.size, memory.size):
        item.status = OUT_OF_BOUNDS  # against what the peer advertised: over tcp/shm its UCX checks nothing
    elif (write and remote.readonly) or (not write and local.readonly):
        item.status = READ_ONLY
    else:
        item.endpoint, item.memh, item.cuda = endpoint, local._ucx.memh, local._ucx.cuda
        item.local = local._ucx.address + op.local_offset
        item.remote, item.rkey = memory.address + op.remote_offset, memory.handle
    return item


class UcxOps:
    """The UCX share of a batch, with the native batch's interface (done/wait/statuses/byte_counts)."""

    def __init__(self, node: "UcxNode", items: list[UcxItem], stall_timeout: float) -> None:
        self._node, self._items, self._stall = node, items, stall_timeout
        self._status = [item.status for item in items]
        self._bytes = [0] * len(items)
        self._pending: dict[int, int] = {}
        self._failed: set = set()  # endpoints to retire once their failed requests are collected
        self._flushes: dict[int, Any] = {}  # flush request -> its endpoint
        self._unflushed: dict[Any, list[int]] = {}  # endpoint -> writes whose put completed, awaiting its flush
        lib, params = U.lib(), {}
        for index, item in enumerate(items):
            if item.status != PENDING:
                continue
            if item.length == 0:
                self._finish(index, U.UCS_OK)
                continue
            param = params.get(item.memh)
            if param is None:  # one per local region: ops on the same region share it
                mask = U.OP_FIELD_MEMH | (U.OP_FIELD_MEMORY_TYPE if item.cuda else 0)
                param = params[item.memh] = ctypes.byref(U.RequestParam(
                    op_attr_mask=mask, memh=item.memh, memory_type=U.MEMORY_TYPE_CUDA if item.cuda else U.MEMORY_TYPE_HOST))
            call = lib.ucp_put_nbx if item.write else lib.ucp_get_nbx
            ptr = call(item.endpoint.handle, item.local, item.length, item.remote, item.rkey, param)
            status = U.status_of(ptr)
            if item.write:
                self._unflushed.setdefault(item.endpoint, [])
            if status is None:
                self._pending[index] = ptr
            else:
                self._finish(index, status)
        for endpoint in list(self._unflushed):  # issued after the puts: it completes once they have landed
            self._flush(endpoint)
        self._last_progress = time.monotonic()

    def _flush(self, endpoint: "UcxEndpoint") -> None:
        lib = U.lib()
        ptr = lib.ucp_ep_flush_nbx(endpoint.handle, ctypes.byref(U.RequestParam()))
        status = U.status_of(ptr)
        if status is None:
            self._flushes[ptr] = endpoint
        else:
            self._flushed(endpoint, status)

    def _flushed(self, endpoint: "UcxEndpoint", status: int) -> None:
        """The endpoint's flush finished: its completed writes have landed (or, on failure, are lost)."""
        for index in self._unflushed.pop(endpoint, []):
            self._settle(index, status)
        if status != U.UCS_OK:
            self._failed.add(endpoint)

    def _finish(self, index: int, status: int) -> None:
        item = self._items[index]
        if status == U.UCS_OK and item.write and item.endpoint in self._unflushed:
            self._unflushed[item.endpoint].append(index)  # landed only when the flush says so
        else:
            self._settle(index, status)

    def _settle(self, index: int, status: int) -> None:
        if status == U.UCS_OK:
            self._status[index], self._bytes[index] = DONE, self._items[index].length
        else:  # the endpoint failed (peer died, reset, unreachable): same meaning as a dead TCP peer
            self._status[index] = PEER_GONE
            self._failed.add(self._items[index].endpoint)

    def _poll(self) -> bool:
        """Progress once and collect finished requests; True when UCX did work or something finished
        (shared-memory copies advance only inside progress calls, so a waiter keeps calling while busy)."""
        if not self._pending and not self._flushes:
            return False
        busy = self._node.progress() > 0
        lib, finished, flushed = U.lib(), [], []
        for index, ptr in self._pending.items():
            status = lib.ucp_request_check_status(ptr)
            if status != U.UCS_INPROGRESS:
                lib.ucp_request_free(ptr)
                finished.append((index, status))
        for ptr in self._flushes:
            status = lib.ucp_request_check_status(ptr)
            if status != U.UCS_INPROGRESS:
                lib.ucp_request_free(ptr)
                flushed.append((ptr, status))
        for index, status in finished:
            del self._pending[index]
            self._finish(index, status)
        for ptr, status in flushed:  # after the puts, so a put that failed is not reported landed
            self._flushed(self._flushes.pop(ptr), status)
        self._retire_failed("failed")
        now = time.monotonic()
        if finished or flushed:
            self._last_progress = now
        elif busy:
            self._last_progress = now
        elif now - self._last_progress > self._stall:
            self._stalled()
        return busy or bool(finished) or bool(flushed)

    def _stalled(self) -> None:
        """Nothing finished for the stall time: fail what is left and retire its endpoints (a forced
        close cancels the requests, so no late byte lands after the failure was reported)."""
        waiting = list(self._pending) + [i for indices in self._unflushed.values() for i in indices]
        for index in waiting:
            self._status[index] = STALLED
            self._failed.add(self._items[index].endpoint)
        self._failed.update(self._flushes.values())
        self._retire_failed("stalled past the stall timeout")
        lib = U.lib()
        for ptr in list(self._pending.values()) + list(self._flushes):  # cancelled by the forced close
            if lib.ucp_request_check_status(ptr) != U.UCS_INPROGRESS:
                lib.ucp_request_free(ptr)
        self._pending.clear()
        self._flushes.clear()
        self._unflushed.clear()

    def _retire_failed(self, why: str) -> None:
        """Retire endpoints with failed ops (other ops of this batch on them fail too)."""
        if not self._failed:
            return
        endpoints, self._failed = self._failed, set()
        for endpoint in endpoints:
            if endpoint is not None and endpoint.broken is None:
                endpoint.retire(why)

    def __len__(self) -> int:
        return len(self._items)

    def _busy(self) -> bool:
        return bool(self._pending or self._flushes)

    def done(self) -> bool:
        self._poll()
        return not self._busy()

    def wait(self, timeout: float) -> bool:
        deadline, busy = time.monotonic() + timeout, time.monotonic()
        while self._busy():
            if self._poll():
                busy = time.monotonic()
                continue
            now = time.monotonic()
            if now >= deadline:
                return False
            if now - busy > SPIN_SECONDS:  # idle for a while: let the progress thread (and a local peer) run
                time.sleep(min(0.001, (now - busy) / 10))
        return True

    def statuses(self) -> list[int]:
        self._poll()
        return list(self._status)

    def byte_counts(self) -> list[int]:
        return list(self._bytes)


class MergedBatch:
    """A native batch and a UCX share behind one interface, results in the caller's op order."""

    def __init__(self, native: Any, native_index: Sequence[int], ucx: UcxOps, ucx_index: Sequence[int]) -> None:
        self._parts = ((native, native_index), (ucx, ucx_index))
        self._n = len(native_index) + len(ucx_index)

    def __len__(self) -> int:
        return self._n

    def done(self) -> bool:
        return all(part.done() for part, _ in self._parts)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(part.wait(max(0.0, deadline - time.monotonic())) for part, _ in self._parts)

    def _merge(self, name: str) -> list[int]:
        out = [0] * self._n
        for part, index in self._parts:
            for i, value in zip(index, getattr(part, name)()):
                out[i] = value
        return out

    def statuses(self) -> list[int]:
        return self._merge("statuses")

    def byte_counts(self) -> list[int]:
        return self._merge("byte_counts")
