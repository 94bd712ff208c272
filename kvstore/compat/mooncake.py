"""Mooncake Store's Python API over kvstore: `MooncakeDistributedStore` with Mooncake's method names
and meanings, so code written for Mooncake Store (or SGLang HiCache's L3) changes one import.

    from kvstore.compat.mooncake import MooncakeDistributedStore   # was: from mooncake.store import ...

    store = MooncakeDistributedStore()
    store.setup("localhost", "memory://", 512 << 20)   # an embedded store; or "etcd://host:port"
    store.put("greeting", b"hello")
    assert store.get("greeting") == b"hello"

What carries over, as Mooncake answers it (checked against mooncake-transfer-engine 0.3.13):
keys are strings and values bytes of any size; `get` of a missing key is b"" and `is_exist` 0;
`put` of a key that exists keeps the first value and returns 0 (`upsert` replaces it); calls that
return a status give 0 or a negative error code (OBJECT_NOT_FOUND -704, INVALID_PARAMS -600,
NO_AVAILABLE_HANDLE -200 and TRANSFER_FAIL -800, as Mooncake's), batch puts one per key; `batch_get_into` returns the bytes each read (the buffer may be larger than the value)
or an error; `*_from`/`*_into` take addresses inside buffers given to `register_buffer` (anything
else is refused, never read or written); tensors round-trip with their dtype and shape.

What differs: there is no master (`master_server_addr` is not used: kvstore's index lives in etcd,
or in this process for "memory://"); `protocol`, `rdma_devices` and `local_buffer_size` are
kvstore's to choose (shared memory on one host, TCP or UCX across hosts); values are verified
against their BLAKE3 digest on every read; removal is immediate (no read leases).
"""
from __future__ import annotations

import ctypes
import json
import logging
import threading
from typing import Any, Sequence

import numpy as np

from ..client import Client
from transfer.errors import TransferError

from ..errors import AllocationFailed, BlockTooLarge, InvalidRequest, KVStoreError, RemoveIncomplete
from ..index.records import MAX_BLOCK_BYTES
from ..keys import ModelFingerprint, external_hashes

log = logging.getLogger(__name__)

OK = 0
INTERNAL_ERROR = -1
INVALID_PARAMS = -600  # as Mooncake: a bad key, size or buffer
OBJECT_NOT_FOUND = -704  # as Mooncake
NO_AVAILABLE_HANDLE = -200  # as Mooncake: no room for the value on any node
TRANSFER_FAIL = -800  # as Mooncake: the bytes did not reach a node
GONE = (OK, OBJECT_NOT_FOUND)  # remove's answers after which the key holds no value
CHUNK_BYTES = MAX_BLOCK_BYTES  # values above one block's cap are stored as chunks behind a manifest
_MANIFEST = b"KVSMOON1"
# Free-form blocks ("bytes" layout): one namespace for whole values, one for chunked values' manifests
# and one for their chunks, so a value can never be read as another's manifest or chunk.
VALUES = ModelFingerprint("mooncake-compat", "uint8", 1, 1, 1, 1, kv_layout="bytes", revision="values v1")
MANIFESTS = ModelFingerprint("mooncake-compat", "uint8", 1, 1, 1, 1, kv_layout="bytes", revision="manifests v1")
CHUNKS = ModelFingerprint("mooncake-compat", "uint8", 1, 1, 1, 1, kv_layout="bytes", revision="chunks v1")


def put_status(error: BaseException) -> int:
    """Mooncake's status for why a value is on no node (callers such as vLLM's Mooncake connector
    treat NO_AVAILABLE_HANDLE as "full: skip", anything else as a failure)."""
    if isinstance(error, (AllocationFailed, BlockTooLarge)):
        return NO_AVAILABLE_HANDLE
    if isinstance(error, (InvalidRequest, ValueError)):
        return INVALID_PARAMS
    if isinstance(error, (TransferError, ConnectionError, TimeoutError)):
        return TRANSFER_FAIL
    return INTERNAL_ERROR


