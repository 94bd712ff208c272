"""UCX objects of the optional ucx route (`pip install -e ".[ucx]"`): one ucxx context and worker per
engine, regions mapped with UCX (packed rkeys go to authenticated peers in the region table), one
endpoint per peer. When and how the route is used: transfer/ucx_routes.py.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

from . import _native, ucx_api as U
from .errors import PeerUnreachable, UnsupportedBuffer

log = logging.getLogger("transfer.ucx")
UNSAFE_ENV = "KVSTORE_UCX_NO_PEER_FAILURE_HANDLING"
CLOSE_WAIT_NS = 100_000_000  # ucxx close_blocking: per-attempt wait for the close request
_RESOURCE = re.compile(r"resource\s+\d+\s*:.*--\s+(\S+)/")


@dataclass
class UcxMemory:
    """A region mapped with UCX: its memory handle, and the packed rkey peers may use (if exported)."""

    memh: int
    address: int
    size: int
    rkey: bytes
    cuda: bool = False

    def advert(self) -> dict:
        """The region-table fields a peer needs for RMA (none when the region is not exported)."""
        return {"ucx": {"addr": self.address, "rkey": self.rkey.hex()}} if self.rkey else {}


class UcxNode:
    """An engine's UCX context + worker. ucxx's progress thread serves the passive side (software
    RMA on tcp needs the target to progress); initiators also progress while they wait."""

    def __init__(self, tls: str, name: str) -> None:
        from ucxx._lib import libucxx

        _native.ucx_load(U.libucp_path())  # the data path's calls (cpp/ucx.cpp)
        self._ucxx = libucxx
        self.context = libucxx.UCXContext(config_dict={"TLS": tls})
        self.transports = tuple(sorted(set(_RESOURCE.findall(self.context.info))))
        if not self.transports:
            raise PeerUnreachable(f"UCX found no usable transport in UCX_TLS={tls!r}")
        self.cuda = bool(self.context.cuda_support)
        # UCX over TCP serves RMA in software and checks no rkey's access: a peer holding the rkey of
        # a region could write it whatever we granted. RDMA NICs enforce it; shared memory reaches
        # only processes of our own user (trusted by uid, as for our own shared-memory route).
        self.unchecked_remote = any(t.startswith("tcp") for t in self.transports)
        self.worker = libucxx.UCXWorker(self.context)
        self.worker.start_progress_thread(False, 100)
        self.tls, self.name = tls, name
        self._closed = False
        # A first get on a fresh tcp endpoint stalls until something was put: new endpoints put one
        # byte here to wire up (8 bytes no one reads; its rkey is the only one in the descriptor).
        self._scratch = bytearray(8)
        self.scratch = self.map(ctypes.addressof((ctypes.c_char * 8).from_buffer(self._scratch)), 8,
                                readonly=False, exported=True)

    def address(self) -> bytes:
        return self.worker.address.tobytes()

    def map(self, address: int, size: int, *, readonly: bool, exported: bool, cuda: bool = False,
            remote_write: bool = True) -> UcxMemory:
        """Register memory with UCX; exported regions also get a packed rkey (read-only, or not
        `remote_write`: remote read only)."""
        prot = U.PROT_LOCAL_READ | (0 if readonly else U.PROT_LOCAL_WRITE)
        if exported:
            prot |= U.PROT_REMOTE_READ | (0 if readonly or not remote_write else U.PROT_REMOTE_WRITE)
        params = U.MemMapParams(field_mask=U.MAP_ADDRESS | U.MAP_LENGTH | U.MAP_PROT | U.MAP_MEMORY_TYPE,
                                address=address, length=size, prot=prot,
                                memory_type=U.MEMORY_TYPE_CUDA if cuda else U.MEMORY_TYPE_HOST)
        memh = ctypes.c_void_p()
        status = U.lib().ucp_mem_map(self.context.handle, ctypes.byref(params), ctypes.byref(memh))
        if status != U.UCS_OK:
            raise UnsupportedBuffer(f"UCX cannot map {size} bytes: {U.status_text(status)}")
        rkey = b""
        if exported:
            buf, n = ctypes.c_void_p(), ctypes.c_size_t()
            status = U.lib().ucp_rkey_pack(self.context.handle, memh, ctypes.byref(buf), ctypes.byref(n))
            if status != U.UCS_OK:
                U.lib().ucp_mem_unmap(self.context.handle, memh)
                raise UnsupportedBuffer(f"UCX cannot pack an rkey: {U.status_text(status)}")
            rkey = ctypes.string_at(buf, n.value)
            U.lib().ucp_rkey_buffer_release(buf)
        return UcxMemory(memh.value, address, size, rkey, cuda)

    def try_map(self, address: int, size: int, *, readonly: bool, exported: bool, cuda: bool = False,
                remote_write: bool = True) -> UcxMemory | None:
        """`map`, or None (the region then uses the other routes) when UCX refuses the memory."""
        try:
            return self.map(address, size, readonly=readonly, exported=exported, cuda=cuda, remote_write=remote_write)
        except UnsupportedBuffer as exc:
            log.warning("%s: region of %d bytes not mapped with UCX (other routes only): %s", self.name, size, exc)
            return None

    def advert(self) -> dict:
        """Descriptor fields: the transports UCX chose and the worker address peers connect to."""
        return {"ucx_tls": self.transports, "ucx_address": self.address().hex(),
                "ucx_scratch": f"{self.scratch.address}:{self.scratch.rkey.hex()}"}

    def unmap(self, memory: UcxMemory) -> None:
        if not self._closed and memory.memh:
            U.lib().ucp_mem_unmap(self.context.handle, memory.memh)
            memory.memh = 0

    def progress(self) -> int:
        """Progress the worker once from this thread; how many events it handled."""
        return U.lib().ucp_worker_progress(self.worker.handle)

    def connect(self, address: bytes, scratch: str) -> "UcxEndpoint":
        endpoint = UcxEndpoint(self, address)
        try:
            endpoint.wire_up(scratch, timeout=10.0)
        except BaseException:
            endpoint.close()
            raise
        return endpoint

    def close(self) -> None:
        if self._closed:
            return
        self.unmap(self.scratch)
        self._closed = True
        self.worker.stop_progress_thread()


@dataclass
class RemoteMemory:
    """What a peer advertised for one region: base address (for RMA only) and packed rkey."""

    address: int
    size: int
    packed: bytes
    handle: int = 0  # unpacked on this endpoint, on first use


@dataclass(eq=False)  # identity: batches keep sets of endpoints
class UcxEndpoint:
    """One peer's UCX endpoint and the rkeys it advertised (unpacked lazily, destroyed on close)."""

    node: UcxNode
    address_bytes: bytes
    remote: dict[int, RemoteMemory] = field(default_factory=dict)
    broken: str | None = None
    error_handling: bool = True  # False: UCX cannot tell this endpoint's peer died (opt-in, see below)
    _replaced: list[int] = field(default_factory=list)  # rkeys re-advertised away, destroyed at close
    _closing: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        import numpy as np

        lib = self.node._ucxx
        address = lib.UCXAddress.create_from_buffer(np.frombuffer(self.address_bytes, np.uint8).copy())
        try:
            self.ep = lib.UCXEndpoint.create_from_worker_address(self.node.worker, address, True)
        except Exception as exc:
            # Without peer-failure handling UCX aborts this whole process when the peer dies during a
            # transfer (cma: "process_vm_readv ... No such process" is fatal), so it is opt-in only.
            if os.environ.get(UNSAFE_ENV) != "1":
                raise PeerUnreachable(
                    f"UCX cannot reach the peer with peer-failure handling over {','.join(self.node.transports)} "
                    f"({exc}); shared-memory-only UCX_TLS has none: add tcp or an RDMA transport "
                    f"(or set {UNSAFE_ENV}=1 to accept that a dying peer aborts this process)") from exc
            log.warning("%s: UCX endpoint without peer-failure handling (%s=1): a peer that dies mid-transfer "
                        "aborts this process", self.node.name, UNSAFE_ENV)
            self.error_handling = False
            try:
                self.ep = lib.UCXEndpoint.create_from_worker_address(self.node.worker, address, False)
            except Exception as exc2:
                raise PeerUnreachable(f"UCX cannot reach the peer: {exc2}") from exc2
        self.handle = self.ep.handle

    def wire_up(self, scratch: str, timeout: float) -> None:
        """Put one byte into the peer's scratch buffer and wait for it (see UcxNode.scratch)."""
        lib = U.lib()
        address, _, packed = scratch.partition(":")
        self.advertise(-1, int(address), 1, bytes.fromhex(packed))
        memory = self.rkey(-1)
        one = ctypes.c_char(b"\x01")
        ptr = lib.ucp_put_nbx(self.handle, ctypes.addressof(one), 1, memory.address, memory.handle,
                              ctypes.byref(U.RequestParam()))
        status, deadline = U.status_of(ptr), time.monotonic() + timeout
        while status is None:
            self.node.progress()
            if (check := lib.ucp_request_check_status(ptr)) != U.UCS_INPROGRESS:
                lib.ucp_request_free(ptr)
                status = check
            elif time.monotonic() > deadline:
                raise PeerUnreachable("UCX endpoint did not wire up in time")  # the request stays with UCX
            else:
                time.sleep(0.0005)
        if status != U.UCS_OK:
            raise PeerUnreachable(f"UCX endpoint failed to wire up: {U.status_text(status)}")

    def advertise(self, region_id: int, address: int, size: int, packed: bytes) -> None:
        if self.broken:
            return
        old = self.remote.get(region_id)
        if old is not None and (old.packed, old.address, old.size) == (packed, address, size):
            return
        if old is not None and old.handle:
            self._replaced.append(old.handle)  # ops issued with it may still run: destroyed at close
        self.remote[region_id] = RemoteMemory(address, size, packed)

    def rkey(self, region_id: int) -> RemoteMemory | None:
        """The region's unpacked rkey; None when it has none or the endpoint was retired."""
        memory = self.remote.get(region_id)
        if memory is not None and not memory.handle:
            handle = ctypes.c_void_p()
            status = U.lib().ucp_ep_rkey_unpack(self.handle, memory.packed, ctypes.byref(handle))
            if status != U.UCS_OK:
                raise PeerUnreachable(f"cannot unpack the peer's rkey for region {region_id}: {U.status_text(status)}")
            memory.handle = handle.value
        return memory

    def retire(self, why: str) -> None:
        """Stop using this endpoint (the peer keeps its TCP streams): force-close it, so that no late
        byte of an op already reported failed lands after the fact (measured: a stalled tcp peer that
        resumes would otherwise complete the get)."""
        if self.broken is None:
            self.broken = why
        self.close()

    def close(self) -> None:
        """Close the endpoint, then destroy its rkeys (UCX: only once no op uses them). The caller
        has removed the native route first, so no op is being issued on it any more."""
        with self._closing:  # retire (after a failure) and Peer.close may race
            if self.ep.alive:  # ucxx crashes closing an endpoint that an error already closed
                try:  # with peer-failure handling ucxx closes by force: outstanding requests are cancelled
                    self.ep.close_blocking(CLOSE_WAIT_NS, 3)
                except Exception:
                    pass
            handles = [m.handle for m in self.remote.values() if m.handle] + self._replaced
            self.remote.clear()
            self._replaced = []
            for handle in handles:
                U.lib().ucp_rkey_destroy(handle)
