"""The user pages whose examples the docs test runs (README.md, docs/*.md), and their runnable
blocks: each ```sh and ```python block, unless a `<!-- not-run: reason -->` line stands right above
its fence or it is one of the README's two set-up commands (what CI itself runs)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"sh": "sh", "bash": "sh", "shell": "sh", "python": "python", "py": "python"}
SKIP_MARKERS = ("<!-- main-command -->", "<!-- test-command -->")
FENCE = re.compile(r"^(`{3,})\s*([A-Za-z0-9_+-]*)")


@dataclass
class Block:
    lang: str  # "sh" or "python"
    text: str
    line: int  # where its fence opens, 1-based


def blocks(page: Path) -> list[Block]:
    """The runnable blocks of a page, in order (see module docstring)."""
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang, start = match.group(1), match.group(2).lower(), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence)), len(lines))
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        runnable = lang in RUN and not above.startswith("<!-- not-run:") and above not in SKIP_MARKERS
        if runnable:
            found.append(Block(RUN[lang], "\n".join(lines[start + 1 : end]), start + 1))
        i = end + 1
    return found


# ETCD_PORT=2379, GATEWAY=8000, 127.0.0.1:8100 (a size such as `=4096` is taken for one too: that
# only keeps a page in the engine queue)
FIXED_PORT = re.compile(r"[=:]\d{4,5}\b|--port[ =]\d+")


def page_id(page: Path) -> str:
    """A page's name in test ids: its path in the checkout (README.md, docs/gateway.md)."""
    return page.relative_to(ROOT).as_posix()


def runs_with_engines(page: Path) -> bool:
    """Whether the page's examples must run in the suite's engine queue, one test at a time: they
    run vLLM (an engine in Python or `vllm serve`), or listen on fixed ports (etcd on 2379, a
    gateway on 8000) that another page's examples use too."""
    return any("vllm" in block.text.lower() or FIXED_PORT.search(block.text) for block in blocks(page))
