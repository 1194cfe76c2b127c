"""Training-run configuration: one dataclass, three presets, overridable by env vars and CLI flags.

Precedence (lowest first): preset -> environment (``SCALEFOLD_<FIELD>``, e.g.
``SCALEFOLD_MAX_STEPS=200``, what a Slurm ``config_*.sh`` exports) -> explicit overrides (CLI flags).

Presets:

* ``mlperf`` -- the closed-division benchmark values (the ``mlperf`` model, crop 256, evaluation
  every 40 iterations, target lDDT-Cα 0.8, lr 1e-3, clip 0.1, SWA decay 0.9);
* ``demo``   -- the built-in CPU run of ``scalefold train`` without arguments (<= 10 minutes on
  2 cores, synthetic store);
* ``tiny``   -- a few-second run for tests.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "SCALEFOLD_"
PRECISIONS = ("fp32", "bf16", "fp64")


@dataclass
class TrainConfig:
    """Everything one ``scalefold train`` run needs besides the model config."""

    preset: str = "demo"
    out: str = "runs/demo"
    # data: an existing store, or the synthetic store to create there if absent
    store: str = "runs/demo-store.h5"
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
    val_min_date: str = "2021-09-17"
    val_max_date: str = "2021-12-11"
    val_max_sequence_length: int = 700
    target_lddt: float = 0.8
    # checkpoints
    checkpoint_every: int = 0  # 0 = only none
    keep_last: int = 3
    resume: bool = False
    progress: bool = True

    # -----------------------------------------------------------------------------------------

    @classmethod
    def from_preset(
        cls, name: str = "demo", overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> TrainConfig:
        """Preset, then ``SCALEFOLD_*`` environment variables, then ``overrides`` (``None`` values skipped)."""
        if name not in PRESETS:
            raise ValueError(f"unknown training preset {name!r}; expected one of {sorted(PRESETS)}")
        cfg = cls(preset=name, **PRESETS[name]())
        cfg = cfg.with_env(os.environ if env is None else env)
        if overrides:
            cfg = cfg.replace(**{k: v for k, v in overrides.items() if v is not None})
        if cfg.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {cfg.precision!r}; expected one of {PRECISIONS}")
        return cfg

    def replace(self, **changes: Any) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise KeyError(f"unknown training options: {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def with_env(self, env: Mapping[str, str]) -> TrainConfig:
        """Values of ``SCALEFOLD_<FIELD>`` variables, converted to the field's type."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                changes[f.name] = _parse(raw, getattr(self, f.name), f.name)
        return self.replace(**changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parse(raw: str, current: Any, name: str) -> Any:
    if isinstance(current, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean")
    if isinstance(current, tuple):
        return tuple(int(x) for x in raw.split(","))
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    if current is None:  # Optional[int] fields
        return None if raw.lower() in ("", "none") else int(raw)
    return raw


def _mlperf() -> dict[str, Any]:
    return {
        "out": "runs/mlperf", "store": "data/store.h5", "model_preset": "mlperf", "num_workers": 8,
        "activation_checkpointing": True, "max_steps": 20000, "eval_every": 40, "warmup_steps": 0,
        "checkpoint_every": 400,
    }  # fmt: skip


def _demo() -> dict[str, Any]:
    # Sized for <= 10 minutes on 2 CPU cores (see README for the measured figures).
    return {
        "out": "runs/demo", "store": "runs/demo-store.h5", "model_preset": "demo",
        "synth_num_chains": 320, "synth_num_families": 40, "synth_length_range": (40, 80),
        "crop_size": 48, "num_recycling_iters": 1, "max_steps": 150, "eval_every": 25,
        "eval_max_chains": 12, "warmup_steps": 10, "checkpoint_every": 50,
    }  # fmt: skip


def _tiny() -> dict[str, Any]:
    return {
        "out": "runs/tiny", "store": "runs/tiny-store.h5", "model_preset": "tiny",
        "synth_num_chains": 20, "synth_num_families": 2, "synth_length_range": (24, 32),
        "num_recycling_iters": 1, "max_steps": 3, "eval_every": 2, "eval_max_chains": 1,
        "checkpoint_every": 2, "progress": False,
    }  # fmt: skip


PRESETS = {"mlperf": _mlperf, "demo": _demo, "tiny": _tiny}

__all__ = ["TrainConfig", "PRESETS", "PRECISIONS", "ENV_PREFIX"]
