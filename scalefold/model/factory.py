"""The run's model: the preset's :class:`~scalefold.model.AlphaFoldConfig` with the run's overrides.

Shared by training and by ``scalefold evaluate`` / ``predict`` (:mod:`scalefold.inference.weights`),
so a checkpoint is read back with exactly the model its run trained.
"""

from __future__ import annotations

import torch

from scalefold.config.training import TrainConfig
from scalefold.model import AlphaFold, AlphaFoldConfig

#: Training options that change the model or its inputs without changing a parameter shape: a
#: checkpoint records the run's values (``model_options``) so that evaluation and prediction rebuild
#: the model the run trained (its preset's defaults otherwise).
MODEL_OPTIONS = ("structure_module_iterations", "num_recycling_iters", "max_msa_clusters", "max_extra_msa")


def model_options(cfg: TrainConfig) -> dict[str, int]:
    """The run's :data:`MODEL_OPTIONS` set by its training preset, config or flags (unset: the model preset's)."""
    return {name: int(getattr(cfg, name)) for name in MODEL_OPTIONS if getattr(cfg, name) is not None}


def build_model_config(cfg: TrainConfig) -> AlphaFoldConfig:
    """The model preset with the run's overrides (crop, MSA sizes, recycling, structure-module iterations)."""
    overrides = {
        "train_sequence_crop_size": cfg.crop_size, "max_msa_clusters": cfg.max_msa_clusters,
        "max_extra_msa": cfg.max_extra_msa, "num_recycling_iters": cfg.num_recycling_iters,
        "clip_grad_max_norm": cfg.clip_grad_max_norm, "swa_decay_rate": cfg.swa_decay,
    }  # fmt: skip
    if cfg.structure_module_iterations is not None:
        overrides["structure_module_config"] = {"num_blocks": cfg.structure_module_iterations}
    precision = "fp32" if cfg.precision in ("fp64", "tf32") else cfg.precision
    return AlphaFoldConfig.from_preset(
        cfg.model_preset, precision=precision, overrides={k: v for k, v in overrides.items() if v is not None}
    )


def build_model(cfg: TrainConfig, model_cfg: AlphaFoldConfig, device: torch.device, dtype: torch.dtype,
                *, training: bool = True) -> AlphaFold:  # fmt: skip
    """The run's model on ``device``; ``training``: initialised from ``cfg.seed`` (identical on every rank)
    with the run's activation checkpointing, else an evaluation copy (its weights are bound later)."""
    if training:
        torch.manual_seed(cfg.seed)
    return AlphaFold(
        model_cfg, activation_checkpointing=cfg.activation_checkpointing if training else False,
        parallel_evoformer=cfg.parallel_evoformer,
    ).to(device, dtype)  # fmt: skip


__all__ = ["build_model", "build_model_config"]
