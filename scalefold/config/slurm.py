"""``python -m scalefold.config.slurm slurm-flags``: a Slurm submission's ``config_*.sh`` variables as
``scalefold train`` arguments (what ``launch/run_and_time.sh`` passes), from the options' one declaration.

Torch-free (``python -S`` works): the launch script runs it before any environment is set up.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from scalefold.config.options import slurm_config_env, slurm_flags
from scalefold.config.training import TrainConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scalefold.config.slurm",
        description="Training options derived from their one declaration (scalefold.config.training.TrainConfig).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("slurm-flags", help="print the `scalefold train` arguments for this environment's config_*.sh "
                   "variables, one a line (what launch/run_and_time.sh passes)")  # fmt: skip
    sub.add_parser("slurm-vars", help="print the config_*.sh variables and the option each sets")
    args = parser.parse_args(argv)
    if args.command == "slurm-vars":
        for var, name in slurm_config_env(TrainConfig).items():
            print(f"{var}\t{name}")
        return 0
    try:
        flags = slurm_flags(os.environ, TrainConfig)
    except ValueError as exc:
        print(f"scalefold: {exc}", file=sys.stderr)
        return 3
    for arg in flags:
        print(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())


