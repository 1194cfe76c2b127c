"""``scalefold tune-kernels``: argument parsing; the work is in :mod:`scalefold.kernels.tune`."""

from __future__ import annotations

import argparse

from scalefold.kernels import tune as tuning


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune-kernels",
        help="time the Triton kernels' launch configs on this GPU at the MLPerf shapes and write the launch-config table",
        description="Time every candidate launch config of the Triton kernels at the MLPerf call sites on the GPU "
        "this runs on, and write the fastest per (architecture, kernel, dtype, shape class) to a launch-config "
        "table (merged with the other architectures of an existing one). Runs then use the table without "
        "autotuning. See scalefold/kernels/tune.py.",
    )  # fmt: skip
    p.add_argument("--out", required=True, metavar="TABLE", help="the table to write (merged if it exists)")
    p.add_argument("--max-seconds", type=float, default=tuning.DEFAULT_MAX_SECONDS,
                   help=f"time budget of the whole command (default {tuning.DEFAULT_MAX_SECONDS:.0f})")  # fmt: skip
    p.add_argument("--dtype", action="append", choices=tuning.TUNE_DTYPES,
                   help="dtype to tune (repeatable; default bf16, the MLPerf precision; "
                   "with --untimed-defaults: all three)")  # fmt: skip
    p.add_argument("--site", action="append", help="only this MLPerf call site, e.g. msa_row (repeatable; default all)")
    p.add_argument(
        "--untimed-defaults",
        action="store_true",
        help="no GPU needed: write each kernel's default config, compiled ahead of time without spills",
    )
    p.add_argument("--arch", action="append", choices=("sm_80", "sm_90"), help="with --untimed-defaults (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="with --untimed-defaults: parallel compile processes")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from scalefold.errors import UserError, require_writable_output
    from scalefold.kernels import aot

    out = require_writable_output(args.out, "--out", (".json",))
    if not args.max_seconds > 0:
        raise UserError(f"--max-seconds {args.max_seconds}: expected a positive number of seconds")
    if args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: expected a positive number")
    if args.arch and not args.untimed_defaults:
        raise UserError("--arch applies to --untimed-defaults; on a GPU the table is tuned for the GPU's architecture")
    if args.site and args.untimed_defaults:
        raise UserError("--site applies to timing on a GPU; --untimed-defaults writes every MLPerf key")
    if not args.untimed_defaults:
        tuning.require_gpu()
    base = tuning.base_table(out)
    aot._kernel_modules()  # the kernels compiled for real, not interpreted (before the model is imported)
    unknown = sorted(set(args.site or ()) - set(aot.all_sites()))
    if unknown:
        raise UserError(f"--site {', '.join(unknown)}: unknown; the MLPerf call sites are {', '.join(aot.all_sites())}")
    if args.untimed_defaults:
        table = tuning.untimed_defaults(base, args.arch, args.dtype or tuning.UNTIMED_DTYPES, args.jobs)
    else:
        table = tuning.tune(base, args.dtype or ("bf16",), args.site, args.max_seconds)
    from scalefold.kernels import launch_table

    launch_table.write(table, out)
    tuning._say(f"wrote {out}")
    return 0
