"""What identifies the weights behind a block's KV: the model's weights as loaded and each LoRA
adapter's, by content, so that no configuration shares KV across different weights.

A model path alone says nothing: a fine-tune or an RL checkpoint redeployed in place keeps it. The
identity is, in order of preference:
- a hub snapshot's commit (the files of `.../models--org--name/snapshots/<commit>/` never change
  under that name), for a model vLLM took from the Hugging Face cache;
- else a digest of the weight files: each file's name and size, a safetensors file's header (its
  tensor table) and samples of every tensor's bytes (its first, middle and last 4 KiB), other
  files' bytes at evenly spaced offsets; files up to 64 MiB are hashed whole, and
  `weights_digest: "full"` hashes every byte of every file. Modification times are left out on
  purpose: the same checkpoint copied to two hosts must key the same, and a rewrite that keeps
  every sampled byte is no fine-tune (training moves every element of a tensor it touches);
- and, combined with either, the operator's `weight_version` where given.
Weights vLLM does not read from a local directory (dummy weights, remote loaders) have no
identity kvstore can check: keys then chain from a per-process nonce (nothing is shared) unless
`weight_version` names them.

An adapter's identity is the same digest over its directory, taken when this process first sees
the adapter (about when vLLM loads it) and again when a request asks vLLM to reload it in place
(`load_inplace`). An adapter whose files changed since without such a reload may be running with
either weights: its requests neither save nor load until vLLM reloads it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

import blake3

from ...errors import UnsupportedDeployment

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
SAMPLE_BYTES = 4096
EVEN_SAMPLES = 64  # samples of a file that is not safetensors (and too large to hash whole)
WHOLE_BELOW = 64 << 20  # files up to this size are hashed whole: cheaper than reasoning about samples
MAX_HEADER = 100 << 20  # the safetensors format's own limit on a header
HUB_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+)/snapshots/([0-9a-f]{40})(?:/|$)")
DIGEST_MODES = ("sampled", "full")


@dataclass(frozen=True)
class FileState:
    """A file's name, size and modification time: what tells this process to digest it again."""

    name: str
    size: int
    mtime_ns: int


def weight_files(path: str) -> list[str]:
    """The weight files of a model or adapter directory (or the file itself), relative names,
    sorted: the top level first, a tree only where the top level holds none."""
    if os.path.isfile(path):
        return [os.path.basename(path)]
    top = sorted(name for name in os.listdir(path) if name.endswith(WEIGHT_SUFFIXES)
                 and os.path.isfile(os.path.join(path, name)))
    if top:
        return top
    found = []
    for root, _, names in os.walk(path):
        found += [os.path.relpath(os.path.join(root, n), path) for n in names if n.endswith(WEIGHT_SUFFIXES)]
    return sorted(found)


