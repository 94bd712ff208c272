"""When the ucx route exists and when a peer uses it (the UCX objects are in transfer/ucx.py).

Which UCX transports an engine may use: its `ucx=` option, a UCX_TLS list ("tcp", "sm", "posix,cma",
"rc,dc,ud,sm"); "auto" takes $UCX_TLS when set, else RDMA + shared memory when an RDMA device exists,
else no UCX; None/"off" never. Over RDMA the NIC enforces each rkey's range and access; over tcp and
shared memory UCX enforces neither, so those are trusted-network/same-user choices (see README).
"""
from __future__ import annotations

import os
from functools import lru_cache

from . import ucx_api as U
from .errors import PeerUnreachable
from .ucx import UcxEndpoint, UcxNode, log

RDMA_TLS = ("rc", "dc", "ud")  # prefixes: rc_verbs, rc_mlx5, dc_mlx5, ud_verbs, ...
SHM_TLS = ("posix", "sysv", "cma", "xpmem", "knem", "cuda_ipc")


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why ucxx cannot be used in this process, or None when it can."""
    try:
        U.lib()
        import ucxx._lib.libucxx  # noqa: F401
    except Exception as exc:  # ImportError, OSError (no libucp), AttributeError (ABI)
        return f"ucxx is not usable ({type(exc).__name__}: {exc}); install the extra: pip install -e '.[ucx]'"
    return None


def rdma_device_present() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def resolve_tls(option: str | None) -> str | None:
    """The UCX_TLS list this engine may use, or None for no UCX route."""
    if option is None or option in ("", "off", "none"):
        return None
    if option == "auto":
        return os.environ.get("UCX_TLS") or ("rc,dc,ud,sm" if rdma_device_present() else None)
    return option


def fast(transports: tuple[str, ...]) -> bool:
    """True when UCX would use RDMA or shared memory (what `transport="auto"` asks for)."""
    return any(t.startswith(RDMA_TLS) or t in SHM_TLS for t in transports)


def start_ucx(option: str | None, name: str) -> UcxNode | None:
    """The engine's UCX node, or None; logs once which routes the engine has and why UCX is absent."""
    tls, node, why = resolve_tls(option), None, ""
    if tls is None:
        why = "off" if option in (None, "", "off", "none") else "no RDMA device and UCX_TLS unset"
    elif (why := unavailable() or "") == "":
        try:
            node = UcxNode(tls, name)
        except Exception as exc:  # no transport left after UCX_TLS, or UCX failed to start
            why = f"UCX did not start with UCX_TLS={tls!r}: {exc}"
    if node is not None and not fast(node.transports):
        log.warning("%s: UCX over %s only: UCX does not check region bounds or read-only flags on this "
                    "side, and anyone who reaches its tcp port can use it; trusted networks only",
                    name, ",".join(node.transports))
    routes = "shm, tcp, file" + (f", ucx ({','.join(node.transports)})" if node else f"; no ucx ({why})")
    log.info("engine %s routes: %s", name, routes)
    return node


def connect_ucx(node: UcxNode | None, descriptor: object, transport: str, same_host_shm: bool) -> UcxEndpoint | None:
    """The UCX endpoint for a new peer when the route is (or `auto` picks) ucx, else None.
    auto: only when shared memory is not already in use and both ends have RDMA or shared memory."""
    theirs = tuple(getattr(descriptor, "ucx_tls", ()) or ())
    address = getattr(descriptor, "ucx_address", None)
    if transport == "ucx":
        if node is None or not address:
            side = "this engine" if node is None else getattr(descriptor, "name", "the peer")
            raise PeerUnreachable(f"transport='ucx' but {side} has no UCX route")
        return node.connect(bytes.fromhex(address), str(getattr(descriptor, "ucx_scratch", "")))
    if transport != "auto" or same_host_shm or node is None or not address:
        return None
    if not (fast(node.transports) and fast(theirs)):
        return None
    try:
        return node.connect(bytes.fromhex(address), str(getattr(descriptor, "ucx_scratch", "")))
    except (PeerUnreachable, ValueError) as exc:  # mismatched transports: fall back to TCP streams
        log.info("%s: UCX cannot reach %s, using tcp: %s", node.name, getattr(descriptor, "name", "peer"), exc)
        return None


def ucx_exports(node: UcxNode, remote_writes: str) -> bool:
    """Whether a region whose remote writes are `remote_writes` gets an rkey for peers: always when
    anyone may write it; else (a read-only rkey) only where UCX enforces the rkey's access."""
    return remote_writes == "any" or not node.unchecked_remote


def direct_cuda(node: UcxNode, region: object, tensor: object) -> None:
    """CUDA regions: map the device memory itself when UCX has CUDA support (no host bounce on the
    ucx route); otherwise only the host staging copy serves (other routes)."""
    staged = getattr(region, "_ucx", None)
    if staged is not None:
        node.unmap(staged)
    region._ucx = None  # type: ignore[attr-defined]
    if node.cuda:
        nbytes = tensor.numel() * tensor.element_size()  # type: ignore[attr-defined]
        writes = getattr(region, "remote_writes", "any")
        region._ucx = node.try_map(tensor.data_ptr(), nbytes, readonly=False,  # type: ignore[attr-defined]
                                   exported=region.remote_access and ucx_exports(node, writes),  # type: ignore[attr-defined]
                                   cuda=True, remote_write=writes == "any")
