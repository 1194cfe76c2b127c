"""One model factory: the Trainer, the memory model and the step benchmark build the same model.

``scalefold estimate-memory`` (and the start-up memory check) once built the model from a copy of the
Trainer's config code that dropped ``structure_module_iterations``: it modelled the demo with 2
structure-module iterations while the demo trains with 4. Both now build through
:mod:`scalefold.model.factory`; these tests pin that for every training preset.
"""

from __future__ import annotations

import pytest

from scalefold.config.training import PRESET_NAMES, TrainConfig
from scalefold.model.factory import build_model_config


class _Captured(Exception):
    """Raised by the spy once the memory model has asked for its model (nothing is run)."""


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_the_memory_model_builds_the_trainers_model(preset, monkeypatch):
    from scalefold.perf import memory
    from scalefold.train import step

    cfg = TrainConfig.from_preset(preset, env={})
    seen = {}

    def spy(cfg_, model_cfg, device="cpu"):
        seen["config"] = model_cfg
        raise _Captured

    monkeypatch.setattr(step, "training_model", spy)
    with pytest.raises(_Captured):
        memory.estimate_memory(cfg, target="cpu")
    trainer_config = build_model_config(cfg)  # what scalefold.train.trainer.train builds the model from
    assert seen["config"].to_dict() == trainer_config.to_dict()
    if cfg.structure_module_iterations is not None:
        assert seen["config"].structure_module_config.num_blocks == cfg.structure_module_iterations


def test_the_step_benchmarks_model_is_the_factorys():
    """``scalefold bench step`` / the memory model's :class:`TrainingStep` holds the factory's model,
    structure-module iterations included (the demo preset: 4, its model preset's default is 2)."""
    from scalefold.train.step import TrainingStep

    cfg = TrainConfig.from_preset("demo", env={})
    assert cfg.structure_module_iterations == 4
    built = TrainingStep.build(cfg)
    assert built.model.config.to_dict() == build_model_config(cfg).to_dict()
    assert built.model.config.structure_module_config.num_blocks == 4
