"""Fixtures for the inference tests: tiny-preset checkpoints in every accepted layout.

Zero-initialised ("final" init) weights are filled with small noise so that structures and pLDDT
vary per residue (a freshly built model predicts every residue at the origin with pLDDT 50).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scalefold.checkpoint.adapters import swa_state_dict
from scalefold.checkpoint.files import build_checkpoint, save_atomic
from scalefold.model import AlphaFold, AlphaFoldConfig

SWA_UPDATES = 3


def random_tiny_model(seed: int) -> AlphaFold:
    """A ``tiny`` AlphaFold whose zero-initialised weights are replaced by small noise."""
    torch.manual_seed(seed)
    model = AlphaFold(AlphaFoldConfig.from_preset("tiny"), activation_checkpointing=False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 and not p.any():
                p.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="session")
def tiny_models() -> tuple[AlphaFold, AlphaFold]:
    """(training weights, SWA weights): two different tiny models."""
    return random_tiny_model(0), random_tiny_model(1)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tiny_models) -> dict[str, Path]:
    """Paths of: ``own`` (ScaleFold checkpoint with SWA), ``no_swa`` (without), ``reference``
    (MLPerf resumable layout, no SWA), ``swa_file`` (the reference SWA file), ``bare`` (a state dict)."""
    model, swa = tiny_models
    root = tmp_path_factory.mktemp("checkpoints")
    swa_sd = swa_state_dict(swa, SWA_UPDATES)
    paths = {
        "own": save_atomic(build_checkpoint(model.state_dict(), {}, 7, swa_state=swa_sd), root / "own.pt"),
        "no_swa": save_atomic(build_checkpoint(model.state_dict(), {}, 7), root / "no_swa.pt"),
        "swa_file": save_atomic(swa_sd, root / "swa.pt"),
        "bare": save_atomic({"module." + k: v for k, v in model.state_dict().items()}, root / "bare.pt"),
    }
    torch.save(
        {"alphafold_state_dict": model.state_dict(), "optimizer_state_dict": {"state": {}, "param_groups": []},
         "iteration": 11},
        root / "reference.pt",
    )  # fmt: skip
    paths["reference"] = root / "reference.pt"
    return paths
