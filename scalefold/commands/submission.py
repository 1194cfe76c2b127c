"""``scalefold submission pack`` and ``scalefold submission check``: an MLPerf HPC submission folder from
finished runs, and its verdict and score by the official ``mlperf-logging`` tools; the work is in
:mod:`scalefold.submission`."""

from __future__ import annotations

import argparse
import json
import sys


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submission",
        help="an MLPerf HPC submission: pack finished runs into the official layout, check it with the official tools",
        description="The MLPerf HPC v3.0 submission of the OpenFold benchmark: `pack` builds "
        "<out>/<submitter>/{results,systems,benchmarks} from finished run directories, `check` runs the "
        "installed mlperf-logging's package checker and result summarizer on it.",
    )  # fmt: skip
    sub = p.add_subparsers(dest="submission_command", metavar="COMMAND")
    pk = sub.add_parser(
        "pack",
        help="the submission folder from finished run directories",
        description="Every run's MLPerf log as results/<system>/<scaling>/openfold/result_<i>.txt (runs in "
        "natural order of their paths: run_x_2 before run_x_10), the system description systems/<system>.json "
        "(filled from what the runs recorded; --system-json wins field by field; what only the submitter knows "
        "is named), the code reference benchmarks/openfold/implementations/scalefold/. Checked before anything "
        "is written.",
    )  # fmt: skip
    pk.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run directories (or their MLPerf logs)")
    pk.add_argument("--out", required=True, help="folder that receives <submitter>/ (the results repository's layout)")
    pk.add_argument("--submitter", required=True, help="the submitting organisation (a folder name)")
    pk.add_argument("--system", required=True, help="the system's name (folder and systems/<name>.json)")
    pk.add_argument("--system-json", help="a system description whose fields win over the detected ones")
    pk.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                    help="strong: time to train, exactly 10 runs; weak: concurrent instances, at least 10")  # fmt: skip
    pk.add_argument("--division", choices=("closed", "open"), default="closed")
    pk.add_argument("--force", action="store_true", help="replace a submission already in --out for this system")
    pk.set_defaults(handler=_run_pack)
    ck = sub.add_parser(
        "check",
        help="the official package checker and result summarizer (HPC 3.0.0) on a submitter's folder",
        description="Runs `python -m mlperf_logging.package_checker DIR hpc 3.0.0`, then `python -m "
        "mlperf_logging.result_summarizer DIR hpc 3.0.0` on a copy of DIR and prints, per system and "
        "benchmark, the verdict, each run's time to train, the RCP verdict and normalisation, and the score "
        "as the summarizer computes it. Exit status 0: the package checker found no errors; 1: it did.",
    )  # fmt: skip
    ck.add_argument("folder", metavar="DIR", help="a submitter's folder (holding results/ and systems/)")
    ck.add_argument("--json", action="store_true", help="one JSON list of objects, one per system and benchmark")
    ck.set_defaults(handler=_run_check)
    p.set_defaults(handler=lambda args: p.print_help() or 2)


def _run_pack(args: argparse.Namespace) -> int:
    from scalefold.submission.pack import pack

    plan = pack(args.runs, args.out, args.submitter, args.system, scaling=args.scaling, division=args.division,
                system_json=args.system_json, force=args.force)  # fmt: skip
    for index, run in enumerate(plan.runs):
        print(f"result_{index}.txt <- {run.log} (seed {run.seed})")
    for warning in plan.warnings:
        print(f"scalefold submission pack: warning: {warning}", file=sys.stderr)
    for name in plan.missing_fields:
        print(f"scalefold submission pack: {plan.system_file.name}: {name} is empty: only the submitter knows "
              "it (give it in --system-json)", file=sys.stderr)  # fmt: skip
    print(f"wrote {plan.result_dir}, {plan.system_file}, {plan.code_dir}")
    print(f"next: scalefold submission check {plan.root}")
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from scalefold.submission.check import check_submission, format_report

    report = check_submission(args.folder)
    if args.json:
        print(json.dumps([check.to_json() for check in report.checks], indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1
