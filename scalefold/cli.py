"""The ``scalefold`` command: one entry point, one subcommand per job.

Each subcommand lives with the code it drives; this module only assembles the parser, so
``scalefold --help`` stays cheap (heavy imports happen inside the handlers), and runs the one
top-level error handler: a mistake in the user's input or environment (a ``UserError``, see
:mod:`scalefold.errors`) ends with ``scalefold COMMAND: error: <message>`` on stderr and exit status 3, without a traceback
unless ``--debug`` (anywhere on the command line) or ``SCALEFOLD_DEBUG=1``; argparse's usage errors
keep status 2; anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from scalefold import __version__
from scalefold.errors import EXIT_USER_ERROR, UserError, user_error_message

DEBUG_FLAG = "--debug"
DEBUG_ENV = "SCALEFOLD_DEBUG"

# (module, function) pairs that add subcommands to the parser. A module that fails to import
# (e.g. an optional dependency missing) is reported when its subcommand would be registered.
_SUBCOMMAND_PROVIDERS: tuple[tuple[str, str], ...] = (
    ("scalefold.commands.train", "add_parsers"),
    ("scalefold.commands.data", "add_parsers"),
    ("scalefold.commands.model_info", "add_parsers"),
    ("scalefold.commands.inference", "add_parsers"),
    ("scalefold.commands.perf", "add_parsers"),
    ("scalefold.commands.plan", "add_parsers"),
    ("scalefold.commands.checkpoint", "add_parsers"),
    ("scalefold.commands.import_weights", "add_parsers"),
    ("scalefold.commands.kernels", "add_parsers"),
    ("scalefold.commands.slurm", "add_parsers"),
    ("scalefold.commands.versions", "add_parsers"),
    ("scalefold.commands.submission", "add_parsers"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalefold",
        description="ScaleFold: AlphaFold2 training for HPC clusters (MLPerf HPC OpenFold).",
    )
    parser.add_argument("--version", action="version", version=f"scalefold {__version__}")
    parser.add_argument(
        DEBUG_FLAG, action="store_true",
        help=f"show the Python traceback of an input error (also {DEBUG_ENV}=1; accepted after the subcommand too)",
    )  # fmt: skip
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
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Every (sub-)subcommand's parser records its name for messages (``bench step``): the innermost
    parser's default wins."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(command_name=sub.prog.removeprefix(parser.prog.split()[0]).strip())
                _name_commands(sub)


def _split_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (before a ``--``), and whether it was there."""
    args, debug = list(argv), False
    end = args.index("--") if "--" in args else len(args)
    while DEBUG_FLAG in args[:end]:
        args.remove(DEBUG_FLAG)
        end -= 1
        debug = True
    return args, debug


def main(argv: Sequence[str] | None = None) -> int:
    argv, debug = _split_debug(sys.argv[1:] if argv is None else argv)
    debug = debug or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0 if args.command is None else 2
    args.debug = debug  # a handler that reports a fault in one line shows the traceback too with --debug
    try:
        result = handler(args)
    except BrokenPipeError:  # the reader of our output went away (`scalefold model-info --names | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0
    except (UserError, OSError) as exc:
        message = user_error_message(exc)
        if message is None:
            raise  # an OSError naming no file: a bug, the traceback is the report
        if debug:
            traceback.print_exc()
        _print_user_error(getattr(args, "command_name", args.command), exc, message)
        return EXIT_USER_ERROR
    return int(result or 0)


def _print_user_error(command: str, exc: BaseException, message: str) -> None:
    """``scalefold COMMAND: <label>: <message>`` (and the error's hint on a line of its own) on stderr."""
    label = getattr(exc, "label", UserError.label)
    print(f"scalefold {command}: {label + ': ' if label else ''}{message}", file=sys.stderr, flush=True)
    hint = getattr(exc, "hint", None)
    if hint:
        print(f"scalefold {command}: {hint}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
