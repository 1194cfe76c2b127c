"""Loader-stall benchmark: priority-queue loader vs in-order loader (ScaleFold Fig. 4 workload).

Same as ``scalefold bench loader``; run ``python bench/loader_stall.py --json --plot stall.png``.
The implementation lives in :mod:`scalefold.perf.loader_bench` (its flags: :mod:`scalefold.commands.bench`), so the installed CLI has it too: a
seeded heavy-tailed workload (log-normal spread, ~10 % of samples 10x slower) that both loaders
build identically, warm-up steps excluded, repeats pooled, out-of-order deliveries counted.
Measured numbers and the exact commands: ``bench/RESULTS.md``.
``--with-dali`` also runs the DALI backend of ``bench/dali_loader.py`` (needs nvidia-dali), the
measurement behind leaving DALI out of ScaleFold.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scalefold.commands.bench import add_bench_loader_parser  # noqa: E402


def _dali_factory(sample_fn, pairs, **kwargs):
    sys.path.append(str(Path(__file__).resolve().parent))
    from dali_loader import DaliLoader

    return DaliLoader(sample_fn, pairs, **kwargs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="loader_stall")
    sub = parser.add_subparsers(dest="bench_command")
    loader_parser = add_bench_loader_parser(sub)
    loader_parser.add_argument(
        "--with-dali", action="store_true", help="also run the DALI backend of bench/dali_loader.py (needs nvidia-dali)"
    )
    args = parser.parse_args(["loader", *(sys.argv[1:] if argv is None else argv)])
    args.extra_loaders = {"dali": _dali_factory} if args.with_dali else None
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
