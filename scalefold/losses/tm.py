"""Predicted-aligned-error (TM-score head) loss (supplement 1.9.7, eq. 38–40).

The squared error of every residue's frame origin seen from every other residue's frame is
binned into ``num_bins`` bins on [0, max_bin] Å; the TM head's pair logits are trained with cross
entropy against it. Only used when the TM head is enabled (fine-tuning); off in MLPerf.
"""

from __future__ import annotations

import torch

from scalefold.losses.common import one_hot_cross_entropy, resolution_filter
from scalefold.model.rigid import Rigid


def _frame_origins_in_frames(frames: Rigid) -> torch.Tensor:
    """[*, N] frames -> [*, N, N, 3]: origin of frame j expressed in frame i."""
    origins = frames.get_trans()[..., None, :, :]
    return frames.invert().unsqueeze(-1).apply(origins)


def tm_loss(
    logits: torch.Tensor,
    final_affine_tensor: torch.Tensor,
    backbone_rigid_tensor: torch.Tensor,
    backbone_rigid_mask: torch.Tensor,
    resolution: torch.Tensor,
    max_bin: float = 31,
    num_bins: int = 64,
    min_resolution: float = 0.1,
    max_resolution: float = 3.0,
    eps: float = 1e-8,
    fp16_scale: float = 0.5,
) -> torch.Tensor:
    """Args:
        logits:                [*, N_res, N_res, num_bins]
        final_affine_tensor:   [*, N_res, 7] predicted backbone frames (quaternion, translation)
        backbone_rigid_tensor: [*, N_res, 4, 4] true backbone frames
        backbone_rigid_mask:   [*, N_res]
        resolution:            [*]
    Returns:
        [*] loss.
    """
    pred = Rigid.from_tensor_7(final_affine_tensor)
    true = Rigid.from_tensor_4x4(backbone_rigid_tensor)
    # [*, N_res, N_res] (no gradient through the target bins)
    sq_diff = torch.sum((_frame_origins_in_frames(pred) - _frame_origins_in_frames(true)) ** 2, dim=-1)
    sq_diff = sq_diff.detach()

    boundaries = torch.linspace(0, max_bin, steps=num_bins - 1, device=logits.device) ** 2
    true_bins = torch.sum(sq_diff[..., None] > boundaries, dim=-1)
    errors = one_hot_cross_entropy(logits, true_bins)

    square_mask = backbone_rigid_mask[..., None] * backbone_rigid_mask[..., None, :]
    loss = torch.sum(errors * square_mask, dim=-1)
    denom = eps + torch.sum(fp16_scale * square_mask, dim=(-1, -2))
    loss = loss / denom[..., None]
    loss = torch.sum(loss, dim=-1) * fp16_scale
    return loss * resolution_filter(resolution, min_resolution, max_resolution)
