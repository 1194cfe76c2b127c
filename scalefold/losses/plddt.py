"""pLDDT (per-residue lDDT-Cα prediction) loss (supplement 1.9.6, Algorithm 29, eq. 37).

The true per-residue CA lDDT of the final predicted structure is binned into ``num_bins`` equal
bins on [0, 1] and the pLDDT head's logits are trained with cross entropy against it, averaged over
residues with a known CA; applied only to structures with resolution in
``[min_resolution, max_resolution]``. The lDDT target carries no gradient.
"""

from __future__ import annotations

import torch

from scalefold.lddt import CA_ATOM37_INDEX, lddt
from scalefold.losses.common import one_hot_cross_entropy, resolution_filter


def lddt_bin_index(score: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Bin of an lDDT score in [0, 1] among ``num_bins`` equal bins (score 1 -> last bin)."""
    bin_index = torch.floor(score * num_bins).long()
    return torch.clamp(bin_index, max=num_bins - 1)


def plddt_loss(
    logits: torch.Tensor,
    all_atom_pred_pos: torch.Tensor,
    all_atom_positions: torch.Tensor,
    all_atom_mask: torch.Tensor,
    resolution: torch.Tensor,
    cutoff: float = 15.0,
    num_bins: int = 50,
    min_resolution: float = 0.1,
    max_resolution: float = 3.0,
    eps: float = 1e-10,
) -> torch.Tensor:
    """Args:
        logits:             [*, N_res, num_bins] pLDDT head output
        all_atom_pred_pos:  [*, N_res, 37, 3] final predicted atom37 positions
        all_atom_positions: [*, N_res, 37, 3] true positions
        all_atom_mask:      [*, N_res, 37]
        resolution:         [*]
    Returns:
        [*] loss.
    """
    ca = CA_ATOM37_INDEX
    ca_mask = all_atom_mask[..., ca : ca + 1]  # [*, N_res, 1]
    # [*, N_res]
    score = lddt(
        all_atom_pred_pos[..., ca, :],
        all_atom_positions[..., ca, :],
        ca_mask,
        cutoff=cutoff,
        eps=eps,
    ).detach()

    errors = one_hot_cross_entropy(logits, lddt_bin_index(score, num_bins))
    ca_mask = ca_mask.squeeze(-1)
    loss = torch.sum(errors * ca_mask, dim=-1) / (eps + torch.sum(ca_mask, dim=-1))
    return loss * resolution_filter(resolution, min_resolution, max_resolution)
