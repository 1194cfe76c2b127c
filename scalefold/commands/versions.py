"""``scalefold check-versions``: the installed torch, Triton and numpy against the tested range; the work is
:func:`scalefold.tested_versions.main`. Standard library only: the Dockerfile runs it on its base image
before anything is installed (``python -m scalefold check-versions`` from the source tree)."""

from __future__ import annotations

import argparse


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check-versions",
        help="print the installed torch, Triton and numpy; exit 1 when torch or Triton is outside the tested range",
        description="The torch and Triton releases ScaleFold is tested with (scalefold/tested_versions.py) against "
        "this environment's.",
    )
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from scalefold.tested_versions import main

    return main()
