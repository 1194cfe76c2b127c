"""Training configuration: presets, TOML/YAML files, config_*.sh / SCALEFOLD_* environment, CLI flags."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scalefold.config.training import SLURM_CONFIG_ENV, TrainConfig, load_config_file, preset_from_env

REPO = Path(__file__).resolve().parents[2]


def test_toml_and_yaml_files_give_the_same_config(tmp_path):
    """A flat TOML table, a ``[train]`` TOML table and a YAML mapping all override the preset."""
    flat = tmp_path / "flat.toml"
    flat.write_text('max_steps = 7\nlr = 5e-4\nprecision = "bf16"\nsynth_length_range = [20, 30]\n')
    nested = tmp_path / "nested.toml"
    nested.write_text('[train]\nmax_steps = 7\nlr = 5e-4\nprecision = "bf16"\nsynth_length_range = [20, 30]\n')
    yml = tmp_path / "run.yaml"
    yml.write_text("max_steps: 7\nlr: 5.0e-4\nprecision: bf16\nsynth_length_range: [20, 30]\n")
    cfgs = [TrainConfig.from_preset("tiny", config_file=p, env={}) for p in (flat, nested, yml)]
    assert cfgs[0] == cfgs[1] == cfgs[2]
    assert (cfgs[0].max_steps, cfgs[0].lr, cfgs[0].precision, cfgs[0].synth_length_range) == (7, 5e-4, "bf16", (20, 30))
    assert cfgs[0].eval_every == TrainConfig.from_preset("tiny", env={}).eval_every  # untouched fields keep the preset


def test_bad_config_files_are_refused_naming_the_problem(tmp_path):
    """Unknown keys, a ``preset`` key, wrong suffixes, missing files and invalid values are clear errors."""
    unknown = tmp_path / "u.toml"
    unknown.write_text("max_stepz = 3\nlr = 1.0\n")
    with pytest.raises(KeyError, match=r"u\.toml.*max_stepz"):
        load_config_file(unknown)
    preset = tmp_path / "p.yaml"
    preset.write_text("preset: mlperf\n")
    with pytest.raises(KeyError, match="preset"):
        load_config_file(preset)
    ini = tmp_path / "c.ini"
    ini.write_text("[train]\n")
    with pytest.raises(ValueError, match=r"c\.ini"):
        load_config_file(ini)
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_config_file(tmp_path / "nope.toml")
    bad = tmp_path / "b.yaml"
    bad.write_text("precision: fp8\n")
    with pytest.raises(ValueError, match="fp8"):
        TrainConfig.from_preset("tiny", config_file=bad, env={})


def test_precedence_preset_file_slurm_env_scalefold_env_flags(tmp_path):
    """preset < file < config_*.sh variables < SCALEFOLD_* variables < explicit overrides."""
    f = tmp_path / "c.toml"
    f.write_text("max_steps = 10\nseed = 10\nlr = 0.01\neval_every = 10\n")
    env = {"DGXSYSTEM": "DGXH100_1x8x1x1", "MAX_STEPS": "20", "SEED": "20", "VAL_EVERY": "20",
           "SCALEFOLD_SEED": "30", "SCALEFOLD_EVAL_EVERY": "30"}  # fmt: skip
    cfg = TrainConfig.from_preset("tiny", config_file=f, env=env, overrides={"eval_every": 40})
    assert (cfg.lr, cfg.max_steps, cfg.seed, cfg.eval_every) == (0.01, 20, 30, 40)


def test_slurm_config_variables_map_to_options():
    """Every variable run_and_time.sh turns into a flag is read from a config_*.sh environment,
    converted to the option's type; empty values (config_common.sh's defaults) are ignored."""
    env = {
        "DGXSYSTEM": "DGXH100_32x8x1x2", "PRECISION": "bf16", "MAX_STEPS": "1200", "VAL_EVERY": "40",
        "CHECKPOINT_EVERY": "0", "TARGET_LDDT": "0.8", "SEED": "42", "INIT_CHECKPOINT": "/data/ref.pt",
        "NUM_ASYNC_VAL_RANKS": "32", "DAP_SIZE": "2", "BP_SIZE": "1", "PARALLEL_EVOFORMER": "0",
        "SUBMISSION_ORG": "Org", "SUBMISSION_PLATFORM": "DGXH100", "PRESET": "mlperf",
    }  # fmt: skip
    cfg = TrainConfig.from_preset("tiny", env=env)
    got = {name: getattr(cfg, name) for name in SLURM_CONFIG_ENV.values() if name != "preset"}
    assert got == {
        "precision": "bf16", "max_steps": 1200, "eval_every": 40, "checkpoint_every": 0, "target_lddt": 0.8,
        "seed": 42, "init_from": "/data/ref.pt", "num_async_eval_ranks": 32, "dap": 2, "bp": 1,
        "parallel_evoformer": False, "submission_org": "Org", "submission_platform": "DGXH100",
    }  # fmt: skip
    assert cfg.preset == "tiny"  # the preset is chosen before the environment is applied
    assert preset_from_env(env) == "mlperf"
    assert TrainConfig.from_preset("tiny", env={**env, "INIT_CHECKPOINT": ""}).init_from is None


def test_slurm_variables_are_ignored_outside_a_slurm_config():
    """Without DGXSYSTEM (no config_*.sh sourced) bare names like SEED or PRESET change nothing."""
    env = {"SEED": "99", "MAX_STEPS": "1000", "PRESET": "mlperf"}
    assert TrainConfig.from_preset("tiny", env=env) == TrainConfig.from_preset("tiny", env={})
    assert preset_from_env(env) == "demo"
    assert preset_from_env({"SCALEFOLD_PRESET": "tiny", **env}) == "tiny"


def test_bad_environment_values_name_the_variable():
    with pytest.raises(ValueError, match="MAX_STEPS='many'"):
        TrainConfig.from_preset("tiny", env={"DGXSYSTEM": "x", "MAX_STEPS": "many"})
    with pytest.raises(ValueError, match="SCALEFOLD_DETERMINISTIC='maybe'"):
        TrainConfig.from_preset("tiny", env={"SCALEFOLD_DETERMINISTIC": "maybe"})


def test_sourced_config_sh_reaches_the_config():
    """The variables a real launch/config_*.sh exports (sourced by bash) configure the run."""
    script = f'source "{REPO}/launch/config_DGXH100_1x8x1x1.sh" >/dev/null && env -0'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    env = dict(item.split("=", 1) for item in proc.stdout.split("\0") if "=" in item)
    assert preset_from_env(env) == "mlperf"
    cfg = TrainConfig.from_preset(preset_from_env(env), env=env)
    assert (cfg.max_steps, cfg.eval_every, cfg.precision, cfg.target_lddt) == (
        int(env["MAX_STEPS"]), int(env["VAL_EVERY"]), env["PRECISION"], float(env["TARGET_LDDT"]))  # fmt: skip
    assert cfg.submission_platform == env["SUBMISSION_PLATFORM"] == "DGXH100_1x8x1x1"


def test_structure_module_iterations_override_reaches_the_model_config():
    from scalefold.model.factory import build_model_config

    default = build_model_config(TrainConfig.from_preset("demo-scratch", env={}))
    assert default.structure_module_config.num_blocks == 2  # the demo-wide model preset's
    cfg = TrainConfig.from_preset("demo-scratch", env={"SCALEFOLD_STRUCTURE_MODULE_ITERATIONS": "8"})
    model_cfg = build_model_config(cfg)
    assert model_cfg.structure_module_config.num_blocks == 8
    assert model_cfg.structure_module_config.c_s == default.structure_module_config.c_s  # the rest is the preset's
