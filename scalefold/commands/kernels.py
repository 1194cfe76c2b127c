"""``scalefold tune-kernels`` and ``scalefold aot-check``: argument parsing; the work is in
:mod:`scalefold.kerneltools` (``tune``; ``sites`` and ``compile_report``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from scalefold.errors import UserError
from scalefold.kerneltools import tune as tuning
from scalefold.kerneltools.targets import ARCHS, DTYPE_NAMES, KERNELS

#: exit status when the installed Triton or its CUDA tools cannot compile for GPUs (not the user's input)
EXIT_NO_TOOLCHAIN = 2


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    _add_tune_parser(subparsers)
    _add_aot_parser(subparsers)


def _add_tune_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune-kernels",
        help="time the Triton kernels' launch configs on this GPU at the MLPerf shapes and write the launch-config table",
        description="Time every candidate launch config of the Triton kernels at the MLPerf call sites on the GPU "
        "this runs on, and write the fastest per (architecture, kernel, dtype, shape class) to a launch-config "
        "table (merged with the other architectures of an existing one). Runs then use the table without "
        "autotuning. See scalefold/kerneltools/tune.py.",
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
    from scalefold.errors import require_writable_output
    from scalefold.kerneltools import sites

    if args.untimed_defaults:
        sites.compile_mode()  # compiled for real GPUs, not interpreted (before the kernels are imported)
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
    sites.kernel_modules()  # the kernels compiled for real, not interpreted (before the model is imported)
    unknown = sorted(set(args.site or ()) - set(sites.all_sites()))
    if unknown:
        raise UserError(f"--site {', '.join(unknown)}: unknown; the MLPerf call sites are {', '.join(sites.all_sites())}")
    if args.untimed_defaults:
        table = tuning.untimed_defaults(base, args.arch, args.dtype or tuning.UNTIMED_DTYPES, args.jobs)
    else:
        table = tuning.tune(base, args.dtype or ("bf16",), args.site, args.max_seconds)
    from scalefold.kernels import launch_table

    launch_table.write(table, out)
    tuning._say(f"wrote {out}")
    return 0


def _add_aot_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "aot-check",
        help="compile every Triton kernel for H100 / A100 without a GPU and report registers, shared memory, spills",
        description="Compile every ScaleFold Triton kernel (every autotune candidate, MLPerf shapes) for real "
        "GPUs without one, and report registers, shared memory and spills per compile. "
        "See scalefold/kerneltools/compile_report.py.",
    )  # fmt: skip
    p.add_argument("--arch", action="append", choices=sorted(ARCHS), help="target (repeatable; default both)")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPE_NAMES), help="data type (repeatable; default all)")
    p.add_argument("--kernel", action="append", choices=KERNELS, help="kernel (repeatable; default all)")
    p.add_argument("--site", action="append", help="only this MLPerf call site, e.g. msa_row (repeatable; default all)")
    p.add_argument("--default-only", action="store_true", help="only the configs used without autotuning")
    p.add_argument("--json", action="store_true", help="JSON lines, one record per compile, instead of the table")
    p.add_argument("--markdown", action="store_true", help="a summary per kernel x dtype x arch (bench/RESULTS.md)")
    p.add_argument(
        "--from-json", metavar="FILE", help="summarise the records of an earlier --json run; compile nothing"
    )
    p.add_argument(
        "--table", nargs="?", const="", metavar="FILE",
        help="compile the entries of a launch-config table instead of the candidates, and check it holds an entry "
        "for every key the MLPerf sites launch and no other (default FILE: the table in use, "
        "scalefold/kernels/launch_configs.json or $SCALEFOLD_LAUNCH_CONFIGS); --arch/--dtype/--site narrow it",
    )  # fmt: skip
    p.add_argument("--no-compile", action="store_true",
                   help="with --table: only check that it holds the keys the MLPerf sites launch (seconds)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="parallel compile processes (default 1)")
    p.add_argument("--cache-dir", help="Triton cache directory (default: a fresh temporary one, so all compiles run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(handler=_run_aot_check)


def _run_aot_check(args: argparse.Namespace) -> int:
    from scalefold.kerneltools import sites

    sites.compile_mode()  # before the kernels (and Triton) are imported
    from scalefold.kerneltools import compile_report as report

    # Triton 3.9 warns once that fp fusion defaults to on; the compile keeps the runtime's default
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    if args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: expected a positive number")
    if args.from_json:
        return _summarise_json(args)
    problem = report.triton_problem()
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_NO_TOOLCHAIN
    if args.no_compile and args.table is None:
        raise UserError("--no-compile applies to --table")
    table = _read_table(args) if args.table is not None else None
    sites.kernel_modules()  # before the model (and through it the kernels) is imported
    known = sites.all_sites(args.kernel or KERNELS)
    unknown = sorted(set(args.site or ()) - set(known))
    if unknown:
        raise UserError(f"--site {', '.join(unknown)}: unknown; the sites of these kernels are {', '.join(known)}")
    missing = [tool for tool in ("ptxas", "cuobjdump") if not Path(report.tool_path(tool)).exists()]
    if missing:
        print(f"Triton's CUDA tools not found ({', '.join(missing)}): cannot compile for GPUs", file=sys.stderr)
        return EXIT_NO_TOOLCHAIN
    with contextlib.ExitStack() as stack:
        if args.cache_dir:
            os.environ["TRITON_CACHE_DIR"] = args.cache_dir
        else:
            os.environ["TRITON_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="scalefold-aot-"))
        start = time.perf_counter()
        if table is not None:
            records, bad = report.check_table(table, args.arch, args.dtype, args.site, args.jobs, not args.no_progress,
                                              compile_=not args.no_compile)  # fmt: skip
        else:
            records = report.run(
                archs=args.arch or tuple(ARCHS),
                dtypes=args.dtype or DTYPE_NAMES,
                kernels=args.kernel or KERNELS,
                default_only=args.default_only,
                sites=args.site,
                jobs=args.jobs,
                progress=not args.no_progress,
            )
            bad = report.problems(records)
        elapsed = time.perf_counter() - start
    report.emit(records, args.json, args.markdown)
    summary = f"{len(records)} compiles in {elapsed:.0f} s, {len(bad)} problem(s)"
    print(summary + "".join(f"\n  {b}" for b in bad), file=sys.stderr)
    return 1 if bad else 0


def _summarise_json(args: argparse.Namespace) -> int:
    """``--from-json``: the records of an earlier run, summarised; nothing compiled."""
    from scalefold.kerneltools import compile_report as report

    try:
        records = report.load_records(args.from_json)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"--from-json {args.from_json}: not a file of --json records ({exc})") from exc
    report.emit(records, args.json, args.markdown)
    bad = report.problems(records)
    print(f"{len(records)} records, {len(bad)} problem(s)" + "".join(f"\n  {b}" for b in bad), file=sys.stderr)
    return 1 if bad else 0


def _read_table(args: argparse.Namespace):
    """``--table``'s launch-config table; :class:`UserError` if it cannot be read."""
    from scalefold.kernels import launch_table

    path = args.table or launch_table.table_path()
    if args.kernel or args.default_only:
        raise UserError("--table checks every kernel's entries: --kernel and --default-only do not apply")
    try:
        return launch_table.read(path)
    except (OSError, launch_table.TableError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"--table {path}: not a readable launch-config table ({reason})") from exc