class ReplicateConfig:
    """Mooncake's put options: `replica_num` copies on distinct nodes (the rest is Mooncake's)."""

    def __init__(self, replica_num: int = 1) -> None:
        self.replica_num = replica_num


class MooncakeDistributedStore:
    """See the module docstring."""

    def __init__(self) -> None:
        self._client: Client | None = None
        self._buffers: dict[int, int] = {}  # registered address -> size
        self._lock = threading.Lock()

    # --- lifetime ---------------------------------------------------------------------------------
    def setup(self, local_hostname: str = "localhost", metadata_server: str = "memory://",
              global_segment_size: int = 1 << 30, local_buffer_size: int = 0, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str = "", *, secret: str | None = None,
              cluster: str = "default") -> int:
        """Connect: "memory://[name]" starts an embedded store of `global_segment_size` bytes of
        DRAM in this process; "etcd://host:port" joins `cluster` of `kvstore serve` daemons (its
        secret from `secret` or KVSTORE_SECRET). 0, or INVALID_PARAMS/INTERNAL_ERROR with a log line."""
        if self._client is not None:
            return OK
        try:
            if metadata_server.startswith("memory://"):
                from ..library import open as open_embedded

                self._client = open_embedded(metadata_server, dram=max(int(global_segment_size), 16 << 20))
            elif metadata_server.startswith(("etcd://", "etcds://")):
                self._client = Client(metadata_server, cluster=cluster, secret=secret)
                if not self._client.mirror.wait_until(lambda m: bool(m.nodes), self._client.timeout):
                    log.warning("no kvstore daemon in cluster %r at %s yet", cluster, metadata_server)
            else:
                log.error("kvstore's metadata server is etcd://HOST:PORT or memory:// (not %r)", metadata_server)
                return INVALID_PARAMS
        except (KVStoreError, OSError, ValueError) as exc:
            log.error("setup failed: %s: %s", type(exc).__name__, exc)
            return INTERNAL_ERROR
        return OK

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        return OK

    def health_check(self) -> int:
        return OK if self._client is not None and not self._client.mirror.stale else INTERNAL_ERROR

    @property
    def client(self) -> Client:
        """The kvstore client underneath (kvstore's own API: put_many, get_many, match_prefix, ...)."""
        if self._client is None:
            raise KVStoreError("call setup() first")
        return self._client

    # --- keys and sizes ---------------------------------------------------------------------------
    @staticmethod
    def _hash(key: str) -> bytes:
        if not isinstance(key, str) or not key:
            raise ValueError("a key is a non-empty str")
        return external_hashes([key])[0]

    def _record_size(self, fingerprint: ModelFingerprint, block_hash: bytes) -> int | None:
        replicas = self.client.mirror.lookup(fingerprint, block_hash)
        return next(iter(replicas.values())).size if replicas else None

    def _manifest(self, key: str) -> tuple[int, int] | None:
        """(value size, chunks) of a chunked value, None when `key` has none."""
        h = self._hash(key)
        size = self._record_size(MANIFESTS, h)
        if size is None:
            return None
        raw = np.empty(size, np.uint8)
        if not self.client.get_many([h], [raw], fingerprint=MANIFESTS)[0]:
            return None
        body = bytes(raw)
        if not body.startswith(_MANIFEST):
            return None
        meta = json.loads(body[len(_MANIFEST):])
        return int(meta["size"]), int(meta["chunks"])

    @staticmethod
    def _chunk_hashes(key: str, chunks: int) -> list[bytes]:
        return external_hashes([f"{key}\0chunk {i}" for i in range(chunks)])

    def get_size(self, key: str) -> int:
        """The value's size in bytes, or OBJECT_NOT_FOUND."""
        try:
            size = self._record_size(VALUES, self._hash(key))
            if size is None and (manifest := self._manifest(key)) is not None:
                size = manifest[0]
        except ValueError:
            return INVALID_PARAMS
        return OBJECT_NOT_FOUND if size is None else size

    def is_exist(self, key: str) -> int:
        size = self.get_size(key)
        return 1 if size >= 0 else (0 if size == OBJECT_NOT_FOUND else size)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [self.is_exist(k) for k in keys]

    # --- put --------------------------------------------------------------------------------------
    def _replicas(self, config: Any) -> int | None:
        return getattr(config, "replica_num", None) if config is not None else None

    def _put_views(self, keys: Sequence[str], views: Sequence[memoryview], config: Any) -> list[int]:
        """One status per key, as Mooncake's batch puts answer: the keys that failed, and only they,
        carry their own code, so a caller retries exactly those."""
        results, small = [OK] * len(keys), []
        for i, (key, view) in enumerate(zip(keys, views)):
            try:
                if self.is_exist(key) == 1:
                    continue  # as Mooncake: a key that exists keeps its first value
                if not view.nbytes:
                    results[i] = INVALID_PARAMS
                elif view.nbytes <= CHUNK_BYTES:
                    small.append((i, self._hash(key), view))
                else:
                    self._put_chunked(key, view, config)
            except ValueError:
                results[i] = INVALID_PARAMS
            except KVStoreError as exc:
                log.warning("put of %r failed: %s", key[:80], exc)
                results[i] = put_status(exc)
        if small:
            failure: KVStoreError | None = None
            try:
                outcomes = self.client.put_batch([(h, v) for _, h, v in small], fingerprint=VALUES,
                                                 replicas=self._replicas(config))
            except KVStoreError as exc:  # the client's configuration: every key alike
                log.warning("put of %d values failed: %s", len(small), exc)
                failure, outcomes = exc, []
            for n, (i, _, _) in enumerate(small):
                error = failure or outcomes[n].error
                if error is not None:
                    results[i] = put_status(error)
                    if failure is None:
                        log.warning("put of %r failed: %s", keys[i][:80], outcomes[n].reason or error)
        return results

    def _put_chunked(self, key: str, view: memoryview, config: Any) -> None:
        """A value over one block's cap: its chunks first, then the manifest that makes it visible."""
        chunks = -(-view.nbytes // CHUNK_BYTES)
        hashes = self._chunk_hashes(key, chunks)
        for i, h in enumerate(hashes):
            part = view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]
            self.client.put_many([(h, part)], fingerprint=CHUNKS, replicas=self._replicas(config))
        manifest = _MANIFEST + json.dumps({"size": view.nbytes, "chunks": chunks}).encode()
        self.client.put_many([(self._hash(key), np.frombuffer(manifest, np.uint8))], fingerprint=MANIFESTS,
                             replicas=self._replicas(config))

    @staticmethod
    def _view(value: Any) -> memoryview:
        view = memoryview(value)
        return view if view.ndim == 1 and view.format in ("B", "b", "c") else view.cast("B")

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self.put_batch([key], [value], config)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        """0 when every value is stored (or its key held one already), else the first error."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        results = self._put_views(keys, [self._view(v) for v in values], config)
        return next((r for r in results if r != OK), OK)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store `value` under `key`, replacing what it held (the old value's error code, and
        nothing stored, when a copy of it could not be removed: a put would keep the old value)."""
        removed = self.remove(key)
        return self.put(key, value, config) if removed in GONE else removed

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        """0 when every value replaced its key's, else the first error (as upsert, key by key)."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        removed = self.batch_remove(keys)
        gone = [i for i, r in enumerate(removed) if r in GONE]
        stored = self.put_batch([keys[i] for i in gone], [values[i] for i in gone], config) if gone else OK
        return next((r for r in removed if r not in GONE), stored)

    # --- get --------------------------------------------------------------------------------------
    def _get_into_view(self, key: str, out: np.ndarray) -> int:
        """Read `key`'s value into the start of `out`: its size, or an error code."""
        size = self.get_size(key)
        if size < 0:
            return size
        if size > out.nbytes:
            return INVALID_PARAMS  # as Mooncake: a buffer too small for the value
        h = self._hash(key)
        if self._record_size(VALUES, h) is not None:
            return size if self.client.get_many([h], [out[:size]], fingerprint=VALUES)[0] else OBJECT_NOT_FOUND
        manifest = self._manifest(key)
        if manifest is None:
            return OBJECT_NOT_FOUND
        total, chunks = manifest
        outs = [out[i * CHUNK_BYTES : min((i + 1) * CHUNK_BYTES, total)] for i in range(chunks)]
        found = self.client.get_many(self._chunk_hashes(key, chunks), outs, fingerprint=CHUNKS)
        return total if all(found) else OBJECT_NOT_FOUND

    def get(self, key: str) -> bytes:
        """The value, or b"" when `key` holds none (as Mooncake)."""
        try:
            size = self.get_size(key)
            if size < 0:
                return b""
            out = np.empty(size, np.uint8)
            return out.tobytes() if self._get_into_view(key, out) == size else b""
        except ValueError:
            return b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    # --- caller buffers (addresses inside registered buffers) ------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Let `*_from`/`*_into` calls address [buffer_ptr, buffer_ptr + size)."""
        if buffer_ptr <= 0 or size <= 0:
            return INVALID_PARAMS
        with self._lock:
            self._buffers[int(buffer_ptr)] = int(size)
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            return OK if self._buffers.pop(int(buffer_ptr), None) is not None else INVALID_PARAMS

    def _span(self, ptr: int, size: int) -> np.ndarray | None:
        """The bytes at [ptr, ptr + size) when they lie inside one registered buffer, else None:
        an address the caller did not register is never read or written."""
        with self._lock:
            inside = any(start <= ptr and ptr + size <= start + length for start, length in self._buffers.items())
        if not inside or size <= 0:
            return None
        return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        spans = [self._span(p, s) for p, s in zip(buffer_ptrs, sizes)]
        ok = [i for i, span in enumerate(spans) if span is not None]
        results = [INVALID_PARAMS] * len(keys)
        for i, r in zip(ok, self._put_views([keys[i] for i in ok], [memoryview(spans[i]) for i in ok], config)):
            results[i] = r
        return results

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Each value into its buffer (which may be larger): the bytes read, or an error code."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        out = []
        for key, ptr, size in zip(keys, buffer_ptrs, sizes):
            span = self._span(ptr, size)
            try:
                out.append(INVALID_PARAMS if span is None else self._get_into_view(key, span))
            except ValueError:
                out.append(INVALID_PARAMS)
        return out

    # --- tensors ----------------------------------------------------------------------------------
    def put_tensor(self, key: str, tensor: Any) -> int:
        """A CPU tensor with its dtype and shape (a small header, then its bytes)."""
        import torch

        t = tensor.detach().cpu().contiguous()
        header = json.dumps({"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}).encode()
        body = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        value = np.concatenate([np.frombuffer(len(header).to_bytes(4, "little") + header, np.uint8), body])
        return self.put(key, value)

    def get_tensor(self, key: str) -> Any:
        """The tensor, or None when `key` holds none (as Mooncake)."""
        import torch

        raw = self.get(key)
        if len(raw) < 4:
            return None
        length = int.from_bytes(raw[:4], "little")
        meta = json.loads(raw[4 : 4 + length])
        data = bytearray(raw[4 + length :])
        dtype = getattr(torch, meta["dtype"])
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(meta["shape"])

    # --- remove -----------------------------------------------------------------------------------
    def remove(self, key: str, force: bool = False) -> int:
        """0 when the key's value is gone, OBJECT_NOT_FOUND when it held none."""
        try:
            h = self._hash(key)
        except ValueError:
            return INVALID_PARAMS
        try:
            if self._record_size(VALUES, h) is not None:
                return OK if self.client.remove([h], fingerprint=VALUES) else OBJECT_NOT_FOUND
            manifest = self._manifest(key)
            if manifest is None:
                return OBJECT_NOT_FOUND
            self.client.remove([h], fingerprint=MANIFESTS)  # invisible first, then its chunks
            self.client.remove(self._chunk_hashes(key, manifest[1]), fingerprint=CHUNKS)
        except RemoveIncomplete as exc:  # a node holding a copy could not be reached
            log.warning("remove of %r incomplete: %s", key[:80], exc)
            return INTERNAL_ERROR
        return OK

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return [self.remove(k, force) for k in keys]
