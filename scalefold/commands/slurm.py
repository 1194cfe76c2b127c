"""``scalefold slurm-flags`` and ``scalefold slurm-vars``: a Slurm submission's ``config_*.sh`` variables as
``scalefold train`` arguments (what ``launch/run_and_time.sh`` passes), from the options' one declaration
(:func:`scalefold.config.options.slurm_flags`).

Standard library only (``python -S -m scalefold slurm-flags`` works): the launch script runs it before
any environment is set up.
"""

from __future__ import annotations

import argparse
import os

from scalefold.errors import UserError


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "slurm-flags",
        help="print the `scalefold train` arguments for this environment's config_*.sh variables, one a line "
        "(what launch/run_and_time.sh passes)",
        description="Training options derived from their one declaration (scalefold.config.training.TrainConfig).",
    )  # fmt: skip
    p.set_defaults(handler=_run_slurm_flags)
    v = subparsers.add_parser("slurm-vars", help="print the config_*.sh variables and the option each sets")
    v.set_defaults(handler=_run_slurm_vars)


def _run_slurm_flags(args: argparse.Namespace) -> int:
    from scalefold.config.options import slurm_flags
    from scalefold.config.training import TrainConfig

    try:
        flags = slurm_flags(os.environ, TrainConfig)
    except ValueError as exc:  # a config variable's value the option does not accept
        raise UserError(str(exc)) from exc
    for arg in flags:
        print(arg)
    return 0


def _run_slurm_vars(args: argparse.Namespace) -> int:
    from scalefold.config.options import slurm_config_env
    from scalefold.config.training import TrainConfig

    for var, name in slurm_config_env(TrainConfig).items():
        print(f"{var}\t{name}")
    return 0
