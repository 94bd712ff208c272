"""A test skipped for a dependency the test install provides fails the run, with every skip's
reason listed; a skip for what no install provides (a GPU) stays a skip."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(body)
    # The checkout (kvstore_testing), the suite's conftest and its helpers, as pyproject's pythonpath gives them.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "helpers")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_a_skip_for_a_missing_test_dependency_fails_the_run(tmp_path):
    """Kills: a suite that goes quiet (green, with the vLLM, etcd or Ray tests skipped) when the
    test install is broken."""
    done = run(tmp_path, "import pytest\n"
                         "pytest.importorskip('no_such_module_anywhere', reason='the vllm extra is part of the test "
                         "install')\n"
                         "def test_x():\n    pass\n")
    assert done.returncode == 1, done.stdout
    assert "skipped, and why" in done.stdout and "the install is broken" in done.stdout


def test_a_skip_for_missing_hardware_stays_a_skip(tmp_path):
    done = run(tmp_path, "import pytest\n"
                         "def test_x():\n    pytest.skip('no CUDA device on this machine')\n")
    assert done.returncode == 0, done.stdout
    assert "no CUDA device" in done.stdout
