"""Small helpers shared by tests."""
from __future__ import annotations

import hashlib

import numpy as np


def sha(data: bytes | memoryview | np.ndarray) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()
