import sys

from kvstore_testing import processes

from . import main

if __name__ == "__main__":
    sys.exit(processes.run_main(main, prog="python -m benchmarks.wrong_kv"))
