"""Training-run configuration: one dataclass, three presets, overridable by env vars and CLI flags.

Precedence (lowest first): preset -> config file (``--config FILE``: TOML or YAML, a flat table of
field names, or the fields under a ``[train]`` table) -> the variables a Slurm ``launch/config_*.sh``
exports (``MAX_STEPS``, ``VAL_EVERY``, ``PRECISION``, ... see :data:`SLURM_CONFIG_ENV`; read only when
``DGXSYSTEM`` is set, the variable every system config exports, so a stray ``SEED`` in an interactive
shell changes nothing) -> ``SCALEFOLD_<FIELD>`` variables (e.g. ``SCALEFOLD_MAX_STEPS=200``, any
field) -> explicit overrides (CLI flags). Unknown keys (in the file or the overrides) are rejected
with their names; unparsable environment values are rejected naming the variable.

Presets:

* ``mlperf`` -- the closed-division benchmark values (the ``mlperf`` model, crop 256, evaluation
  every 40 iterations, target lDDT-Cα 0.8, lr 1e-3, clip 0.1, SWA decay 0.9); needs an existing
  store (``scalefold preprocess``), no step-0 baseline evaluation;
* ``demo``   -- the built-in CPU run of ``scalefold train`` without arguments (<= 10 minutes on
  2 cores, synthetic store, created when absent);
* ``tiny``   -- a few-second run for tests (synthetic store, created when absent).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_PREFIX = "SCALEFOLD_"
#: Set by every ``launch/config_*.sh``: its presence says "the environment is a Slurm submission's".
SLURM_CONFIG_MARKER = "DGXSYSTEM"
#: ``config_*.sh`` variable -> training option (the names ``run_and_time.sh`` maps to flags).
SLURM_CONFIG_ENV = {
    "PRESET": "preset", "PRECISION": "precision", "MAX_STEPS": "max_steps", "VAL_EVERY": "eval_every",
    "CHECKPOINT_EVERY": "checkpoint_every", "TARGET_LDDT": "target_lddt", "SEED": "seed",
    "INIT_CHECKPOINT": "init_from", "NUM_ASYNC_VAL_RANKS": "num_async_eval_ranks", "DAP_SIZE": "dap",
    "BP_SIZE": "bp", "PARALLEL_EVOFORMER": "parallel_evoformer", "SUBMISSION_ORG": "submission_org",
    "SUBMISSION_PLATFORM": "submission_platform",
}  # fmt: skip
PRECISIONS = ("fp32", "tf32", "bf16", "fp64")
CUDA_GRAPHS_MODES = ("auto", "on", "off")


@dataclass
class TrainConfig:
    """Everything one ``scalefold train`` run needs besides the model config."""

    preset: str = "demo"
    out: str = "runs/demo"
    # data: an existing store, or (synthesize_missing_store: the demo/tiny presets, or
    # --synthesize-missing-store) the synthetic store to create there if absent
    store: str = "runs/demo-store.h5"
    synthesize_missing_store: bool = False
    synth_num_chains: int = 320
    synth_num_families: int = 40
    synth_length_range: tuple[int, int] = (40, 120)
    synth_seed: int = 0
    num_workers: int = 1
    # model (AlphaFoldConfig preset and data-pipeline overrides; None keeps the model preset's)
    model_preset: str = "demo"
    crop_size: int | None = None
    max_msa_clusters: int | None = None
    max_extra_msa: int | None = None
    num_recycling_iters: int | None = None
    activation_checkpointing: bool = False
    precision: str = "fp32"
    # schedule
    max_steps: int = 100
    seed: int = 1234
    deterministic: bool = False
    lr: float = 1e-3
    warmup_lr_init: float = 1e-5
    warmup_steps: int = 0
    clip_grad_max_norm: float = 0.1
    swa_decay: float = 0.9
    max_consecutive_nonfinite: int = 10
    # evaluation (validation = chains released in the CAMEO window)
    eval_every: int = 40
    eval_max_chains: int = 0  # 0 = all validation chains
    # synchronous evaluation: also score the untrained model (step 0, for the curves; after run_start,
    # so timed, and not logged to MLPerf); never with --init-from
    eval_baseline: bool = True
    val_min_date: str = "2021-09-17"
    val_max_date: str = "2021-12-11"
    val_max_sequence_length: int = 700
    target_lddt: float = 0.8
    # checkpoints
    checkpoint_every: int = 0  # 0 = only none
    keep_last: int = 3
    resume: bool = False
    progress: bool = True
    # starting point: a reference-format checkpoint (weights + Adam state), SWA starts from it
    init_from: str | None = None
    # parallelism: the last ``num_async_eval_ranks`` ranks evaluate asynchronously (0 = synchronous
    # evaluation on the main training rank); DAP / branch parallelism land with issue 5
    num_async_eval_ranks: int = 0
    # seconds without progress after which the evaluation ranks count as stuck (asynchronous evaluation),
    # and the timeout of torch.distributed's collectives (init_process_group)
    eval_timeout_s: float = 1800.0
    process_group_timeout_s: float = 1800.0
    dap: int = 1
    bp: int = 1
    parallel_evoformer: bool = False
    # torch.compile of the Evoformer / extra-MSA blocks (eager fallback when compilation fails)
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile backend ("aot_eager": tracing only, fast to build)
    # CUDA graphs of the no-grad recycling passes, captured before run_start (scalefold.train.graphed_step):
    # auto = on for CUDA devices without DAP/BP, eager elsewhere; on = the same but refuse where unusable
    cuda_graphs: str = "auto"
    # MLPerf log: submission_org, and the platform logged as "{nodes}x{platform}" ("": the device type)
    submission_org: str = "ScaleFold"
    submission_platform: str = ""

    # -----------------------------------------------------------------------------------------

    @classmethod
    def from_preset(
        cls,
        name: str = "demo",
        overrides: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
    ) -> TrainConfig:
        """Preset, then ``config_file``, then ``SCALEFOLD_*`` environment variables, then ``overrides``
        (``None`` values skipped)."""
        if name not in PRESETS:
            raise ValueError(f"unknown training preset {name!r}; expected one of {sorted(PRESETS)}")
        cfg = cls(preset=name, **PRESETS[name]())
        if config_file is not None:
            cfg = cfg.replace(**load_config_file(config_file))
        cfg = cfg.with_env(os.environ if env is None else env)
        if overrides:
            cfg = cfg.replace(**{k: v for k, v in overrides.items() if v is not None})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject values no run can use (clear messages instead of failures deep in the loop)."""
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; expected one of {PRECISIONS}")
        for name in ("max_steps", "eval_every", "checkpoint_every", "num_async_eval_ranks", "max_consecutive_nonfinite"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dap < 1 or self.bp not in (1, 2):
            raise ValueError(f"dap must be >= 1 and bp 1 or 2, got dap={self.dap} bp={self.bp}")
        if self.cuda_graphs not in CUDA_GRAPHS_MODES:
            raise ValueError(f"unknown cuda_graphs mode {self.cuda_graphs!r}; expected one of {CUDA_GRAPHS_MODES}")
        if self.cuda_graphs == "on" and self.dap * self.bp > 1:  # DAP/BP collectives are not captured
            raise ValueError(f"cuda_graphs 'on' is not supported with dap={self.dap} bp={self.bp}; use auto or off")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        for name in ("eval_timeout_s", "process_group_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def replace(self, **changes: Any) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise KeyError(f"unknown training options: {sorted(unknown)}")
        if "synth_length_range" in changes:  # lists from TOML / YAML
            changes["synth_length_range"] = tuple(changes["synth_length_range"])
        return dataclasses.replace(self, **changes)

    def with_env(self, env: Mapping[str, str]) -> TrainConfig:
        """Values of the ``config_*.sh`` variables (when ``DGXSYSTEM`` is set), then of the
        ``SCALEFOLD_<FIELD>`` variables, converted to the field's type. ``PRESET`` is not applied
        here (the preset is chosen first, see :func:`preset_from_env`)."""
        changes: dict[str, Any] = {}
        if env.get(SLURM_CONFIG_MARKER):
            for var, name in SLURM_CONFIG_ENV.items():
                raw = env.get(var)
                if raw not in (None, "") and name != "preset":  # config_common.sh exports empty defaults
                    changes[name] = _parse(raw, getattr(self, name), name, var)
        for f in dataclasses.fields(self):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and f.name != "preset":
                changes[f.name] = _parse(raw, getattr(self, f.name), f.name, ENV_PREFIX + f.name.upper())
        return self.replace(**changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def preset_from_env(env: Mapping[str, str] | None = None, default: str = "demo") -> str:
    """The preset a launch asks for: ``SCALEFOLD_PRESET``, else ``PRESET`` of a ``config_*.sh``
    environment (``DGXSYSTEM`` set), else ``default``."""
    env = os.environ if env is None else env
    if env.get(ENV_PREFIX + "PRESET"):
        return env[ENV_PREFIX + "PRESET"]
    if env.get(SLURM_CONFIG_MARKER) and env.get("PRESET"):
        return env["PRESET"]
    return default


_CONFIG_VALUE_KINDS = {  # type of an option's default -> (accepted config-file value types, their name)
    bool: ((bool,), "true or false"), int: ((int,), "an integer"), float: ((int, float), "a number"),
    str: ((str,), "a string"), tuple: ((list, tuple), "a list"),
}  # fmt: skip


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Field values from a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file.

    The file is a flat table of :class:`TrainConfig` field names (or has them under ``train``);
    unknown keys raise ``KeyError`` naming them, a ``preset`` key is refused (choose it with ``--preset``).
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {path} is a directory (expected a .toml or .yaml file of training options)")
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        with path.open("rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {path}: not valid TOML ({exc})") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ValueError(f"config file {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    else:
        raise ValueError(f"config file {path}: expected a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a table of options, got {type(data).__name__}")
    if set(data) == {"train"} and isinstance(data["train"], dict):
        data = data["train"]
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"preset"}
    unknown = sorted(set(data) - names)
    if unknown:
        raise KeyError(f"config file {path}: unknown training options {unknown}")
    for name, value in data.items():  # a value of the wrong type would fail deep inside the run
        default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)
        kinds, what = _CONFIG_VALUE_KINDS.get(type(default), ((object,), ""))
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise ValueError(f"config file {path}: {name} = {value!r}: expected {what}")
    return dict(data)


_OPTIONAL_STR_FIELDS = ("init_from",)


def _parse(raw: str, current: Any, name: str, var: str | None = None) -> Any:
    """``raw`` (an environment value) converted to the type of field ``name``; errors name ``var``."""
    var = var or ENV_PREFIX + name.upper()
    raw = raw.strip()
    try:
        if isinstance(current, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("not a boolean (1/0, true/false, yes/no, on/off)")
        if isinstance(current, tuple):
            return tuple(int(x) for x in raw.split(","))
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if current is None:  # Optional fields: init_from (a path) and the int overrides
            if raw.lower() in ("", "none"):
                return None
            return raw if name in _OPTIONAL_STR_FIELDS else int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {var}={raw!r} is not valid for option {name!r}: {exc}") from None
    return raw


def _mlperf() -> dict[str, Any]:
    return {
        "out": "runs/mlperf", "store": "data/store.h5", "model_preset": "mlperf", "num_workers": 8,
        "activation_checkpointing": True, "max_steps": 20000, "eval_every": 40, "warmup_steps": 0,
        "checkpoint_every": 400, "eval_baseline": False,  # no untimed-data work, no extra timed evaluation
    }  # fmt: skip


def _demo() -> dict[str, Any]:
    # Sized for <= 10 minutes on 2 CPU cores (see README for the measured figures).
    return {
        "out": "runs/demo", "store": "runs/demo-store.h5", "synthesize_missing_store": True, "model_preset": "demo",
        "synth_num_chains": 320, "synth_num_families": 40, "synth_length_range": (40, 80),
        "crop_size": 48, "num_recycling_iters": 1, "max_steps": 150, "eval_every": 25,
        "eval_max_chains": 12, "warmup_steps": 10, "checkpoint_every": 50,
    }  # fmt: skip


def _tiny() -> dict[str, Any]:
    return {
        "out": "runs/tiny", "store": "runs/tiny-store.h5", "synthesize_missing_store": True, "model_preset": "tiny",
        "synth_num_chains": 20, "synth_num_families": 2, "synth_length_range": (24, 32),
        "num_recycling_iters": 1, "max_steps": 3, "eval_every": 2, "eval_max_chains": 1,
        "checkpoint_every": 2, "progress": False,
    }  # fmt: skip


PRESETS = {"mlperf": _mlperf, "demo": _demo, "tiny": _tiny}

__all__ = [
    "TrainConfig", "PRESETS", "PRECISIONS", "CUDA_GRAPHS_MODES", "ENV_PREFIX", "SLURM_CONFIG_ENV", "SLURM_CONFIG_MARKER",
    "load_config_file", "preset_from_env",
]  # fmt: skip
