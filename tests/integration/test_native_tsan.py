"""The native data plane under ThreadSanitizer: tests/native/tsan_driver.cpp (two engines on real
loopback TCP, plaintext and AES-GCM streams, concurrent submitters, connections served while the
engine closes) must run with no race reported. The Python interpreter here cannot load libtsan,
hence a native driver."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_native_engine_is_clean_under_thread_sanitizer(tmp_path):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    binary = tmp_path / "tsan_driver"
    # The data plane only: files that bind to Python (module.cpp, index_probe.cpp) need pybind11.
    sources = [str(p) for p in sorted((ROOT / "cpp").glob("*.cpp")) if "pybind11" not in p.read_text()]
    build = subprocess.run(["c++", "-O1", "-g", "-fsanitize=thread", "-std=c++17", "-pthread", f"-I{ROOT / 'cpp'}",
                            str(ROOT / "tests" / "native" / "tsan_driver.cpp"), *sources, "-lcrypto", "-o", str(binary)],
                           capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "tsan" in build.stderr.lower():
        pytest.skip(f"ThreadSanitizer unavailable: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300,
                         env={"TSAN_OPTIONS": "halt_on_error=0 exitcode=66"})
    assert "WARNING: ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "0 failures" in run.stdout
