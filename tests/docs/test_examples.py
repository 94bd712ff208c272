"""Every example in README.md and docs/*.md runs as written, as a user would run it: each page's
```sh and ```python blocks in order, in one bash session (so a server started with `&` and a
variable set in one block serve the next), in an empty directory with a HOME of its own. A block
that cannot run here says why in a `<!-- not-run: reason -->` line right above its fence; the
README's two set-up commands are what CI itself runs, so they are left out here.

Each page runs under `umask 022`, as a stock shell does, and a recipe that must show an effect
(blocks handed over, a hit) checks it and fails otherwise.

Kills: an example that drifted from the code (a flag renamed, an argument that no longer exists,
a tour that stores nothing and so fails its own next line), and a recipe that exits 0 having done
nothing (a secret written world-readable, which the daemon refuses, and engines that recompute)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from doc_pages import PAGES, ROOT, blocks, page_id

PAGE_TIMEOUT_S = 600


def session(page: Path) -> str:
    """One bash script for the page: sh blocks as they are, python blocks through `python -`.
    Each block announces itself on stderr, so a failure names the block it came from."""
    # Servers a page starts with `&` are stopped when it ends (or fails), so their output pipe closes.
    # A stock shell's umask (a CI runner's or pytest's may differ): a file an example writes must be
    # made private by the example itself, as a user's would have to be.
    parts = ["set -e -o pipefail", "umask 022",
             "trap 'rc=$?; kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; exit $rc' EXIT"]
    for block in blocks(page):
        parts.append(f"echo '>>> {page.name}:{block.line}' >&2")
        if block.lang == "sh":
            parts.append(block.text)
        else:
            parts.append(f"{sys.executable} - <<'KVSTORE_DOC_EXAMPLE'\n{block.text}\nKVSTORE_DOC_EXAMPLE")
    return "\n".join(parts) + "\n"


def test_the_pages_have_examples_to_run():
    """The harness finds what it should: the README has runnable blocks beyond its two set-up
    commands, and a not-run marker really keeps a block out."""
    assert any(blocks(page) for page in PAGES)
    readme = blocks(ROOT / "README.md")
    assert readme and not any(b.text.strip().startswith("sh scripts/install") for b in readme)


# The page's own bound, not pytest's default 300 s: a page that starts etcd, a daemon, two vLLM
# engines and the gateway took 109 s alone here and passed 300 s in a fresh-venv run.
@pytest.mark.timeout(PAGE_TIMEOUT_S + 60)
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=page_id)
def test_every_example_on_the_page_runs_as_written(page: Path, tmp_path: Path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    script = tmp_path / "session.sh"
    script.write_text(session(page))
    proc = subprocess.Popen(["bash", str(script)], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = "(timed out)"
    finally:
        try:  # whatever the page started in the background goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, f"{page.name}: an example failed (the last '>>>' names it):\n{out[-6000:]}"
