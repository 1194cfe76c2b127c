"""Each training option is declared once (``TrainConfig`` + ``option`` metadata); the flags, the
``SCALEFOLD_*`` overrides, the Slurm variable map and ``run_and_time.sh``'s flags derive from it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scalefold.config.options import add_arguments, flag_of, overrides_from_args, slurm_flags
from scalefold.config.training import SLURM_CONFIG_ENV, TrainConfig

REPO = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    return parser


def test_every_declared_flag_reaches_its_option():
    """A value given with each generated flag arrives as that option's override, typed."""
    cli = [f for f in dataclasses.fields(TrainConfig) if f.metadata["cli"]]
    assert {flag_of(f) for f in cli} >= {"--dap", "--bp", "--max-steps", "--no-progress", "--init-from", "--preset"}
    args = _parser().parse_args(["--dap", "2", "--lr", "0.5", "--no-progress", "--resume", "--init-from", "x.pt"])
    overrides = overrides_from_args(args, TrainConfig)
    assert set(overrides) == {f.name for f in cli}
    assert overrides["dap"] == 2 and overrides["lr"] == 0.5 and overrides["init_from"] == "x.pt"
    assert overrides["progress"] is False and overrides["resume"] is True and overrides["seed"] is None
    with pytest.raises(SystemExit):
        _parser().parse_args(["--bp", "3"])  # declared choices


def test_environment_and_slurm_variables_follow_the_declaration():
    env = {"DGXSYSTEM": "x", "DAP_SIZE": "4", "PARALLEL_EVOFORMER": "1", "SUBMISSION_ORG": "Acme",
           "SCALEFOLD_MAX_STEPS": "7", "SCALEFOLD_CROP_SIZE": "none", "INIT_CHECKPOINT": ""}  # fmt: skip
    cfg = TrainConfig.from_preset("tiny", env=env)
    assert (cfg.dap, cfg.parallel_evoformer, cfg.submission_org, cfg.max_steps) == (4, True, "Acme", 7)
    assert cfg.crop_size is None and cfg.init_from is None  # empty Slurm values are ignored
    assert {v: n for v, n in SLURM_CONFIG_ENV.items() if n in ("dap", "bp", "init_from")} == {
        "DAP_SIZE": "dap", "BP_SIZE": "bp", "INIT_CHECKPOINT": "init_from"}  # fmt: skip
    with pytest.raises(ValueError, match="DAP_SIZE='two'"):
        TrainConfig.from_preset("tiny", env={"DGXSYSTEM": "x", "DAP_SIZE": "two"})


def test_slurm_flags_pass_what_the_config_sets():
    """Set values become flags; layout options only when they differ from the default; switches when true;
    options without a flag (SUBMISSION_ORG) stay with the environment."""
    env = {"PRECISION": "bf16", "MAX_STEPS": "1200", "DAP_SIZE": "1", "BP_SIZE": "2", "NUM_ASYNC_VAL_RANKS": "0",
           "PARALLEL_EVOFORMER": "0", "INIT_CHECKPOINT": "", "SUBMISSION_ORG": "Acme", "PRESET": "tiny"}  # fmt: skip
    flags = slurm_flags(env, TrainConfig)
    assert flags == ["--precision", "bf16", "--max-steps", "1200", "--bp", "2"]
    assert _parser().parse_args(flags).bp == 2  # what it prints, the real parser accepts
    assert slurm_flags({"PARALLEL_EVOFORMER": "1", "DAP_SIZE": "8"}, TrainConfig) == ["--dap", "8", "--parallel-evoformer"]
    with pytest.raises(ValueError, match="MAX_STEPS"):
        slurm_flags({"MAX_STEPS": "many"}, TrainConfig)


def test_slurm_flags_command_needs_only_the_standard_library():
    """run_and_time.sh runs the module with the node's python3: no site-packages (``-S``: no torch) needed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCALEFOLD_")}
    env.update(PYTHONPATH=str(REPO), DAP_SIZE="2", VAL_EVERY="40")
    proc = subprocess.run([sys.executable, "-S", "-m", "scalefold", "slurm-flags"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["--eval-every", "40", "--dap", "2"]
    bad = subprocess.run([sys.executable, "-S", "-m", "scalefold", "slurm-flags"],
                         env={**env, "SEED": "x"}, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert bad.returncode == 3 and "SEED='x'" in bad.stderr and "Traceback" not in bad.stderr
