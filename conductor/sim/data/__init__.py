"""Inputs that ship with the simulator, by name: `--trace mooncake-conversation` and
`--scenario textbook` work from any directory (README.md here says where they come from)."""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = {"mooncake-conversation": os.path.join(HERE, "mooncake_conversation_trace.jsonl.xz"),
          "mooncake-synthetic": os.path.join(HERE, "mooncake_synthetic_trace.jsonl.xz")}
SCENARIOS = {"textbook": os.path.join(HERE, "textbook.json")}


def resolve(name_or_path: str, known: dict[str, str]) -> str:
    """A built-in input's file for its name; anything else is a path, returned as given."""
    return known.get(name_or_path, name_or_path)
