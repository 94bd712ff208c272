"""A second preimage for the block checksum kvstore used before BLAKE3 (xxh3-64 seeded with the
first 8 bytes of the block's hash, little-endian): other bytes of the same length whose old checksum
is the victim's. Tests hand these to today's put and get paths and expect them refused.

How: for inputs over 240 bytes, xxh3 adds each 64-byte stripe into eight 64-bit accumulators, lane
i of a stripe adding its word d to accumulator i^1 and lo32(x) * hi32(x) (x = d ^ the secret's word)
to accumulator i; nothing mixes them until the block of 16 stripes ends. With x's low or high half
zero the product is zero, and d's other half is free. So four words (lanes 6 and 7 of stripes 0 and
1) are rewritten: both of a lane's words with a zero product, their sum (a free low half in one, a
free high half in the other reaches any sum) set to put back what the old words added to the
neighbouring accumulator, products included. Every accumulator ends as before, hence the checksum.
The seed's secret comes from python-xxhash's own library (XXH3_generateSecret_fromSeed, xxhash.h's
documented call), so nothing here restates xxh3's constants.
"""
from __future__ import annotations

import ctypes
import struct

import xxhash

M64, M32 = (1 << 64) - 1, (1 << 32) - 1
SECRET_BYTES = 192  # XXH3_SECRET_DEFAULT_SIZE: the size of the secret a seed derives


def old_seed(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little")


def old_checksum(block_hash: bytes, data: bytes) -> int:
    """The checksum kvstore sealed blocks with before BLAKE3."""
    return xxhash.xxh3_64_intdigest(data, seed=old_seed(block_hash))


def _secret(seed: int) -> bytes:
    from xxhash import _xxhash

    lib = ctypes.CDLL(_xxhash.__file__)
    derive = lib.XXH3_generateSecret_fromSeed
    derive.argtypes, derive.restype = [ctypes.c_void_p, ctypes.c_uint64], None
    buffer = ctypes.create_string_buffer(SECRET_BYTES)
    derive(buffer, seed)
    return buffer.raw


def _pair(total: int, key_low_free: int, key_high_free: int) -> tuple[int, int]:
    """Two words, each with a zero product under its key, that add up to `total` (mod 2^64): the
    first keeps its key's high half (x = low only), the second its key's low half (x = high only)."""
    low = ((total & M32) - (key_high_free & M32)) & M32  # first word's low half
    carry = (low + (key_high_free & M32)) >> 32
    high = ((total >> 32) - (key_low_free >> 32) - carry) & M32  # second word's high half
    first = (key_low_free & ~M32) | low
    second = (high << 32) | (key_high_free & M32)
    return first, second


def forge(block_hash: bytes, data: bytes) -> bytes:
    """Bytes unlike `data`, of its length, with the same old checksum under `block_hash`."""
    if len(data) <= 240:
        raise ValueError("forge() handles xxh3's long inputs (over 240 bytes)")
    secret = _secret(old_seed(block_hash))
    word = lambda buf, at: struct.unpack_from("<Q", buf, at)[0]  # noqa: E731
    product = lambda x: (x & M32) * (x >> 32)  # noqa: E731
    # (stripe, lane) -> (offset in the data, the secret word it meets): stripe s uses secret + 8s.
    spots = {(s, lane): (64 * s + 8 * lane, word(secret, 8 * s + 8 * lane)) for s in (0, 1) for lane in (6, 7)}
    old = {k: word(data, at) for k, (at, _) in spots.items()}
    products = {k: product(old[k] ^ key) for k, (_, key) in spots.items()}
    # Lane 6's words go to accumulator 7, which also loses lane 7's products (now zero), and back.
    want6 = (old[0, 6] + old[1, 6] + products[0, 7] + products[1, 7]) & M64
    want7 = (old[0, 7] + old[1, 7] + products[0, 6] + products[1, 6]) & M64
    out = bytearray(data)
    for lane, want in ((6, want6), (7, want7)):
        (at0, key0), (at1, key1) = spots[0, lane], spots[1, lane]
        first, second = _pair(want, key0, key1)
        struct.pack_into("<Q", out, at0, first)
        struct.pack_into("<Q", out, at1, second)
    forged = bytes(out)
    if forged == data or old_checksum(block_hash, forged) != old_checksum(block_hash, data):
        raise AssertionError("the forgery did not hold: xxh3's long-input layout is not what forge() assumes")
    return forged
