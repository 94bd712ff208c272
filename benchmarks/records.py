"""What every benchmark writes with `--json PATH`: strict JSON, a figure that could not be measured
as null (never NaN or Infinity, which JSON does not have)."""
from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: str, document: Any) -> None:
    with open(path, "w") as f:
        json.dump(finite(document), f, indent=1, allow_nan=False)
