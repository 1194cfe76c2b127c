"""The demo model ``demo-wide``: what the demo presets train (the narrow ``demo`` model stays available with
SCALEFOLD_MODEL_PRESET=demo), recognised by evaluate/predict from its parameter shapes, rebuilt with its own
widths; the ``demo`` preset (stage 2 of the recipe) runs it with 4 structure-module iterations."""

from __future__ import annotations

import torch

from scalefold.config.training import DEMO_STRUCTURE_MODULE_ITERATIONS, TrainConfig
from scalefold.inference.weights import detect_preset, inference_config
from scalefold.model.alphafold import AlphaFold
from scalefold.model.config import AlphaFoldConfig
from scalefold.model.factory import build_model_config


def test_the_demo_presets_train_it_and_share_one_store():
    scratch, demo = (TrainConfig.from_preset(name, env={}) for name in ("demo-scratch", "demo"))
    assert scratch.model_preset == demo.model_preset == "demo-wide"
    assert scratch.store == demo.store == "runs/demo-store.h5"  # one synthetic store for both stages
    stage1, stage2 = build_model_config(scratch), build_model_config(demo)
    assert stage1.evoformer_stack_config.c_z == stage2.evoformer_stack_config.c_z == 64
    assert stage1.evoformer_stack_config.c_m == 64
    assert stage1.structure_module_config.num_blocks == 2  # stage 1: the model preset's iterations
    assert stage2.structure_module_config.num_blocks == DEMO_STRUCTURE_MODULE_ITERATIONS == 4
    assert stage1.train_sequence_crop_size == stage2.train_sequence_crop_size == 48  # same data sizes
    narrow = build_model_config(TrainConfig.from_preset("demo-scratch", env={"SCALEFOLD_MODEL_PRESET": "demo"}))
    assert narrow.evoformer_stack_config.c_z == 16  # the narrow demo model, on request


def test_its_checkpoints_are_recognised_and_rebuilt_wide():
    with torch.device("meta"):
        state = AlphaFold(AlphaFoldConfig.from_preset("demo-wide")).state_dict()
    assert detect_preset(state) == "demo-wide"
    cfg = inference_config("demo-wide")
    assert cfg.evoformer_stack_config.c_z == 64 and cfg.structure_module_config.c_s == 128
    assert inference_config("demo").evoformer_stack_config.c_z == 16


def test_inference_takes_structure_module_iterations_from_the_checkpoint_not_the_training_preset():
    """A checkpoint that recorded no iteration count (stage 1, the narrow demo, older runs) ran the model
    preset's 2, although the ``demo`` training preset now sets 4; one that recorded 4 (stage 2) gets 4."""
    assert inference_config("demo-wide").structure_module_config.num_blocks == 2
    assert inference_config("demo").structure_module_config.num_blocks == 2
    stage2 = inference_config("demo-wide", model_options={"structure_module_iterations": 4, "num_recycling_iters": 1})
    assert stage2.structure_module_config.num_blocks == 4
