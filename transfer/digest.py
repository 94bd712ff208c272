"""The xxh3 that engine copies use to take digests on the way (`Engine.submit(..., digest_seeds=)`).

The native module calls the very xxh3 python-xxhash loaded (resolved from its extension, as the
ucx route resolves libucp), so a digest taken while copying equals `xxhash.xxh3_64_intdigest` of
the same bytes by construction; checked once here. Without it, copies take no digests.
"""
from __future__ import annotations

import logging

import xxhash

from . import _native

log = logging.getLogger("transfer.digest")


def _load() -> bool:
    try:
        from xxhash import _xxhash

        _native.digest_load(_xxhash.__file__)
        # xxh3 takes different code paths for 0-16, 17-240 and longer inputs: check one of each.
        probes = [bytes(i % 251 for i in range(n)) for n in (5, 200, 5000)]
        return all(_native.xxh3(p, seed) == xxhash.xxh3_64_intdigest(p, seed=seed) for p, seed in zip(probes, (7, 8, 9)))
    except (ImportError, AttributeError, RuntimeError, OSError) as exc:
        log.info("native xxh3 unavailable (%s): engine copies take no digests", exc)
        return False


AVAILABLE = _load()
