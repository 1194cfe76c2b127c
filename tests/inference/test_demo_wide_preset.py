"""The candidate demo model ``demo-wide``: trained by the demo presets with SCALEFOLD_MODEL_PRESET=demo-wide,
recognised by evaluate/predict from its parameter shapes, rebuilt with its own widths."""

from __future__ import annotations

import torch

from scalefold.inference.weights import detect_preset, inference_config
from scalefold.model.alphafold import AlphaFold
from scalefold.model.config import AlphaFoldConfig
from scalefold.train.build import build_model_config
from scalefold.train.config import TrainConfig


def test_the_demo_presets_train_it_when_the_environment_says_so():
    cfg = TrainConfig.from_preset("demo-scratch", env={"SCALEFOLD_MODEL_PRESET": "demo-wide"})
    model_cfg = build_model_config(cfg)
    assert cfg.model_preset == "demo-wide" and cfg.store.endswith("demo-wide-store.h5")
    assert model_cfg.evoformer_stack_config.c_z == 64 and model_cfg.evoformer_stack_config.c_m == 64
    demo = build_model_config(TrainConfig.from_preset("demo-scratch", env={}))
    assert demo.evoformer_stack_config.c_z == 16  # the default demo model is unchanged
    assert model_cfg.train_sequence_crop_size == demo.train_sequence_crop_size == 48  # same data sizes


def test_its_checkpoints_are_recognised_and_rebuilt_wide():
    with torch.device("meta"):
        state = AlphaFold(AlphaFoldConfig.from_preset("demo-wide")).state_dict()
    assert detect_preset(state) == "demo-wide"
    cfg = inference_config("demo-wide")
    assert cfg.evoformer_stack_config.c_z == 64 and cfg.structure_module_config.c_s == 128
    assert inference_config("demo").evoformer_stack_config.c_z == 16