def file_states(path: str, names: list[str]) -> tuple[FileState, ...]:
    base = path if os.path.isdir(path) else os.path.dirname(path)
    out = []
    for name in names:
        st = os.stat(os.path.join(base, name))
        out.append(FileState(name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _read_at(f: BinaryIO, offset: int, length: int) -> bytes:
    return os.pread(f.fileno(), length, offset)


def _safetensors_parts(f: BinaryIO, size: int) -> Iterator[bytes] | None:
    """The header and samples of every tensor of a safetensors file; None when it is not one."""
    if size < 8:
        return None
    header_len = int.from_bytes(_read_at(f, 0, 8), "little")
    if not 2 <= header_len <= min(MAX_HEADER, size - 8):
        return None
    header = _read_at(f, 8, header_len)
    try:
        table = json.loads(header)
    except ValueError:
        return None
    if not isinstance(table, dict):
        return None
    start = 8 + header_len

    def parts() -> Iterator[bytes]:
        yield header
        for name in sorted(k for k in table if k != "__metadata__"):
            begin, end = (table[name].get("data_offsets") or (0, 0)) if isinstance(table[name], dict) else (0, 0)
            length = int(end) - int(begin)
            for at in sorted({0, max(0, length // 2 - SAMPLE_BYTES // 2), max(0, length - SAMPLE_BYTES)}):
                yield _read_at(f, start + int(begin) + at, min(SAMPLE_BYTES, length))
    return parts()


def _even_parts(f: BinaryIO, size: int) -> Iterator[bytes]:
    step = max(1, size // EVEN_SAMPLES)
    for at in range(0, size, step):
        yield _read_at(f, at, SAMPLE_BYTES)
    yield _read_at(f, max(0, size - SAMPLE_BYTES), SAMPLE_BYTES)


def _whole_parts(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(8 << 20):
        yield chunk


def files_digest(path: str, names: list[str], mode: str = "sampled") -> str:
    """A content digest of `names` under `path` (see the module docstring for what it reads)."""
    if mode not in DIGEST_MODES:
        raise UnsupportedDeployment(f"weights_digest must be one of {', '.join(DIGEST_MODES)}, not {mode!r}")
    base = path if os.path.isdir(path) else os.path.dirname(path)
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if mode == "full" else 1)
    hasher.update(f"kvstore weights v1 {mode}\0".encode())
    for name in names:
        with open(os.path.join(base, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            hasher.update(f"{name}\0{size}\0".encode())
            parts = None
            if mode == "sampled" and size > WHOLE_BELOW:
                parts = (_safetensors_parts(f, size) if name.endswith(".safetensors") else None) or _even_parts(f, size)
            for part in parts or _whole_parts(f):
                hasher.update(len(part).to_bytes(8, "little"))
                hasher.update(part)
    return hasher.hexdigest()[:32]


def hub_commit(path: str) -> str | None:
    """`org/name@commit` of a Hugging Face cache snapshot directory, else None."""
    match = HUB_SNAPSHOT.search(os.path.realpath(path) if os.path.exists(path) else path) or HUB_SNAPSHOT.search(path)
    if match is None:
        return None
    return f"{match.group(1).replace('--', '/')}@{match.group(2)}"


def _local_model_dir(model: str, revision: str | None) -> str | None:
    """Where vLLM read `model` from: the path itself, or its snapshot in the Hugging Face cache."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision or None, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache (or no hub library): not a directory we can read
        return None


VERSION_ENV = "KVSTORE_WEIGHT_VERSION"


def configured_version(extra: dict[str, Any]) -> str:
    """The weights' version the operator names, read now: the first line of `weight_version_file`
    (an RL loop or a deploy script rewrites it before resetting the cache), else the
    KVSTORE_WEIGHT_VERSION environment variable, else `weight_version`; "" when none is set."""
    path = extra.get("weight_version_file")
    if path:
        try:
            with open(str(path)) as f:
                first = f.readline().strip()
        except OSError as exc:
            raise UnsupportedDeployment(f"kv_connector_extra_config.weight_version_file {path!r} cannot be read "
                                        f"({exc.strerror}): it names the weights' version") from None
        if first:
            return first
    return os.environ.get(VERSION_ENV, "").strip() or str(extra.get("weight_version") or "")


def weights_identity(vllm_config: Any, extra: dict[str, Any], version: str | None = None) -> str:
    """The identity of the weights this engine loaded, combined with `version` (default: the
    configured one)."""
    version = configured_version(extra) if version is None else str(version)
    mode = str(extra.get("weights_digest", "sampled"))
    if mode not in DIGEST_MODES:
        raise UnsupportedDeployment(f"kv_connector_extra_config.weights_digest must be one of "
                                    f"{', '.join(DIGEST_MODES)}, not {mode!r}")
    model = vllm_config.model_config
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto") or "auto")
    identity = None
    if load_format != "dummy":
        local = _local_model_dir(str(model.model), getattr(model, "revision", None))
        if local is not None:
            identity = hub_commit(local) if mode == "sampled" else None
            if identity is None:
                names = weight_files(local)
                identity = f"files {files_digest(local, names, mode)}" if names else None
    if identity is None:
        if not version:
            # Nothing to check the weights against: share with no other process.
            log.warning("kvstore: cannot identify the weights of %s (load format %s): KV is keyed to this process "
                        "only; set kv_connector_extra_config.weight_version to share it", model.model, load_format)
            return f"nonce {secrets.token_hex(16)}"
        return f"version {version}"
    return f"{identity} version {version}" if version else identity


class AdapterIdentities:
    """Each LoRA adapter's content digest, as this process first saw it (or last reloaded it)."""

    def __init__(self, mode: str = "sampled") -> None:
        self._mode = mode
        self._known: dict[tuple[int, str], tuple[tuple[FileState, ...], str]] = {}
        self._changed: set[tuple[int, str]] = set()  # files changed without a reload: unknown weights
        self._lock = threading.Lock()

    def identity(self, lora_request: Any) -> str | None:
        """The adapter's digest; None when the weights vLLM runs cannot be told (changed files,
        not reloaded, or unreadable): the request must neither save nor load."""
        key = (int(lora_request.lora_int_id), str(lora_request.lora_path))
        path = _local_model_dir(key[1], None)
        if path is None:
            return None
        try:
            names = weight_files(path)
            states = file_states(path, names)
        except OSError:
            return None
        if not names:
            return None
        reload = bool(getattr(lora_request, "load_inplace", False))
        with self._lock:
            known = self._known.get(key)
            if known is not None and known[0] == states and (key not in self._changed or not reload):
                return None if key in self._changed else known[1]
            try:
                digest = files_digest(path, names, self._mode)
            except OSError:
                return None
            if known is None or reload:  # vLLM loads (or reloads) the adapter from these files
                self._known[key] = (states, digest)
                self._changed.discard(key)
                return digest
            if digest != known[1]:
                log.warning("kvstore: adapter %s at %s changed on disk since vLLM loaded it: its requests neither save "
                            "nor load KV until vLLM reloads it (load_inplace)", lora_request.lora_name, path)
                self._known[key] = (states, known[1])
                self._changed.add(key)
                return None
            self._known[key] = (states, digest)  # touched, same bytes
            return None if key in self._changed else digest
