"""The one lDDT-Cα scoring of a model on validation batches: training's evaluations and ``scalefold evaluate``.

The score is the MLPerf metric (:func:`scalefold.lddt.validation_lddt_ca`): chain-level lDDT-Cα of the
final atom positions against the last recycling slice's true positions, all recycling passes run.
"""

from __future__ import annotations

import numpy as np
import torch

from scalefold.lddt import validation_lddt_ca


def target_lddt_ca(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> float:
    """lDDT-Cα of a model's ``outputs`` on one validation batch ``[1, ..., R]`` (mean over the batch)."""
    score = validation_lddt_ca(
        outputs["final_atom_positions"].float(),  # [1, N_res, 37, 3]
        batch["all_atom_positions"][..., -1].float(),
        batch["all_atom_mask"][..., -1].float(),
    )
    return float(score.mean())


@torch.no_grad()
def score_batches(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], autocast: bool) -> float:
    """Mean chain-level lDDT-Cα of ``model`` over the validation ``batches`` (all recycling passes)."""
    model.eval()
    scores = []
    for batch in batches:
        device_type = batch["aatype"].device.type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            out = model(batch)
        scores.append(target_lddt_ca(out, batch))
    return float(np.mean(scores)) if scores else float("nan")


__all__ = ["score_batches", "target_lddt_ca"]
