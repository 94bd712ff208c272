"""kvstore.codec: lz4 over byte planes. Round trips at every width and size, raw where the gain is
under MIN_GAIN, damaged frames refused (CodecError) or caught by the digest over the raw bytes, and
the shuffle being what makes bf16 compress."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.codec import LZ4_W1, LZ4_W2, LZ4_W4, MIN_GAIN, Chooser, CodecError, check_codec, decode, encode
from kvstore.errors import InvalidRequest
from kvstore.integrity import block_digest


def bf16(n: int, seed: int = 0) -> bytes:
    """Synthetic bf16 KV: normal values, truncated from float32 (the high half of each word)."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.mark.parametrize("codec", [LZ4_W1, LZ4_W2, LZ4_W4])
@pytest.mark.parametrize("size", [1, 3, 4097, 65536, 65539])
def test_round_trips_at_every_width_and_size(codec, size):
    """Kills: a plane split or tail that drops or reorders bytes (odd sizes leave a tail)."""
    data = (bytes(range(7)) * (size // 7 + 1))[:size]  # compressible, so a frame is made
    frame = encode(data, codec)
    if frame is not None:
        assert bytes(decode(frame, codec, size)) == data


def test_bytes_that_do_not_compress_stay_raw():
    """Kills: storing frames that save nothing (every read then pays a decode for no room)."""
    noise = np.random.default_rng(1).integers(0, 256, 65536, dtype=np.uint8).tobytes()
    assert all(encode(noise, c) is None for c in (LZ4_W1, LZ4_W2, LZ4_W4))
    assert Chooser().encode("fp", noise) == (0, None)


def test_the_shuffle_is_what_makes_bf16_compress():
    """Kills: dropping the byte shuffle for 2-byte dtypes (lz4 alone finds nothing in bf16)."""
    data = bf16(32768)
    assert encode(data, LZ4_W1) is None  # plain lz4: under MIN_GAIN
    frame = encode(data, LZ4_W2)
    assert frame is not None and len(data) / len(frame) >= 1.15
    codec, chosen = Chooser().encode("fp", data)
    assert codec == LZ4_W2 and chosen == frame
    assert len(chosen) <= len(data) * (1 - MIN_GAIN)


def test_a_damaged_frame_never_yields_the_block():
    """Kills: trusting a frame that decodes: every single-byte change either fails to decode or
    decodes to bytes whose digest is not the block's."""
    data = bf16(8192, seed=2)
    key = b"k" * 16
    digest = block_digest(key, data)
    frame = bytearray(encode(data, LZ4_W2))
    rng = np.random.default_rng(3)
    for at in rng.integers(0, len(frame), 200):
        bad = bytearray(frame)
        bad[at] ^= 0x5A
        try:
            got = decode(bytes(bad), LZ4_W2, len(data))
        except CodecError:
            continue
        assert block_digest(key, got) != digest
    with pytest.raises(CodecError):
        decode(bytes(frame[:-1]), LZ4_W2, len(data))  # truncated
    with pytest.raises(CodecError):
        decode(bytes(frame), 9, len(data))  # a codec id not known


def test_codec_names():
    assert check_codec(None) is None and check_codec("none") is None and check_codec("lz4") == "lz4"
    with pytest.raises(InvalidRequest):
        check_codec("zstd")
