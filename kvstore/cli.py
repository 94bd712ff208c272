"""`kvstore` command line: composes the transfer engine, store and conductor for people."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description="KV-cache store and transfer engine")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the quick-start demo on the embedded default")
    demo.add_argument("what", nargs="?", default="transfer", choices=["transfer"])
    bench = commands.add_parser("bench", help="run a benchmark (same as python -m benchmarks.NAME)")
    bench.add_argument("what", choices=["transfer"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from transfer.demo import run

        return run()
    if args.command == "bench":
        from benchmarks.transfer import main as bench_main

        return bench_main(args.rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
