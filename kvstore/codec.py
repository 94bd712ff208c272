"""Block codecs: lz4 over byte planes, for the NVMe tier (`kvstore serve --disk-codec lz4`) and the
TCP wire (`Client(wire_codec="lz4")`). Off by default.

Why byte planes ("shuffle"): a bf16 or fp16 KV block is pairs of bytes whose high byte (sign,
exponent) repeats a lot and whose low byte (mantissa) is noise. lz4 over the bytes as they lie finds
no matches (measured 0.996x on synthetic bf16); over the high bytes gathered in one plane and the low
bytes in another it finds them in the first (1.5x) and nothing in the second, which is then kept raw
rather than run through lz4 for nothing (that halves the compression time). Overall about 1.2x on
synthetic bf16 with lz4 (zstd reaches more, at several times the CPU); fp16 exponents spread wider and
gain less, often nothing: such blocks are stored raw.

Framing of a coded block (codec LZ4_W1/W2/W4: W planes, element width W bytes):

    W x u32 little-endian   the stored length of each plane (== the plane's length: kept raw)
    the planes, in order    plane p = bytes p, p+W, p+2W, ... of the block's first size//W*W bytes
    the tail                the last size % W bytes, raw

The block's size (raw) comes from its record, so the frame does not repeat it. A block whose frame
would not be at least MIN_GAIN smaller than its bytes is stored raw (codec RAW): reading it then
costs nothing extra. Digests are always over the raw bytes (kvstore.integrity), taken after decoding:
a corrupted frame either fails to decode (CodecError) or decodes to bytes that fail their digest.
"""
from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np

from .errors import InvalidRequest

RAW, LZ4_W1, LZ4_W2, LZ4_W4 = 0, 1, 2, 3
WIDTHS = {LZ4_W1: 1, LZ4_W2: 2, LZ4_W4: 4}
NAMES = {RAW: "raw", LZ4_W1: "lz4", LZ4_W2: "lz4+shuffle2", LZ4_W4: "lz4+shuffle4"}
CODECS = ("lz4",)  # what --disk-codec and wire_codec accept (besides none/off)
MIN_GAIN = 0.05  # a frame saving less than this share of the block is not worth decoding: raw
# A fingerprint's best width is learned on its first block and checked again every PROBE_EVERY
# blocks (all widths tried on that one): blocks of one model compress alike, and a dtype that gains
# nothing (fp8, most fp16) then costs one probe in PROBE_EVERY instead of a wasted pass per block.
PROBE_EVERY = 256
_U32 = struct.Struct("<I")


class CodecError(InvalidRequest):
    """Coded bytes that do not decode (damaged, or not what their record says)."""


def check_codec(name: str | None) -> str | None:
    """None (no codec) or a codec name from CODECS; InvalidRequest (one line) otherwise."""
    if name in (None, "", "none", "off", "raw"):
        return None
    if name not in CODECS:
        raise InvalidRequest(f"codec {str(name)[:40]!r} not known: use one of {', '.join(CODECS)} or none")
    return name


def _lz4():
    try:
        import lz4.block
    except ImportError:  # pragma: no cover - a declared dependency
        raise InvalidRequest("the lz4 codec needs the lz4 package (pip install lz4)") from None
    return lz4.block


def _flat(data: Any) -> np.ndarray:
    view = memoryview(data)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return np.frombuffer(view, np.uint8)


def encode(data: Any, codec: int) -> bytes | None:
    """`data` framed with `codec` (an LZ4_* id), or None when that saves less than MIN_GAIN."""
    width = WIDTHS.get(codec)
    if width is None:
        raise CodecError(f"codec {codec} not known")
    src = _flat(data)
    size = src.nbytes
    if size == 0:
        return None
    block = _lz4()
    plane = size // width
    heads, bodies = [], []
    for p in range(width):
        raw = src[p : plane * width : width] if width > 1 else src
        raw = np.ascontiguousarray(raw)  # a strided gather: one plane's bytes side by side
        packed = block.compress(raw, store_size=False) if plane else b""
        if len(packed) >= plane:
            packed = raw.tobytes()
        heads.append(_U32.pack(len(packed)))
        bodies.append(packed)
    tail = src[plane * width :].tobytes()
    total = 4 * width + sum(map(len, bodies)) + len(tail)
    if total > size * (1 - MIN_GAIN):
        return None
    return b"".join(heads + bodies + [tail])


def decode_into(stored: Any, codec: int, size: int, out: Any) -> None:
    """Decode a frame into `out` (a writable buffer of `size` bytes); CodecError when it does not."""
    width = WIDTHS.get(codec)
    if width is None:
        raise CodecError(f"codec {codec} not known")
    src = memoryview(stored).cast("B") if memoryview(stored).format != "B" else memoryview(stored)
    dst = _flat(out)
    if dst.nbytes != size or dst.flags.writeable is False:
        raise CodecError(f"a buffer of {dst.nbytes} bytes for a {size}-byte block")
    plane = size // width
    if len(src) < 4 * width:
        raise CodecError("a coded block shorter than its header")
    lengths = [_U32.unpack_from(src, 4 * p)[0] for p in range(width)]
    if 4 * width + sum(lengths) + size - plane * width != len(src):
        raise CodecError(f"a coded block of {len(src)} bytes does not match its header")
    block = _lz4()
    at = 4 * width
    for p, length in enumerate(lengths):
        chunk = src[at : at + length]
        at += length
        if length == plane:
            got = np.frombuffer(chunk, np.uint8)
        else:
            try:
                raw = block.decompress(chunk, uncompressed_size=plane)
            except Exception as exc:  # noqa: BLE001 - lz4.block.LZ4BlockError and friends: damaged bytes
                raise CodecError(f"a coded block does not decode: {exc}") from None
            if len(raw) != plane:
                raise CodecError(f"a coded plane decoded to {len(raw)} bytes, expected {plane}")
            got = np.frombuffer(raw, np.uint8)
        if width == 1:
            dst[:plane] = got
        else:
            dst[p : plane * width : width] = got
    dst[plane * width :] = np.frombuffer(src[at:], np.uint8)


def decode(stored: Any, codec: int, size: int) -> bytearray:
    """The block's raw bytes (a new buffer); CodecError when the frame does not decode."""
    out = bytearray(size)
    decode_into(stored, codec, size, out)
    return out


class Chooser:
    """Picks each block's codec by its fingerprint (see PROBE_EVERY): encode(fp, data) -> (codec,
    frame), (RAW, None) when coding gains too little. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._best: dict[str, list[int]] = {}  # fingerprint -> [codec, blocks since the last probe]

    def encode(self, fingerprint: str, data: Any) -> tuple[int, bytes | None]:
        with self._lock:
            state = self._best.get(fingerprint)
            probe = state is None or state[1] >= PROBE_EVERY
            if not probe:
                state[1] += 1
                codec = state[0]
        if not probe:
            if codec == RAW:
                return RAW, None
            frame = encode(data, codec)
            return (codec, frame) if frame is not None else (RAW, None)
        best, frame = RAW, None
        for codec in (LZ4_W2, LZ4_W1, LZ4_W4):
            candidate = encode(data, codec)
            if candidate is not None and (frame is None or len(candidate) < len(frame)):
                best, frame = codec, candidate
        with self._lock:
            if len(self._best) > 4096:  # many fingerprints: forget the old ones rather than grow
                self._best.clear()
            self._best[fingerprint] = [best, 1]
        return best, frame
