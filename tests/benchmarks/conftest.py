"""The `run_benchmark` fixture (bench_run.runner). This folder has no __init__.py on purpose: as a
package it would be named `benchmarks` and hide the real one from every test."""
from __future__ import annotations

import pytest

from bench_run import runner


@pytest.fixture
def run_benchmark(tmp_path):
    return runner(tmp_path)
