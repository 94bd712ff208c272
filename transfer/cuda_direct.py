"""CUDA regions without a second host hop: an op between a CUDA region and host memory this
process can address (a region of this engine, or a same-host peer's shared memory mapped here)
is one device<->host copy straight into or out of that memory, instead of a copy into the CUDA
region's host staging and a second, host-to-host copy by the native engine.

The destination's memory is pinned (page-locked, `cudaHostRegister`) the first time a CUDA op
touches it, so the copy runs at the link's DMA rate rather than through the driver's pageable
bounce buffers; a region that cannot be pinned is copied to pageable (still one hop). Ops to
peers on other hosts, and to file regions, still take the staged route.
"""
from __future__ import annotations

from typing import Any

from .ops import Read, Write
from .regions import Region

# Pin host regions up to this size for device copies: pinning costs about a second per 10 GiB
# once, and locks the pages; larger regions (a daemon's whole arena) are copied pageable.
PIN_MAX_BYTES = 16 << 30


def host_tensor(region: Region) -> Any | None:
    """`region`'s host memory as a flat uint8 CPU tensor (made once), or None when it has none."""
    tensor = region._host_tensor
    if tensor is None:
        if region.buffer is None or region.kind in ("cuda", "file"):
            return None
        import warnings

        import numpy as np
        import torch

        with warnings.catch_warnings():  # a read-only region is only ever read from (copy_direct)
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(np.frombuffer(region.buffer, dtype=np.uint8))
        region._host_tensor = tensor
        pin(region, tensor)
    return tensor


def pin(region: Region, tensor: Any) -> None:
    """Page-lock `region`'s memory for device copies (best effort, once; undone by `unpin`)."""
    import torch

    if region._pinned or region.size > PIN_MAX_BYTES or not torch.cuda.is_available():
        return
    if int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), region.size, 0)) == 0:
        region._pinned = True


def unpin(region: Region) -> None:
    if region._pinned and region._host_tensor is not None:
        import torch

        torch.cuda.cudart().cudaHostUnregister(region._host_tensor.data_ptr())
    region._pinned = False
    region._host_tensor = None


def copy_direct(op: Read | Write, local: Region, other: Region | None) -> bool:
    """Run `op` (its local side a CUDA region) as one copy between the device and `other`'s host
    memory; False (nothing copied) when it must take the staged route: no host memory, or bounds
    or permissions the native engine reports per op."""
    if other is None or local._cuda_tensor is None or (isinstance(op, Write) and other.readonly) or \
            (isinstance(op, Read) and local.readonly):
        return False
    target = host_tensor(other)
    if target is None:
        return False
    length, here, there = op.length, op.local_offset, op.remote_offset
    if min(length, here, there) < 0 or here + length > local.size or there + length > other.size:
        return False
    import torch

    device = local._cuda_tensor.view(-1).view(torch.uint8)
    if isinstance(op, Write):
        target[there:there + length].copy_(device[here:here + length])
    else:
        device[here:here + length].copy_(target[there:there + length])
    return True
