"""Registered regions: what a buffer, tensor, mmap or file looks like to the engine."""
from __future__ import annotations

import fcntl
import mmap as _mmap
import os
from dataclasses import dataclass, field
from typing import Any

from . import _native
from .errors import ProtocolError, UnsupportedBuffer


@dataclass(frozen=True)
class BufferView:
    """Address and size of a registerable object, plus what keeps its memory alive."""

    address: int
    nbytes: int
    readonly: bool
    keepalive: Any
    cuda_tensor: Any = None  # set when `keepalive` is a host staging copy of a CUDA tensor


def _torch_view(tensor: Any) -> BufferView:
    if not tensor.is_contiguous():
        raise UnsupportedBuffer("tensor must be contiguous to be registered")
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type == "cuda":
        import torch

        # No GPUDirect on this path: a pinned host copy is what the transports see.
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staging.copy_(tensor.view(-1).view(torch.uint8))
        return BufferView(staging.data_ptr(), nbytes, False, staging, cuda_tensor=tensor)
    if tensor.device.type != "cpu":
        raise UnsupportedBuffer(f"tensors on {tensor.device.type} are not supported")
    return BufferView(tensor.data_ptr(), nbytes, False, tensor)


def buffer_view(obj: Any) -> BufferView:
    """Resolve a torch tensor, numpy array, bytearray, memoryview, mmap or bytes to a BufferView."""
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        return _torch_view(obj)
    try:
        view = memoryview(obj)
    except TypeError as exc:
        raise UnsupportedBuffer(f"cannot register {type(obj).__name__}: no buffer protocol") from exc
    if not view.c_contiguous:
        raise UnsupportedBuffer("buffer must be C-contiguous to be registered")
    if view.nbytes == 0:
        raise UnsupportedBuffer("cannot register an empty buffer")
    # Flat bytes: Region.host_view() is sliced by byte offsets, whatever the array's shape and dtype.
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    address, nbytes, readonly = _native.buffer_address(flat)
    # Holding the memoryview pins the export: a bytearray cannot resize, an mmap cannot close.
    return BufferView(address, nbytes, bool(readonly), flat)


@dataclass(eq=False)
class Region:
    """A region registered with a local Engine: ops name it by `id`, never by address."""

    id: int
    size: int
    kind: str  # "memory" | "shm" | "file" | "cuda"
    readonly: bool
    remote_access: bool
    buffer: memoryview | None = None  # host bytes of memory-backed regions
    remote_writes: str = "any"  # who may write it over a data connection: "any", "granted", "none"
    _keepalive: Any = field(default=None, repr=False)
    _cuda_tensor: Any = field(default=None, repr=False)
    _shm_fd: int | None = field(default=None, repr=False)
    _ucx: Any = field(default=None, repr=False)  # UcxMemory when mapped with UCX (transfer/ucx.py)
    _host_tensor: Any = field(default=None, repr=False)  # its memory as a torch tensor, for device copies
    _pinned: bool = field(default=False, repr=False)  # page-locked for device copies (cuda_direct.py)

    def host_view(self) -> memoryview:
        """The region's host bytes (the staging copy for CUDA regions); file regions have none."""
        if self.buffer is not None:
            return self.buffer
        if self.kind == "file" or self._keepalive is None:
            raise UnsupportedBuffer(f"region {self.id} ({self.kind}) has no host memory view")
        import torch

        return memoryview(self._keepalive.reshape(-1).view(torch.uint8).numpy())

    def sync_to_device(self, offset: int = 0, length: int | None = None) -> None:
        """CUDA regions: copy staged host bytes to the tensor (after reads land; the engine does it for
        staged routes). Bytes that came over ucx into device-mapped memory are not staged: calling
        this after them would copy older staging bytes over them."""
        if self._cuda_tensor is None:
            return
        import torch

        length = self.size - offset if length is None else length
        flat = self._cuda_tensor.view(-1).view(torch.uint8)
        flat[offset : offset + length].copy_(self._keepalive[offset : offset + length], non_blocking=False)

    def sync_from_device(self, offset: int = 0, length: int | None = None) -> None:
        """CUDA regions: copy the tensor's bytes into the host staging buffer (before writes)."""
        if self._cuda_tensor is None:
            return
        import torch

        length = self.size - offset if length is None else length
        flat = self._cuda_tensor.view(-1).view(torch.uint8)
        self._keepalive[offset : offset + length].copy_(flat[offset : offset + length])



POPULATE_CHUNK = 256 << 20  # pages filled per call: an interrupt (Ctrl-C) is seen between calls
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+


def map_shared(fd: int, size: int, *, writable: bool) -> _mmap.mmap:
    """Map a shared-memory fd with its page tables filled up front, so the first transfer into
    it does not pay a page fault per 4 KiB. A large mapping is filled a chunk at a time: one
    MAP_POPULATE over gigabytes runs in the kernel for seconds, deaf to Ctrl-C."""
    prot = _mmap.PROT_READ | (_mmap.PROT_WRITE if writable else 0)
    if size <= POPULATE_CHUNK:
        return _mmap.mmap(fd, size, _mmap.MAP_SHARED | getattr(_mmap, "MAP_POPULATE", 0), prot)
    mapping = _mmap.mmap(fd, size, _mmap.MAP_SHARED, prot)
    try:
        populate(mapping, size, writable)
    except BaseException:
        mapping.close()
        raise
    return mapping


def populate(mapping: _mmap.mmap, size: int, writable: bool) -> None:
    """Fill `mapping`'s page tables chunk by chunk (Python sees signals between chunks)."""
    advice = MADV_POPULATE_WRITE if writable else MADV_POPULATE_READ
    for start in range(0, size, POPULATE_CHUNK):
        length = min(POPULATE_CHUNK, size - start)
        try:
            mapping.madvise(advice, start, length)
        except (OSError, ValueError):  # an older kernel: touch a byte of every page instead
            view = memoryview(mapping)[start : start + length]
            try:
                if writable:
                    for at in range(0, length, _mmap.PAGESIZE):
                        view[at] = view[at]
                else:
                    sum(view[:: _mmap.PAGESIZE])
            finally:
                view.release()


SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def anonymous_shared(size: int, name: str) -> tuple[int, _mmap.mmap]:
    """A shared-memory file (memfd) of `size` bytes and its mapping; the fd can be sent to peers.
    Its size is sealed first: a peer that could shrink it would SIGBUS us on our next touch."""
    fd = os.memfd_create(f"kvstore-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        return fd, map_shared(fd, size, writable=True)
    except BaseException:
        os.close(fd)
        raise


def check_sealed(fd: int, size: int) -> None:
    """Refuse a peer's shared-memory fd unless its size is sealed and covers `size` bytes: otherwise
    the peer could truncate it under our mapping and kill us with SIGBUS."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        actual = os.fstat(fd).st_size
    except OSError as exc:
        raise ProtocolError(f"peer sent a descriptor that is not sealed shared memory: {exc}") from exc
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        raise ProtocolError("peer sent shared memory whose size is not sealed")
    if actual < size:
        raise ProtocolError(f"peer sent {actual} bytes of shared memory for a {size}-byte region")
