"""Block keys: a model fingerprint and chained block hashes, identical across processes and hosts.

    h_0 = H(fingerprint), h_i = H(h_{i-1} || tokens_i as little-endian u32), H = xxh3-128,

over full blocks only. No Python `hash()`, no pickling, no dict ordering: the same tokens give the
same keys under any PYTHONHASHSEED, on any machine.
"""
from __future__ import annotations

import array
import json
import sys
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any, Iterable, Sequence

import re

import numpy as np
import xxhash

from transfer.auth import TENANT_NAME, TENANT_RULE

from .errors import FingerprintMismatch, InvalidFingerprint, InvalidTokens

HASH_BYTES = 16
TENANT_SEPARATOR = ":"  # a tenant's fingerprint digest is `tenant:hash` (never in a tenant name)
# A fingerprint's digest: 32 hex chars, behind its tenant's name and ':' when it has one (fullmatch).
FINGERPRINT_DIGEST = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,63}:)?[0-9a-f]{32}")
BlockHash = bytes  # 16 bytes
DEFAULT_LAYOUT = "default"  # K and V pages per layer: the fingerprint's fields give a block's size
BYTES_LAYOUT = "bytes"  # free-form blocks of any size (the fingerprint only names them)
DTYPE_BYTES = {"float64": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "int8": 1,
               "uint8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that makes two workers' KV bytes interchangeable."""

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_layout: str = DEFAULT_LAYOUT
    revision: str = ""
    tp_rank: int = 0
    tp_world_size: int = 1
    tokenizer_id: str = ""
    adapter_id: str = ""
    tenant: str = ""
    cache_salt: str = ""
    # Pipeline stage: two stages hold different layers under otherwise equal fingerprints.
    pp_rank: int = 0
    pp_world_size: int = 1
    layer_start: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise InvalidFingerprint(f"{f.name} must be an int, not {type(value).__name__}")
            elif not isinstance(value, str):
                raise InvalidFingerprint(f"{f.name} must be a str, not {type(value).__name__}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size", "tp_world_size", "pp_world_size"):
            if getattr(self, name) <= 0:
                raise InvalidFingerprint(f"{name} must be positive")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise InvalidFingerprint(f"tp_rank {self.tp_rank} outside a world of {self.tp_world_size}")
        if not 0 <= self.pp_rank < self.pp_world_size:
            raise InvalidFingerprint(f"pp_rank {self.pp_rank} outside a world of {self.pp_world_size}")
        if self.layer_start < 0:
            raise InvalidFingerprint("layer_start must not be negative")
        if not self.model_id or not self.dtype:
            raise InvalidFingerprint("model_id and dtype are required")
        if self.tenant and not TENANT_NAME.fullmatch(self.tenant):
            raise InvalidFingerprint(f"tenant must be {TENANT_RULE} (it names the fingerprint's owner in its "
                                     f"digest), not {self.tenant[:80]!r}: use cache_salt to keep caches apart")

    # Computed once per instance (frozen fields never change); cached_property bypasses __setattr__.
    @cached_property
    def _canonical(self) -> bytes:
        fields_ = asdict(self)
        for name, default in _OPTIONAL_FIELDS.items():  # absent at their default: older digests stay valid
            if fields_[name] == default:
                del fields_[name]
        return json.dumps(fields_, sort_keys=True, separators=(",", ":")).encode()

    def canonical(self) -> bytes:
        """Deterministic encoding: sorted-key JSON of every field."""
        return self._canonical

    @cached_property
    def digest(self) -> str:
        """The name of this fingerprint in metadata keys: 32 hex chars, behind `tenant:` when the
        fingerprint has a tenant (a daemon given tenants lets only that tenant write, reserve,
        commit or look up under it: `fingerprint_tenant`)."""
        digest = xxhash.xxh3_128_hexdigest(self._canonical)
        return f"{self.tenant}{TENANT_SEPARATOR}{digest}" if self.tenant else digest

    @cached_property
    def _root(self) -> BlockHash:
        return xxhash.xxh3_128_digest(self._canonical)

    def root_hash(self) -> BlockHash:
        """h_0 of every chain under this fingerprint."""
        return self._root

    @property
    def block_bytes(self) -> int | None:
        """Bytes of one block under the default layout (a key and a value page of `block_size`
        tokens x `num_kv_heads` x `head_size` per layer), or None when the layout names its own
        geometry (a vLLM paged cache, "bytes" for free-form blocks) or the dtype is not one it knows."""
        itemsize = DTYPE_BYTES.get(self.dtype)
        if self.kv_layout != DEFAULT_LAYOUT or itemsize is None:
            return None
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * itemsize

    def check_compatible(self, other: "ModelFingerprint") -> None:
        """Raise FingerprintMismatch naming every field that differs."""
        diffs = {f.name: (getattr(self, f.name), getattr(other, f.name)) for f in fields(self)
                 if getattr(self, f.name) != getattr(other, f.name)}
        if diffs:
            listed = ", ".join(f"{k}: {a!r} != {b!r}" for k, (a, b) in diffs.items())
            raise FingerprintMismatch(f"incompatible model fingerprints ({listed})", diffs)


_OPTIONAL_FIELDS = {"pp_rank": 0, "pp_world_size": 1, "layer_start": 0}


def fingerprint_tenant(name: str) -> str:
    """The tenant whose namespace the fingerprint name (a digest, or a free-form name) is in: the
    part before the first ':', "" when it has none (the cluster's own namespace)."""
    tenant, sep, _ = name.partition(TENANT_SEPARATOR)
    return tenant if sep else ""


# array('I') packs a list of ints at C speed, refusing floats, negatives and ids past 2**32 - 1
_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian u32 array; raises InvalidTokens on anything else."""
    if _NATIVE_U32 and type(tokens) is list and tokens and type(tokens[0]) is int:
        # A 12k-id list: ~0.1 ms this way, ~0.9 ms through np.asarray's type inference (the
        # gateway hashes every prompt). Anything array refuses takes the checks below.
        try:
            return np.frombuffer(array.array("I", tokens), dtype="<u4")
        except (TypeError, OverflowError):
            pass
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidTokens("token ids must be a flat sequence")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidTokens(f"token ids must be integers, not {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise InvalidTokens("token ids must fit in an unsigned 32-bit integer")
    return arr.astype("<u4", copy=False)


def encode_extra_keys(keys: Any) -> bytes:
    """Deterministic bytes for one block's extra keys (nested tuples of str/bytes/int/None), as
    `chain_hashes(extras=...)` folds them into the block's hash: the connector encodes vLLM's extra
    keys (adapter, multimodal item, cache salt) this way, and so must everyone else who computes
    the same keys (the gateway from KV events, the stand-in engines)."""
    if keys is None:
        return b"N"
    if isinstance(keys, bool):
        return b"T" if keys else b"F"
    if isinstance(keys, int):
        return b"I" + str(keys).encode() + b";"
    if isinstance(keys, str):
        raw = keys.encode()
        return b"S" + len(raw).to_bytes(4, "little") + raw
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
        return b"B" + len(raw).to_bytes(4, "little") + raw
    if isinstance(keys, (tuple, list)):
        return b"(" + b"".join(encode_extra_keys(k) for k in keys) + b")"
    if isinstance(keys, float):
        return b"D" + repr(keys).encode() + b";"
    raise TypeError(f"cannot encode a block extra key of type {type(keys).__name__}")


def chain_hashes(fingerprint: ModelFingerprint, tokens: Sequence[int] | np.ndarray,
                 parent: BlockHash | None = None, extras: Sequence[bytes | None] | None = None) -> list[BlockHash]:
    """Hashes of every full block of `tokens` (a trailing partial block gets none).

    `parent` continues an existing chain (the hash of the block before `tokens`). `extras[i]`, when
    given, is folded into block i's hash: whatever besides tokens decides its KV (LoRA adapter,
    multimodal inputs, prompt embeddings, cache salt)."""
    size = fingerprint.block_size
    data = token_array(tokens).tobytes()
    step = size * 4
    previous = fingerprint.root_hash() if parent is None else parent
    digest = xxhash.xxh3_128_digest
    out = []
    for i, start in enumerate(range(0, len(data) - step + 1, step)):
        extra = extras[i] if extras is not None and i < len(extras) else None
        block = data[start : start + step]
        if extra:  # length-prefixed, so tokens and extras can never be confused with each other
            block += b"\xffEXTRA" + len(extra).to_bytes(8, "little") + extra
        previous = digest(previous + block)
        out.append(previous)
    return out


TAIL_SEED = 0x7461696C  # a partial block's hash is a different function: it never equals a full block's


def tail_hash(fingerprint: ModelFingerprint, tail: Sequence[int] | np.ndarray, previous: BlockHash | None = None,
              extra: bytes | None = None) -> BlockHash:
    """Hash of a partial block (1 to block_size - 1 tokens) behind `previous`, the hash of the full
    block before it (None: the chain's start). Found only behind exactly the same prefix."""
    data = token_array(tail).tobytes()
    if not 0 < len(data) < fingerprint.block_size * 4:
        raise InvalidTokens(f"a partial block holds 1 to {fingerprint.block_size - 1} tokens, not {len(data) // 4}")
    if extra:
        data += b"\xffEXTRA" + len(extra).to_bytes(8, "little") + extra
    start = fingerprint.root_hash() if previous is None else previous
    return xxhash.xxh3_128_digest(start + len(data).to_bytes(8, "little") + data, seed=TAIL_SEED)


def external_hashes(ids: Iterable[int | bytes | str], fingerprint: ModelFingerprint | None = None) -> list[BlockHash]:
    """Block hashes from a chain computed elsewhere (Mooncake trace `hash_ids`, vLLM block hashes).

    Such ids are already prefix-chained by their producer; they are mapped one to one onto 16-byte
    keys, salted with the fingerprint so two models' id 0 never collide."""
    salt = fingerprint.root_hash() if fingerprint is not None else b""
    out = []
    for value in ids:
        if isinstance(value, bool):
            raise InvalidTokens("a block id cannot be a bool")
        if isinstance(value, int):
            raw = value.to_bytes(16, "little", signed=value < 0)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
        elif isinstance(value, str):
            raw = value.encode()
        else:
            raise InvalidTokens(f"unsupported block id type {type(value).__name__}")
        out.append(xxhash.xxh3_128_digest(salt + raw))
    return out
