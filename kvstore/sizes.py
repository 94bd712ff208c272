"""Sizes as people write them: '2GiB', '512 MB', '4096' (bytes). The command line, the serve
config file and library mode all read sizes through parse_size."""
from __future__ import annotations

import re

from .errors import InvalidConfig

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(value: int | str) -> int:
    """'2GiB', '512 MB', '4096' or an int -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidConfig(f"not a size: {value!r} (try '512MiB' or '2GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
