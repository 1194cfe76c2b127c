"""The ``scalefold`` command: one entry point, one subcommand per job.

Each subcommand lives with the code it drives; this module only assembles the parser, so
``scalefold --help`` stays cheap (heavy imports happen inside the handlers).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from scalefold import __version__

# (module, function) pairs that add subcommands to the parser. A module that fails to import
# (e.g. an optional dependency missing) is reported when its subcommand would be registered.
_SUBCOMMAND_PROVIDERS: tuple[tuple[str, str], ...] = (
    ("scalefold.train.cli", "add_parsers"),
    ("scalefold.data.cli", "add_parsers"),
    ("scalefold.model.cli", "add_parsers"),
    ("scalefold.inference.cli", "add_parsers"),
    ("scalefold.perf.cli", "add_parsers"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalefold",
        description="ScaleFold: AlphaFold2 training for HPC clusters (MLPerf HPC OpenFold).",
    )
    parser.add_argument("--version", action="version", version=f"scalefold {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, func_name in _SUBCOMMAND_PROVIDERS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # that part of the application is not present in this build
            raise
        add: Callable[[argparse._SubParsersAction], None] = getattr(module, func_name)
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0 if args.command is None else 2
    result = handler(args)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
