"""``scalefold model-info``: the meta-device build (initialisers skipped) has exactly the real model's
parameters -- names, shapes and the count MLPerf logs."""

from __future__ import annotations

import json

import torch

from scalefold.cli import main
from scalefold.commands.model_info import meta_model
from scalefold.model import AlphaFold, AlphaFoldConfig


def test_meta_build_has_the_real_models_parameters():
    real = AlphaFold(AlphaFoldConfig.from_preset("tiny"))
    meta = meta_model("tiny")
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert all(p.is_meta for p in meta.parameters())
    assert torch.empty(1).device.type == "cpu"  # the meta device and the init skipping end with the build


def test_cli_counts_the_mlperf_model(capsys):
    assert main(["model-info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["preset"] == "mlperf" and info["parameters"] == 93_229_082
    assert sum(info["per_module"].values()) == info["parameters"]
