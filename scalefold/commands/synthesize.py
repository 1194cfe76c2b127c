"""``scalefold synth``: write the built-in synthetic dataset (see :mod:`scalefold.data.synthetic`)."""

from __future__ import annotations

import argparse
import json
import time


def _check_synth_args(args: argparse.Namespace) -> None:
    from scalefold.errors import require_range, require_writable_output

    require_range(args.num_chains, "--num-chains", 1)
    require_range(args.num_families, "--num-families", 1, args.num_chains)
    require_range(args.min_length, "--min-length", 16)
    require_range(args.max_length, "--max-length", args.min_length)
    require_range(args.max_template_hits, "--max-template-hits", 0)
    require_range(args.workers, "--workers", 1)
    require_writable_output(args.out, "--out")


def _cmd_synth(args: argparse.Namespace) -> int:
    from scalefold.data.synthetic import SynthConfig, synthesize

    _check_synth_args(args)
    start = time.perf_counter()
    summary = synthesize(
        args.out,
        num_chains=args.num_chains,
        num_families=args.num_families or max(1, args.num_chains // 8),
        length_range=(args.min_length, args.max_length),
        seed=args.seed,
        workers=args.workers,
        config=SynthConfig(max_template_hits=args.max_template_hits),
    )
    summary["seconds"] = round(time.perf_counter() - start, 2)
    print(
        f"wrote {summary['chains']} chains ({summary['training']} training, {summary['validation']} validation) "
        f"in {summary['families']} families, {summary['template_hits']} template hits, "
        f"to {summary['path']} in {summary['seconds']} s"
    )
    if args.json:
        print(json.dumps(summary))
    return 0


def add_synth_parser(subparsers) -> None:
    """Register ``scalefold synth --out STORE [--num-chains N] [--seed S] ...``."""
    p = subparsers.add_parser(
        "synth",
        help="generate a synthetic protein dataset store (no downloads needed)",
        description="Deterministic protein-like chains (folds, all atoms, MSAs with co-evolution) in the store format.",
    )
    p.add_argument("--out", required=True, metavar="STORE", help="store file to write (HDF5)")
    p.add_argument("--num-chains", type=int, default=320)
    p.add_argument("--num-families", type=int, default=None, help="folds (default: num-chains / 8)")
    p.add_argument("--min-length", type=int, default=40)
    p.add_argument("--max-length", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-template-hits", type=int, default=4,
        help="template hits per chain: earlier-released members of its family (0 = no templates)",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="processes (the output does not depend on it)")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    p.set_defaults(handler=_cmd_synth)


__all__ = ["add_synth_parser"]
