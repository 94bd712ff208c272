"""The few UCP calls ucxx's Python API does not expose (memory maps, rkeys, put/get), via ctypes on
the libucp that ucxx itself loaded, applied to ucxx's own context, worker and endpoint handles.
ctypes drops the GIL for each call."""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

c_void_p, c_size_t, c_uint64, c_uint32, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int

# ucp.h constants (UCX 1.x ABI).
MAP_ADDRESS, MAP_LENGTH, MAP_FLAGS, MAP_PROT, MAP_MEMORY_TYPE = 1, 2, 4, 8, 16
PROT_LOCAL_READ, PROT_LOCAL_WRITE, PROT_REMOTE_READ, PROT_REMOTE_WRITE = 1, 2, 1 << 8, 1 << 9
OP_FIELD_FLAGS, OP_FIELD_MEMORY_TYPE, OP_FIELD_MEMH = 1 << 4, 1 << 6, 1 << 8
EP_CLOSE_FORCE = 1
MEMORY_TYPE_HOST, MEMORY_TYPE_CUDA = 0, 1
UCS_OK, UCS_INPROGRESS = 0, 1
ERR_LAST = -100


class MemMapParams(ctypes.Structure):
    _fields_ = [("field_mask", c_uint64), ("address", c_void_p), ("length", c_size_t), ("flags", ctypes.c_uint),
                ("prot", ctypes.c_uint), ("memory_type", c_int), ("exported_memh_buffer", c_void_p)]


class RequestParam(ctypes.Structure):
    _fields_ = [("op_attr_mask", c_uint32), ("flags", c_uint32), ("request", c_void_p), ("cb", c_void_p),
                ("datatype", c_uint64), ("user_data", c_void_p), ("reply_buffer", c_void_p),
                ("memory_type", c_int), ("recv_info", c_void_p), ("memh", c_void_p)]


@lru_cache(maxsize=1)
def libucp_path() -> str:
    """libucp as ucxx loads it (the wheel's copy, or the system's when ucxx was told to prefer it)."""
    # UCX reads these when libucs loads (importing ucxx): its log lines go to stderr, never into a
    # stdout that a process speaks a protocol on; and no warning about ucxx's own UCX_MEMTYPE_CACHE.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import libucx
    import ucxx  # noqa: F401  (loads libucs/libuct/libucp in the order they need)

    path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0")
    return path if os.path.exists(path) else "libucp.so.0"


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """libucp via ctypes, for the control-path calls (mapping, rkeys, wire-up); the data path's
    put/get/flush/progress run in the native module (cpp/ucx.cpp)."""
    path = libucp_path()
    ucp = ctypes.CDLL(path)
    sigs = {
        "ucp_mem_map": (c_int, [c_void_p, ctypes.POINTER(MemMapParams), ctypes.POINTER(c_void_p)]),
        "ucp_mem_unmap": (c_int, [c_void_p, c_void_p]),
        "ucp_rkey_pack": (c_int, [c_void_p, c_void_p, ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t)]),
        "ucp_rkey_buffer_release": (None, [c_void_p]),
        "ucp_ep_rkey_unpack": (c_int, [c_void_p, ctypes.c_char_p, ctypes.POINTER(c_void_p)]),
        "ucp_rkey_destroy": (None, [c_void_p]),
        "ucp_put_nbx": (c_void_p, [c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, ctypes.POINTER(RequestParam)]),
        "ucp_get_nbx": (c_void_p, [c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, ctypes.POINTER(RequestParam)]),
        "ucp_request_check_status": (c_int, [c_void_p]),
        "ucp_request_free": (None, [c_void_p]),
        "ucp_worker_progress": (ctypes.c_uint, [c_void_p]),
        "ucp_ep_flush_nbx": (c_void_p, [c_void_p, ctypes.POINTER(RequestParam)]),
        "ucs_status_string": (ctypes.c_char_p, [c_int]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(ucp, name) if hasattr(ucp, name) else getattr(ctypes.CDLL(path.replace("ucp", "ucs")), name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(ucp, name, fn)
    return ucp


def status_of(ptr: int | None) -> int | None:
    """A ucs_status_ptr_t: 0 = done at once, a negative status = failed, None = a request to poll."""
    if not ptr:
        return UCS_OK
    signed = ptr - (1 << 64) if ptr >= 1 << 63 else ptr
    return signed if ERR_LAST <= signed < 0 else None


def status_text(status: int) -> str:
    text = lib().ucs_status_string(status)
    return text.decode() if text else f"UCS status {status}"
