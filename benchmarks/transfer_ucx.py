"""`python -m benchmarks.transfer_ucx`: the ucx records of `benchmarks.transfer` alone (our engine
over UCX vs raw UCX and ucx_perftest; the code is in benchmarks.ucx_records). Any transfer argument
but --systems passes through:

    python -m benchmarks.transfer_ucx [--json PATH] [--quick] [--ucx-tls sm|tcp ...]
"""
from __future__ import annotations

import sys

from benchmarks import transfer
from kvstore_testing import processes


def main(argv: list[str] | None = None) -> int:
    """These records alone: `benchmarks.transfer --systems ucx` (other transfer arguments pass through)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--systems" or a.startswith("--systems=") for a in argv):
        print("python -m benchmarks.transfer_ucx: error: --systems is ucx here (use benchmarks.transfer for others)",
              file=sys.stderr)
        return 2
    return transfer.main(["--systems", "ucx", *argv])


if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.transfer_ucx"))
