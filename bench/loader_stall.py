"""Loader-stall benchmark: priority-queue loader vs in-order loader (ScaleFold Fig. 4 workload).

Same as ``scalefold bench loader``; run ``python bench/loader_stall.py --json --plot stall.png``.
The implementation lives in :mod:`scalefold.data.bench_cli` so the installed CLI has it too.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scalefold.data.bench_cli import add_bench_loader_parser  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="loader_stall")
    sub = parser.add_subparsers(dest="bench_command")
    add_bench_loader_parser(sub)
    args = parser.parse_args(["loader", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
